"""jinja2 sources of device code and reports; `render` is the one way they are instantiated."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import jinja2

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent)),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)

_DEQUANT = {
    "float16": dict(vec="half2", magic="0x64006400u", name="f16_u4", magic_value=1024,
                    raw_hi_magic=64, raw_hi_magic_bits="0x54005400u"),
    "bfloat16": dict(vec="__nv_bfloat162", magic="0x43004300u", name="bf16_u4", magic_value=128,
                     raw_hi_magic=128, raw_hi_magic_bits="0x43004300u"),
}


def dequant_function_names(dtype: str, bits: int = 4, operand: str = "b") -> tuple[str, str]:
    """(unscaled, scaled) extern names of the decode for this dtype and bit width, with the values in
    the register order of the MMA's B fragments (operand "b") or, for swapped operands, A's ("a")."""
    _check(dtype, bits)
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' or 'b', got {operand!r}")
    name = _DEQUANT[dtype]["name"]
    order = "a_" if operand == "a" else ""
    return f"tm_dequant_{order}{name}", f"tm_dequant_scaled_{order}{name}"


class ZeroDecode(NamedTuple):
    """Extern names of the zero-point decodes (w = s * (code - z)) in A order, and how many halves of
    subtrahends the unscaled one takes per row pair of a sub-tile (pairs of equal halves: 4 per row
    in fp16, 2 in bf16)."""

    subtrahends: str   # (z0, z1) -> the sub-tile's subtrahends, once per group
    unscaled: str      # (word, subtrahends) -> code - z (the scales go on the sums)
    offsets: str       # (z0 z1, s0 s1) -> o = (8 - z) * s of the two rows, once per group
    scaled: str        # (word, scales, offsets) -> (code - 8) * s + o
    halves: int


def zero_decode(dtype: str, bits: int = 4) -> ZeroDecode:
    """The decode of weights with zero points of their own beside the scales (templates/dequant.cuh.j2)."""
    _check(dtype, bits)
    name = _DEQUANT[dtype]["name"]
    # fp16 takes the nibbles at bit 4 in place (as 16 * code) and subtracts 64 + z after scaling by 1/16
    return ZeroDecode(f"tm_zero_subtrahends_{name}", f"tm_dequant_zero_a_{name}", f"tm_zero_offsets_{name}",
                      f"tm_dequant_scaled_offset_a_{name}", 8 if dtype == "float16" else 4)


def mma_operand_dtype(dtype: str) -> str:
    """The PTX operand type name (mma.sync / wgmma) of an activation dtype."""
    _check(dtype, 4)
    return {"float16": "fp16", "bfloat16": "bf16"}[dtype]


def raw_decode(dtype: str, bits: int = 4) -> tuple[str, int, int]:
    """(extern name, magic of pairs 0 and 2, magic of pairs 1 and 3) of the raw-code decode in A order:
    every pair decodes to its magic value + code."""
    _check(dtype, bits)
    d = _DEQUANT[dtype]
    return f"tm_decode_raw_a_{d['name']}", d["magic_value"], d["raw_hi_magic"]


def e4m3_bits(value: int) -> int:
    """The FP8 e4m3 bit pattern of a small integer (|value| <= 15, exact in 3 mantissa bits below 16)."""
    if not -15 <= value <= 15:
        raise ValueError(f"{value} is not a small integer that e4m3 holds exactly")
    if value == 0:
        return 0
    magnitude = abs(value)
    exponent = magnitude.bit_length() - 1
    mantissa = (magnitude << 3 >> exponent) & 0x7
    if (mantissa | 8) << exponent >> 3 != magnitude:
        raise ValueError(f"{value} needs more than e4m3's 3 mantissa bits")
    return (0x80 if value < 0 else 0) | (exponent + 7) << 3 | mantissa


def _byte_table(values) -> str:
    """Four values' e4m3 bytes as one 32-bit word, the first in the lowest byte (prmt's byte 0)."""
    word = sum(e4m3_bits(v) << 8 * i for i, v in enumerate(values))
    return f"0x{word:08x}u"


# The FP8 decode's tables (prmt looks up 8 bytes of two words): a nibble's low 3 bits j index them;
# codes 8-15 (bit 3 set) decode to j, codes 0-7 to j - 8.
E4M3_TABLES = {"POS_LO": _byte_table(range(0, 4)), "POS_HI": _byte_table(range(4, 8)),
               "NEG_LO": _byte_table(range(-8, -4)), "NEG_HI": _byte_table(range(-4, 0))}


def fp8_decode_name(bits: int = 4) -> str:
    """Extern name of the INT4 -> FP8 e4m3 decode for W4A8: a packed word to the lane's two 32-bit A
    registers of an 8-bit wgmma/mma k32 step's half (rows g and g + 8), each holding the codes - 8 of k
    = 2t, 2t + 8, 2t + 1, 2t + 9 of the word's 16 x 16 sub-tile (see fp8_k_order in
    schedules/marlin_mma/layout.py: the activations are stored in that order)."""
    _check("float16", bits)
    return "tm_decode_e4m3_a_u4"


@lru_cache(maxsize=None)
def render_dequant(dtype: str, bits: int = 4) -> str:
    """CUDA source of the INT`bits` -> `dtype` register decode (templates/dequant.cuh.j2)."""
    _check(dtype, bits)
    return _ENV.get_template("dequant.cuh.j2").render(dtype=dtype, bits=bits, **_DEQUANT[dtype], **E4M3_TABLES)


def render(template: str, **context) -> str:
    return _ENV.get_template(template).render(**context)


def _check(dtype: str, bits: int) -> None:
    if dtype not in _DEQUANT:
        raise ValueError(f"no dequant template for dtype {dtype!r}; have {tuple(_DEQUANT)}")
    if bits != 4:
        raise ValueError(f"no dequant template for {bits}-bit codes; only 4-bit is implemented")
