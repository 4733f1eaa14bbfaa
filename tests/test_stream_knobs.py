"""stream_mma's knobs and validity check, and the A-fragment order of the swapped-operand decode (all CPU)."""
import re

import pytest
import torch

from schedules import stream_mma
from schedules.arch import get_arch
from schedules.marlin_mma.layout import _subtile_map, pack_weight
from schedules.problem import Problem
from schedules.registry import Schedule
from schedules.stream_mma import Knobs, check
from templates import dequant_function_names, render_dequant

H200, A100 = get_arch("sm_90a"), get_arch("sm_80")


# --- check ------------------------------------------------------------------------------------------

def test_default_knobs_are_valid_for_a_llama_layer():
    assert check(Problem(12288, 4096), Knobs(), H200) is None
    assert check(Problem(12288, 4096), Knobs(), A100) is None


@pytest.mark.parametrize("problem,knobs,reason", [
    (Problem(4096, 4096), Knobs(warps=0), "warps=0 must be positive"),
    (Problem(4096, 4096), Knobs(ahead=0), "ahead=0 must be positive"),
    (Problem(4096, 4096), Knobs(warps=64, unroll=1), "1024"),
    # N not a multiple of the slab's 64 columns
    (Problem(4096 + 32, 4096), Knobs(), "not a multiple of block_n=64"),
    # K not a multiple of 16 * unroll (channelwise, so the group cannot be the reason)
    (Problem.make(4096, 4096 + 64, -1), Knobs(unroll=8), r"K=4160 is not a multiple of unroll \* 16 = 128"),
    # group not a multiple of 16 * unroll: a batch would straddle two scale rows
    (Problem(4096, 4096, group=128), Knobs(unroll=16), r"group=128 must be a multiple of unroll \* 16 = 256"),
    (Problem(4096, 4096, group=64), Knobs(unroll=8), r"group=64 must be a multiple of unroll \* 16 = 128"),
    # batches < split_k * warps: 1024 / 64 = 16 batches for 4 * 8 = 32 warps
    (Problem(4096, 1024), Knobs(warps=8, unroll=4, split_k=4), "leave some of the split_k \\* warps = 32 warps"),
    (Problem(4096, 4096), Knobs(m_tiles=4, unroll=8, ahead=4), "registers"),
    (Problem(4096, 4096), Knobs(m_tiles=4, unroll=8, ahead=2, fold_zero_point=True, fold_lag=True), "registers"),
])
def test_check_names_the_reason(problem, knobs, reason):
    got = check(problem, knobs, H200)
    assert got is not None and re.search(reason, got), got


def test_batches_equal_to_workers_is_enough():
    # 16 batches of 64 rows for 2 * 8 warps: every warp has one; 4 * 8 warps would leave some idle.
    assert check(Problem(4096, 1024), Knobs(warps=8, unroll=4, split_k=2), H200) is None
    assert check(Problem(4096, 1024), Knobs(warps=8, unroll=4, split_k=4), H200) is not None


def test_register_estimate_grows_with_every_buffer():
    base = Knobs(m_tiles=1, unroll=4, ahead=1)
    assert base.registers_estimate() == 76   # the measured point named in knobs.py
    for bigger in (Knobs(m_tiles=2, unroll=4, ahead=1), Knobs(m_tiles=1, unroll=8, ahead=1),
                   Knobs(m_tiles=1, unroll=4, ahead=2), Knobs(m_tiles=1, unroll=4, ahead=1, fold_zero_point=True)):
        assert bigger.registers_estimate() > base.registers_estimate(), bigger.name


# --- space, names, registry ------------------------------------------------------------------------

def test_space_is_nonempty_and_valid():
    p = Problem(12288, 4096)
    space = stream_mma.space(p, H200)
    assert space
    assert all(check(p, kb, H200) is None for kb in space)
    assert len({kb.name for kb in space}) == len(space)   # names are unique keys
    # the space reaches every value of every axis somewhere
    for field, values in stream_mma.AXES.items():
        assert {getattr(kb, field) for kb in space} == set(values), field


def test_schedule_round_trips_through_a_dict():
    for kb in (Knobs(), Knobs(4, 2, 2, 16, ahead=3, fold_zero_point=True, max_blocks=2)):
        s = Schedule("stream_mma", kb)
        d = s.to_dict()
        assert d["family"] == "stream_mma"
        back = Schedule.from_dict(d)
        assert back == s and back.knobs == kb and isinstance(back.knobs, Knobs)
        assert back.name == f"stream_mma:{kb.name}"


@pytest.mark.parametrize("m_tiles", [1, 2, 4])
def test_block_shape(m_tiles):
    kb = Knobs(m_tiles=m_tiles, warps=4, unroll=2)
    assert kb.block_m == 8 * m_tiles
    assert kb.block_n == 64
    assert kb.block_k == 16 * 2 * 4
    assert kb.threads == 128


