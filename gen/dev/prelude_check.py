"""`gen prelude-check`: compile every winner of tuned tables with the kernels' own prelude and with
TileLang's headers, and compare the machine code (no GPU).

Why: the prelude (templates/tl_prelude.cuh.j2) replaces TileLang's headers to make nvcc ~3x faster,
and must not change a kernel: a table's timings were measured on TileLang's build. nvcc's choices
read more than the prelude's semantics (it weighs an asm statement by its text when it decides whether
to unroll a loop; CUDA's bf16-to-float conversion schedules differently from cutlass's), so only the
machine code shows that a kernel is the same. Run it after a change to the prelude, the schedules,
TileLang or the CUDA toolkit.
"""
from __future__ import annotations

import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gen.cli import positive_int

SAME, DIFFERENT, NOT_COVERED = "same", "different", "not covered"


def register(subparsers) -> None:
    p = subparsers.add_parser("prelude-check", help="compile tuned winners with the own prelude and with "
                                                    "TileLang's headers and compare their machine code",
                              description="Compile each distinct winner of the tuned tables (default: every "
                                          "table tilemarlin reads) both ways for its table's arch with nvcc "
                                          "(no GPU) and compare the cubins' instructions byte for byte. Exit "
                                          "status 1 when a covered kernel differs or fails to build.")
    p.add_argument("--table", type=Path, action="append", default=None,
                   help="a tuned table file (repeatable; default: the shipped tables and TILEMARLIN_CACHE_DIR's)")
    p.add_argument("--workers", type=positive_int("a worker count of at least 1"), default=None,
                   help="kernels compiled at once (default: the CPU count)")
    p.set_defaults(func=run)


def tilelang_source(family: str, arch: str, problem, knobs) -> str:
    """The CUDA TileLang writes for the schedule, its headers included (lowered, not compiled)."""
    import tilelang
    import tvm

    from schedules.arch import get_arch
    from schedules.registry import Schedule

    fam, target = Schedule(family, knobs).module, get_arch(arch).target
    with tvm.transform.PassContext(opt_level=3, config=fam.PASS_CONFIGS), tvm.target.Target(target):
        return tilelang.lower(fam.build(problem, knobs), target=target).kernel_source


def machine_code(source: str, arch: str) -> dict[str, bytes]:
    """The .text sections of the cubin nvcc makes of `source` for `arch`, as TileLang runs nvcc."""
    from tilelang.contrib import nvcc

    cubin = bytes(nvcc.compile_cuda(source, target_format="cubin", arch=arch,
                                    options=nvcc.default_compile_options()))
    (table,) = struct.unpack_from("<Q", cubin, 0x28)                        # ELF64 section headers
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, table + i * size) for i in range(count)]
    strings = sections[names][4]

    def name(section) -> str:
        start = strings + section[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    return {name(s): cubin[s[4]:s[4] + s[5]] for s in sections if name(s).startswith(".text.")}


def compare(problem, schedule, arch: str) -> str:
    """SAME, DIFFERENT or NOT_COVERED (the prelude does not take the code) for one kernel."""
    from templates import with_own_prelude

    plain = tilelang_source(schedule.family, arch, problem, schedule.knobs)
    own = with_own_prelude(plain)
    if own == plain:
        return NOT_COVERED
    return SAME if machine_code(own, arch) == machine_code(plain, arch) else DIFFERENT


def winners(paths: list[Path]) -> list[tuple]:
    """The distinct (problem, schedule, arch) of the tables' entries, in a stable order."""
    from runtime.table import TunedTable

    found = set()
    for path in paths:
        table = TunedTable.read(path)
        found |= {(problem, entry.schedule, table.gpu.arch) for (problem, _), entry in table.items()}
    return sorted(found, key=lambda job: (job[2], job[0].name, job[1].name))


def run(args) -> int:
    from runtime.table import TableError, table_files

    try:
        jobs = winners(args.table or table_files())
    except (OSError, TableError) as exc:
        print(f"gen prelude-check: {exc}", file=sys.stderr)
        return 2

    def verdict(job):
        try:
            return job, compare(*job)
        except Exception as exc:     # noqa: BLE001 - a build that fails is reported with the others
            return job, f"error: {type(exc).__name__}: {str(exc)[:300]}"

    with ThreadPoolExecutor(args.workers) as pool:    # nvcc runs as a child process: threads suffice
        results = list(pool.map(verdict, jobs))
    counts = {}
    for (problem, schedule, arch), result in results:
        kind = result if result in (SAME, DIFFERENT, NOT_COVERED) else "error"
        counts[kind] = counts.get(kind, 0) + 1
        if kind in (DIFFERENT, "error"):
            print(f"{arch} {problem.name} {schedule.name}: {result}")
    print(f"winners compared: {len(results)} (" + ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items())) + ")")
    return 1 if counts.get(DIFFERENT) or counts.get("error") else 0
