"""The hopper_wgmma family: sm_90a only, and its PTX really uses TMA, wgmma and warp specialization."""
import re

import pytest

from runtime.kernels import compile_schedule
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


def test_word_map_places_every_packed_value():
    """The kernel stores value (pair, elem) of the packed word at [row, col] to W[k, n] of its tile;
    replay the very function it uses, on plain ints, against layout.pack_weight and the decode's
    pair order (pair p = nibbles p and p + 4)."""
    import torch

    from schedules.hopper_wgmma.kernel import unpacked_position

    codes = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    words = layout.pack_weight(codes).to(torch.int64) & 0xFFFFFFFF
    seen = torch.zeros_like(codes, dtype=torch.bool)
    for row in range(words.shape[0]):
        for col in range(words.shape[1]):
            for pair in range(4):
                for elem in range(2):
                    n, k = unpacked_position(row, col, pair, elem)
                    nibble = (int(words[row, col]) >> (4 * (pair + 4 * elem))) & 15
                    assert nibble == codes[k, n], (row, col, pair, elem)
                    seen[k, n] = True
    assert seen.all()


def test_decode_is_the_lop3_template(compiled):
    src, ptx = compiled
    assert "tm_dequant_f16_u4(" in src.split("__global__", 1)[1]
    assert "lop3.b32" in ptx
