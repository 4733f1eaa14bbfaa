"""The RMSNorm that writes act-order's gathered order (schedules/norm_gather.py,
runtime.op.rms_norm_gather): the code nvcc makes of it on the CPU, the op's checks, and on a GPU its
output against transformers' RMSNorm followed by the gather."""
import re

import pytest
import torch

from runtime import op
from schedules.arch import get_arch
from schedules.norm_gather import build, supports
from tests.reference import poison_next_allocation
from tests.test_gather import ptx_of

SM90, SM80 = get_arch("sm_90a"), get_arch("sm_80")


def compiled(k, dtype="float16", arch=SM90):
    import tilelang

    return tilelang.compile(build(k, dtype, arch), target=arch.target)


@pytest.fixture(scope="module")
def ptx():
    return ptx_of(compiled(4096), SM90)


def test_the_row_is_read_once_and_written_16_bytes_a_store(ptx):
    # 16 bytes of the row, 8 indices in two, 8 weights: four 16-byte loads a thread
    assert len(re.findall(r"\bld\.global(\.nc)?\.v4\.u32\b", ptx)) == 4
    assert re.search(r"\bld\.shared\.u16\b", ptx)                          # gathered from the shared copy
    assert len(re.findall(r"\bst\.global\.v4\.u32\b", ptx)) == 1          # 8 outputs a store
    assert "griddepcontrol.launch_dependents" in ptx                      # the GEMM launches at once


def test_the_mean_square_is_a_block_sum_and_one_reciprocal_square_root(ptx):
    assert re.search(r"\bshfl\.sync\.(bfly|down)\.b32\b", ptx)            # the warps' sums
    assert len(re.findall(r"\brsqrt\.approx\.(ftz\.)?f32\b", ptx)) == 1
    assert re.search(r"\bfma\.rn\.f32\b|\bmul\.(rn\.)?f32\b", ptx)


def test_indices_and_weights_are_loaded_before_the_wait_for_the_row(ptx):
    steps = [line.strip().split()[0] for line in ptx.splitlines()
             if re.search(r"\bld\.global|griddepcontrol\.wait", line)]
    assert steps[:5] == ["ld.global.v4.u32"] * 3 + ["griddepcontrol.wait;", "ld.global.v4.u32"], steps


@pytest.mark.parametrize("k,dtype,arch", [(11008, "float16", SM90), (3584, "bfloat16", SM90), (5120, "float16", SM80)])
def test_other_widths_dtypes_and_archs_build(k, dtype, arch):
    ptx = ptx_of(compiled(k, dtype, arch), arch)
    assert re.search(r"\bst\.global\.v4\.u32\b", ptx)
    assert ("griddepcontrol" in ptx) == arch.hopper


@pytest.mark.parametrize("k", [4100, 576, 960])
def test_widths_the_threads_do_not_split_evenly_are_refused(k):
    """(576 and 960: multiples of 64 that 128 threads do not split; the fold leaves such norms alone.)"""
    assert not supports(k)
    with pytest.raises(ValueError, match="must be a multiple of 128"):
        build(k, "float16", SM90)
    assert supports(896) and supports(11008)


ONES = torch.ones(64, dtype=torch.float16)
EPS = torch.tensor([1e-6])


@pytest.mark.parametrize("weight,eps,match", [
    (ONES.float(), EPS, "weight must be contiguous torch.float16 \\[64\\]"),
    (torch.ones(32, dtype=torch.float16), EPS, "weight must be"),
    (ONES, EPS.double(), "eps must be float32 \\[1\\]"),
    (ONES, torch.tensor(1e-6), "eps must be float32 \\[1\\]"),
])
def test_the_op_refuses_a_weight_or_eps_that_does_not_fit(weight, eps, match):
    with pytest.raises(ValueError, match=match):
        op.rms_norm_gather(torch.zeros(3, 64, dtype=torch.float16), weight, torch.arange(64, dtype=torch.int32), eps)


def test_the_op_runs_on_cuda_gpus_only():
    with pytest.raises(RuntimeError, match="runs on CUDA GPUs"):
        op.rms_norm_gather(torch.zeros(3, 64, dtype=torch.float16), ONES, torch.arange(64, dtype=torch.int32), EPS)


def reference(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama) with the original weight, then the gather."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype))[..., perm.long()]


def drawn(m, k, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=generator) * 3).to(dtype)
    weight = (torch.rand(k, device="cuda", generator=generator) + 0.5).to(dtype)
    perm = torch.randperm(k, device="cuda", generator=generator).int()
    return x, weight, perm


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,dtype", [(m, 4096, torch.float16) for m in (1, 3, 17, 100, 257, 1024, 8192)]
                         + [(1, 5120, torch.bfloat16), (17, 3584, torch.bfloat16), (3, 8192, torch.float16),
                            (16, 11008, torch.float16)])
def test_the_op_matches_the_norm_then_the_gather(m, k, dtype):
    """Within one rounding of the output: the block's sum of squares is not torch's order of summation.
    The output block is NaN before the call."""
    x, weight, perm = drawn(m, k, dtype, m + k)
    ordered, eps = weight[perm.long()].contiguous(), torch.tensor([1e-5], device="cuda")
    poisoned = poison_next_allocation((m, k), dtype, "cuda")     # after every other allocation
    out = op.rms_norm_gather(x, ordered, perm, eps)
    want = reference(x, weight, perm, 1e-5)
    assert out.data_ptr() == poisoned and not out.isnan().any()
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), want.float(), rtol=2 * ulp, atol=1e-6)


@pytest.mark.gpu
def test_three_dimensional_inputs_in_a_cuda_graph():
    k = 4096
    x, weight, perm = drawn(18, k, torch.float16, 5)
    x = x.view(2, 9, k)
    ordered, eps = weight[perm.long()].contiguous(), torch.tensor([1e-6], device="cuda")
    want = op.rms_norm_gather(x, ordered, perm, eps)
    torch.testing.assert_close(want.float(), reference(x, weight, perm, 1e-6).float(), rtol=2e-3, atol=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.rms_norm_gather(x, ordered, perm, eps)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
