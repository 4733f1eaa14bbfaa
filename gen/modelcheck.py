"""`gen modelcheck`: how well the cost model ranks what was measured (no GPU needed).

    gen modelcheck --table cache/tuned/nvidia-h200_sm_90a_132sm.json
    gen modelcheck --table T.json --sweep a.json --sweep b.json --top 6

For every (layer shape, M) with at least --min correct timings (the tuned table's all_timings at each
bucket's edge, and `gen sweep --json` records), the measured candidates are ranked by
schedules/cost.py and compared with the measured best: the first pick's time, and the best time in
the selection a tune would measure (`--top`, at least half of it from each family). Per family and
across families; also the model's mean log error (bias) per family. For refitting the model after a
tune or a sweep: a change to cost.py is better when these ratios fall.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass

MIN_TIMINGS = 4


@dataclass
class Quality:
    """The model's ranking over `groups` (layer, M) pairs: measured time of its first pick and of the
    best in its top selection, each over the measured best; log(estimate / measured) over all timings."""

    groups: int
    first_mean: float
    first_worst: float
    top_mean: float
    log_bias: float
    log_rms: float


def load_timings(table_paths: list[str], sweep_paths: list[str]) -> dict:
    """{(problem, m): {schedule: us}} from tuned tables and sweep records; a schedule whose knobs this
    version no longer has is skipped, a missing or malformed file is a ValueError that names it."""
    from schedules.problem import Problem
    from schedules.registry import Schedule

    groups: dict = {}

    def add(problem_dict, m, timing):
        if timing.get("us") is None or timing.get("error"):
            return
        try:
            schedule = Schedule.from_dict(timing["schedule"])
        except (KeyError, TypeError, ValueError):
            return
        groups.setdefault((Problem(**problem_dict), int(m)), {})[schedule] = float(timing["us"])

    for path, kind in [(p, "table") for p in table_paths] + [(p, "sweep") for p in sweep_paths]:
        try:
            with open(path) as f:
                data = json.load(f)
            records = [(e["problem"], e["bucket"], e.get("all_timings", [])) for e in data["entries"]] \
                if kind == "table" else [(r["problem"], r["m"], r["results"]) for r in data]
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            what = "a tuned table" if kind == "table" else "a `gen sweep --json` file"
            raise ValueError(f"{path} is not {what} ({exc!r})") from None
        for problem_dict, m, timings in records:
            for timing in timings:
                add(problem_dict, m, timing)
    return groups


def ranking_quality(groups: dict, arch, gpu, top: int, family: str | None = None,
                    min_timings: int = MIN_TIMINGS) -> Quality | None:
    """The cost model's ranking of the measured candidates (of `family`, or all), or None if no group
    has `min_timings` of them."""
    from schedules.cost import estimate_us

    from .search import top_of_each_family

    first, best_of_top, logs = [], [], []
    for (problem, m), timed in groups.items():
        mine = {s: us for s, us in timed.items() if (family is None or s.family == family)
                and s.module.check(problem, s.knobs, arch) is None}
        if len(mine) < min_timings:
            continue
        estimates = {s: estimate_us(problem, s, m, gpu) for s in mine}
        ranked = sorted(mine, key=lambda s: (estimates[s], s.name))
        best = min(mine.values())
        first.append(mine[ranked[0]] / best)
        best_of_top.append(min(mine[s] for s in top_of_each_family(ranked, top)) / best)
        logs += [math.log(estimates[s] / us) for s, us in mine.items()]
    if not first:
        return None
    return Quality(len(first), statistics.mean(first), max(first), statistics.mean(best_of_top),
                   statistics.mean(logs), math.sqrt(statistics.mean(x * x for x in logs)))


def register(subparsers) -> None:
    p = subparsers.add_parser("modelcheck", help="how well the cost model ranks recorded timings (no GPU)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="append", default=[], metavar="JSON", help="a tuned table (repeatable)")
    p.add_argument("--sweep", action="append", default=[], metavar="JSON",
                   help="a `gen sweep --json` file (repeatable)")
    p.add_argument("--arch", default="sm_90a", help="the arch the timings were taken on (default sm_90a)")
    p.add_argument("--top", type=int, default=6, help="the selection a tune would measure (default 6)")
    p.set_defaults(func=run)


def run(args) -> int:
    from schedules.arch import get_arch
    from schedules.cost import GpuSpec

    from .tune import format_table

    try:
        if not args.table and not args.sweep:
            raise ValueError("give recorded timings: --table T.json and/or --sweep S.json")
        if args.top < 1:
            raise ValueError(f"--top must be at least 1, got {args.top}")
        arch = get_arch(args.arch)
        gpu = GpuSpec.for_arch(arch)
        groups = load_timings(args.table, args.sweep)
    except ValueError as exc:
        print(f"gen modelcheck: {exc}", file=sys.stderr)
        return 2
    families = sorted({s.family for timed in groups.values() for s in timed})
    rows = []
    for family in [None] + families:
        q = ranking_quality(groups, arch, gpu, args.top, family)
        if q is not None:
            rows.append([family or "all families", q.groups, f"{q.first_mean:.3f}", f"{q.first_worst:.2f}",
                         f"{q.top_mean:.3f}", f"{q.log_bias:+.3f}", f"{q.log_rms:.3f}"])
    if not rows:
        print(f"gen modelcheck: no layer and M with {MIN_TIMINGS} or more correct timings valid on {arch.name}",
              file=sys.stderr)
        return 1
    print(f"cost model ({gpu.name}) against {sum(len(t) for t in groups.values())} timings; times relative to "
          "the measured best of each layer and M")
    print(format_table(["family", "layer-Ms", "first pick", "worst", f"best of top {args.top}", "log bias",
                        "log rms"], rows))
    return 0
