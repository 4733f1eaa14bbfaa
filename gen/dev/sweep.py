"""`gen sweep`: time a grid of one family's knobs on a model's layers, for kernel development.

    gen sweep --family stream_mma --knobs "warps=4,8 unroll=4,8 split_k=1,2,4,8" --model llama-2-7b --ms 1,8
    gen sweep --family stream_mma --knobs "fold_zero_point=0,1" --shapes 4096x22016 --ms 1 --json out.json

Where `gen tune` lets the cost model choose the candidates and records winners, a sweep measures
exactly the grid it is given (knobs not named keep the family's defaults) and records nothing in
the tuned table: it answers "is this knob faster, and where". Every candidate goes through the same
compile, reference check and timing as in the tune (gen/search.py); the output is per layer and M
the FP16 time and the fastest candidates, then the layers summed with each layer's best.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

from gen.models import add_layer_arguments
from gen.tune.options import positive_workers


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="time a grid of one schedule family's knobs (kernel development)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, help="schedule family, e.g. stream_mma")
    p.add_argument("--knobs", default="", help='the grid: "name=v1,v2 name=v3 ..." (unnamed knobs keep their defaults)')
    add_layer_arguments(p, shapes_help="KxN shapes, comma separated, e.g. 4096x12288,11008x4096")
    p.add_argument("--ms", default="1,16", help="M values (bucket edges), comma separated (default: %(default)s)")
    p.add_argument("--show", type=int, default=5, help="fastest candidates printed per layer and M (default: %(default)s)")
    p.add_argument("--json", metavar="FILE",
                   help="write every candidate's time, error and knobs to FILE (rewritten after every bucket)")
    p.add_argument("--workers", type=positive_workers, help="parallel compile processes (default: one per CPU core)")
    p.add_argument("--between", action="store_true",
                   help="time every candidate (and FP16) after the activations' producer, as a model runs its GEMMs, "
                        "instead of back to back")
    p.set_defaults(func=run)


def parse_grid(family, text: str) -> list:
    """Every Knobs of `family` in the grid "name=v1,v2 name=v3"; a knob named twice, an unknown knob
    or a value of the wrong type is an error that names it."""
    from schedules.knob_space import knob_value

    known = [f.name for f in dataclasses.fields(family.Knobs)]
    axes: dict[str, list] = {}
    for item in text.split():
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"bad knob {item!r}: expected name=value[,value...]")
        if name not in known:
            raise ValueError(f"{family.NAME} has no knob {name!r}; its knobs: {', '.join(known)}")
        if name in axes:
            raise ValueError(f"knob {name!r} is given twice")
        axes[name] = [knob_value(family.Knobs, name, v) for v in values.split(",")]
    names = list(axes)
    return [family.Knobs(**dict(zip(names, combo))) for combo in itertools.product(*axes.values())]


def run(args) -> int:
    from schedules.registry import family as family_named

    from gen.tune.options import parse_buckets, targets_from_args

    try:
        fam = family_named(args.family)
        grid = parse_grid(fam, args.knobs)
        targets = targets_from_args(args)
        ms = parse_buckets(args.ms, flag="--ms")
    except ValueError as exc:
        print(f"gen sweep: {exc}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gen sweep: no CUDA GPU is visible; a sweep measures, so it needs one "
              "(`gen tune --dry-run` ranks candidates without a GPU)", file=sys.stderr)
        return 2
    return sweep_on_gpu(args, fam, grid, targets, ms)


def sweep_on_gpu(args, fam, grid, targets, ms) -> int:
    from schedules.arch import current_arch
    from schedules.cost import GpuSpec, estimate_us
    from schedules.registry import Schedule

    from gen.tune.command import format_table
    from gen.tune.measuring import MeasureError
    from gen.tune.rounds import compile_and_measure_with_progress
    from gen.tune.search import BucketSearch, Result

    arch, gpu = current_arch(), GpuSpec.current()
    searches, invalid = [], 0
    for t in targets:
        valid = [k for k in grid if fam.check(t.problem, k, arch) is None]
        invalid += len(grid) - len(valid)
        schedules = [Schedule(fam.NAME, k) for k in valid]
        for m in ms:
            searches.append(BucketSearch(t.problem, m, [Result(s, estimate_us(t.problem, s, m, gpu)) for s in schedules]))
    print(f"sweep of {len(grid)} {fam.NAME} knob settings x {len(targets)} shapes x M in {ms} on {arch.name}"
          + (f"; {invalid} (shape, setting) pairs fail the family's check and are skipped" if invalid else ""))
    if not any(s.results for s in searches):
        print("gen sweep: no valid candidate in the grid", file=sys.stderr)
        return 2
    finished = []

    def save(search=None):
        # After every bucket, so that a sweep cut short (a time limit) keeps what it measured.
        if search is not None:
            finished.append(search)
        if args.json:
            write_records(Path(args.json), finished, args.between)

    try:
        compile_and_measure_with_progress(searches, arch, args.workers, {t.problem: t.label for t in targets},
                                          on_bucket=save, between=args.between)
    except MeasureError as exc:
        print(f"gen sweep: {exc}", file=sys.stderr)
        return 1
    print(report(targets, ms, searches, args.show, format_table))
    if args.json:
        write_records(Path(args.json), searches, args.between)
        print(f"wrote {args.json}")
    return 0


def write_records(path: Path, searches, between: bool = False) -> None:
    """The searches' timings as `gen sweep --json` records (what --seed and gen modelcheck read); timed
    after the activations' producer (--between), each record says so (`"harness": "between"`, as a
    tuned table's entries do), since those times include a kernel boundary the cost model leaves out."""
    from runtime.cache_files import atomic_write
    from runtime.table import BETWEEN

    harness = {"harness": BETWEEN} if between else {}
    atomic_write(path, json.dumps([{"problem": dataclasses.asdict(s.problem), "m": s.bucket, "fp16_us": s.fp16_us,
                                    **harness, "results": s.timings()} for s in searches], indent=1))


def report(targets, ms, searches, show: int, format_table) -> str:
    """Per layer and M the fastest candidates, then per M the layers summed (each layer's best)."""
    by = {(s.problem, s.bucket): s for s in searches}
    rows, sums = [], {m: [0.0, 0.0, True] for m in ms}
    for t in targets:
        for m in ms:
            s = by[(t.problem, m)]
            timed = sorted((r for r in s.results if r.us is not None and r.error is None), key=lambda r: r.us)
            failed = sum(r.error is not None for r in s.results)
            fp16 = s.fp16_us
            best = " ".join(f"{r.schedule.knobs.name}:{r.us:.1f}" for r in timed[:show]) or "(none correct)"
            speed = f"{fp16 / timed[0].us:.2f}x" if timed and fp16 else "-"
            rows.append([t.label, m, f"{fp16:.1f}" if fp16 else "-", speed, failed, best])
            if timed and fp16:
                sums[m][0] += fp16
                sums[m][1] += timed[0].us
            else:
                sums[m][2] = False
    out = [format_table(["layer", "M", "FP16 us", "best vs FP16", "failed", "fastest (knobs:us)"], rows), ""]
    summed = [[m, f"{f:.1f}", f"{q:.1f}", f"{f / q:.2f}x"] for m, (f, q, complete) in sums.items() if complete and q]
    if summed:
        out.append(format_table(["M", "FP16 sum us", "best sum us", "speedup"], summed))
    return "\n".join(out)
