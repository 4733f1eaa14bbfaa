"""The torch-facing op: y = x @ dequant(W) for INT4 weights packed in a schedule family's layout.

`tilemarlin::w4a16_gemm` is an op of torch's dispatcher. Its fake implementation gives torch.compile the
output's shape, so `torch.compile(fullgraph=True)` traces through it; its real implementation is
CUDA-graph safe: it does no host synchronization and no Python branching on device values, allocates
only the output (and a split-K workspace the first time a size is seen on a stream), and launches
the GEMM kernel on the current stream (W4A8: after its activation kernel; act-order layers call
`tilemarlin::gather_columns` first).

Choosing a kernel: M = x.numel() // K picks an M bucket, and runtime/dispatch.py the schedule for
(problem, bucket): the tuned table's, else the fallback's (one warning per problem says how to tune
it). The choice and its compiled kernel are cached per (device, problem, layout, bucket), so after
the first call of a bucket a call costs dictionary lookups; a kernel is loaded from the store (or
compiled) at most once per process, under a lock of its own, so that threads running other shapes
never wait for it, and checked on its first run (runtime/selfcheck.py).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch

from schedules.problem import LAYER_ACTS, Problem
from schedules.quant import FP8_K_TILE
from schedules.registry import FAMILIES, Schedule, group_size_problem

from . import selfcheck
from .dispatch import DEFAULT_LAYOUT, dispatch_for, schedule_for
from .launch import launch_schedule
from .precompile import activation_kernels, build_missing, plan
from .table import bucket_of
# A layout belongs to the family whose package defines it (the stream families read marlin_mma's).
_FAMILY_OF_LAYOUT = {fam.LAYOUT: fam for fam in FAMILIES.values() if fam.layout.__name__.startswith(fam.__name__ + ".")}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KernelCheckWarning(UserWarning):
    """A kernel disagreed with the reference on its first run here; another one runs instead."""


# --- argument checks (shared by the real and the fake implementation) ---------------------------

def layout_family(layout: str):
    """The schedule family whose kernels read weights packed in `layout`."""
    try:
        return _FAMILY_OF_LAYOUT[layout]
    except KeyError:
        raise ValueError(f"unknown weight layout {layout!r}; known: {sorted(_FAMILY_OF_LAYOUT)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The Problem dtype of a torch dtype, for the dtypes the kernels take."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"the kernels take float16 or bfloat16 activations and scales, not {dtype}; "
                        f"convert with .half() or .to(torch.bfloat16)") from None


# W4A8's FP8 wgmma kernels take k-tiles this deep, each within one quantization group.
FP8_K_TILE = 128


@functools.lru_cache(maxsize=None)
def problem_of(n: int, k: int, group: int, dtype: str, layout: str = DEFAULT_LAYOUT,
               zero_points: bool = False, act: str = "dtype") -> Problem:
    """The Problem of a layer, after checking that `layout` can hold its weights (N, K) and that the
    kernel families take its group size. A layer's activations are its dtype's or FP8's (`act`
    "dtype" or "fp8"); fp8_rounded is what the op runs W4A8 as at some buckets, not a layer's choice."""
    if act not in LAYER_ACTS:
        raise ValueError(f"act={act!r}: a layer's activations are 'dtype' (W4A16) or 'fp8' (W4A8)")
    problem = Problem.make(n=n, k=k, group=group, dtype=dtype, zero_points=zero_points, act=act)
    layout_family(layout).layout.check_packable(problem.k, problem.n)
    reason = group_size_problem(group, k)
    if reason:
        raise ValueError(reason)
    if problem.fp8 and problem.group % FP8_K_TILE:
        raise ValueError(f"group size {group} with K={k} cannot run as W4A8 (act='fp8'): its kernels take "
                         f"{FP8_K_TILE}-deep k-tiles within one group, so the group size (or K, channelwise) must "
                         f"be a multiple of {FP8_K_TILE}")
    return problem


