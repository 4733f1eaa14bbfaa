"""The schedule for a (problem, bucket) that no tuned table covers, chosen in milliseconds.

Ranking a family's whole knob space with the cost model takes tens of seconds (over 100,000 points
for a large layer), far too long on a serving path. Winners transfer well instead: the kernel that
won one layer and batch size on a GPU is usually good for a neighbouring shape, and the tuned tables
hold the winners of every tuned (layer, bucket). The nearest are the same shape's: a problem that
differs from a tuned one only in the activations' dtype or in its zero points runs the same loads,
tiles and splits, and only its decode differs. So the fallback first takes the tuned winner of such a
twin at the same bucket (same dtype first, then same zero points), if it is valid for the problem (the
family's check: divisibility, shared memory, registers; scale_on_acc, for one, takes no zero points).
Otherwise it takes the winners of every trusted table for this arch (this GPU's first), keeps the
valid ones, and lets the cost model pick among that handful at the bucket's M (on the H200 the
cost model's pick among them ran bf16 o_proj at M = 64 in 12.6 us where the fp16 twin's winner takes
7.4). Only where no winner fits (a new arch, or an odd shape) does it rank the whole space, and it
says so in the warning the caller raises.
"""
from __future__ import annotations

import dataclasses

from schedules.arch import Arch
from schedules.cost import GpuSpec, best_schedule, estimate_us
from schedules.problem import Problem
from schedules.registry import Schedule
from schedules.stream_wgmma.knobs import form_for


def for_problem(problem: Problem, schedule: Schedule) -> Schedule:
    """A winner in the form `problem` takes (stream_wgmma.knobs.form_for: FP8 activations' 128-deep
    k-tiles and scales on the sums; no scale_on_acc with zero points), others as they are (the
    family's check then decides)."""
    if schedule.family == "stream_wgmma":
        return Schedule(schedule.family, form_for(problem, schedule.knobs))
    return schedule


def ranked_transfers(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners) -> list[Schedule]:
    """The `winners` that can run `problem` on `arch` (in its form: for_problem), fastest estimate at
    `bucket` first. Ties go to the schedule's name, so the order never depends on the order of the
    tables."""
    forms = {for_problem(problem, s) for s in winners}
    valid = sorted({s for s in forms if s.module.check(problem, s.knobs, arch) is None}, key=lambda s: s.name)
    return sorted(valid, key=lambda s: estimate_us(problem, s, bucket, gpu))


def transferred(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners) -> Schedule | None:
    """The cost model's pick among `winners` that can run `problem` on `arch`, or None."""
    ranked = ranked_transfers(problem, bucket, arch, gpu, winners)
    return ranked[0] if ranked else None


def twins(problem: Problem) -> list[Problem]:
    """The problems of the same shape, group and bits that differ in dtype or zero points, nearest
    first: the other zero-point setting, then the other dtype, then both. With FP8 activations (no
    zero points): the other dtype's, then the W4A16 problems of either dtype."""
    other_dtype = "bfloat16" if problem.dtype == "float16" else "float16"
    if problem.fp8:
        return [dataclasses.replace(problem, dtype=other_dtype), dataclasses.replace(problem, act="dtype"),
                dataclasses.replace(problem, act="dtype", dtype=other_dtype)]
    return [dataclasses.replace(problem, zero_points=not problem.zero_points),
            dataclasses.replace(problem, dtype=other_dtype),
            dataclasses.replace(problem, dtype=other_dtype, zero_points=not problem.zero_points)]


def twin_winners(problem: Problem, bucket: int, arch: Arch, table) -> list[tuple[Schedule, Problem]]:
    """(tuned winner, twin) of each twin at `bucket` whose winner can run `problem`, nearest first."""
    found = []
    for twin in twins(problem):
        schedule = table.lookup(twin, bucket)
        if schedule is not None:
            schedule = for_problem(problem, schedule)
        if schedule is not None and schedule.module.check(problem, schedule.knobs, arch) is None:
            found.append((schedule, twin))
    return found


def fallback_schedule(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners,
                      table=None) -> tuple[Schedule, str]:
    """(schedule, how it was chosen) for an untuned (problem, bucket); `table` (a TunedTable) offers
    the twins' entries."""
    found = twin_winners(problem, bucket, arch, table) if table is not None else []
    if found:
        schedule, twin = found[0]
        return schedule, f"the tuned winner of {twin.name} at this bucket"
    schedule = transferred(problem, bucket, arch, gpu, winners)
    if schedule is not None:
        return schedule, f"the best-estimated of {len(set(winners))} tuned winners"
    return best_schedule(problem, bucket, arch, gpu), "the cost model's pick of the whole search space"
