"""`gen modelcheck`: how well the cost model ranks what was measured (no GPU needed).

    gen modelcheck --table cache/tuned/nvidia-h200_sm_90a_132sm.json
    gen modelcheck --table T.json --sweep a.json --sweep b.json --top 6

For every (layer shape, M) with at least --min correct timings (the tuned table's all_timings at each
bucket's edge, and `gen sweep --json` records), the measured candidates are ranked by
schedules/cost.py and compared with the measured best: the first pick's time, and the best time in
the selection a tune would measure (`--top`, at least half of it from each family). Per family and
across families; also the model's mean log error (bias) per family. For refitting the model after a
tune or a sweep: a change to cost.py is better when these ratios fall.

    gen modelcheck --reach cache/tuned/nvidia-h200_sm_90a_132sm.json

--fallback asks how good the untuned-shape fallback is: each problem of the table left out in turn,
its buckets' fallback choices against the fastest the tune measured (gen/dev/fallback_check.py).

--reach asks the other question, whether a cold tune would find a table's winners at all: for every
entry, is its winner (up to the family's variant axes, which the first round does not spread over)
among the first round's candidates (gen.tune.search.plan with --top), and where does the model rank it
within its family? A winner outside the knob space (reached by `gen tune --variants`) has no rank.
"""
from __future__ import annotations

import json
from pathlib import Path
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
    version no longer has is skipped, and so are timings made after the activations' producer
    (harness "between": the cost model estimates a kernel replayed back to back); a missing or
    malformed file is a ValueError that names it."""
    from runtime.table import HARNESSES, REPLAY
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
            if kind == "table":      # the candidates' timings: inline, or in the history file beside it
                from runtime.table import history_path_of

                history = history_path_of(Path(path))
                inline = {(json.dumps(e["problem"], sort_keys=True), e["bucket"]): e.get("all_timings", [])
                          for e in data["entries"]}
                if history.exists():
                    for h in json.loads(history.read_text())["entries"]:
                        inline[(json.dumps(h["problem"], sort_keys=True), h["bucket"])] = h["all_timings"]
                records = [(e["problem"], e["bucket"], e.get("harness", REPLAY),
                            inline[(json.dumps(e["problem"], sort_keys=True), e["bucket"])]) for e in data["entries"]]
            else:
                records = [(r["problem"], r["m"], r.get("harness", REPLAY), r["results"]) for r in data]
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            what = "a tuned table" if kind == "table" else "a `gen sweep --json` file"
            raise ValueError(f"{path} is not {what} ({exc!r})") from None
        for problem_dict, m, harness, timings in records:
            if harness not in HARNESSES:
                raise ValueError(f"{path}: harness {harness!r} is not one of {HARNESSES}")
            if harness != REPLAY:
                continue
            for timing in timings:
                add(problem_dict, m, timing)
    return groups


def ranking_quality(groups: dict, arch, gpu, top: int, family: str | None = None,
                    min_timings: int = MIN_TIMINGS) -> Quality | None:
    """The cost model's ranking of the measured candidates (of `family`, or all), or None if no group
    has `min_timings` of them."""
    from schedules.cost import estimate_us

    from gen.tune.search import top_of_each_family

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


@dataclass
class Reach:
    """One tuned-table entry as a cold tune's first round sees it."""

    problem: object
    bucket: int
    winner: object
    in_first_round: bool
    family_rank: int | None      # 0 = the model's first pick of the winner's family; None = outside the space


def first_round_reach(table_path: str, arch, gpu, top: int) -> list[Reach]:
    """Per entry of the tuned table at `table_path`: whether the first round of a cold tune measures the
    entry's winner and the winner's place in its family's ranking; a malformed table is a ValueError."""
    from schedules.problem import Problem
    from schedules.registry import Schedule

    from gen.tune.search import first_round_ranking, top_of_each_family, without_variants

    try:
        with open(table_path) as f:
            entries = [(Problem(**e["problem"]), int(e["bucket"]), Schedule.from_dict(e["schedule"]))
                       for e in json.load(f)["entries"]]
    except OSError as exc:
        raise ValueError(f"{table_path}: {exc.strerror}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{table_path} is not a tuned table ({exc!r})") from None
    reach = []
    for problem, bucket, winner in entries:
        ranked = first_round_ranking(problem, bucket, arch, gpu)
        key = without_variants(winner)
        first = {without_variants(s) for s in top_of_each_family(ranked, top)}
        family = [without_variants(s) for s in ranked if s.family == winner.family]
        reach.append(Reach(problem, bucket, winner, key in first, family.index(key) if key in family else None))
    return reach