def packed_shapes(problem: Problem, layout: str = DEFAULT_LAYOUT) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (packed weight, packed scales) in `layout`, as its layout module defines them."""
    return layout_family(layout).layout.packed_shapes(problem.k, problem.n, problem.scale_rows)


def _check_args(x, qweight, scales, n, k, group, layout, zero_points, act="dtype") -> Problem:
    # Sizes may come in as SymInts under torch.compile(dynamic=True): the weights fix them, so they are
    # specialized to plain ints here.
    n, k, group = int(n), int(k), int(group)
    dtype = dtype_name(x.dtype)
    if scales.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype} but the weights' scales are {scales.dtype}: "
                        f"cast the input with x.to({scales.dtype})")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x of shape {tuple(x.shape)} does not end in the weight's K={k} input features")
    problem = problem_of(n, k, group, dtype, layout, zero_points, act)
    weight_shape, scales_shape = packed_shapes(problem, layout)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != weight_shape:
        raise ValueError(f"packed weight must be int32 {weight_shape} for N={n}, K={k} in {layout}, "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if tuple(scales.shape) != scales_shape:
        what = " with their zero points" if zero_points else ""
        raise ValueError(f"scales{what} must be {scales_shape} for K={k}, group={problem.group}, N={n}, "
                         f"got {tuple(scales.shape)}")
    return problem


def _check_device(x, qweight, scales, op: str) -> None:
    if x.device.type != "cuda":
        raise RuntimeError(f"tilemarlin::{op} runs on CUDA GPUs, but x is on {x.device}; "
                           f"move the input and the layer to a GPU (e.g. model.cuda())")
    for name, t in (("packed weight", qweight), ("scales", scales)):
        if t.device != x.device:
            raise RuntimeError(f"x is on {x.device} but the {name} is on {t.device}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"the {name} must be contiguous and 16-byte aligned (repack the layer)")


# --- the op --------------------------------------------------------------------------------------

# The namespace can be defined once per process. A reload of this module (importlib.reload, IPython's
# autoreload) runs it again in the same globals: it keeps the first registration, whose
# implementations look up this module's current functions through those globals.
_LIBRARY = globals().get("_LIBRARY") or torch.library.Library("tilemarlin", "DEF")


def _define(name: str, impl, fake):
    """Register tilemarlin::<name> with torch's dispatcher, its schema read from `impl`'s annotations:
    `impl` for every device (it refuses all but CUDA GPUs with a clear error), `fake` for tracing, and
    an autograd kernel whose backward refuses (without one, autograd would pass the op by with a
    warning and a wrong gradient). Plain torch.library registration rather than
    torch.library.custom_op, whose wrapper imports torch._dynamo at an op's first call: 1.5 s on a
    first request, 6.5 s where Python compiles torch's sources afresh."""
    qualified = f"tilemarlin::{name}"
    if hasattr(torch.ops.tilemarlin, name):     # a reload: registered already
        return getattr(torch.ops.tilemarlin, name).default
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, lib=_LIBRARY)(fake)
    op = getattr(torch.ops.tilemarlin, name).default

    def autograd_kernel(keyset, *args):
        out = op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return _NoGradient.apply(qualified, out, *(a for a in args if isinstance(a, torch.Tensor)))
        return out

    _LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op


class _NoGradient(torch.autograd.Function):
    """An op's output where an input requires a gradient: a backward through it refuses (frozen
    quantized weights; the ops serve inference). It refuses when it runs, through the refuse_gradient
    op, not when torch.compile traces it: compiling a model whose parameters require gradients traces
    its backward too, and that must not fail a forward that never runs one."""

    @staticmethod
    def forward(ctx, qualified: str, out: torch.Tensor, *inputs):
        ctx.qualified = qualified
        ctx.inputs = [(i, a.shape, a.dtype) for i, a in enumerate(inputs) if a.requires_grad]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        grads = [None] * len(ctx.needs_input_grad)
        index, shape, dtype = ctx.inputs[0]
        grads[2 + index] = refuse_gradient(grad, grad.new_empty(shape, dtype=dtype), ctx.qualified)
        return tuple(grads)


def _refuse_gradient(grad: torch.Tensor, like: torch.Tensor, qualified: str) -> torch.Tensor:
    """A backward through op `qualified`, refused (the gradient it stands for would be `like`'s)."""
    raise RuntimeError(f"{qualified} has no gradient: tilemarlin serves inference with frozen INT4 "
                       f"weights; run the model under torch.no_grad() or torch.inference_mode()")


def _refuse_gradient_fake(grad: torch.Tensor, like: torch.Tensor, qualified: str) -> torch.Tensor:
    return torch.empty_like(like)


