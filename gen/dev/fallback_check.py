"""`gen modelcheck --fallback T.json`: the untuned-shape fallback's choice against a tune, from recorded
timings (no GPU).

Each problem of the table is left out in turn, as if nobody had tuned it: the fallback
(runtime/fallback.py) chooses for each of its buckets from the rest of the table (its twins' winners,
else the better-estimated winner of the nearest tuned layers and buckets), and the choice's measured
time at that bucket
(the tune measures the fallback's candidates beside its own: gen/tune/search.py's transfers) is
compared with the fastest measured there. With `whole_shape` the problem's shape leaves in every
form (dtype, zero points, activations), as for a model nobody tuned: no twin is left to take. A
choice the tune did not time has no ratio; the count of those says how much of the table the check
covers.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from runtime.table import TunedTable
from schedules.problem import Problem


@dataclass
class FallbackResult:
    problem: Problem
    bucket: int
    choice: str          # the schedule's name
    how: str             # how the fallback chose it
    ratio: float | None  # its measured time over the fastest measured; None: not measured


def fallback_against_tune(table: TunedTable, timings: dict, arch, gpu,
                          whole_shape: bool = False) -> list[FallbackResult]:
    """For every (problem, bucket) of `table` with recorded `timings` ({(problem, bucket): {schedule:
    us}}, gen.dev.modelcheck.load_timings), the fallback's choice with the problem (`whole_shape`: its
    shape in every form) left out."""
    from runtime.fallback import TunedWinner, fallback_schedule

    results = []
    everything = tuple(TunedWinner(p, bucket, entry.schedule) for (p, bucket), entry in table.items())
    for problem in sorted({p for (p, _), _ in table.items()}, key=lambda p: p.name):
        rest, winners = left_out(table, everything, problem, whole_shape)
        for (p, bucket), _ in table.items():
            timed = timings.get((p, bucket))
            if p != problem or not timed:
                continue
            schedule, how = fallback_schedule(problem, bucket, arch, gpu, winners, rest)
            mine = timed.get(schedule)
            ratio = mine / min(timed.values()) if mine is not None else None
            results.append(FallbackResult(problem, bucket, schedule.name, how, ratio))
    return results


def left_out(table: TunedTable, winners: tuple, problem: Problem, whole_shape: bool) -> tuple[TunedTable, tuple]:
    """(table, winners) as if nobody had tuned `problem` (`whole_shape`: its shape in any dtype or
    form): the entries and the winners (TunedWinner) of everything else."""
    def kept(other: Problem) -> bool:
        return other != problem and not (whole_shape and _shape(other) == _shape(problem))

    rest = TunedTable(table.gpu)
    for (p, bucket), entry in table.items():
        if kept(p):
            rest.record(p, bucket, entry.schedule, entry.us)
    return rest, tuple(w for w in winners if kept(w.problem))


def _shape(problem: Problem) -> tuple:
    return problem.n, problem.k, problem.group, problem.bits


def summary(results: list[FallbackResult], within: float = 1.10) -> str:
    """One line: how many choices were measured, their median and worst ratio, how many within `within`."""
    ratios = [r.ratio for r in results if r.ratio is not None]
    if not ratios:
        return f"none of the fallback's {len(results)} choices was measured"
    return (f"{len(ratios)} of {len(results)} choices measured: median {statistics.median(ratios):.3f}x the "
            f"fastest, worst {max(ratios):.2f}x, {sum(r <= within for r in ratios)} within "
            f"{round((within - 1) * 100)} %")
