"""The kernels `gen bench` compares: tilemarlin (symmetric, with zero points, with act-order, W4A8, and
as it serves an untuned shape), FP16 torch.matmul, torch's INT4 kernel, FP8 W8A8 torch._scaled_mm, and
humming (W4A16 and W4A8).

Each contender turns one layer's weights into its own format, in as many copies as L2 needs to miss
(gen.timing.weight_copies), and returns a function from activations x [M, K] (fp16, or bf16 in a
`--dtype bfloat16` run) to the list of calls to time, one per copy. The baseline is
gen.timing.Fp16Baseline, torch.matmul in the run's dtype, which `gen tune` times too.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from schedules.problem import Problem
from schedules.quant import dequantize

from gen.bench import report
from gen.timing import Fp16Baseline, copies_for, random_weights, weight_copies


class KernelUnavailable(Exception):
    """The kernel cannot run in this environment at all: skipped for the whole run, noted in meta."""


@dataclass
class LayerWeights:
    """One layer's random INT4 weights on the GPU, the source every contender's copies are made from."""
    name: str
    k: int
    n: int
    group: int            # rows per scale (K for channelwise)
    codes: object         # uint8 [K, N] in 0..15
    scales: object        # [K / group, N] in the activations' dtype (fp16 or bf16)


def layer_weights(layer, group: int, dtype: str = "float16") -> LayerWeights:
    """Random weights (gen.timing.random_weights) for `layer` (with .name, .k, .n) at `group` rows per
    scale, scales in `dtype`."""
    problem = Problem.make(n=layer.n, k=layer.k, group=group, dtype=dtype)
    codes, scales = random_weights(problem)
    return LayerWeights(layer.name, problem.k, problem.n, problem.group, codes, scales)


@dataclass
class Contender:
    calls: Callable       # x -> list of zero-argument calls, one per weight copy
    exact: bool           # computes exactly dequantize(codes, scales), so it is checked against the reference


def tilemarlin_contender(w: LayerWeights) -> Contender:
    try:
        from runtime.op import w4a16_gemm
    except ImportError as exc:
        raise KernelUnavailable(f"runtime.op is not importable: {exc}") from None
    from schedules import marlin_mma

    copies = weight_copies(marlin_mma.pack(w.codes, w.scales))
    return Contender(lambda x: [functools.partial(w4a16_gemm, x, qw, qs, w.n, w.k, w.group) for qw, qs in copies],
                     exact=True)


def untuned_dispatch(problem: Problem):
    """The op's choices on this GPU (runtime.dispatch.Dispatch) as if nobody had tuned `problem`'s
    shape: its entries, in every dtype and form, left out of the tuned table and of the winners the
    fallback transfers from (gen.dev.fallback_check.left_out)."""
    import dataclasses

    from gen.dev.fallback_check import left_out
    from runtime.dispatch import dispatch_for

    dispatch = dispatch_for()
    table, winners = left_out(dispatch.table, dispatch.winners, problem, whole_shape=True)
    return dataclasses.replace(dispatch, table=table, winners=winners)


def tilemarlin_untuned_contender(w: LayerWeights) -> Contender:
    """tilemarlin as it serves a layer whose shape no table holds: at each M, the kernel the fallback
    (runtime/fallback.py) chooses with this shape left out (untuned_dispatch), on the same packed
    weights as tilemarlin. Beside tilemarlin on shapes tuned just before, it measures what the
    fallback costs against a tune of the shape."""
    try:
        from runtime.launch import launch_schedule
        from runtime.op import DEFAULT_LAYOUT, dtype_name
    except ImportError as exc:
        raise KernelUnavailable(f"runtime.op is not importable: {exc}") from None
    from runtime.kernels import compile_schedule
    from runtime.table import bucket_of
    from schedules import marlin_mma

    problem = Problem.make(n=w.n, k=w.k, group=w.group, dtype=dtype_name(w.scales.dtype))
    dispatch = untuned_dispatch(problem)
    copies = weight_copies(marlin_mma.pack(w.codes, w.scales))

    def calls(x):
        schedule, _ = dispatch.choose(problem, bucket_of(x.shape[0]), DEFAULT_LAYOUT)
        kernel = compile_schedule(problem, schedule, dispatch.arch)
        out = x.new_empty((x.shape[0], w.n))

        def run(qweight, scales):
            launch_schedule(kernel, schedule, problem, x, qweight, scales, out)
            return out

        return [functools.partial(run, qw, qs) for qw, qs in copies]

    return Contender(calls, exact=True)


def tilemarlin_zero_points_contender(w: LayerWeights) -> Contender:
    """tilemarlin with zero points of its own per group and column (0..15, drawn from torch's generator
    as it stands): the same codes and scales, the kernels that take the zero points off the codes. Not the
    reference's symmetric weights, so not checked here (tests/test_kernel_gpu.py checks them)."""
    try:
        from runtime.op import w4a16_gemm
    except ImportError as exc:
        raise KernelUnavailable(f"runtime.op is not importable: {exc}") from None
    from schedules import marlin_mma

    zeros = torch.randint(0, 16, w.scales.shape, device=w.scales.device)
    copies = weight_copies(marlin_mma.pack(w.codes, w.scales, zeros))
    return Contender(lambda x: [functools.partial(w4a16_gemm, x, qw, qs, w.n, w.k, w.group, zero_points=True)
                                for qw, qs in copies], exact=False)


