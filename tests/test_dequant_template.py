"""The lop3 / magic-number decode, rendered per dtype and replayed bit for bit in numpy."""
import numpy as np
import pytest
import torch

from templates import dequant_function_names, render_dequant


def lop3_and_or(a, b, c):
    return (a & b) | c


def half2(u):
    """(low, high) fp16 halves of a 32-bit pattern."""
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16).astype(np.float32)


def bf162(u):
    words = np.array([u & 0xFFFF, u >> 16], dtype=np.uint32) << 16
    return words.view(np.float32)


def decode_fp16(q):
    """What tm_dequant_f16_u4 computes (constants copied from the template's comments)."""
    magic = 0x64006400
    q8 = q >> 8
    lo = lambda x: half2(lop3_and_or(x, 0x000F000F, magic)) - 1032
    hi = lambda x: half2(lop3_and_or(x, 0x00F000F0, magic)) / 16 - 72
    return [lo(q), hi(q), lo(q8), hi(q8)]


def decode_bf16(q):
    magic = 0x43004300
    return [bf162(lop3_and_or(q >> s, 0x000F000F, magic)) - 136 for s in (0, 4, 8, 12)]


@pytest.mark.parametrize("decode", [decode_fp16, decode_bf16])
def test_magic_numbers_give_code_minus_eight_in_fragment_order(decode):
    rng = np.random.default_rng(0)
    for _ in range(200):
        nibbles = rng.integers(0, 16, 8)
        q = int(sum(int(v) << (4 * i) for i, v in enumerate(nibbles)))
        pairs = decode(q)
        for p in range(4):   # pair p holds nibbles (p, p + 4): layout.py's contract
            assert list(pairs[p]) == [nibbles[p] - 8, nibbles[p + 4] - 8]


@pytest.mark.parametrize("dtype,vec,magic", [("float16", "half2", "0x64006400u"), ("bfloat16", "__nv_bfloat162", "0x43004300u")])
def test_template_renders_per_dtype(dtype, vec, magic):
    src = render_dequant(dtype)
    plain, scaled = dequant_function_names(dtype)
    assert f"void {plain}(" in src and f"void {scaled}(" in src
    assert "lop3.b32" in src and magic in src and vec in src
    assert "{{" not in src and "{%" not in src


def test_template_refuses_what_it_cannot_decode():
    with pytest.raises(ValueError, match="8-bit"):
        render_dequant("float16", 8)
    with pytest.raises(ValueError, match="float32"):
        render_dequant("float32")


def test_fp16_decode_constants_are_the_fp16_values_claimed():
    as_half = lambda bits: float(torch.tensor([bits], dtype=torch.int16).view(torch.float16))
    assert as_half(0x6408) == 1032 and as_half(0x2C00) == 1 / 16 and as_half(0xD480 - 0x10000) == -72
