"""Read a kernel's machine code (SASS) without a GPU: which instructions its main loop issues, and how
soon each global load is waited for.

Why: ptxas tracks loads with six scoreboards, and an instruction can only wait for a scoreboard to
drain, not for one load on it. When every global load of a loop shares one scoreboard, the first
consumer of an old load also waits for the loads issued just before it, and a register prefetch
buys nothing (H200; docs/performance.md). The PTX cannot show this; the control bits of the SASS do.

Needs `ptxas`, `cuobjdump` and `nvdisasm` on PATH (the last two come in NVIDIA's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels).
"""
from __future__ import annotations

import collections
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("ptxas", "cuobjdump", "nvdisasm")
_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s+/\* (0x[0-9a-f]{16}) \*/")
_CONTROL = re.compile(r"\s+/\* (0x[0-9a-f]{16}) \*/")
_GLOBAL_LOAD = re.compile(r"^(@!?U?P\w+\s+)?LDG\b")


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str            # e.g. "LDG.E.64.CONSTANT R22, desc[UR10][R22.64]"
    write_barrier: int   # scoreboard the result is tracked on (7: none)
    wait_mask: int       # scoreboards this instruction waits for

    @property
    def opcode(self) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split()[0].split(".")[0]


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def _assemble(ptx: str, arch: str, tmp: str) -> tuple[Path, str]:
    """ptxas -v on `ptx` for `arch`: the cubin's path in `tmp` and what ptxas printed."""
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"reading SASS needs {', '.join(missing)} on PATH "
                           "(pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, unzip, add nvidia/cu13/bin)")
    src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
    src.write_text(ptx)
    res = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(src), "-o", str(cubin)], check=True,
                         capture_output=True, text=True)
    return cubin, res.stdout + res.stderr


def disassemble(ptx: str, arch: str) -> str:
    """cuobjdump -sass of `ptx` assembled by ptxas for `arch`."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin, _ = _assemble(ptx, arch, tmp)
        return subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def ptxas_findings(ptx: str, arch: str) -> list[str]:
    """ptxas's register and spill line for `ptx` and every performance warning it gives, such as
    wgmmas it serializes (each waited for before the next: docs/performance.md lists the causes met)."""
    with tempfile.TemporaryDirectory() as tmp:
        _, log = _assemble(ptx, arch, tmp)
    keep = ("Used ", "spill stores", "Potential Performance Loss", "is injected")
    return [line.split("ptxas info    : ")[-1].strip() for line in log.splitlines() if any(k in line for k in keep)]


def parse(sass: str) -> list[Instruction]:
    """The instructions of cuobjdump's listing with their scoreboard control bits (Volta and newer:
    bits 41+ of the second 64-bit word hold stall 4, yield 1, write barrier 3, read barrier 3, wait mask 6)."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        found = _LINE.match(line)
        control = _CONTROL.match(lines[i + 1]) if found else None
        if found and control:
            bits = int(control.group(1), 16) >> 41
            out.append(Instruction(int(found.group(1), 16), found.group(2), (bits >> 5) & 7, (bits >> 11) & 63))
    return out


def main_loop(code: list[Instruction]) -> list[Instruction]:
    """The instructions of the longest backward branch's body: the kernel's main loop. Branches placed
    after the kernel's last EXIT (ptxas moves the retry paths of mbarrier waits there) do not count;
    a warp-specialized kernel's producer may exit before the consumers' loop."""
    exits = [ins.address for ins in code if ins.opcode == "EXIT"]
    end = exits[-1] if exits else float("inf")
    best = None
    for ins in code:
        if ins.address > end:
            break
        target = re.search(r"BRA (0x[0-9a-f]+)", ins.text)
        if target and int(target.group(1), 16) < ins.address:
            span = (int(target.group(1), 16), ins.address)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise ValueError("no loop in this kernel")
    return [ins for ins in code if best[0] <= ins.address <= best[1]]


def load_waits(loop: list[Instruction]) -> list[tuple[Instruction, int, Instruction]]:
    """For every global load in `loop`: (load, instructions until the first wait on its scoreboard,
    the waiting instruction), following the loop around once."""
    out = []
    for i, ins in enumerate(loop):
        if not _GLOBAL_LOAD.match(ins.text) or ins.write_barrier == 7:
            continue
        for distance in range(1, len(loop) + 1):
            later = loop[(i + distance) % len(loop)]
            if later.wait_mask >> ins.write_barrier & 1:
                out.append((ins, distance, later))
                break
    return out


def conversions_before_the_last_wait(code: list[Instruction]) -> list[Instruction]:
    """The F2FP (fp32 -> fp16/bf16) instructions between the kernel's last HGMMA and the first
    `WARPGROUP.DEPBAR.LE gsb0, 0x0` after it: reads of wgmma accumulators that the last wgmmas may
    still be writing. ptxas hoisted unconditional conversions above that wait (staged_store on branch
    a staged_store form that was never merged: ~25 % of the outputs missed their last k-tile); under a predicate
    (the row guard of every epilogue here) it kept them below."""
    mma = [i for i, ins in enumerate(code) if ins.opcode == "HGMMA"]
    if not mma:
        return []
    wait = next((i for i in range(mma[-1], len(code)) if "DEPBAR.LE gsb0, 0x0" in code[i].text), len(code))
    return [ins for ins in code[mma[-1]:wait] if ins.opcode == "F2FP"]


def report(sass: str, soon: int = 40) -> str:
    """The main loop's instruction mix and its global loads waited for within `soon` instructions."""
    try:
        loop = main_loop(parse(sass))
    except ValueError:       # short k-loops are unrolled whole (split-K at small K)
        return "main loop: none (the k-loop is fully unrolled)"
    mix = collections.Counter(ins.opcode for ins in loop)
    lines = [f"main loop: {len(loop)} instructions",
             "  " + ", ".join(f"{op} {n}" for op, n in mix.most_common())]
    waits = load_waits(loop)
    early = [(load, d, waiter) for load, d, waiter in waits if d <= soon]
    lines.append(f"global loads in the loop: {len(waits)}, waited for within {soon} instructions: {len(early)}")
    for load, distance, waiter in early:
        lines.append(f"  {load.address:05x} {load.text[:56]:56s} sb{load.write_barrier} waited {distance:3d} later "
                     f"by {waiter.text[:40]}")
    return "\n".join(lines)
