"""marlin_mma: Marlin's design on mma.sync (sm_80 and newer), see kernel.py for the why."""
from __future__ import annotations

import torch

from ..arch import Arch
from ..family import lazy_build
from ..knob_space import valid_points
from ..problem import Problem
from ..quant import FP8_K_TILE, torch_dtype
from . import layout
from .knobs import Knobs, check
from .traits import FP8_KNOB_FACTORS, KNOB_FACTORS, TRAITS


# The TileLang pass configs the kernels compile with.
PASS_CONFIGS = {
    # The consumer is hand-written register code: keep the plain cp.async multistage pipeline.
    "tl.disable_warp_specialized": True,
}


build = lazy_build(__name__)

NAME = "marlin_mma"
LAYOUT = "marlin_mma.v1"

# Named axes of the search space; `check` prunes what cannot work for a given problem and arch.
AXES = {
    "block_m": (16, 32, 64, 128),
    "block_n": (64, 128, 256),
    "block_k": (64, 128),
    "warps": ((1, 2, 1), (1, 4, 1), (1, 1, 4), (1, 2, 2), (1, 4, 2), (2, 2, 1), (2, 4, 1), (4, 2, 1)),
    "num_stages": (3, 4, 6),
    "split_k": (1, 2, 3, 4, 6, 8, 12, 16),
    "scale_on_acc": (False, True),
}

VARIANT_AXES: tuple[str, ...] = ()   # every axis changes the kernel's structure


def from_axes(values: tuple) -> Knobs:
    """The knobs at one point of AXES (the "warps" axis sets three knobs; Knobs.warps reads them back)."""
    bm, bn, bk, (wm, wn, wk), *rest = values
    return Knobs(bm, bn, bk, wm, wn, wk, *rest)


def space(problem: Problem, arch: Arch) -> list[Knobs]:
    """Every valid point of the named axes for `problem` on `arch`."""
    return valid_points(AXES, from_axes, check, problem, arch)


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [K, N], scales [G, N], zero points [G, N] or None for 8) -> (packed weight [K/16, 2N]
    int32, scales [G, N] contiguous; with zero points the scales and the zero points stacked, [2G, N])."""
    if scales.dim() != 2 or scales.shape[1] != codes.shape[1] or codes.shape[0] % scales.shape[0]:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes.shape)}")
    if zeros is None:
        return layout.pack_weight(codes), scales.contiguous()
    return layout.pack_weight(codes), layout.stack_zero_points(scales, zeros)


def unpack(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layout.unpack_weight(weight), scales


def workspace_elems(problem: Problem, knobs: Knobs, m: int) -> tuple[int, int]:
    """(fp32 workspace elements, int32 tile counters) one call with `m` rows needs (0, 0 if none): an
    [m, N] tile of sums, or the slots of m rows that a family's knobs ask for (stream_wgmma's
    split_wait: one per split but the last), which share this signature and these checks."""
    if not knobs.uses_workspace:
        return 0, 0
    slots = getattr(knobs, "workspace_slots", 1)
    return slots * m * problem.n, -(-m // knobs.block_m) * (problem.n // knobs.block_n)


def kernel_args(problem: Problem, knobs: Knobs, a, weight, scales, out, workspace=None, counters=None) -> tuple:
    """The kernel's positional arguments, in the order build() declares them, after checking every
    tensor: a wrong dtype, shape or device is an error that names the tensor, never a wrong answer.
    With FP8 activations (problem.fp8) `a` is the triple (float8_e4m3fn [M, K] in the FP8 k order,
    token scales fp32 [M, 1], k-tile sums fp32 [M, K / 128]) that schedules.quant.fp8_kernel_activations
    makes; the sums may be None for a kernel that does not read them (stream_wgmma without
    offset_decode)."""
    dtype = torch_dtype(problem.dtype)
    token_scales = tile_sums = None
    if problem.fp8:
        if not (isinstance(a, (tuple, list)) and len(a) == 3):
            raise TypeError("FP8 activations are the triple (float8_e4m3fn values [M, K], fp32 token scales [M, 1], "
                            "fp32 k-tile sums [M, K / 128])")
        a, token_scales, tile_sums = a
        _expect("FP8 activations", a, torch.float8_e4m3fn, (None, problem.k))
        _expect("token scales", token_scales, torch.float32, (a.shape[0], 1))
        if not getattr(knobs, "offset_decode", False):
            tile_sums = None        # (this kernel does not take them)
        else:
            _expect("k-tile sums", tile_sums, torch.float32, (a.shape[0], problem.k // FP8_K_TILE))
    else:
        _expect("activations", a, dtype, (None, problem.k))
    m = a.shape[0]
    weight_shape, scales_shape = layout.packed_shapes(problem.k, problem.n, problem.scale_rows)
    _expect("packed weight", weight, torch.int32, weight_shape)
    _expect("scales", scales, dtype, scales_shape)
    _expect("output", out, dtype, (m, problem.n))
    tensors = {"activations": a, "packed weight": weight, "scales": scales, "output": out}
    if token_scales is not None:
        tensors["token scales"] = token_scales
    if tile_sums is not None:
        tensors["k-tile sums"] = tile_sums
    if knobs.uses_workspace:
        ws_elems, n_counters = workspace_elems(problem, knobs, m)
        _expect("split-K workspace", workspace, torch.float32, None, min_elems=ws_elems)
        _expect("split-K counters", counters, torch.int32, None, min_elems=n_counters)
        tensors.update({"split-K workspace": workspace, "split-K counters": counters})
    for what, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{what} is on {t.device}; tilemarlin kernels need CUDA tensors")
        if t.device != a.device:
            raise ValueError(f"{what} is on {t.device} but the activations are on {a.device}")
    head = (a,) if token_scales is None else (a, token_scales) if tile_sums is None else (a, token_scales, tile_sums)
    if not knobs.uses_workspace:
        return (*head, weight, scales, out)
    return (*head, weight, scales, out, workspace[:ws_elems].view(-1, problem.n), counters)


def _expect(what, t, dtype, shape, min_elems=0) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
            want = "x".join("M" if s is None else str(s) for s in shape)
            raise ValueError(f"{what} must have shape [{want}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if t.numel() < min_elems:
        raise ValueError(f"{what} has {t.numel()} elements, this call needs {min_elems}")


__all__ = ["NAME", "LAYOUT", "AXES", "Knobs", "check", "from_axes", "space", "build", "PASS_CONFIGS", "pack", "unpack",
           "workspace_elems", "kernel_args", "layout", "VARIANT_AXES", "TRAITS", "KNOB_FACTORS",
           "FP8_KNOB_FACTORS"]