def _gemm(x, qweight, scales, n, k, group, layout, zero_points, act, name) -> torch.Tensor:
    """Both ops' implementation: checks, the output, the launch of its M bucket's kernel."""
    problem = _check_args(x, qweight, scales, n, k, group, layout, zero_points, act)
    _check_device(x, qweight, scales, name)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel():
        with _current_device(x.device):
            _launch(x.reshape(-1, k), qweight, scales, out.view(-1, n), problem, layout)
    return out


def _current_device(device: torch.device):
    """x's GPU as the current device for a launch, the caller's again after it. A kernel library's host
    code (TileLang's export, TVM's packed API) makes its tensors' device current and leaves it so, and
    launches on that device's current stream: with a model spread over GPUs in one process
    (device_map="auto"), a call on another GPU than the current one would otherwise switch the
    caller's current device under it. (A CPU tensor gets no guard: the launch refuses it.)"""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int,
                layout: str = DEFAULT_LAYOUT, zero_points: bool = False) -> torch.Tensor:
    return _gemm(x, qweight, scales, n, k, group, layout, zero_points, "dtype", "w4a16_gemm")


def _w4a16_gemm_fake(x, qweight, scales, n, k, group, layout=DEFAULT_LAYOUT, zero_points=False):
    _check_args(x, qweight, scales, n, k, group, layout, zero_points)
    return x.new_empty((*x.shape[:-1], n))


def _w4a8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int,
               layout: str = DEFAULT_LAYOUT) -> torch.Tensor:
    return _gemm(x, qweight, scales, n, k, group, layout, False, "fp8", "w4a8_gemm")


def _w4a8_gemm_fake(x, qweight, scales, n, k, group, layout=DEFAULT_LAYOUT):
    _check_args(x, qweight, scales, n, k, group, layout, False, "fp8")
    return x.new_empty((*x.shape[:-1], n))


refuse_gradient = _define("refuse_gradient", _refuse_gradient, _refuse_gradient_fake)
_W4A16_OP = _define("w4a16_gemm", _w4a16_gemm, _w4a16_gemm_fake)
_W4A8_OP = _define("w4a8_gemm", _w4a8_gemm, _w4a8_gemm_fake)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int,
               layout: str = DEFAULT_LAYOUT, zero_points: bool = False) -> torch.Tensor:
    """y[..., N] = x[..., K] @ dequant(W)[K, N] with INT4 weights packed in `layout`
    (torch.ops.tilemarlin.w4a16_gemm).

    Parameters
    ----------
    x : float16 or bfloat16 CUDA tensor [..., K]; any strides (a non-contiguous x is copied).
    qweight, scales : the packed weight and scales (``schedules.marlin_mma.pack``), on x's device,
        scales in x's dtype; with zero_points each group's scale row is followed by its zero points z,
        whole numbers in x's dtype (``marlin_mma.pack(codes, scales, zeros)``).
    n, k, group : output features, input features, rows per scale (-1: one group spanning K).
    layout : the packing of qweight and scales.
    zero_points : whether scales carries zero points (w = s * (q - z) instead of s * (q - 8)).

    Returns
    -------
    A new tensor [..., N] in x's dtype.
    """
    return _W4A16_OP(x, qweight, scales, n, k, group, layout, zero_points)


def w4a8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int,
              layout: str = DEFAULT_LAYOUT) -> torch.Tensor:
    """W4A8: y[..., N] = fp8(x)[..., K] @ dequant(W)[K, N] on FP8 tensor cores (Hopper, sm_90a)
    (torch.ops.tilemarlin.w4a8_gemm).

    x is quantized per token (row) to FP8 e4m3 by a kernel of its own (schedules/fp8_activations.py:
    scale = the smallest power of two s with 448 s >= the row's largest magnitude), then multiplied by
    the same packed INT4 weights and scales that w4a16_gemm takes (symmetric weights; no zero points).
    At the buckets where the tuned table times the W4A16 kernel faster (small M), that kernel runs
    instead, rounding x to those FP8 values itself (runtime.dispatch.Dispatch.serving_problem).
    Arguments and result as w4a16_gemm's. Raises RuntimeError on a GPU without FP8 wgmma.
    """
    return _W4A8_OP(x, qweight, scales, n, k, group, layout)


