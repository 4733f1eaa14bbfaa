"""The schedule for a (problem, bucket) that no tuned table covers, chosen in milliseconds.

Ranking a family's whole knob space with the cost model takes tens of seconds (over 100,000 points
for a large layer), far too long on a serving path. Winners transfer well instead: the kernel that
won one layer and batch size on a GPU is usually good for a neighbouring shape, and the tuned tables
hold the winners of every tuned (layer, bucket). The nearest are the same shape's: a problem that
differs from a tuned one only in the activations' dtype or in its zero points runs the same loads,
tiles and splits, and only its decode differs. So the fallback first takes the tuned winner of such a
twin at the same bucket (same dtype first, then same zero points), if it is valid for the problem (the
family's check: divisibility, shared memory, registers; scale_on_acc, for one, takes no channelwise scales).
Otherwise it takes the winners of the NEAREST tuned (layer, bucket)s that can run the problem
(`distance`: M buckets apart, then how far N and K are in ratio), and the cost model picks between
those few, unless the nearest is all but the same layer and bucket (SAME_SHAPE), whose winner runs
as it is. Nearness beats the cost model's ranking of every winner: on layers no table held (bf16
Llama-3-70B at tp 4 and 8, Qwen2.5-72B's INT4 checkpoints at tp 4 and 8, 156 (layer, bucket)s timed
on the H200), this choice ran within 10 % of a tune's fastest in 121, the cost model's pick among all
winners in 95 (docs/performance.md, "The fallback's choice against a tune").
Only where no winner fits (a new arch, or an odd shape) does it rank the whole space, and it
says so in the warning the caller raises.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from schedules.arch import Arch
from schedules.cost import GpuSpec, best_schedule, estimate_us
from schedules.problem import Problem
from schedules.registry import Schedule
from schedules.stream_wgmma.knobs import form_for


NEAREST = 2        # tuned (layer, bucket)s whose winners the cost model chooses between
SAME_SHAPE = 0.1   # a tuned winner this near (same bucket, N and K within ~10 % together) runs as it is


class TunedWinner(NamedTuple):
    """A tuned table's winner and the (problem, bucket) it won."""

    problem: Problem
    bucket: int
    schedule: Schedule


def distance(problem: Problem, bucket: int, tuned: TunedWinner) -> float:
    """How far a tuned (problem, bucket) is from an untuned one: octaves of M bucket apart, plus the
    natural-log ratios of N and of K, plus half a step for a different dtype or zero-point setting and
    a step for other activations (what the kernel reads and decodes differs, not its tiles)."""
    other = tuned.problem
    return (abs(math.log2(bucket / tuned.bucket)) + abs(math.log(problem.n / other.n))
            + abs(math.log(problem.k / other.k)) + 0.5 * (problem.dtype != other.dtype)
            + 0.5 * (problem.zero_points != other.zero_points) + 1.0 * (problem.act != other.act))


def for_problem(problem: Problem, schedule: Schedule) -> Schedule:
    """A winner in the form `problem` takes (stream_wgmma.knobs.form_for: FP8 activations' 128-deep
    k-tiles and scales on the sums; no scale_on_acc with channelwise scales), others as they are (the
    family's check then decides)."""
    if schedule.family == "stream_wgmma":
        return Schedule(schedule.family, form_for(problem, schedule.knobs))
    return schedule


def _can_run(problem: Problem, schedule: Schedule, arch: Arch) -> bool:
    return schedule.module.check(problem, schedule.knobs, arch) is None


def ranked_transfers(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners) -> list[Schedule]:
    """The schedules of `winners` (TunedWinner) that can run `problem` on `arch` (in its form:
    for_problem), fastest estimate at `bucket` first: what a tune measures beside the nearest ones.
    Ties go to the schedule's name, so the order never depends on the order of the tables."""
    forms = {for_problem(problem, w.schedule) for w in winners}
    valid = sorted((s for s in forms if _can_run(problem, s, arch)), key=lambda s: s.name)
    return sorted(valid, key=lambda s: estimate_us(problem, s, bucket, gpu))


