"""marlin_mma: Marlin's design on mma.sync (sm_80 and newer), see kernel.py for the why."""
from __future__ import annotations

import itertools

import torch

from ..arch import Arch
from ..problem import Problem
from . import layout
from .kernel import PASS_CONFIGS, build
from .knobs import Knobs, check

NAME = "marlin_mma"
LAYOUT = "marlin_mma.v1"

# Named axes of the search space; `check` prunes what cannot work for a given problem and arch.
AXES = {
    "block_m": (16, 32, 64, 128),
    "block_n": (64, 128, 256),
    "block_k": (64, 128),
    "warps": ((1, 2, 1), (1, 4, 1), (1, 1, 4), (1, 2, 2), (1, 4, 2), (2, 2, 1), (2, 4, 1), (4, 2, 1)),
    "num_stages": (3, 4, 6),
    "split_k": (1, 2, 4, 8),
}


def space(problem: Problem, arch: Arch) -> list[Knobs]:
    """Every valid point of the named axes for `problem` on `arch`."""
    out = []
    for bm, bn, bk, (wm, wn, wk), stages, sk in itertools.product(*AXES.values()):
        knobs = Knobs(bm, bn, bk, wm, wn, wk, stages, sk)
        if check(problem, knobs, arch) is None:
            out.append(knobs)
    return out


def pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [K, N], scales [G, N]) -> (packed weight [K/16, 2N] int32, scales [G, N] contiguous)."""
    if scales.dim() != 2 or scales.shape[1] != codes.shape[1] or codes.shape[0] % scales.shape[0]:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes.shape)}")
    return layout.pack_weight(codes), scales.contiguous()


def unpack(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layout.unpack_weight(weight), scales


def workspace_elems(problem: Problem, knobs: Knobs, m: int) -> tuple[int, int]:
    """(fp32 workspace elements, int32 tile counters) one call with `m` rows needs (0, 0 if none)."""
    if knobs.split_k == 1:
        return 0, 0
    return m * problem.n, -(-m // knobs.block_m) * (problem.n // knobs.block_n)


def kernel_args(problem, knobs, a, weight, scales, out, workspace, counters) -> tuple:
    """The kernel's positional arguments, in the order build() declares them."""
    if knobs.split_k == 1:
        return a, weight, scales, out
    return a, weight, scales, out, workspace[: a.shape[0] * problem.n].view(a.shape[0], problem.n), counters


__all__ = ["NAME", "LAYOUT", "AXES", "Knobs", "check", "space", "build", "PASS_CONFIGS", "pack", "unpack",
           "workspace_elems", "kernel_args", "layout"]
