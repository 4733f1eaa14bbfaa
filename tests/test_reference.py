"""The GPU tests' verdict (tests/reference.py), on the CPU: it passes a correct output and fails a broken one."""
import pytest
import torch

from schedules.quant import dequantize, quantize_rtn, reference_matmul
from tests.reference import TOLERANCES, assert_matches_reference, generator, relative_norm_error, seed_of

M, K, N = 1024, 512, 4096


@pytest.fixture(scope="module")
def case():
    """(a, codes, scales, fp32 reference) of a 1024 x 4096 output, as the GPU tests build them."""
    gen = generator(seed_of("reference helper"), "cpu")
    codes, scales = quantize_rtn(torch.randn(K, N, generator=gen).half(), 128)
    a = torch.randn(M, K, generator=gen).half()
    return a, codes, scales, reference_matmul(a, codes, scales)


def kernel_like(a, codes, scales, dtype):
    """What a correct kernel computes: weights rounded to `dtype`, fp32 sums, the output rounded to `dtype`."""
    w = dequantize(codes, scales).to(dtype).float()
    return (a.float() @ w).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_accepts_the_reference_and_its_rounding_noise(case, dtype):
    a, codes, scales, ref = case
    assert_matches_reference(ref.to(dtype), ref)
    a = a.to(dtype)
    assert_matches_reference(kernel_like(a, codes, scales, dtype), reference_matmul(a, codes, scales))
    tol = TOLERANCES[torch.float16]
    assert_matches_reference(ref.clone(), ref, rel_tol=tol.rel, elem_tol=tol.elem)


def median_element(ref):
    """The index of an element of median magnitude: half of all elements are at least as large."""
    flat = ref.abs().flatten().argsort()[ref.numel() // 2]
    return tuple(int(i) for i in torch.unravel_index(flat, ref.shape))


def test_rejects_one_zeroed_element_that_the_norm_alone_misses(case):
    a, codes, scales, ref = case
    out = kernel_like(a, codes, scales, torch.float16)
    index = median_element(ref)
    out[index] = 0
    assert relative_norm_error(out, ref) < TOLERANCES[torch.float16].rel   # the norm cannot see it
    with pytest.raises(AssertionError, match=rf"element \({index[0]}, {index[1]}\) is 0,"):
        assert_matches_reference(out, ref, context="seed=1")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_rejects_a_single_nan_or_inf(case, value):
    a, codes, scales, ref = case
    out = kernel_like(a, codes, scales, torch.float16)
    out[517, 3001] = value
    message = r"seed=7: 1 of 4194304 output elements are NaN or Inf .* at \(517, 3001\)"
    with pytest.raises(AssertionError, match=message):
        assert_matches_reference(out, ref, context="seed=7")


def test_rejects_a_wrong_shape_and_a_uniformly_wrong_output(case):
    _, _, _, ref = case
    with pytest.raises(AssertionError, match="output shape"):
        assert_matches_reference(ref[:, :-64].half(), ref)
    with pytest.raises(AssertionError, match="relative error"):
        assert_matches_reference((ref * 1.01).half(), ref)


def test_seeds_are_fixed_per_case():
    assert seed_of("o", 128, 17) == seed_of("o", 128, 17) != seed_of("o", 128, 18)
    draw = lambda seed: torch.randn(8, generator=generator(seed, "cpu"))
    assert torch.equal(draw(5), draw(5)) and not torch.equal(draw(5), draw(6))


def test_the_tuner_and_first_run_checks_verdict_sees_one_wrong_element(case):
    """schedules.quant.mismatch, which decides whether the tuner times a candidate and whether a served
    kernel passes its first-run check: a correct output passes; one element off by 5 % of the largest
    magnitude, far below the norm's tolerance over 4M outputs, fails; so does a NaN."""
    from schedules.quant import mismatch

    a, codes, scales, ref = case
    out = kernel_like(a, codes, scales, torch.float16)
    assert mismatch(out, ref, "float16") is None
    out[517, 3001] += 0.05 * ref.abs().max()
    assert relative_norm_error(out, ref) < TOLERANCES[torch.float16].rel
    assert "an element is off by" in mismatch(out, ref, "float16")
    out[517, 3001] = float("nan")
    assert "over the tolerance" in mismatch(out, ref, "float16")       # (its error reads inf or nan)