def _nearest(problem: Problem, bucket: int, arch: Arch, winners, count: int) -> list[tuple[float, Schedule]]:
    """(distance, schedule in `problem`'s form) of the `count` nearest `winners` with distinct schedules
    that can run it, nearest first; ties in distance go to the names, so the order never depends on
    the order of the tables."""
    found: dict[Schedule, float] = {}
    for tuned in sorted(winners, key=lambda w: (distance(problem, bucket, w), w.schedule.name, w.problem.name,
                                                w.bucket)):
        schedule = for_problem(problem, tuned.schedule)
        if schedule not in found and _can_run(problem, schedule, arch):
            found[schedule] = distance(problem, bucket, tuned)
            if len(found) == count:
                break
    return [(d, s) for s, d in found.items()]


def nearest_transfers(problem: Problem, bucket: int, arch: Arch, winners, count: int = NEAREST) -> list[Schedule]:
    """The distinct schedules, in `problem`'s form, of the `count` nearest `winners` (TunedWinner, by
    `distance`) that can run it, nearest first."""
    return [schedule for _, schedule in _nearest(problem, bucket, arch, winners, count)]


def transferred(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners) -> Schedule | None:
    """The nearest `winners`' schedule (TunedWinner) that can run `problem` on `arch`: the nearest as it
    is within SAME_SHAPE, else the cost model's pick of the NEAREST; None where none can."""
    near = _nearest(problem, bucket, arch, winners, NEAREST)
    if not near:
        return None
    if near[0][0] <= SAME_SHAPE:
        return near[0][1]
    return min((s for _, s in near), key=lambda s: (estimate_us(problem, s, bucket, gpu), s.name))


def twins(problem: Problem) -> list[Problem]:
    """The problems of the same shape, group and bits that differ in dtype or zero points, nearest
    first: the other dtype (the same form: the zero points' decode decides more of a winner's knobs
    than the dtype's, docs/performance.md), then the other zero-point setting, then both. With FP8
    activations, also rounded to them in the kernel (no zero points): the other dtype's, then the W4A16
    problems of either dtype."""
    other_dtype = "bfloat16" if problem.dtype == "float16" else "float16"
    if problem.act != "dtype":
        return [dataclasses.replace(problem, dtype=other_dtype), dataclasses.replace(problem, act="dtype"),
                dataclasses.replace(problem, act="dtype", dtype=other_dtype)]
    return [dataclasses.replace(problem, dtype=other_dtype),
            dataclasses.replace(problem, zero_points=not problem.zero_points),
            dataclasses.replace(problem, dtype=other_dtype, zero_points=not problem.zero_points)]


def twin_winners(problem: Problem, bucket: int, arch: Arch, table) -> list[tuple[Schedule, Problem]]:
    """(tuned winner, twin) of each twin at `bucket` whose winner can run `problem`, nearest first."""
    found = []
    for twin in twins(problem):
        schedule = table.lookup(twin, bucket)
        if schedule is not None:
            schedule = for_problem(problem, schedule)
        if schedule is not None and _can_run(problem, schedule, arch):
            found.append((schedule, twin))
    return found


def fallback_schedule(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners,
                      table=None, exclude: frozenset = frozenset()) -> tuple[Schedule, str]:
    """(schedule, how it was chosen) for an untuned (problem, bucket); `winners` are the tuned winners
    (TunedWinner) to transfer from, `table` (a TunedTable) offers the twins' entries; never a schedule
    in `exclude` (in `problem`'s form: one that failed its first-run check)."""
    found = [(s, twin) for s, twin in twin_winners(problem, bucket, arch, table) if s not in exclude] \
        if table is not None else []
    if found:
        schedule, twin = found[0]
        return schedule, f"the tuned winner of {twin.name} at this bucket"
    others = [w for w in winners if for_problem(problem, w.schedule) not in exclude]
    schedule = transferred(problem, bucket, arch, gpu, others)
    if schedule is not None:
        return schedule, (f"from the tuned winners of the nearest layers and buckets (the nearest where it is all but "
                          f"this one, else the better-estimated of the {NEAREST} nearest)")
    return best_schedule(problem, bucket, arch, gpu, exclude), "the cost model's pick of the whole search space"
