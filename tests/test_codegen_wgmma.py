"""The hopper_wgmma family: sm_90a only, and its PTX really uses TMA, wgmma and warp specialization."""
import re

import pytest

from gen.compile import compile_schedule
from schedules import hopper_wgmma
from schedules.arch import get_arch
from schedules.hopper_wgmma import Knobs, check
from schedules.marlin_mma import layout
from schedules.problem import Problem
from schedules.registry import Schedule


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    kernel = compile_schedule(Problem(512, 1024, 128), Schedule("hopper_wgmma", Knobs(128, 128, 64, 256, 3)),
                              get_arch("sm_90a"))
    path = tmp_path_factory.mktemp("ptx") / "k.ptx"
    kernel.export_ptx(str(path))
    return kernel.get_kernel_source(), path.read_text()


def test_tma_loads_and_wgmma(compiled):
    src, ptx = compiled
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::(cta|cluster)\.global\.mbarrier", ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16", ptx)
    assert "mbarrier" in ptx


def test_warp_specialized_producer(compiled):
    src, _ = compiled
    # 256 consumer threads plus a 128-thread producer warpgroup.
    assert "__launch_bounds__(384" in src and "warpgroup_reg_alloc" in src


def test_not_offered_before_hopper():
    p = Problem(4096, 4096)
    assert "sm_90a" in check(p, Knobs(), get_arch("sm_80"))
    assert hopper_wgmma.space(p, get_arch("sm_80")) == []
    assert len(hopper_wgmma.space(p, get_arch("sm_90a"))) > 10


def test_shares_the_marlin_layout():
    assert hopper_wgmma.LAYOUT == "marlin_mma.v1" and hopper_wgmma.layout is layout


def test_inverse_map_finds_every_packed_value():
    """The kernel finds W[k, n] of a tile by (row, column, shift) into the packed tile; replay the
    very function it uses, on plain ints, against layout.pack_weight."""
    import torch

    from schedules.hopper_wgmma.kernel import packed_position

    codes = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    words = layout.pack_weight(codes).to(torch.int64) & 0xFFFFFFFF
    for kk in range(32):
        for nn in range(128):
            row, col, shift = packed_position(nn, kk)
            assert (int(words[row, col]) >> shift) & 15 == codes[kk, nn], (kk, nn)
