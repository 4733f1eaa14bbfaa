"""W4A8's activation kernels (schedules/fp8_activations.py): the code nvcc makes of them for sm_90a on
the CPU, and on a GPU their output against schedules.quant.quantize_fp8_per_token, in the FP8 k order."""
import re

import pytest
import torch

from schedules.arch import get_arch
from schedules.fp8_activations import build, build_with_sums
from schedules.marlin_mma.layout import fp8_k_order
from schedules.quant import fp8_k_tile_sums, quantize_fp8_per_token

SM90 = get_arch("sm_90a")


def compiled(k, dtype="float16", arch=SM90, builder=build):
    import tilelang

    return tilelang.compile(builder(k, dtype, arch), target=arch.target)


@pytest.fixture(scope="module")
def ptx():
    from tilelang.contrib import nvcc
    from tvm.target import Target

    with Target(SM90.target):
        return nvcc.get_ptx_from_source(compiled(4096).get_kernel_source())


def test_the_ptx_converts_to_e4m3_with_saturation_and_reduces_across_the_block(ptx):
    assert re.search(r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b", ptx)
    assert re.search(r"\bshfl\.sync\.bfly\.b32\b", ptx)          # the block's amax, warp by warp
    assert re.search(r"\bst\.global\.f32\b", ptx)                  # the row's scale
    assert re.search(r"\bld\.global(\.nc)?\.v4\.u32\b", ptx)          # the row read once, 16 bytes a load
    # ... then (512 threads, 256 groups of 16 columns) half a group a thread from shared memory, stored
    # in the FP8 k order 8 bytes at a time
    assert re.search(r"\bld\.shared\.v2\.u32\b", ptx) and re.search(r"\bst\.global\.v2\.(u32|b32)\b", ptx)
    assert not re.search(r"\bst\.global\.(u8|b8)\b", ptx)
    assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == 8        # IEEE x / scale, 8 a thread (the scale: no division)
    assert "griddepcontrol.launch_dependents" in ptx             # the next kernel launches at once
    # launched as the previous kernel drains, it waits for that kernel's writes before reading the row
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.parametrize("k,dtype", [(11008, "float16"), (3584, "bfloat16")])
def test_llama_and_qwen_widths_build(k, dtype):
    source = compiled(k, dtype).get_kernel_source()
    assert "fp8_e4_t" in source and "AllReduce<tl::MaxOp" in source


@pytest.mark.parametrize("builder", [build, build_with_sums])
def test_before_hopper_they_are_refused(builder):
    with pytest.raises(ValueError, match="Hopper"):
        builder(4096, "float16", get_arch("sm_80"))


@pytest.mark.parametrize("builder", [build, build_with_sums])
def test_the_row_is_read_in_16_byte_chunks_at_k_11008(builder):
    """256 threads, 43 elements a thread: a plain T.copy would read the row 2 bytes a load."""
    from tilelang.contrib import nvcc
    from tvm.target import Target

    with Target(SM90.target):
        ptx = nvcc.get_ptx_from_source(compiled(11008, builder=builder).get_kernel_source())
    assert not re.search(r"\bld\.global(\.nc)?\.(u16|b16)\b", ptx)
    assert len(re.findall(r"\bld\.global(\.nc)?\.v4\.u32\b", ptx)) == 6     # 1376 chunks over 256 threads


def test_widths_the_k_order_cannot_cover_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        build(4100, "float16", SM90)


def test_the_sums_need_whole_k_tiles():
    with pytest.raises(ValueError, match="multiple of 128"):
        build_with_sums(4112, "float16", SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(m, 4096) for m in (1, 3, 16, 17, 100, 257, 1024)] + [(1, 11008), (3, 28672)])
def test_the_kernel_matches_the_reference_in_the_fp8_k_order(m, k):
    """(K = 11008: 256 threads a row; K = 28672: Llama-3-70B's down_proj, a row of 56 KB staged in
    shared memory, past the 48 KB a launch gets unasked.)"""
    kernel = compiled(k)
    generator = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=generator).half() * 3
    x[m // 2] = 0
    q = torch.full((m, k), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    s = torch.full((m, 1), float("nan"), device="cuda")
    kernel(x, q, s)
    q_ref, s_ref = quantize_fp8_per_token(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    order = fp8_k_order(k).cuda()
    # the same IEEE division (div.rn.f32) and round-to-nearest conversion as torch's: the same bytes
    assert torch.equal(q.view(torch.uint8), q_ref[:, order].contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 4096), (17, 4096), (257, 4096), (3, 11008), (100, 11008), (2, 28672)])
def test_the_kernel_with_sums_adds_each_128_columns(m, k):
    """The same values and scales, and each k-tile's sum of the e4m3 values (fp32, in another order
    than torch's: the values are multiples of 2^-9, so sums below 2^15 are exact either way)."""
    kernel = compiled(k, builder=build_with_sums)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).half() * 3
    x[m // 2] = 0
    q = torch.full((m, k), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    s = torch.full((m, 1), float("nan"), device="cuda")
    sums = torch.full((m, k // 128), float("nan"), device="cuda")
    kernel(x, q, s, sums)
    q_ref, s_ref = quantize_fp8_per_token(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref[:, fp8_k_order(k).cuda()].contiguous().view(torch.uint8))
    torch.testing.assert_close(sums, fp8_k_tile_sums(q_ref), rtol=1e-6, atol=1e-2)


def test_a_thread_takes_a_whole_group_where_the_groups_outnumber_the_threads():
    from tilelang.contrib import nvcc
    from tvm.target import Target

    from schedules.fp8_activations import quantize_unit

    assert [quantize_unit(k) for k in (4096, 3584, 11008, 14336)] == [8, 8, 16, 16]
    with Target(SM90.target):
        ptx = nvcc.get_ptx_from_source(compiled(11008, builder=build_with_sums).get_kernel_source())
    # 688 groups over 256 threads in three steps: 16 e4m3 bytes a store, a k-tile's 8 lanes add theirs
    assert len(re.findall(r"\bst\.global\.v4\.(u32|b32)\b", ptx)) == 3
    assert re.search(r"\bcvt\.rn\.f16x2\.e4m3x2\b", ptx) and re.search(r"\bshfl\.sync\.bfly\.b32\b", ptx)


def test_the_block_is_as_wide_as_the_row_splits_evenly():
    from schedules.row_kernels import threads_for

    assert [threads_for(k) for k in (4096, 3584, 11008, 14336, 4112)] == [512, 512, 256, 512, 128]

