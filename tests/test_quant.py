"""Round-to-nearest quantization and the fp32 reference."""
import pytest
import torch

from schedules.problem import Problem
from schedules.quant import dequantize, quantize_rtn, reference_matmul, relative_error


@pytest.mark.parametrize("group", [128, -1])
def test_rtn_error_is_within_about_half_a_step(group):
    w = torch.randn(512, 192, dtype=torch.float16)
    codes, scales = quantize_rtn(w, group)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales.dtype == torch.float16 and scales.shape == (512 // (128 if group > 0 else 512), 192)
    step = scales.float().repeat_interleave(512 // scales.shape[0], dim=0)
    err = (dequantize(codes, scales) - w.float()).abs()
    # Half a step, plus the fp16 rounding of the scale at the clamped extreme (max |w| = 7.5 steps).
    assert (err <= 0.51 * step).all()


def test_bf16_scales():
    codes, scales = quantize_rtn(torch.randn(256, 64), 128, dtype="bfloat16")
    assert scales.dtype == torch.bfloat16


def test_reference_is_fp32_matmul_of_dequantized_weights():
    codes = torch.randint(0, 16, (256, 64), dtype=torch.uint8)
    scales = torch.rand(2, 64, dtype=torch.float16)
    a = torch.randn(5, 256, dtype=torch.float16)
    w = (codes.float() - 8) * scales.float().repeat_interleave(128, dim=0)
    ref = reference_matmul(a, codes, scales)
    assert ref.dtype == torch.float32
    assert torch.allclose(ref, a.float() @ w, rtol=1e-5, atol=1e-4)


def test_relative_error_flags_nan_and_measures_difference():
    ref = torch.ones(4, 4)
    assert relative_error(ref.clone(), ref) == 0
    assert relative_error(torch.full((4, 4), float("nan")), ref) == float("inf")
    assert abs(relative_error(ref * 1.01, ref) - 0.01) < 1e-6


@pytest.mark.parametrize("kwargs,msg", [
    (dict(n=64, k=200, group=128), "not a multiple of the group"),
    (dict(n=64, k=256, dtype="float32"), "dtype"),
    (dict(n=64, k=256, bits=3), "3-bit"),
    (dict(n=0, k=256), "positive"),
])
def test_problem_rejects_what_no_kernel_serves(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Problem(**kwargs)


def test_quantize_rejects_k_not_multiple_of_group():
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        quantize_rtn(torch.randn(200, 64), 128)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_all_zero_group_gets_a_positive_scale_and_zero_codes(dtype):
    w = torch.randn(256, 64)
    w[64:128, 5] = 0
    codes, scales = quantize_rtn(w, 64, dtype=dtype)
    assert bool((scales > 0).all())
    assert bool((codes[64:128, 5] == 8).all()) and bool((dequantize(codes, scales)[64:128, 5] == 0).all())
