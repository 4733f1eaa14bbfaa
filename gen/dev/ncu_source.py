"""Where a kernel's warps wait, from Nsight Compute's source page: `ncu --import R.ncu-rep --page source
--csv --print-source sass` gives a row per SASS instruction with its executions, its stall samples and
one column per stall reason. ncu runs on the GPU machine only; this reads its text anywhere (`gen profile
--read-ncu FILE.csv`), which is how the M = 16 and M = 8 kernels were compared (H200; docs/performance.md).
"""
from __future__ import annotations

import csv
from collections import Counter
from dataclasses import dataclass

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass(frozen=True)
class Line:
    address: str
    source: str
    executed: int
    samples: int
    stalls: dict[str, int]      # reason (without "stall_") -> samples

    @property
    def opcode(self) -> str:
        """The instruction's name without modifiers or a predicate guard: "HGMMA", "LOP3", "BRA"."""
        words = self.source.split()
        word = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        return word.split(".")[0]


def read(path) -> list[Line]:
    """The SASS lines of the first kernel in the file (its first line names the kernel, the second is
    the header)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next((r for r in rows if EXECUTED in r and SAMPLES in r), None)
    if header is None:
        raise ValueError(f"{path}: no '{EXECUTED}' and '{SAMPLES}' columns; is it ncu's --page source --csv "
                         "output with --print-source sass?")
    at = rows.index(header)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    lines = []
    for row in rows[at + 1:]:
        if len(row) != len(header):
            break                      # the next kernel's name line, or the end
        cell = dict(zip(header, row))
        lines.append(Line(cell.get("Address", ""), cell.get("Source", "").strip(), _int(cell[EXECUTED]),
                          _int(cell[SAMPLES]), {r[len("stall_"):]: _int(cell[r]) for r in reasons}))
    return lines


def _int(text: str) -> int:
    try:
        return int(float(text.replace(",", "")))
    except ValueError:
        return 0


def summary(lines: list[Line], top: int = 15) -> str:
    """Stall reasons by share of samples, opcodes by share of executed instructions (and of samples),
    and the `top` lines with the most samples, with their three largest reasons."""
    total_executed = sum(line.executed for line in lines)
    total_samples = sum(line.samples for line in lines)
    executed, samples = total_executed or 1, total_samples or 1      # shares of nothing are zero
    reasons = Counter()
    for line in lines:
        reasons.update(line.stalls)
    ops, op_samples = Counter(), Counter()
    for line in lines:
        ops[line.opcode] += line.executed
        op_samples[line.opcode] += line.samples
    out = [f"{total_executed} warp instructions executed, {total_samples} stall samples",
           "stall reasons (share of samples): " + ", ".join(f"{r} {n / samples:.2f}" for r, n in reasons.most_common()
                                                            if n / samples >= 0.01),
           "opcodes (share of executed / of samples): " + ", ".join(
               f"{op} {n / executed:.3f}/{op_samples[op] / samples:.2f}" for op, n in ops.most_common(20))]
    out.append(f"the {top} lines with the most samples:")
    for line in sorted(lines, key=lambda line: -line.samples)[:top]:
        why = ", ".join(f"{r} {n}" for r, n in Counter(line.stalls).most_common(3) if n)
        out.append(f"  {line.samples / samples:6.3f}  {line.address[-6:]:>6}  {line.source[:64]:64}  {why}")
    return "\n".join(out)
