"""stream_mma's fold_zero_point on CPU: the raw-code decode replayed bit for bit from the rendered
template, and the algebra that takes the magic numbers and the zero point off the fp32 sums."""
import re

import numpy as np
import pytest

from schedules.marlin_mma.layout import _subtile_map
from templates import raw_decode, render_dequant

SHIFTS = {"q": 0, "q8": 8, "q >> 4": 4, "q >> 8": 8, "q >> 12": 12}


def raw_decode_replay(dtype):
    """A function word -> four 32-bit A registers, built from the rendered template's statements."""
    name, _, _ = raw_decode(dtype)
    src = render_dequant(dtype)
    body = src[src.index(name):].split("}", 1)[0]
    magics = {m: int(v, 16) for m, v in re.findall(r"(MAGIC\w*) = (0x[0-9a-f]+)u", body)}
    statements = re.findall(r"out\[(\d)\] = tilemarlin::lop3_and_or\(([^,]+), (0x[0-9a-f]+)u, (MAGIC\w*)\)", body)
    assert sorted(int(i) for i, _, _, _ in statements) == [0, 1, 2, 3]
    ops = {int(i): (SHIFTS[expr.strip()], int(mask, 16), magics[magic]) for i, expr, mask, magic in statements}
    return lambda q: [((q >> ops[i][0]) & ops[i][1]) | ops[i][2] for i in range(4)]


def halves(u, dtype):
    pair = np.array([u & 0xFFFF, u >> 16], dtype=np.uint16)
    if dtype == "float16":
        return pair.view(np.float16).astype(np.float64)
    return (pair.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def a_fragment_positions():
    """(row, col) of A register pair q, element e for lane l: the PTX m16n8k16 A fragment."""
    lane = np.arange(32)[:, None, None]
    q = np.arange(4)[None, :, None]
    e = np.arange(2)[None, None, :]
    shape = (32, 4, 2)
    return np.broadcast_to(lane // 4 + 8 * (q % 2), shape), np.broadcast_to(2 * (lane % 4) + 8 * (q // 2) + e, shape)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_raw_decode_gives_exact_offset_codes_in_a_order(dtype):
    _, lo_magic, hi_magic = raw_decode(dtype)
    replay = raw_decode_replay(dtype)
    kmap, nmap = _subtile_map()                     # nibble i of lane l -> (k, n) in the sub-tile
    rows, cols = a_fragment_positions()             # A = W^T: row n, col k
    rng = np.random.default_rng(1)
    for _ in range(50):
        codes = rng.integers(0, 16, size=(16, 16))  # W[k, n] of one sub-tile
        for lane in range(32):
            word = sum(int(codes[kmap[lane, i], nmap[lane, i]]) << (4 * i) for i in range(8))
            for q, reg in enumerate(replay(word)):
                for e, value in enumerate(halves(reg, dtype)):
                    n, k = rows[lane, q, e], cols[lane, q, e]
                    magic = lo_magic if k % 16 < 8 else hi_magic
                    assert value == magic + codes[k, n], (lane, q, e)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_offsets_come_off_the_sums(dtype):
    """What one batch computes, with the MMAs as exact float64 products and the offsets the kernel's
    plan gives its constant-A MMA: (P - off) * scale equals the reference sum of (code - 8) * scale * x,
    for every weight column and row of M."""
    from schedules.problem import Problem
    from schedules.stream_mma import Knobs
    from schedules.stream_mma.plan import Plan

    _, lo_magic, hi_magic = raw_decode(dtype)
    plan = Plan(Problem(4096, 4096, dtype=dtype), Knobs(fold_zero_point=True))
    lo_off, hi_off = plan.lo_off, plan.hi_off
    rng = np.random.default_rng(2)
    k, n, m = 64, 16, 3                                             # 4 k-steps, one group
    codes = rng.integers(0, 16, size=(k, n))
    scale = rng.uniform(0.001, 0.02, size=n)
    x = rng.standard_normal((m, k)).astype(np.float16).astype(np.float64)
    hi = (np.arange(k) % 16) >= 8
    raw = np.where(hi[:, None], hi_magic, lo_magic) + codes         # what the decode hands the MMA
    sums = x @ raw                                                  # P^T: [m, n]
    offsets = x @ np.where(hi, hi_off, lo_off)                      # the constant-A MMA: [m]
    got = (sums - offsets[:, None]) * scale[None, :]
    want = x @ ((codes - 8) * scale[None, :])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
