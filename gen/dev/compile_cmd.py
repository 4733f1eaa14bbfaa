"""`gen compile`: build one schedule for an explicit arch (no GPU needed) and show what nvcc got."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gen.cli import positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser("compile", help="compile one schedule for an arch and write its CUDA/PTX",
                              description="Compile one schedule with nvcc for --arch (works without a GPU). "
                                          "Without --knobs, the cost model's best schedule for --m is used.")
    p.add_argument("--shape", required=True, help="KxN, e.g. 4096x12288")
    p.add_argument("--group", type=int, default=128, help="group size, -1 for channelwise (default 128)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--arch", default="sm_90a", help="nvcc arch: sm_90a (H100/H200), sm_80 (A100), ...")
    p.add_argument("--m", type=positive_int("a batch size of at least 1"), default=1,
                   help="batch size the cost model picks for (default 1)")
    p.add_argument("--family", help="the schedule family: with --knobs the one they belong to (default marlin_mma), "
                   "without, the family the cost model picks in (default: any)")
    p.add_argument("--knobs", default="", help="comma-separated key=value overrides, e.g. split_k=2,block_n=128")
    p.add_argument("--out", type=Path, default=None, help="folder for kernel.cu and kernel.ptx")
    p.add_argument("--sass", action="store_true",
                   help="also read the machine code: the main loop's instructions and how soon its global loads "
                        "are waited for (needs ptxas, cuobjdump and nvdisasm on PATH; see gen/dev/sass.py)")
    p.set_defaults(func=run)


def parse_knobs(family, text: str):
    """key=value pairs -> the family's Knobs (unknown keys and bad values are errors)."""
    from schedules.knob_space import knob_value

    values = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError("expected key=value")
            values[key] = knob_value(family.Knobs, key, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad knob {item!r}: {exc}") from None
    return family.Knobs(**values)


def _best_in(problem, m: int, arch, family_name: str | None):
    """The cost model's pick at M = m, within `family_name` where one is named; ValueError where that
    family is unknown or has no valid schedule on the arch."""
    from schedules.cost import GpuSpec, best_schedule, rank

    if family_name is None:
        return best_schedule(problem, m, arch, GpuSpec.for_arch(arch))
    ranked = rank(problem, m, arch, GpuSpec.for_arch(arch), families=[family_name])
    if not ranked:
        raise ValueError(f"no {family_name} schedule can run {problem.name} on {arch.name}")
    return ranked[0]


def run(args) -> int:
    from schedules.arch import get_arch
    from schedules.registry import Schedule, family

    from runtime.kernels import compile_schedule
    from runtime.op import problem_of
    from gen.models import parse_shapes

    if args.sass:
        from gen.dev.sass import missing_tools

        if missing_tools():      # before a compile of several seconds whose machine code cannot be read
            print(f"gen compile: --sass needs {', '.join(missing_tools())} on PATH (see gen/dev/sass.py)", file=sys.stderr)
            return 2
    try:
        layers = parse_shapes(args.shape)
        if len(layers) != 1:
            raise ValueError(f"--shape takes one KxN, got {args.shape!r}")
        problem = problem_of(layers[0].n, layers[0].k, args.group, args.dtype)
        arch = get_arch(args.arch)
        if args.knobs:
            name = args.family or "marlin_mma"
            schedule = Schedule(name, parse_knobs(family(name), args.knobs))
        else:
            schedule = _best_in(problem, args.m, arch, args.family)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"gen compile: {exc}", file=sys.stderr)
        return 2
    reason = schedule.module.check(problem, schedule.knobs, arch)
    if reason:
        print(f"gen compile: {schedule.name} is not valid for {problem.name} on {arch.name}: {reason}", file=sys.stderr)
        return 2
    kernel = compile_schedule(problem, schedule, arch)
    print(f"compiled {schedule.name} for {problem.name} on {arch.name}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel.cu").write_text(kernel.get_kernel_source())
        kernel.export_ptx(str(args.out / "kernel.ptx"))
        print(f"wrote {args.out / 'kernel.cu'} and {args.out / 'kernel.ptx'}")
    if args.sass:
        import tempfile

        from gen.dev.sass import disassemble, ptxas_findings, report

        with tempfile.TemporaryDirectory() as tmp:
            kernel.export_ptx(f"{tmp}/kernel.ptx")
            ptx = Path(f"{tmp}/kernel.ptx").read_text()
        print("\n".join(f"ptxas: {line}" for line in ptxas_findings(ptx, arch.name)))
        print(report(disassemble(ptx, arch.name)))
    return 0
