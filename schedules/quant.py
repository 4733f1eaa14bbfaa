"""Round-to-nearest INT4 quantization (symmetric, or with zero points) and the fp32 reference every
kernel is checked against.

Convention used across tilemarlin: the weight is W[K, N] (input features x output features), so that
C = A @ W with A[M, K]. `codes` are unsigned integers in [0, 2**bits), the stored zero point is
2**(bits-1) (8 for INT4), and w = (code - 8) * scale[k // group, n].
"""
from __future__ import annotations

import torch

from .problem import Problem

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# The smallest scale RTN gives a group, so that an all-zero group gets a positive scale (its codes all
# 8) rather than 0: 1e-8 in bf16, and fp16's smallest subnormal, since 1e-8 rounds to 0 in fp16.
_MIN_SCALE = {"float16": 2.0 ** -24, "bfloat16": 1e-8}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use one of {tuple(_TORCH_DTYPES)}") from None


def zero_point(bits: int) -> int:
    return 1 << (bits - 1)


def quantize_rtn(weight_kn: torch.Tensor, group: int = 128, bits: int = 4, dtype: str = "float16"):
    """Round-to-nearest symmetric quantization of W[K, N].

    Returns (codes uint8 [K, N], scales [K // group, N] in `dtype`); ``group=-1`` is channelwise.
    The scale is rounded to `dtype` before the codes are computed, so that dequantizing with the
    stored scale reproduces exactly what the codes were chosen for.
    """
    w = _grouped(weight_kn, group, bits, dtype)
    qmax = (1 << bits) - 1
    # GPTQ's symmetric convention: the range [-max, max] spread over 2**bits - 1 steps.
    scales = (w.abs().amax(dim=1) * (2.0 / qmax)).clamp_min(_MIN_SCALE[dtype])
    scales = scales.to(torch_dtype(dtype))
    return _rounded_codes(w, scales, zero_point(bits), bits), scales


def quantize_rtn_asymmetric(weight_kn: torch.Tensor, group: int = 128, bits: int = 4, dtype: str = "float16"):
    """Round-to-nearest quantization of W[K, N] with a zero point per group and column.

    Returns (codes uint8 [K, N], scales [K // group, N] in `dtype`, zero points int64 [K // group, N]).
    Each group's range is widened to hold 0, so that zero weights stay exact (and a group of one
    repeated value is its top or bottom code): s = (max - min) / 15, z = round(-min / s). As in
    quantize_rtn the scale is rounded to `dtype` before the codes and zero points are chosen.
    """
    w = _grouped(weight_kn, group, bits, dtype)
    qmax = (1 << bits) - 1
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scales = ((high - low) / qmax).clamp_min(_MIN_SCALE[dtype]).to(torch_dtype(dtype))
    zeros = torch.round(-low / scales.float()).clamp_(0, qmax)
    return _rounded_codes(w, scales, zeros.unsqueeze(1), bits), scales, zeros.to(torch.int64)


def _grouped(weight_kn: torch.Tensor, group: int, bits: int, dtype: str) -> torch.Tensor:
    """W[K, N] as fp32 [K // group, group, N], after checking that it makes a Problem."""
    if weight_kn.dim() != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {tuple(weight_kn.shape)}")
    k, n = weight_kn.shape
    problem = Problem.make(n=n, k=k, group=group, dtype=dtype, bits=bits)
    return weight_kn.float().reshape(problem.num_groups, problem.group, n)


