"""jinja2 sources of device code and reports; `render` is the one way they are instantiated."""
from __future__ import annotations

import re
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


# offset_decode's code c is the e4m3 byte c, worth c * 2^-9: sums of decoded weights are 1/512 of the
# codes'.
FP8_DECODE_UNIT = 512.0


def fp8_decode_name(bits: int = 4, offset: bool = False) -> str:
    """Extern name of the INT4 -> FP8 e4m3 decode for W4A8: a packed word to the lane's two 32-bit A
    registers of an 8-bit wgmma/mma k32 step's half (rows g and g + 8), each holding the codes - 8 (with
    `offset`, the codes c as e4m3 bytes, value c * 2^-9) of k = 2t, 2t + 8, 2t + 1, 2t + 9 of the
    word's 16 x 16 sub-tile (see fp8_k_order in schedules/marlin_mma/layout.py: the activations are
    stored in that order)."""
    _check("float16", bits)
    return "tm_decode_e4m3_offset_a_u4" if offset else "tm_decode_e4m3_a_u4"


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


# --- the kernels' own prelude in place of TileLang's headers -----------------------------------------

# TileLang's include block in the CUDA it generates: an MSVC guard around cuda.h, its template
# headers, and a bf16 guard
_TILELANG_INCLUDES = re.compile(r"(?:#if defined\(_MSC_VER\)[^\n]*\n(?:.*\n)*?#endif\n)?"
                                r"((?:#include <tl_templates/cuda/[\w/.]+>\n)+)"
                                r"(?:#ifdef ENABLE_BF16\n#include <tl_templates/cuda/cuda_bf16_fallbacks.cuh>\n#endif\n)?")
_OURS = "namespace tilemarlin {"     # the decode's (dequant.cuh.j2): others' TileLang code stays as it is
_INCLUDED = re.compile(r"<tl_templates/cuda/([\w/.]+)>")
# the headers the GEMMs (W4A16 and W4A8) include, and the names of theirs they call
PRELUDE_HEADERS = frozenset({"instruction/wgmma.h", "instruction/mma.h", "intrin.h", "barrier.h", "copy.h",
                             "copy_sm90.h", "cluster.h", "cuda_fp8.h", "reduce.h", "scan.h", "ldsm.h",
                             "threadblock_swizzle.h", "debug.h"})
PRELUDE_NAMES = frozenset({"DataType", "GmmaDescriptor", "initialize_wgmma_descriptor", "fence_barrier_init",
                           "fence_proxy_async", "prefetch_tma_descriptor", "tma_load", "tl_shuffle_elect",
                           "warpgroup_arrive", "warpgroup_commit_batch", "warpgroup_wait", "warpgroup_fence_operand",
                           "warpgroup_reg_alloc", "warpgroup_reg_dealloc", "wgmma_rs", "cluster_sync",
                           "block_rank_in_cluster", "cp_async_gs", "cp_async_gs_conditional", "cp_async_commit",
                           "cp_async_wait", "ptx_ldmatrix_x4", "mma_sync"})
_TL_NAME = re.compile(r"\btl::(\w+)")
_WGMMA_ANY = re.compile(r"\btl::wgmma_rs<[^>]*>")
_WGMMA = re.compile(r"tl::wgmma_rs<tl::DataType::(kFloat16|kBFloat16|kFloat8_e4m3), tl::DataType::\1, "
                    r"tl::DataType::kFloat32, 64, (\d+), (16|32), false, false, 1, 1>")
_MMA_ANY = re.compile(r"\btl::mma_sync<[^>]*>")
_MMA = re.compile(r"tl::mma_sync<tl::DataType::(kFloat16|kBFloat16), tl::DataType::\1, tl::DataType::kFloat32, "
                  r"16, 8, 16, false, true>")
_WGMMA_PTX = {"kFloat16": ("f16", 16), "kBFloat16": ("bf16", 16), "kFloat8_e4m3": ("e4m3", 32)}
# TileLang's types and namespaces the prelude lacks (it has fp8_e4_t, for pointers)
_FOREIGN = re.compile(r"\b(?:cute|cutlass)::|\bfp8_e[58]_t\b|\bfp8_e[458]_\d+_t\b|"
                      r"tl::DataType::(?!kFloat16\b|kBFloat16\b|kFloat32\b|kFloat8_e4m3\b)")


def with_own_prelude(code: str) -> str:
    """TileLang's CUDA with its include block replaced by templates/tl_prelude.cuh.j2 (the few
    definitions the code calls, on plain CUDA headers: nvcc runs ~3x faster, to the same machine code)
    where the prelude covers the code (the GEMMs, W4A16 and W4A8); otherwise, as for the activation
    kernels, the code unchanged."""
    block = _TILELANG_INCLUDES.search(code)
    if block is None or not _prelude_covers(code, block):
        return code
    shapes = sorted({(m.group(1), int(m.group(2))) for m in map(_WGMMA.fullmatch, _WGMMA_ANY.findall(code))})
    prelude = _ENV.get_template("tl_prelude.cuh.j2").render(wgmma_shapes=[_wgmma_shape(*s) for s in shapes])
    return code[:block.start()] + prelude + code[block.end():]


def _prelude_covers(code: str, block: re.Match) -> bool:
    """Whether `code` is tilemarlin's (its decode's namespace before TileLang's include block, which
    holds all of TileLang's includes) and includes and calls nothing of TileLang's that the prelude
    lacks (by name: a name nvcc then refuses makes runtime.kernels.build_kernel build with TileLang's
    headers)."""
    before, after = code[:block.start()], code[block.end():]
    return (_OURS in before and set(_INCLUDED.findall(block.group(1))) <= PRELUDE_HEADERS
            and not _INCLUDED.search(before) and not _INCLUDED.search(after)
            and set(_TL_NAME.findall(code)) <= PRELUDE_NAMES and not _FOREIGN.search(code)
            and all(_MMA.fullmatch(call) for call in _MMA_ANY.findall(code))
            and all(_known_wgmma(call) for call in _WGMMA_ANY.findall(code)))


def _known_wgmma(call: str) -> bool:
    """An m64 register-operand wgmma with fp32 sums in the k its operands' type takes."""
    match = _WGMMA.fullmatch(call)
    return match is not None and _WGMMA_PTX[match.group(1)][1] == int(match.group(3))


def _wgmma_shape(enum: str, n: int) -> dict:
    """What tl_prelude.cuh.j2 renders for an m64n{n} register-operand wgmma with fp32 sums (k16; FP8:
    k32): its PTX, the n / 2 sums per thread as "+f" operands, then A's four registers, B's descriptor
    and the predicate that keeps (1) or overwrites (0) the sums; scales +1, B not transposed (FP8
    operands take no transpose operand)."""
    (ptx, k), sums = _WGMMA_PTX[enum], n // 2
    outputs = ", ".join(f"%{i}" for i in range(sums))
    inputs = ", ".join(f"%{sums + i}" for i in range(4))
    modes = "1, 1" if ptx == "e4m3" else "1, 1, 0"
    asm = (f"{{\\n.reg .pred keep;\\nsetp.ne.b32 keep, %{sums + 5}, 0;\\n"
           f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx}.{ptx} {{{outputs}}}, {{{inputs}}}, "
           f"%{sums + 4}, keep, {modes};\\n}}\\n")
    return dict(enum=enum, ptx=ptx, n=n, k=k, asm=asm, outputs=", ".join(f'"+f"(d[{i}])' for i in range(sums)))
