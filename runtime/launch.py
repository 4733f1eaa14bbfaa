"""Running a compiled GEMM kernel: its arguments from the schedule family, with the split-K workspace
of the output's stream (runtime/workspace.py). The op and the first-run check launch through here."""
from __future__ import annotations

import torch

from schedules.problem import Problem
from schedules.registry import Schedule

from .workspace import split_k_workspace


def launch_schedule(kernel, schedule: Schedule, problem: Problem, a, qweight, scales, out: torch.Tensor) -> None:
    """Run `kernel`, compiled from `schedule` for `problem`, on kernel-ready activations a (contiguous;
    FP8 problems: the (values, token scales) pair), with the split-K workspace of out's stream."""
    fam, knobs = schedule.module, schedule.knobs
    fp32_elems, counters = fam.workspace_elems(problem, knobs, out.shape[0])
    partials, tile_counters = split_k_workspace(out.device, fp32_elems, counters) if fp32_elems or counters else (None, None)
    kernel(*fam.kernel_args(problem, knobs, a, qweight, scales, out, partials, tile_counters))
