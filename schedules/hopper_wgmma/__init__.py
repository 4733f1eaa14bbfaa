"""hopper_wgmma: TMA + wgmma + warp specialization for large M on sm_90a (see kernel.py)."""
from __future__ import annotations

from ..arch import Arch
from ..knob_space import positional, valid_points
from ..problem import Problem
from .. import marlin_mma
from .kernel import PASS_CONFIGS, build
from .knobs import Knobs, check

NAME = "hopper_wgmma"
# Reads marlin_mma's packed weights: one packed copy of a layer serves both families.
LAYOUT = marlin_mma.LAYOUT
layout = marlin_mma.layout
pack, unpack = marlin_mma.pack, marlin_mma.unpack

AXES = {
    "block_m": (64, 128, 256),
    "block_n": (64, 128, 256),
    "block_k": (32, 64, 128),
    "threads": (128, 256),
    "num_stages": (2, 3, 4),
}


from_axes = positional(Knobs)    # AXES name the Knobs fields in order


def space(problem: Problem, arch: Arch) -> list[Knobs]:
    """Every valid point of the named axes for `problem` on `arch`."""
    return valid_points(AXES, from_axes, check, problem, arch)


def workspace_elems(problem: Problem, knobs: Knobs, m: int) -> tuple[int, int]:
    return 0, 0


def kernel_args(problem: Problem, knobs: Knobs, a, weight, scales, out, workspace=None, counters=None) -> tuple:
    """Same arguments and checks as marlin_mma without split-K."""
    return marlin_mma.kernel_args(problem, marlin_mma.Knobs(), a, weight, scales, out)


__all__ = ["NAME", "LAYOUT", "AXES", "Knobs", "check", "from_axes", "space", "build", "PASS_CONFIGS", "pack", "unpack",
           "workspace_elems", "kernel_args", "layout"]
