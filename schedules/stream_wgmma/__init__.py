"""stream_wgmma: weights decoded from global memory into wgmma's register A operand, activations
from shared memory (sm_90a; see kernel.py for the why). Reads marlin_mma's packed layout."""
from __future__ import annotations

from ..arch import Arch
from ..knob_space import valid_points
from ..problem import Problem
from .. import marlin_mma
from .kernel import PASS_CONFIGS, build
from .knobs import Knobs, check

NAME = "stream_wgmma"
LAYOUT = marlin_mma.LAYOUT
layout = marlin_mma.layout
pack, unpack = marlin_mma.pack, marlin_mma.unpack
# The same kernel signature and split-K epilogue (schedules/epilogue.py), so the same arguments, checks
# and workspace.
workspace_elems, kernel_args = marlin_mma.workspace_elems, marlin_mma.kernel_args

AXES = {
    "block_m": (64, 128, 256),
    "groups": (1, 2, 4),
    "warpgroups": (1, 2),
    "block_k": (64, 128),
    "stages": (3, 4),
    "ahead": (1, 2),        # 2 needs the registers of block_m <= 64 (measured +5-10 % there, session 3)
    "overlap": (False, True),
    "split_k": (1, 2, 4),
    # Compiled and checked on CPU only (SASS: no global load left in the k-loop, perf-notes v11);
    # joins the search once measured on a GPU.
    "smem_weights": (False,),
    "tma": (False,),
    "release_barriers": (False,),
}


def space(problem: Problem, arch: Arch) -> list[Knobs]:
    """Every valid point of the named axes for `problem` on `arch`."""
    return valid_points(AXES, lambda values: Knobs(*values), check, problem, arch)


__all__ = ["NAME", "LAYOUT", "AXES", "Knobs", "check", "space", "build", "PASS_CONFIGS", "pack", "unpack",
           "workspace_elems", "kernel_args", "layout"]
