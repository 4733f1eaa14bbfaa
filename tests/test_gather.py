"""Act-order's column gather (schedules/gather.py, runtime.op.gather_columns): the code nvcc makes of it
for sm_90a, its argument checks, and on a GPU x[..., perm] exactly, under CUDA graphs and torch.compile."""
import re

import pytest
import torch

from runtime.op import gather_columns
from schedules.arch import get_arch
from schedules.gather import build

SM90 = get_arch("sm_90a")


@pytest.fixture(scope="module")
def ptx():
    import tilelang
    from tilelang.contrib import nvcc
    from tvm.target import Target

    source = tilelang.compile(build(11008), target=SM90.target).get_kernel_source()
    with Target(SM90.target):
        return nvcc.get_ptx_from_source(source)


def test_the_next_kernel_launches_first_and_this_one_waits_for_the_previous(ptx):
    launch = ptx.index("griddepcontrol.launch_dependents")
    wait = ptx.index("griddepcontrol.wait")
    first_load = re.search(r"\bld\.global", ptx).start()
    assert launch < wait < first_load


def test_the_arguments_are_checked():
    x = torch.zeros(3, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="int64 \\[K\\]"):
        gather_columns(x, torch.arange(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="int64 \\[K\\]"):
        gather_columns(x, torch.arange(32))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        gather_columns(x.float(), torch.arange(64))
    with pytest.raises(RuntimeError, match="CUDA"):
        gather_columns(x, torch.arange(64))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 17, 100, 257, 1024, 8192])
@pytest.mark.parametrize("k,dtype", [(4096, torch.float16), (11008, torch.bfloat16)])
def test_the_gather_is_exact(m, k, dtype):
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn((m, k), generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(k, generator=gen, device="cuda")
    assert torch.equal(gather_columns(x, perm), x[:, perm])


@pytest.mark.gpu
def test_graphs_and_compile():
    k = 4096
    x = torch.randn((2, 5, k), device="cuda", dtype=torch.float16)
    perm = torch.randperm(k, device="cuda")
    gather_columns(x, perm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather_columns(x, perm)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x[..., perm])
    compiled = torch.compile(lambda t: gather_columns(t, perm) * 2, fullgraph=True)
    assert torch.equal(compiled(x), x[..., perm] * 2)


def test_rows_per_block_fit_the_staged_bytes():
    from schedules.gather import STAGED_BYTES, rows_per_block

    assert rows_per_block(4096, "float16") == 4 and rows_per_block(14336, "bfloat16") == 2
    assert rows_per_block(29568, "float16") == 1
    assert all(rows_per_block(k, "float16") * k * 2 <= STAGED_BYTES for k in (4096, 11008, 14336, 18944))