def register(subparsers) -> None:
    p = subparsers.add_parser("modelcheck", help="how well the cost model ranks recorded timings (no GPU)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="append", default=[], metavar="JSON", help="a tuned table (repeatable)")
    p.add_argument("--sweep", action="append", default=[], metavar="JSON",
                   help="a `gen sweep --json` file (repeatable)")
    p.add_argument("--arch", default="sm_90a", help="the arch the timings were taken on (default sm_90a)")
    p.add_argument("--top", type=int, default=None,
                   help="the selection a tune would measure (default 6; with --reach the tune's first round, 12)")
    p.add_argument("--reach", metavar="JSON", help="instead: which of this tuned table's winners a cold tune's "
                   "first round measures")
    p.add_argument("--fallback", metavar="JSON", help="instead: the untuned-shape fallback's choice for each of "
                   "this tuned table's problems, left out in turn, against the fastest its tune measured")
    p.set_defaults(func=run)


def run(args) -> int:
    from schedules.arch import get_arch
    from schedules.cost import GpuSpec

    from gen.tune.search import DEFAULT_TOP
    from gen.tune.command import format_table

    try:
        top = args.top if args.top is not None else (DEFAULT_TOP if args.reach else 6)
        if top < 1:
            raise ValueError(f"--top must be at least 1, got {top}")
        arch = get_arch(args.arch)
        gpu = GpuSpec.for_arch(arch)
        if args.reach:
            return print_reach(first_round_reach(args.reach, arch, gpu, top), top)
        if args.fallback:
            return print_fallback(args.fallback, arch, gpu)
        if not args.table and not args.sweep:
            raise ValueError("give recorded timings: --table T.json and/or --sweep S.json (or --reach T.json, "
                             "or --fallback T.json)")
        groups = load_timings(args.table, args.sweep)
    except ValueError as exc:
        print(f"gen modelcheck: {exc}", file=sys.stderr)
        return 2
    families = sorted({s.family for timed in groups.values() for s in timed})
    rows = []
    for family in [None] + families:
        q = ranking_quality(groups, arch, gpu, top, family)
        if q is not None:
            rows.append([family or "all families", q.groups, f"{q.first_mean:.3f}", f"{q.first_worst:.2f}",
                         f"{q.top_mean:.3f}", f"{q.log_bias:+.3f}", f"{q.log_rms:.3f}"])
    if not rows:
        print(f"gen modelcheck: no layer and M with {MIN_TIMINGS} or more correct timings valid on {arch.name}",
              file=sys.stderr)
        return 1
    print(f"cost model ({gpu.name}) against {sum(len(t) for t in groups.values())} timings; times relative to "
          "the measured best of each layer and M")
    print(format_table(["family", "layer-Ms", "first pick", "worst", f"best of top {top}", "log bias",
                        "log rms"], rows))
    return 0


def print_reach(reach: list[Reach], top: int) -> int:
    """The entries whose winner the first round misses, and how many it measures."""
    from gen.tune.command import format_table

    missed = [r for r in reach if not r.in_first_round]
    print(f"a cold tune's first round (top {top}) measures {len(reach) - len(missed)} of {len(reach)} winners "
          "(up to variant axes)")
    if missed:
        print(format_table(["KxN", "bucket", "winner", "rank in family"],
                           [[f"{r.problem.k}x{r.problem.n}", r.bucket, r.winner.name,
                             "outside the space" if r.family_rank is None else r.family_rank + 1] for r in missed]))
    return 0


def print_fallback(table_path: str, arch, gpu) -> int:
    """The fallback's choice per bucket, each problem left out of the table (gen/dev/fallback_check.py)."""
    from runtime.table import TableError, TunedTable

    from gen.dev.fallback_check import fallback_against_tune, summary
    from gen.tune.command import format_table

    try:
        table = TunedTable.read(table_path)
    except (OSError, TableError) as exc:
        raise ValueError(f"{table_path}: {exc}") from None
    timings = load_timings([table_path], [])
    for whole_shape, left_out in ((False, "each problem"), (True, "each shape in every dtype and form")):
        results = fallback_against_tune(table, timings, arch, gpu, whole_shape=whole_shape)
        by_problem: dict = {}
        for r in results:
            by_problem.setdefault(r.problem.name, []).append(f"{r.bucket}: " + ("-" if r.ratio is None else
                                                                                f"{r.ratio:.2f}"))
        print(f"{left_out} left out: the fallback's choice over the fastest measured, per bucket (-: the tune "
              "did not time it)")
        print(format_table(["problem", "buckets"], [[name, "  ".join(cells)] for name, cells in by_problem.items()]))
        print(summary(results))
    return 0
