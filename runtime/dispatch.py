"""How the op chooses a GPU's kernel for a (problem, M bucket), apart from running it.

The tuned table of the GPU names the schedule, else the fallback picks one (runtime/fallback.py: its
twin's winner, or one of the arch's tuned winners; one warning per problem says how to tune it), for
the problem that serves the bucket (`Dispatch.serving_problem`: a W4A8 problem's W4A16 twin at some).
`Dispatch` holds what the choice depends on and makes it as a function of those inputs alone, so the
op (runtime/op.py) and the precompile plan (runtime/precompile.py) name the same kernels;
`dispatch_for` reads a GPU's table and winners once per process.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch

from schedules.arch import Arch
from schedules.problem import Problem
from schedules.registry import FAMILIES, Schedule

from .table import bucket_of

DEFAULT_LAYOUT = FAMILIES["marlin_mma"].LAYOUT


class UntunedShapeWarning(UserWarning):
    """A problem has no tuned kernel on this GPU; the fallback's choice among the tuned winners runs
    (runtime/fallback.py)."""


@dataclass(frozen=True)
class Dispatch:
    """What the op's choice of a kernel depends on, for one GPU: its arch, its cost-model numbers
    (schedules.cost.GpuSpec), its tuned table, and the arch's tuned winners an untuned shape
    chooses from (runtime.table.winners_for_arch)."""

    arch: Arch
    gpu: object
    table: object
    winners: tuple   # runtime.fallback.TunedWinner

    def serving_problem(self, problem: Problem, bucket: int) -> Problem:
        """The problem whose kernel runs `problem` at `bucket`: itself, except that a W4A8 problem runs
        as fp8_rounded on its W4A16 twin's schedule (the same packed weights; FP16 / BF16 MMAs on the
        activations rounded to their FP8 values by the kernel, the same products, no activation kernel
        before it) where the tuned table times the twin's kernel faster at that bucket and its family
        rounds (stream_mma, stream_wgmma): at small M, memory-bound, the FP8 kernels' 128-deep k-tiles
        and promoted sums cost more than their math saves. Without both entries, the problem itself."""
        if not problem.fp8:
            return problem
        fp8, dense = self.table.entry(problem, bucket), self.table.entry(problem.w4a16_twin, bucket)
        if fp8 is None or dense is None or dense.us >= fp8.us:
            return problem
        rounded = problem.rounded_twin
        return rounded if dense.schedule.module.check(rounded, dense.schedule.knobs, self.arch) is None else problem

    def choose(self, problem: Problem, bucket: int, layout: str) -> tuple[Schedule, str | None]:
        """(schedule, how it was chosen: None for the tuned table's entry, else the fallback's note).
        The schedule's family must read weights packed in `layout`."""
        from . import fallback

        # (fp8_rounded runs its W4A16 twin's schedules: it has no entries of its own)
        schedule, how = self.table.lookup(problem.w4a16_twin if problem.rounds_fp8 else problem, bucket), None
        if schedule is None:
            schedule, how = fallback.fallback_schedule(problem, bucket, self.arch, self.gpu, self.winners,
                                                       self.table)
        if schedule.module.LAYOUT != layout:
            raise ValueError(f"{schedule.name} reads weights in layout {schedule.module.LAYOUT}, but these are "
                             f"packed in {layout}; repack the layer for it")
        return schedule, how


_LOCK = threading.Lock()     # guards the dicts below; held for lookups and inserts only
_TABLES: dict[int, object] = {}          # device index -> this GPU's TunedTable
_WINNERS: dict[str, tuple] = {}          # arch -> the tuned winners an untuned shape chooses from
_WARNED: set[Problem] = set()


def cuda_device(device) -> torch.device:
    """`device` as a torch.device with an index; None is the current CUDA device."""
    device = torch.device("cuda") if device is None else torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def dispatch_for(device=None) -> Dispatch:
    """What the op's choices on `device` depend on: its arch, its cost-model numbers, its tuned table
    and the arch's tuned winners, each read once per process."""
    from schedules.arch import current_arch
    from schedules.cost import GpuSpec

    device = cuda_device(device)
    arch = current_arch(device)
    return Dispatch(arch, GpuSpec.current(device), _tuned_table(device), _winners(arch.name))


def schedule_for(problem: Problem, m: int, device=None, layout: str = DEFAULT_LAYOUT) -> Schedule:
    """The schedule the op runs for `problem` at M = m on `device`: the tuned table's, else its twin's
    winner or the best of the tuned winners that fit (runtime/fallback.py), warning once per problem.
    Its family must use `layout`."""
    device = cuda_device(device)
    # The bucket's upper edge, as the tuner measures it: one choice per bucket.
    schedule, how = dispatch_for(device).choose(problem, bucket_of(m), layout)
    if how is not None:
        _warn_untuned(problem, device, schedule, how)
    return schedule


def forget_tables() -> None:
    """Read the tuned tables again at the next choice (runtime.load_artifact installs entries); the
    kernels already chosen keep serving."""
    with _LOCK:
        _TABLES.clear()
        _WINNERS.clear()


def _tuned_table(device: torch.device):
    table = _TABLES.get(device.index)
    if table is None:
        from .table import GpuKey, load_tuned_table

        table = load_tuned_table(GpuKey.current(device))
        with _LOCK:
            table = _TABLES.setdefault(device.index, table)
    return table


def _winners(arch: str) -> tuple:
    winners = _WINNERS.get(arch)
    if winners is None:
        from .table import winners_for_arch

        winners = winners_for_arch(arch)
        with _LOCK:
            winners = _WINNERS.setdefault(arch, winners)
    return winners


def _warn_untuned(problem: Problem, device: torch.device, schedule: Schedule, how: str) -> None:
    with _LOCK:
        if problem in _WARNED:
            return
        _WARNED.add(problem)
    command = f"gen tune --shapes {problem.k}x{problem.n} --group {-1 if problem.channelwise else problem.group}"
    if problem.dtype != "float16":
        command += f" --dtype {problem.dtype}"
    if problem.zero_points:
        command += " --zero-points"
    if problem.fp8:
        command += " --act fp8"
    warnings.warn(
        f"no tuned kernel for {problem.name} on {torch.cuda.get_device_name(device)}; running {schedule.name}, "
        f"{how}, which may be slower. Tune this shape with: {command}",
        UntunedShapeWarning, stacklevel=2)