def tilemarlin_act_order_contender(w: LayerWeights) -> Contender:
    """tilemarlin serving an act-order layer as QuantLinear does: the weight rows stored sorted by group
    (the same codes and scales as tilemarlin), and each call gathers x's columns by the layer's
    permutation (a random one per layer, drawn from torch's generator as it stands) before the GEMM.
    The gather is timed with the kernel. The layers a loaded checkpoint serves without one gather nothing
    (report.gathers: a gated MLP's down_proj, whose input columns come in its order, and the layers fed
    by an RMSNorm, which writes them in theirs). x[:, perm] @ W is not the
    reference's x @ W, so not checked here (tests/test_checkpoint_gpu.py checks act-order layers
    against their dequantized weights)."""
    try:
        from runtime.op import gather_columns, w4a16_gemm
    except ImportError as exc:
        raise KernelUnavailable(f"runtime.op is not importable: {exc}") from None
    from schedules import marlin_mma

    copies = weight_copies(marlin_mma.pack(w.codes, w.scales))
    if not report.gathers("tilemarlin_act", w.name):
        return Contender(lambda x: [functools.partial(w4a16_gemm, x, qw, qs, w.n, w.k, w.group)
                                    for qw, qs in copies], exact=True)
    perm = torch.randperm(w.k, device=w.codes.device).int()

    def gathered_gemm(x, qweight, scales):
        return w4a16_gemm(gather_columns(x, perm), qweight, scales, w.n, w.k, w.group)

    return Contender(lambda x: [functools.partial(gathered_gemm, x, qw, qs) for qw, qs in copies], exact=False)


def tilemarlin_w4a8_contender(w: LayerWeights) -> Contender:
    """tilemarlin W4A8 (runtime.op.w4a8_gemm): each call quantizes x per token to FP8 e4m3 (the
    activation kernel, timed with the GEMM), then runs the FP8 kernel on the same packed weights. FP8
    activations are not the reference's, so not checked here (tests/test_w4a8_gpu.py checks them
    against the W4A8 reference)."""
    try:
        from runtime.op import w4a8_gemm
    except ImportError as exc:
        raise KernelUnavailable(f"runtime.op is not importable: {exc}") from None
    from schedules import marlin_mma

    if torch.cuda.get_device_capability() < (9, 0):
        raise KernelUnavailable("W4A8 needs FP8 wgmma (sm_90a)")
    copies = weight_copies(marlin_mma.pack(w.codes, w.scales))
    return Contender(lambda x: [functools.partial(w4a8_gemm, x, qw, qs, w.n, w.k, w.group) for qw, qs in copies],
                     exact=False)