def _rounded_codes(w: torch.Tensor, scales: torch.Tensor, zero, bits: int) -> torch.Tensor:
    """Codes uint8 [K, N] of grouped weights w: round(w / s) + zero, clamped to the code range."""
    codes = torch.round(w / scales.float().unsqueeze(1)) + zero
    return codes.clamp_(0, (1 << bits) - 1).to(torch.uint8).reshape(-1, w.shape[-1])


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int = 4, zeros: torch.Tensor | None = None
               ) -> torch.Tensor:
    """fp32 W[K, N] from codes [K, N], scales [K // group, N] and zero points (same shape as the scales;
    None: 8 everywhere)."""
    k, n = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != n or k % groups:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape {(k, n)}")
    zero = float(zero_point(bits)) if zeros is None else zeros.float().to(codes.device).unsqueeze(1)
    w = codes.float().reshape(groups, k // groups, n) - zero
    return (w * scales.float().unsqueeze(1)).reshape(k, n)


def reference_matmul(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int = 4,
                     zeros: torch.Tensor | None = None, precision: torch.dtype = torch.float32) -> torch.Tensor:
    """The fp32 reference: A @ dequantize(W), computed in fp32 on A's device (in `precision`, float64,
    where no TF32 or autocast setting of the caller may round it: autocast leaves float64 alone)."""
    w = dequantize(codes.to(a.device), scales.to(a.device), bits, None if zeros is None else zeros.to(a.device))
    return a.to(precision) @ w.to(precision)


FP8_E4M3_MAX = 448.0     # the largest finite float8_e4m3fn
FP8_K_TILE = 128         # W4A8's k-tile: the activations' sums come per 128 columns (fp8_k_tile_sums)


def fp8_token_scales(a: torch.Tensor) -> torch.Tensor:
    """W4A8's per-token scales of a [M, K], fp32 [M, 1]: the smallest power of two s with 448 s >= the
    row's largest magnitude (1 for an all-zero row). With amax = m 2^E, m in [1, 2), that is 2^(E - 8)
    while m <= 1.75 (448 = 1.75 * 2^8), else 2^(E - 7): no division, so the kernels compute the same
    bits. A power of two makes a / s exact, and e4m3's rounding of a / s the same as rounding a to
    e4m3's 3 mantissa bits wherever a / s is a normal e4m3 number (>= 2^-6): what lets the W4A16
    kernels round activations themselves without the scale (schedules/fp8_rounding.py)."""
    amax = a.float().abs().amax(dim=-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax)      # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    scales = torch.ldexp(torch.ones_like(amax), torch.where(mantissa <= 0.875, exponent - 9, exponent - 8))
    return torch.where(amax > 0, scales, torch.ones_like(amax))


def quantize_fp8_per_token(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A8's activations: (a8 float8_e4m3fn [M, K], scales fp32 [M, 1]) with a ~ a8 * scales, one
    power-of-two scale per row (token) taken dynamically from its largest magnitude (fp8_token_scales),
    which lands in (224, 448]."""
    scales = fp8_token_scales(a)
    return (a.float() / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scales


def reference_w4a8(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int = 4,
                   zeros: torch.Tensor | None = None, precision: torch.dtype = torch.float32) -> torch.Tensor:
    """The fp32 product W4A8 kernels must match: a's per-token FP8 values times their scales, times
    the dequantized weights (in `precision`, as reference_matmul)."""
    a8, token_scales = quantize_fp8_per_token(a)
    return (a8.float() * token_scales).to(precision) @ dequantize(codes, scales, bits, zeros).to(precision)


def fp8_k_tile_sums(a8: torch.Tensor) -> torch.Tensor:
    """The sum of each 128 columns' FP8 values of a8 [M, K] (before the token scale), fp32 [M, K / 128]:
    what the W4A8 GEMM adds back for its offset weight decode (templates/dequant.cuh.j2)."""
    m, k = a8.shape
    return a8.float().view(m, k // FP8_K_TILE, FP8_K_TILE).sum(dim=-1)


def fp8_kernel_activations(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a W4A8 kernel takes for activations `a` [M, K]: their per-token FP8 values with the
    columns in the FP8 k order (schedules/marlin_mma/layout.fp8_k_order), the token scales and the
    k-tile sums (fp8_k_tile_sums), computed by torch (schedules/fp8_activations.py is the kernel that
    serves them)."""
    from .marlin_mma.layout import fp8_k_order

    a8, token_scales = quantize_fp8_per_token(a)
    return a8[:, fp8_k_order(a.shape[-1]).to(a.device)].contiguous(), token_scales, fp8_k_tile_sums(a8)


def problem_reference(problem, a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None = None, precision: torch.dtype = torch.float32) -> torch.Tensor:
    """The fp32 product a kernel of `problem` must match: W4A16's reference_matmul, or with FP8
    activations (also rounded to them in the kernel, fp8_rounded) reference_w4a8 (in `precision`, as
    reference_matmul)."""
    if problem.fp8 or problem.rounds_fp8:
        return reference_w4a8(a, codes.to(a.device), scales.to(a.device), problem.bits, precision=precision)
    return reference_matmul(a, codes, scales, problem.bits, zeros, precision)


def kernel_activations(problem, a: torch.Tensor):
    """The activations argument of the kernels' kernel_args for `problem`: `a` itself, or with FP8
    activations the pair fp8_kernel_activations gives."""
    return fp8_kernel_activations(a) if problem.fp8 else a


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in fp32; NaN or Inf anywhere in `out` gives inf."""
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return (torch.linalg.vector_norm(out - ref.float()) / torch.linalg.vector_norm(ref.float()).clamp_min(1e-30)).item()


# What a kernel's output may differ from the fp32 reference by: fp16 or bf16 rounding of the output
# and of the partial sums, relative to the output as a whole (the norm) and to its largest value (each
# element, so that one wrong element among millions is still caught).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
ELEMENT_TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2}


def mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> str | None:
    """Why `out` is not `ref` within the tolerances of `dtype`, or None."""
    err = relative_error(out, ref)
    if not err <= TOLERANCE[dtype]:
        return f"relative error {err:.3g} over the tolerance {TOLERANCE[dtype]}"
    worst = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().clamp_min(1e-30).item()
    if not worst <= ELEMENT_TOLERANCE[dtype] * scale:
        return (f"an element is off by {worst:.3g}, over {ELEMENT_TOLERANCE[dtype]} of the reference's "
                f"largest magnitude {scale:.3g}")
    return None