@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 33])
def test_workspace_elems(m):
    p = Problem(4096, 4096)
    assert stream_mma.workspace_elems(p, Knobs(m_tiles=2, split_k=1), m) == (0, 0)
    for kb in (Knobs(m_tiles=2, split_k=4), Knobs(m_tiles=1, split_k=2), Knobs(m_tiles=4, split_k=3)):
        assert stream_mma.workspace_elems(p, kb, m) == (m * p.n, -(-m // kb.block_m) * (p.n // kb.block_n))


# --- the A-order decode ------------------------------------------------------------------------------

def function_body(src: str, name: str) -> str:
    start = src.index(f"void {name}(")
    return src[start:src.index("\n}\n", start)]


def a_order(dtype: str) -> list[int]:
    """[j for out[i] = p[j], i = 0..3] in the unscaled A-order decode."""
    plain, _ = dequant_function_names(dtype, operand="a")
    body = function_body(render_dequant(dtype), plain)
    pairs = {int(i): int(j) for i, j in re.findall(r"out\[(\d)\]\s*=\s*p\[(\d)\];", body)}
    assert sorted(pairs) == [0, 1, 2, 3], body
    return [pairs[i] for i in range(4)]


def a_order_scaled(dtype: str) -> list[tuple[int, str]]:
    """[(j, scale) for out[i] = __hmul2(p[j], scale), i = 0..3] in the scaled A-order decode."""
    _, scaled = dequant_function_names(dtype, operand="a")
    body = function_body(render_dequant(dtype), scaled)
    found = re.findall(r"out\[(\d)\]\s*=\s*__hmul2\(p\[(\d)\],\s*(s[01])\);", body)
    pairs = {int(i): (int(j), s) for i, j, s in found}
    assert sorted(pairs) == [0, 1, 2, 3], body
    return [pairs[i] for i in range(4)]


def expected_a_fragment(lane: int, q: int, e: int) -> tuple[int, int]:
    """(row, col) of A (16 x 16, row-major) that element e of register pair q of `lane` holds in
    mma.m16n8k16: a0,a1 row g, cols 2t..2t+1; a2,a3 row g+8; a4,a5 row g, cols +8; a6,a7 row g+8, +8."""
    g, t = lane // 4, lane % 4
    return g + 8 * (q % 2), 2 * t + 8 * (q // 2) + e


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_decode_names(dtype):
    plain, scaled = dequant_function_names(dtype, operand="a")
    suffix = "f16_u4" if dtype == "float16" else "bf16_u4"
    assert (plain, scaled) == (f"tm_dequant_a_{suffix}", f"tm_dequant_scaled_a_{suffix}")
    src = render_dequant(dtype)
    assert f"void {plain}(" in src and f"void {scaled}(" in src


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_decode_fills_the_mma_a_fragment_of_w_transposed(dtype):
    order = a_order(dtype)
    assert sorted(order) == [0, 1, 2, 3]
    km, nm = _subtile_map()   # nibble i of lane l -> (k, n) inside a 16x16 sub-tile of W
    for lane in range(32):
        for q in range(4):
            for e in range(2):
                nibble = order[q] + 4 * e      # the decode turns nibbles (p, p+4) into pair p
                k, n = int(km[lane, nibble]), int(nm[lane, nibble])
                # W^T[row = n, col = k] = W[k, n]
                assert (n, k) == expected_a_fragment(lane, q, e), (dtype, lane, q, e)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scaled_a_decode_has_the_same_order_and_the_scale_of_its_row(dtype):
    scaled = a_order_scaled(dtype)
    assert [j for j, _ in scaled] == a_order(dtype)
    # The kernel passes the scales of W columns (16j + g, 16j + 8 + g) as (s0, s1): A rows g and g + 8.
    for q, (_, s) in enumerate(scaled):
        assert s == ("s0" if q % 2 == 0 else "s1"), (dtype, q, s)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_words_decode_to_the_a_fragments_of_each_sub_tile(dtype):
    """From pack_weight's memory layout: lane l's word j of a slab (packed[kt, l * 4 + j], what one
    16-byte stream load brings) decodes, in A order, to the A fragment of W^T's sub-tile j."""
    order = a_order(dtype)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.int32)
    packed = pack_weight(codes).to(torch.int64) & 0xFFFFFFFF     # [1, 128]
    wt = codes.t()                                               # W^T [64, 16]
    for lane in range(32):
        for j in range(4):
            word = int(packed[0, lane * 4 + j])
            nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
            pairs = [(nibbles[p], nibbles[p + 4]) for p in range(4)]     # decode_*: pair p, code - 8 aside
            for q in range(4):
                for e in range(2):
                    row, col = expected_a_fragment(lane, q, e)
                    assert pairs[order[q]][e] == int(wt[16 * j + row, col]), (dtype, lane, j, q, e)
