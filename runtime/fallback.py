"""The schedule for a (problem, bucket) that no tuned table covers, chosen in milliseconds.

Ranking a family's whole knob space with the cost model takes tens of seconds (over 100,000 points
for a large layer), far too long on a serving path. Winners transfer well instead: the kernel that
won one layer and batch size on a GPU is usually good for a neighbouring shape, and the tuned tables
hold the winners of every tuned (layer, bucket). So the fallback takes the winners of every trusted
table for this arch (this GPU's first), keeps those that are valid for the problem (the family's
check: divisibility, shared memory, registers), and lets the cost model pick among that handful at
the bucket's M. Only where no winner fits (a new arch, or an odd shape) does it rank the whole
space, and it says so in the warning the caller raises.
"""
from __future__ import annotations

from schedules.arch import Arch
from schedules.cost import GpuSpec, best_schedule, estimate_us
from schedules.problem import Problem
from schedules.registry import Schedule


def transferred(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners) -> Schedule | None:
    """The cost model's pick among `winners` that can run `problem` on `arch`, or None. Ties go to
    the schedule's name, so the choice never depends on the order of the tables."""
    valid = sorted({s for s in winners if s.module.check(problem, s.knobs, arch) is None}, key=lambda s: s.name)
    if not valid:
        return None
    return min(valid, key=lambda s: estimate_us(problem, s, bucket, gpu))


def fallback_schedule(problem: Problem, bucket: int, arch: Arch, gpu: GpuSpec, winners) -> tuple[Schedule, str]:
    """(schedule, how it was chosen) for an untuned (problem, bucket)."""
    schedule = transferred(problem, bucket, arch, gpu, winners)
    if schedule is not None:
        return schedule, f"the best-estimated of {len(set(winners))} tuned winners"
    return best_schedule(problem, bucket, arch, gpu), "the cost model's pick of the whole search space"
