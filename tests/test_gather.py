"""Act-order's column gather (schedules/gather.py, runtime.op.gather_columns): the code nvcc makes of it
on the CPU, the op's checks, and on a GPU its output against x[:, perm], exactly."""
import re

import pytest
import torch

from runtime import op
from schedules.arch import get_arch
from schedules.gather import build
from tests.reference import poison_next_allocation

SM90, SM80 = get_arch("sm_90a"), get_arch("sm_80")


def compiled(k, dtype="float16", arch=SM90):
    import tilelang

    return tilelang.compile(build(k, dtype, arch), target=arch.target)


def ptx_of(kernel, arch):
    from tilelang.contrib import nvcc
    from tvm.target import Target

    with Target(arch.target):
        return nvcc.get_ptx_from_source(kernel.get_kernel_source())


@pytest.fixture(scope="module")
def ptx():
    return ptx_of(compiled(4096), SM90)


def test_the_row_is_read_once_and_written_16_bytes_a_store(ptx):
    assert len(re.findall(r"\bld\.global(\.nc)?\.v4\.u32\b", ptx)) == 3   # the row's 16 bytes, 8 indices
    assert re.search(r"\bld\.shared\.u16\b", ptx)                          # gathered from the shared copy
    assert len(re.findall(r"\bst\.global\.v4\.u32\b", ptx)) == 1          # 8 outputs a store
    assert "griddepcontrol.launch_dependents" in ptx                      # the GEMM launches at once


def test_the_indices_are_loaded_before_the_wait_for_the_row(ptx):
    """The indices (no kernel writes them) are in flight before the kernel waits for the previous one's
    writes, and the row's load follows the wait: the two round trips overlap."""
    steps = [line.strip().split()[0] for line in ptx.splitlines()
             if re.search(r"\bld\.global|griddepcontrol\.wait|\bbar\.sync", line)]
    assert steps[:5] == ["ld.global.v4.u32", "ld.global.v4.u32", "griddepcontrol.wait;", "ld.global.v4.u32",
                         "bar.sync"], steps


def test_before_hopper_it_builds_without_the_early_launch():
    ptx = ptx_of(compiled(4096, arch=SM80), SM80)
    assert "griddepcontrol" not in ptx and re.search(r"\bst\.global\.v4\.u32\b", ptx)


@pytest.mark.parametrize("k,dtype", [(11008, "float16"), (3584, "bfloat16")])
def test_widths_that_the_threads_do_not_split_in_whole_steps_build_with_a_guard(k, dtype):
    """The last step's threads past the row write nothing: the guard is on the 8-column chunk, K / 8
    of them (TileLang writes it in 256-column units of a warp: K / 256)."""
    source = compiled(k, dtype).get_kernel_source()
    chunks = k // 8
    assert re.search(rf"< {chunks}\)|< {chunks // 32}\)", source), source[-1500:]


def test_whole_steps_need_no_guard():
    assert "if (" not in compiled(4096).get_kernel_source().split("gather_columns_kernel(", 2)[2]


@pytest.mark.parametrize("k", [4096, 11008])
def test_the_row_is_read_in_16_byte_chunks_at_every_width(k):
    """At K = 11008 (256 threads, 43 elements a thread) a plain T.copy reads the row 2 bytes a load."""
    ptx = ptx_of(compiled(k), SM90)
    assert not re.search(r"\bld\.global(\.nc)?\.(u16|b16)\b", ptx)
    assert re.search(r"\bld\.global(\.nc)?\.v4\.u32\b", ptx)


def test_widths_that_are_not_whole_stores_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        build(4100, "float16", SM90)


@pytest.mark.parametrize("perm,match", [
    (torch.arange(64), "int32"),
    (torch.arange(32, dtype=torch.int32), r"int32 \[K\]"),
    (torch.arange(128, dtype=torch.int32)[::2], "contiguous"),
])
def test_the_op_refuses_a_permutation_that_does_not_fit(perm, match):
    with pytest.raises(ValueError, match=match):
        op.gather_columns(torch.zeros(3, 64, dtype=torch.float16), perm)


def test_the_op_runs_on_cuda_gpus_only():
    with pytest.raises(RuntimeError, match="runs on CUDA GPUs"):
        op.gather_columns(torch.zeros(3, 64, dtype=torch.float16), torch.arange(64, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,dtype", [(m, 4096, torch.float16) for m in (1, 3, 17, 100, 257, 1024, 8192)]
                         + [(1, 11008, torch.float16), (17, 11008, torch.bfloat16), (3, 28672, torch.float16),
                            (16, 14336, torch.bfloat16), (1, 3584, torch.float16)])
def test_the_op_matches_the_indexing(m, k, dtype):
    """(K = 11008: 256 threads, the last step partial; K = 28672: a row of 56 KB in shared memory;
    K = 3584: 448 chunks for 512 threads.) The output block is NaN before the call."""
    generator = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, device="cuda", generator=generator).to(dtype)
    perm = torch.randperm(k, device="cuda", generator=generator).int()
    poisoned = poison_next_allocation((m, k), dtype, "cuda")
    out = op.gather_columns(x, perm)
    assert out.data_ptr() == poisoned and torch.equal(out, x[:, perm.long()])


@pytest.mark.gpu
def test_three_dimensional_and_strided_inputs_in_a_cuda_graph():
    k = 4096
    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 9, 2 * k, device="cuda", generator=generator).half()[..., ::2]   # not contiguous
    perm = torch.randperm(k, device="cuda", generator=generator).int()
    want = x[..., perm.long()]
    assert torch.equal(op.gather_columns(x, perm), want)
    static = x.contiguous()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.gather_columns(static, perm)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
