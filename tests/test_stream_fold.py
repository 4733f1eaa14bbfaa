"""stream_mma's fold_zero_point on CPU: the raw-code decode replayed bit for bit from the rendered
template, and the algebra that takes the magic numbers and the zero point off the fp32 sums."""
import re

import numpy as np
import pytest

from schedules.marlin_mma.layout import _subtile_map
from templates import fma_decode, raw_decode, render_dequant

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
    """What one batch computes, with the MMAs as exact float64 products: (P - off) * scale equals the
    reference sum of (code - 8) * scale * x, for every weight column and row of M."""
    _, lo_magic, hi_magic = raw_decode(dtype)
    lo_off, hi_off = lo_magic + 8, hi_magic + 8                     # as kernel.py builds a_off
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


def rounded(v, dtype):
    """float64 v rounded to nearest even in `dtype`, as float64 (the products are exact in float64)."""
    if dtype == "float16":
        return np.float64(np.float16(v))
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])    # v fits float32 here exactly
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return np.float64(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def fma_decode_replay(dtype):
    """word, (s0, s1) -> the four A registers of the one-fma decode as float64 pairs, built from the
    rendered template: each lop3 as in the raw decode, then fma(value, s, c) rounded once."""
    name, constants, _ = fma_decode(dtype)
    src = render_dequant(dtype)
    body = src[src.index("void " + name):].split("\n}", 1)[0]
    consts = src[src.index("void " + constants):].split("\n}", 1)[0]
    magics = {m: int(v, 16) for m, v in re.findall(r"(MAGIC\w*) = (0x[0-9a-f]+)u", body)}
    factors = {c: halves(int(v, 16), dtype)[0] for c, v in re.findall(r"(NEG_\w+) = tilemarlin::as_\w+\((0x[0-9a-f]+)u\)",
                                                                        consts)}
    # c[i] = s0 / s1, or = __hmul2(s0 / s1, NEG_*): constant i as (which scale, factor)
    table = {int(i): (int(s), factors.get(f, 1.0)) for i, s, f in
             re.findall(r"c\[(\d)\] = (?:__hmul2\()?s(\d)(?:, (NEG_\w+)\))?;", consts)}
    statements = re.findall(r"out\[(\d)\] = __hfma2\(tilemarlin::as_\w+\(tilemarlin::lop3_and_or\(([^,]+), "
                            r"(0x[0-9a-f]+)u, (MAGIC\w*)\)\), c\[(\d)\], c\[(\d)\]\);", body)
    assert sorted(int(s[0]) for s in statements) == [0, 1, 2, 3]
    aliases = {int(i): int(j) for i, j in re.findall(r"c\[(\d)\] = c\[(\d)\];", consts)}

    def replay(word, s):
        c = {i: rounded(s[which] * factor, dtype) for i, (which, factor) in table.items()}
        c.update({i: c[j] for i, j in aliases.items()})
        regs = {}
        for i, expr, mask, magic, mul, add in statements:
            raw = ((word >> SHIFTS[expr.strip()]) & int(mask, 16)) | magics[magic]
            regs[int(i)] = [rounded(v * c[int(mul)] + c[int(add)], dtype) for v in halves(raw, dtype)]
        return [regs[i] for i in range(4)], c
    return replay


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fma_decode_gives_code_times_scale_rounded_once(dtype):
    """zero_point_batch's decode: every A value is code * s of its row's scale, rounded once (the magic
    number's product comes off exactly), and the zero point's fragment holds -8 * s of each row."""
    replay = fma_decode_replay(dtype)
    kmap, nmap = _subtile_map()
    rows, cols = a_fragment_positions()
    rng = np.random.default_rng(3)
    for trial in range(40):
        codes = rng.integers(0, 16, size=(16, 16))
        scale = rng.uniform(-63.0, 63.0) if trial % 4 == 0 else rng.uniform(1e-4, 0.05)
        s = [rounded(scale, dtype), rounded(-0.37 * scale, dtype)]     # the scales of rows g and g + 8
        for lane in range(0, 32, 3):
            word = sum(int(codes[kmap[lane, i], nmap[lane, i]]) << (4 * i) for i in range(8))
            regs, consts = replay(word, s)
            for q, pair in enumerate(regs):
                for e, value in enumerate(pair):
                    n, k = rows[lane, q, e], cols[lane, q, e]
                    assert value == rounded(codes[k, n] * s[q % 2], dtype), (lane, q, e)
            assert [consts[i] for i in (6, 7, 8, 9)] == [-8 * s[0], -8 * s[1], -8 * s[0], -8 * s[1]]