def fp8_w8a8_contender(w: LayerWeights) -> Contender:
    """FP8 W8A8, torch._scaled_mm with tensor-wide scales: the dequantized weights in FP8 e4m3
    (column-major, as cuBLASLt takes them), the activations quantized to FP8 outside the timed calls
    (the kernel alone), their rows padded to a multiple of 16 (which _scaled_mm needs)."""
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability() < (8, 9):
        raise KernelUnavailable("torch._scaled_mm needs FP8 tensor cores (sm_89+)")
    weight = dequantize(w.codes, w.scales).float()
    w_scale = weight.abs().amax() / 448.0
    w8 = (weight / w_scale).to(torch.float8_e4m3fn).t().contiguous().t()      # [K, N] column-major
    copies = weight_copies((w8,))
    one = torch.ones((), device=w8.device)

    def calls(x):
        a_scale = x.float().abs().amax() / 448.0
        rows = -(-x.shape[0] // 16) * 16
        x8 = torch.zeros((rows, w.k), device=x.device).to(torch.float8_e4m3fn)
        x8[:x.shape[0]] = (x.float() / a_scale).to(torch.float8_e4m3fn)
        return [functools.partial(torch._scaled_mm, x8, b, scale_a=a_scale * one, scale_b=w_scale * one,
                                  out_dtype=x.dtype) for (b,) in copies]

    return Contender(calls, exact=False)


def humming_w4a8_contender(w: LayerWeights) -> Contender:
    """humming's W4A8: its INT4 weights (as humming_contender) with FP8 e4m3 activations quantized per
    token inside its call. Its own quantization, so not checked against our reference."""
    return _humming(w, {"dtype": "float8e4m3", "quant_mode": "dynamic_token"})


def fp16_contender(w: LayerWeights) -> Contender:
    return Contender(Fp16Baseline(w.codes, w.scales, dtype=w.scales.dtype).calls, exact=True)


def torch_int4_contender(w: LayerWeights) -> Contender:
    """torch's tinygemm kernel: bf16 activations, weights as uint8 [N, K/2] (even k in the high nibble)
    converted to its tiled int32 layout, and (scale, zero) pairs per group with w = (q - 8) * scale + zero."""
    if not (hasattr(torch, "_weight_int4pack_mm") and hasattr(torch, "_convert_weight_to_int4pack")):
        raise KernelUnavailable(f"torch {torch.__version__} has no _weight_int4pack_mm")
    tiles = [t for t in (8, 4, 2) if w.k % (16 * t) == 0]
    if not tiles:
        raise ValueError(f"K={w.k} is not a multiple of 32, which tinygemm needs")
    codes_nk = w.codes.t().contiguous()
    packed = torch._convert_weight_to_int4pack((codes_nk[:, 0::2] << 4 | codes_nk[:, 1::2]).contiguous(), tiles[0])
    scales = w.scales.to(torch.bfloat16)
    scale_zero = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()   # symmetric: zero 0
    copies = weight_copies((packed, scale_zero))

    def calls(x):
        xb = x.to(torch.bfloat16)   # converted outside the graph: only the kernel is timed
        return [functools.partial(torch._weight_int4pack_mm, xb, p, w.group, sz) for p, sz in copies]

    return Contender(calls, exact=True)


def humming_contender(w: LayerWeights) -> Contender:
    """humming-kernels' HummingLayer with its default kernel choices. It quantizes the weight itself
    (its own symmetric INT4 scales), so its result is not checked against our reference. Its weights
    live inside layer objects, so the copies are whole layers, as many as copies_for its format's bytes."""
    return _humming(w, None)


def _humming(w: LayerWeights, input_config: dict | None) -> Contender:
    """HummingLayer copies of w's weights with `input_config` (None: activations in their dtype)."""
    try:
        from humming.layer import HummingLayer
    except ImportError as exc:
        raise KernelUnavailable(f"humming is not importable: {exc}") from None
    weight_nk = dequantize(w.codes, w.scales).to(w.scales.dtype).t().contiguous()
    layers = []
    for _ in range(copies_for(report.weight_bytes("humming", w.k, w.n, w.group))):
        config = {"dtype": "int4", "group_size": 0 if w.group == w.k else w.group}   # 0: channelwise
        layer = HummingLayer(shape_n=w.n, shape_k=w.k, weight_config=config, torch_dtype=w.scales.dtype,
                             input_config=dict(input_config) if input_config else None).cuda()
        layer.load_from_unquantized(weight_nk)
        layer.transform()
        layers.append(layer)
    return Contender(lambda x: [functools.partial(layer, x) for layer in layers], exact=False)


CONTENDERS = {"tilemarlin": tilemarlin_contender, "fp16": fp16_contender,
              "torch_int4": torch_int4_contender, "humming": humming_contender,
              "tilemarlin_untuned": tilemarlin_untuned_contender,
              "tilemarlin_zp": tilemarlin_zero_points_contender, "tilemarlin_act": tilemarlin_act_order_contender,
              "tilemarlin_w4a8": tilemarlin_w4a8_contender, "fp8_w8a8": fp8_w8a8_contender,
              "humming_w4a8": humming_w4a8_contender}