def _launch(a: torch.Tensor, qweight, scales, out: torch.Tensor, problem: Problem, layout: str) -> None:
    """Run the kernel of a's M bucket: out[M, N] = a[M, K] @ dequant(W), on the current stream. FP8
    activations: quantized by the activation kernel for the FP8 kernel, or, at buckets where the
    W4A16 twin's kernel serves (Dispatch.serving_problem), a itself: that kernel rounds it to its FP8
    values (Problem.rounds_fp8)."""
    a = _rows_for_kernels(a)
    if problem.fp8:
        _check_fp8_gpu(out.device)
    launcher = _launcher(out.device, problem, layout, bucket_of(a.shape[0]))
    if launcher.problem.fp8:
        a = _quantized(a, problem, getattr(launcher.schedule.knobs, "offset_decode", False))
    launch_schedule(launcher.kernel, launcher.schedule, launcher.problem, a, qweight, scales, out)


def _rows_for_kernels(a: torch.Tensor) -> torch.Tensor:
    """a [M, K], contiguous and 16-byte aligned (a copy where it is not): the kernels load rows with
    16-byte copies."""
    if not a.is_contiguous() or a.data_ptr() % 16:
        a = a.clone(memory_format=torch.contiguous_format)
    return a


def _quantized(a: torch.Tensor, problem: Problem, sums: bool) -> tuple:
    """(FP8 e4m3 [M, K] in the FP8 k order, token scales fp32 [M, 1], k-tile sums fp32 [M, K / 128] or,
    unless `sums` (a kernel with offset_decode reads them), None) of a, by the activation kernel."""
    values = torch.empty(a.shape, dtype=torch.float8_e4m3fn, device=a.device)
    token_scales = torch.empty((a.shape[0], 1), dtype=torch.float32, device=a.device)
    if not sums:
        _activation_kernel("fp8_activations", a.device, problem.k, problem.dtype)(a, values, token_scales)
        return values, token_scales, None
    tile_sums = torch.empty((a.shape[0], problem.k // FP8_K_TILE), dtype=torch.float32, device=a.device)
    _activation_kernel("fp8_activations_sums", a.device, problem.k, problem.dtype)(a, values, token_scales,
                                                                                    tile_sums)
    return values, token_scales, tile_sums


_FP8_GPUS: set = set()


def _check_fp8_gpu(device: torch.device) -> None:
    """A RuntimeError on a GPU without FP8 wgmma (before sm_90a); checked once per device."""
    if device.index in _FP8_GPUS:
        return
    from schedules.arch import current_arch

    arch = current_arch(device)
    if not arch.hopper:
        raise RuntimeError(f"W4A8 runs on FP8 wgmma (Hopper, sm_90a); {torch.cuda.get_device_name(device)} "
                           f"is {arch.name}: use w4a16_gemm (QuantLinear act='dtype') there")
    _FP8_GPUS.add(device.index)


# --- act-order's column gather -------------------------------------------------------------------

def _gather_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    _check_gather(x, perm)
    k = x.shape[-1]
    a = _rows_for_kernels(x.reshape(-1, k))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        with _current_device(x.device):
            _gather_into(a, perm, out.view(-1, k))
    return out


def _gather_columns_fake(x, perm):
    _check_gather(x, perm)
    return x.new_empty(x.shape)


def _check_gather(x: torch.Tensor, perm: torch.Tensor) -> None:
    dtype_name(x.dtype)
    if x.dim() == 0 or perm.dim() != 1 or perm.dtype != torch.int32 or perm.shape[0] != x.shape[-1]:
        raise ValueError(f"perm must be int32 [K] for x of shape {tuple(x.shape)}, got {perm.dtype} "
                         f"{tuple(perm.shape)}")
    if perm.device != x.device or not perm.is_contiguous():
        raise ValueError(f"perm must be contiguous on x's device {x.device}, got {perm.device}")


def _gather_into(a: torch.Tensor, perm: torch.Tensor, out: torch.Tensor) -> None:
    """out[M, K] = a[:, perm] by the gather kernel (schedules/gather.py), on the current stream."""
    if a.device.type != "cuda":
        raise RuntimeError(f"tilemarlin::gather_columns runs on CUDA GPUs, but x is on {a.device}")
    if perm.data_ptr() % 16:     # the kernel reads the indices with 16-byte loads
        perm = perm.clone()
    _activation_kernel("gather_columns", a.device, a.shape[1], dtype_name(a.dtype))(a, perm, out)


_GATHER_OP = _define("gather_columns", _gather_columns, _gather_columns_fake)


def gather_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x[..., perm] (torch.ops.tilemarlin.gather_columns): act-order's activations in the order of the
    layer's weight rows, sorted by group. A kernel of one block per row that lets the GEMM after it
    launch at once (schedules/gather.py); CUDA-graph and torch.compile safe like the GEMM ops.

    x : float16 or bfloat16 CUDA tensor [..., K]. perm : int32 [K] on x's device, contiguous, a
    permutation of range(K) (the checkpoint loaders check it; the kernel does not).
    Returns a new tensor of x's shape and dtype."""
    return _GATHER_OP(x, perm)


# --- act-order's RMSNorm, written in the gathered order ------------------------------------------

def _rms_norm_gather(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    _check_gather(x, perm)
    _check_norm(x, weight, eps)
    k = x.shape[-1]
    a = _rows_for_kernels(x.reshape(-1, k))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        with _current_device(x.device):
            _norm_gather_into(a, weight, perm, eps, out.view(-1, k))
    return out


def _rms_norm_gather_fake(x, weight, perm, eps):
    _check_gather(x, perm)
    _check_norm(x, weight, eps)
    return x.new_empty(x.shape)


def _check_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> None:
    k = x.shape[-1]
    if weight.shape != (k,) or weight.dtype != x.dtype or weight.device != x.device or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {x.dtype} [{k}] on {x.device}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if eps.shape != (1,) or eps.dtype != torch.float32 or eps.device != x.device:
        raise ValueError(f"eps must be float32 [1] on {x.device}, got {eps.dtype} {tuple(eps.shape)} on {eps.device}")


def _norm_gather_into(a: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, eps: torch.Tensor,
                      out: torch.Tensor) -> None:
    """out[M, K] = the RMSNorm of a's rows in perm's order (schedules/norm_gather.py), on the current stream."""
    if a.device.type != "cuda":
        raise RuntimeError(f"tilemarlin::rms_norm_gather runs on CUDA GPUs, but x is on {a.device}")
    # the kernel reads indices and weights with 16-byte loads
    perm, weight = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (perm, weight))
    _activation_kernel("rms_norm_gather", a.device, a.shape[1], dtype_name(a.dtype))(a, weight, perm, eps, out)


_NORM_GATHER_OP = _define("rms_norm_gather", _rms_norm_gather, _rms_norm_gather_fake)


def rms_norm_gather(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """(torch.ops.tilemarlin.rms_norm_gather) transformers' RMSNorm of x's last dimension, written in
    act-order's order: out[..., j] = weight[j] * (x[..., perm[j]] / sqrt(mean(x^2) + eps)), `weight`
    already in that order. One kernel of one block per row (schedules/norm_gather.py); CUDA-graph and
    torch.compile safe like the other ops.

    x : float16 or bfloat16 CUDA tensor [..., K]. weight : [K] in x's dtype. perm : int32 [K], a
    permutation of range(K) (unchecked by the kernel). eps : float32 [1]; all on x's device.
    Returns a new tensor of x's shape and dtype."""
    return _NORM_GATHER_OP(x, weight, perm, eps)


_ACTIVATION_KERNELS: dict[tuple, object] = {}


def _activation_kernel(kind: str, device: torch.device, k: int, dtype: str):
    """runtime.kernels.compile_activation_kernel's kernel, looked up without a lock after its first call."""
    key = (kind, device.index, k, dtype)
    kernel = _ACTIVATION_KERNELS.get(key)
    if kernel is None:
        from schedules.arch import current_arch

        from .kernels import compile_activation_kernel

        kernel = compile_activation_kernel(kind, k, dtype, current_arch(device))
        with _LOCK:
            kernel = _ACTIVATION_KERNELS.setdefault(key, kernel)
    return kernel


# --- choosing and loading kernels ----------------------------------------------------------------

@dataclass(frozen=True)
class _Launcher:
    problem: Problem      # the one whose kernel serves the bucket (Dispatch.serving_problem)
    schedule: Schedule
    kernel: object


_LOCK = threading.Lock()     # guards the dicts below; held for lookups and inserts only
_LAUNCHERS: dict[tuple, _Launcher] = {}
_UNCHECKED: dict[tuple, _Launcher] = {}  # chosen inside a CUDA-graph capture, checked at the next call outside
_KEY_LOCKS: dict[tuple, threading.Lock] = {}


def _key_lock(key) -> threading.Lock:
    with _LOCK:
        return _KEY_LOCKS.setdefault(key, threading.Lock())


def _launcher(device: torch.device, problem: Problem, layout: str, bucket: int) -> _Launcher:
    key = (device.index, problem, layout, bucket)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        # One thread resolves and loads this key; threads running other shapes never wait for it.
        with _key_lock(key):
            launcher = _LAUNCHERS.get(key)
            if launcher is None:
                launcher = _UNCHECKED.get(key) or _chosen(device, problem, layout, bucket)
                if _must_wait_for_check(launcher, bucket, device):
                    with _LOCK:
                        _UNCHECKED[key] = launcher
                    return launcher
                launcher = _checked(launcher, bucket, device)
                with _LOCK:
                    _LAUNCHERS[key] = launcher
                    _UNCHECKED.pop(key, None)
    return launcher


def _chosen(device: torch.device, problem: Problem, layout: str, bucket: int) -> _Launcher:
    """The kernel that serves `problem` at `bucket` (Dispatch.serving_problem, schedule_for), loaded."""
    from schedules.arch import current_arch

    from .kernels import compile_schedule

    served = dispatch_for(device).serving_problem(problem, bucket)
    schedule = schedule_for(served, bucket, device, layout)
    return _Launcher(served, schedule, compile_schedule(served, schedule, current_arch(device)))


def _must_wait_for_check(launcher: _Launcher, bucket: int, device: torch.device) -> bool:
    """Inside CUDA-graph capture nothing can be compared: a kernel not checked at this bucket before
    serves the capture unchecked (kept apart, not looked up again), and the first call outside capture
    checks it (warm-up before capture, as CUDA graphs need anyway, does)."""
    return torch.cuda.is_current_stream_capturing() and not selfcheck.is_verified(launcher.kernel, bucket, device)


def _checked(launcher: _Launcher, bucket: int, device: torch.device) -> _Launcher:
    """The launcher after its kernel's first-run check at this bucket (runtime/selfcheck.py); a kernel
    that fails it is replaced, with a warning, by the fallback's choice among the other schedules,
    which must pass too."""
    from .fallback import fallback_schedule
    from .kernels import compile_schedule

    problem, schedule = launcher.problem, launcher.schedule
    try:
        selfcheck.check_once(launcher.kernel, problem, schedule, bucket, device)
        return launcher
    except selfcheck.KernelCheckError as exc:
        # (compared in the problem's form: a winner of another form may become the kernel that failed)
        dispatch = dispatch_for(device)
        replacement, how = fallback_schedule(problem, bucket, dispatch.arch, dispatch.gpu, dispatch.winners,
                                             dispatch.table, exclude=frozenset({schedule}))
        warnings.warn(f"{exc}; running {replacement.name} ({how}) instead", KernelCheckWarning, stacklevel=3)
        kernel = compile_schedule(problem, replacement, dispatch.arch)
        selfcheck.check_once(kernel, problem, replacement, bucket, device)
        return _Launcher(problem, replacement, kernel)


def precompile(problems: Iterable[Problem], ms: Iterable[int], device=None, layout: str = DEFAULT_LAYOUT,
               workers: int | None = None) -> dict:
    """Compile, in parallel, every kernel the op will run for `problems` at the M values `ms`
    (runtime.precompile.plan) and the activation kernels their layers run beside them (W4A8's:
    runtime.precompile.activation_kernels), so that first calls only load them from the store; kernels
    already there are not rebuilt. Returns {job: error or None}, a job being a (problem, schedule) pair
    or a runtime.kernels.ActivationJob."""
    from .kernels import ActivationJob

    problems = list(problems)
    dispatch = dispatch_for(device)
    jobs = [*plan(problems, ms, dispatch, layout), *(ActivationJob(*kernel) for kernel in activation_kernels(problems))]
    return build_missing(jobs, dispatch.arch, workers)
