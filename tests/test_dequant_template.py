"""The lop3 / magic-number decode, rendered per dtype and run bit for bit on the CPU.

No constant of the decode is typed into the check: `Device` reads the rendered CUDA source (the lop3
immediate and its operand order, the magic numbers, masks, shifts, constants and the order of the
outputs) and executes its entry points statement by statement on numpy words, with each half-precision
intrinsic emulated exactly (one rounding to nearest even, as the hardware does). The results are
compared bit for bit with the reference dequantization (schedules/quant.py), and the expected order
of the values is derived here from the PTX fragment definitions, so changing any constant or any
output order in templates/dequant.cuh.j2 fails these tests.
"""
import re

import numpy as np
import pytest
import torch

from schedules.quant import dequantize
from templates import dequant_function_names, raw_decode, render_dequant, zero_decode
from tests.reference import seed_of

DTYPES = ("float16", "bfloat16")
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# --- half-precision arithmetic, exactly -----------------------------------------------------------

def halves(bits, dtype):
    """The (low, high) 16-bit values of 32-bit words, as exact float64."""
    bits = np.atleast_1d(np.asarray(bits, dtype=np.uint32))
    lo, hi = (bits & 0xFFFF).astype(np.uint16), (bits >> 16).astype(np.uint16)
    if dtype == "float16":
        return lo.view(np.float16).astype(np.float64), hi.view(np.float16).astype(np.float64)
    widen = lambda h: (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return widen(lo), widen(hi)


SIGNIFICANT_BITS = {"float16": 11, "bfloat16": 8}
SMALLEST_NORMAL = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -126}


def to_bits16(x, dtype):
    """float64 -> 16-bit patterns, rounded once to nearest even (then the casts below are exact)."""
    assert np.all((x == 0) | (np.abs(x) >= SMALLEST_NORMAL[dtype])), "subnormal results are not emulated"
    mantissa, exponent = np.frexp(x)
    bits = SIGNIFICANT_BITS[dtype]
    rounded = np.ldexp(np.rint(np.ldexp(mantissa, bits)), exponent - bits)
    if dtype == "float16":
        return rounded.astype(np.float16).view(np.uint16).astype(np.uint32)
    return rounded.astype(np.float32).view(np.uint32) >> 16


def join(lo, hi, dtype):
    return (to_bits16(lo, dtype) | (to_bits16(hi, dtype) << 16)).astype(np.uint32)


def exact_sum(p, c):
    """p + c in float64, which must be exact, so that rounding it to 16 bits rounds only once."""
    s = p + c
    assert np.all((s - p == c) & (s - c == p)), "float64 sum not exact: emulation unsafe"
    return s


def half2_op(fn):
    def apply(dtype, *words):
        parts = [halves(w, dtype) for w in words]
        return join(fn(*(p[0] for p in parts)), fn(*(p[1] for p in parts)), dtype)
    return apply


ARITHMETIC = {   # the half2 / bfloat162 overloads of cuda_fp16.h and cuda_bf16.h the template may call
    "__hsub2": half2_op(lambda a, b: exact_sum(a, -b)),
    "__hadd2": half2_op(lambda a, b: exact_sum(a, b)),
    "__hmul2": half2_op(lambda a, b: a * b),          # 11 x 11 bits: exact in float64
    "__hfma2": half2_op(lambda a, b, c: exact_sum(a * b, c)),
}
BROADCASTS = {   # (low, high) half to both halves; their names differ per type
    "float16": ("__low2half2", "__high2half2"),
    "bfloat16": ("__low2bfloat162", "__high2bfloat162"),
}


def intrinsics(dtype):
    low, high = BROADCASTS[dtype]
    return {**ARITHMETIC, low: lambda dtype, w: (w & 0xFFFF) * np.uint32(0x10001),
            high: lambda dtype, w: (w >> 16) * np.uint32(0x10001)}


# --- the rendered source, executed ----------------------------------------------------------------

class Pointer:
    """A pointer to 32-bit cells (every type this code points to is 32 bits wide: unsigned, half2,
    __nv_bfloat162); reinterpret_cast keeps the cells."""

    def __init__(self, cells):
        self.cells = cells


TOKEN = re.compile(r"\s*(0x[0-9a-fA-F]+u?|\d+u?|[A-Za-z_][\w:]*|>>|[()\[\],*<>&])")
FUNCTION = re.compile(r"__device__ __forceinline__ [\w:]+\*? (\w+)\(([^)]*)\) \{")


class Device:
    """Executes the entry points of one rendered dequant.cuh on numpy uint32 words."""

    def __init__(self, source: str, dtype: str):
        self.dtype = dtype
        self.intrinsics = intrinsics(dtype)
        self.functions = {}
        for match in FUNCTION.finditer(source):
            depth, end = 1, match.end()
            while depth:
                depth += {"{": 1, "}": -1}.get(source[end], 0)
                end += 1
            params = [p.split()[-1].lstrip("*") for p in match.group(2).split(",")]
            self.functions[match.group(1)] = (params, source[match.end():end - 1])
        self.lop3 = self._lop3()
        self.prmt = self._prmt()
        self.bit_casts = self._bit_casts()

    def _lop3(self):
        """lop3_and_or from its inline PTX: the immediate (a truth table over operands 0xF0, 0xCC, 0xAA)
        and which parameter feeds which operand."""
        params, body = self.functions.pop("lop3_and_or")
        asm = re.search(r'lop3\.b32 %0, %1, %2, %3, (0x[0-9a-fA-F]+);[^:]*: "=r"\(\w+\) : '
                        r'"r"\((\w+)\), "r"\((\w+)\), "r"\((\w+)\)', body)
        assert asm, f"no lop3.b32 in lop3_and_or: {body}"
        lut, operands = int(asm.group(1), 16), [params.index(name) for name in asm.group(2, 3, 4)]

        def lop3(*args):
            a, b, c = (args[i] for i in operands)
            out = np.zeros(np.broadcast(a, b, c).shape, dtype=np.uint32)
            for index in range(8):
                if lut >> index & 1:
                    out |= ((a if index & 4 else ~a) & (b if index & 2 else ~b) & (c if index & 1 else ~c))
            return out
        return lop3

    def _prmt(self):
        """prmt from its inline PTX (the default mode, checked): byte i of the result is byte (selector
        nibble i & 7) of the eight bytes b:a, or that byte's sign bit replicated where nibble bit 3 is set."""
        params, body = self.functions.pop("prmt")
        asm = re.search(r'prmt\.b32 %0, %1, %2, %3;[^:]*: "=r"\(\w+\) : "r"\((\w+)\), "r"\((\w+)\), "r"\((\w+)\)', body)
        assert asm, f"no default-mode prmt.b32 in prmt: {body}"
        operands = [params.index(name) for name in asm.group(1, 2, 3)]

        def prmt(*args):
            a, b, selector = (np.asarray(args[i], dtype=np.uint64) for i in operands)
            source = a | (b << np.uint64(32))
            out = np.zeros(np.broadcast(a, b, selector).shape, dtype=np.uint64)
            for i in range(4):
                nibble = (selector >> np.uint64(4 * i)) & np.uint64(0xF)
                byte = (source >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
                sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                out |= np.where(nibble & np.uint64(8), sign, byte) << np.uint64(8 * i)
            return out.astype(np.uint32)
        return prmt

    def _bit_casts(self):
        """The as_<vec>(unsigned) helpers, checked to reinterpret their argument's bits and nothing else."""
        names = [f for f in self.functions if f.startswith("as_")]
        for name in names:
            params, body = self.functions.pop(name)
            assert re.fullmatch(rf"\s*return \*reinterpret_cast<[\w:]+\*>\(&{params[0]}\);\s*", body), body
        return set(names)

    def call(self, name, *args):
        params, body = self.functions[name]
        env = dict(zip(params, args))
        body = re.sub(r"//[^\n]*", "", body)
        for statement in filter(None, (s.strip() for s in body.split(";"))):
            self._execute(statement, env)

    def _execute(self, statement, env):
        if m := re.fullmatch(r"(?:const )?[\w:]+ (\w+)\[(\d+)\]", statement):          # half2 p[4]
            env[m.group(1)] = Pointer([None] * int(m.group(2)))
        elif m := re.fullmatch(r"(?:const )?[\w:]+\*? (\w+) = (.+)", statement, re.S):  # declaration
            env[m.group(1)] = self._eval(m.group(2), env)
        elif m := re.fullmatch(r"(\w+)\[(\d+)\] = (.+)", statement, re.S):             # store
            env[m.group(1)].cells[int(m.group(2))] = self._eval(m.group(3), env)
        else:                                                                          # a call
            self._eval(statement, env)

    def _eval(self, text, env):
        tokens = TOKEN.findall(text)
        assert "".join(tokens) == re.sub(r"\s", "", text), f"cannot read {text!r}"
        value, rest = self._shift(tokens, env)
        assert not rest, f"left over in {text!r}: {rest}"
        return value

    def _shift(self, tokens, env):
        value, tokens = self._unary(tokens, env)
        while tokens and tokens[0] == ">>":
            amount, tokens = self._unary(tokens[1:], env)
            value = value >> np.uint32(amount)
        return value, tokens

    def _unary(self, tokens, env):
        if tokens[0] == "*":
            pointer, tokens = self._unary(tokens[1:], env)
            return pointer.cells[0], tokens
        return self._primary(tokens, env)

    def _primary(self, tokens, env):
        head, tokens = tokens[0], tokens[1:]
        if re.fullmatch(r"0x[0-9a-fA-F]+u?|\d+u?", head):
            return np.uint32(int(head.rstrip("u"), 0)), tokens
        if head == "(":
            value, tokens = self._shift(tokens, env)
            return value, tokens[1:]
        if head == "reinterpret_cast":
            tokens = tokens[tokens.index(">") + 1:]
            return self._primary(tokens, env)
        name = head.split("::")[-1]
        if tokens and tokens[0] == "[":
            return env[name].cells[int(tokens[1])], tokens[3:]
        if not tokens or tokens[0] != "(":
            return env[name], tokens
        args, tokens = [], tokens[1:]
        while tokens[0] != ")":
            arg, tokens = self._shift(tokens, env)
            args.append(arg)
            tokens = tokens[1:] if tokens[0] == "," else tokens
        tokens = tokens[1:]
        if name == "lop3_and_or":
            return self.lop3(*args), tokens
        if name == "prmt":
            return self.prmt(*args), tokens
        if name in self.bit_casts:
            return args[0], tokens
        if name in self.intrinsics:
            return self.intrinsics[name](self.dtype, *args), tokens
        assert name in self.functions, f"{name}() is neither defined in the source nor emulated here"
        return self.call(name, *args), tokens


def run(dtype, name, words, scales=None, source=None, subtrahends=None):
    """Run entry point `name` on 32-bit `words` (and one scale pair, and the zero decode's subtrahends,
    per word; a list for a pointer to several words); the four 32-bit outputs."""
    device = Device(render_dequant(dtype) if source is None else source, dtype)
    frag = Pointer([None] * 4)
    args = (Pointer([words]),) + tuple(Pointer(v if isinstance(v, list) else [v]) for v in (scales, subtrahends)
                                       if v is not None) + (frag,)
    device.call(name, *args)
    return frag.cells


# --- what the outputs must be, from the fragment definitions ----------------------------------------

def b_pair_position(p):
    """(k, n) offsets of B-order output pair p inside the lane's 16 x 16 sub-tile (layout.py's
    contract, from the PTX B fragment): n8 tile p // 2, register p % 2 (b0 b1 at k 2t, b2 b3 at k 2t+8)."""
    return 8 * (p % 2), 8 * (p // 2)


def a_pair_position(o):
    """(k, n) offsets of A-order output register o: the PTX A fragment of m16n8k16 has (a0 a1) at (row g,
    col 2t), (a2 a3) at (row g+8, col 2t), (a4 a5) at (row g, col 2t+8), (a6 a7) at (row g+8, col 2t+8);
    with swapped operands A = W^T, so rows are n and columns k."""
    return 8 * (o // 2), 8 * (o % 2)


B_ORDER = [next(p for p in range(4) if b_pair_position(p) == b_pair_position(o)) for o in range(4)]
A_ORDER = [next(p for p in range(4) if b_pair_position(p) == a_pair_position(o)) for o in range(4)]


def test_the_orders_follow_from_the_fragments():
    assert B_ORDER == [0, 1, 2, 3] and A_ORDER == [0, 2, 1, 3]


def sample_words():
    rng = np.random.default_rng(seed_of("dequant words"))
    every_code = np.array([0x11111111 * v for v in range(16)], dtype=np.uint32)
    return np.concatenate([every_code, rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)])


def nibbles(words):
    return np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1)        # [words, 8]


def sample_scales(dtype, count):
    """Scale pairs (one per n8 tile), positive and of the sizes quantize_rtn gives, as dtype bits."""
    gen = torch.Generator().manual_seed(seed_of("dequant scales", dtype))
    scales = (torch.rand(count, 2, generator=gen) * 0.2 + 1e-3).to(TORCH[dtype])
    return scales, scales.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


def sample_zero_points(dtype, count):
    """Zero-point pairs (one per n8 tile), integers 0..15 (every one among the first 16 pairs), and
    the pairs as the kernel holds them: one 32-bit word of two dtype values."""
    gen = torch.Generator().manual_seed(seed_of("dequant zero points", dtype))
    zeros = torch.randint(0, 16, (count, 2), generator=gen)
    zeros[:16] = torch.arange(16).unsqueeze(1)
    bits = zeros.to(TORCH[dtype]).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    return zeros, bits[:, 0] | (bits[:, 1] << 16)


def zero_offsets(dtype, zero_words, scale_words, source=None):
    """The offsets (8 - z) * s of each zero-point and scale pair, made by the template's own entry point."""
    device = Device(render_dequant(dtype) if source is None else source, dtype)
    out = Pointer([None])
    device.call(zero_decode(dtype).offsets, Pointer([zero_words]), Pointer([scale_words]), out)
    return out.cells[0]


def zero_subtrahends(dtype, zero_words, source=None) -> list:
    """The zero decode's subtrahend words for each zero-point pair, made by the template's own
    subtrahend entry point (as the kernels make them, once per group)."""
    device = Device(render_dequant(dtype) if source is None else source, dtype)
    out = Pointer([None] * (zero_decode(dtype).halves // 2))
    device.call(zero_decode(dtype).subtrahends, Pointer([zero_words]), out)
    return out.cells


def expected_bits(values: torch.Tensor, dtype) -> np.ndarray:
    """fp32 values [words, 4 pairs, 2] rounded to dtype, as [4, words] 32-bit words (low = element 0)."""
    bits = values.to(TORCH[dtype]).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    return (bits[..., 0] | (bits[..., 1] << 16)).T


def decoded_values(codes, scales, order):
    """The reference dequantization of each output pair: pair p holds nibbles (p, p + 4) of its word
    (layout.py) times the scale of its n8 tile; `order` lists the pair of each output register."""
    count = codes.shape[0]
    picked = torch.tensor(codes[:, [[p, p + 4] for p in order]].reshape(1, -1).astype(np.uint8))   # [words * 8]
    tile = torch.tensor([b_pair_position(p)[1] // 8 for p in order]).repeat_interleave(2)
    per_value = scales[:, tile].reshape(1, -1)                                   # the scale of each value
    return dequantize(picked, per_value).reshape(count, 4, 2)


def decode_mismatches(dtype, source=None) -> list[str]:
    """Every entry point of the rendered decode against the reference; the outputs that differ."""
    words = sample_words()
    codes = nibbles(words)
    scales, scale_bits = sample_scales(dtype, len(words))
    ones = torch.ones(len(words), 2)
    plain_b, scaled_b = dequant_function_names(dtype, operand="b")
    plain_a, scaled_a = dequant_function_names(dtype, operand="a")
    raw_name, magic_lo, magic_hi = raw_decode(dtype)
    tile = torch.tensor([b_pair_position(p)[1] // 8 for p in A_ORDER])
    # raw decode: every value is its pair's magic + code, exactly (the kernel takes the magic off)
    raw_magic = torch.tensor([magic_lo if p in (0, 2) else magic_hi for p in A_ORDER], dtype=torch.float32)
    raw_codes = torch.tensor(codes[:, [[p, p + 4] for p in A_ORDER]].astype(np.float32))
    cases = {
        plain_b: (None, decoded_values(codes, ones, B_ORDER)),
        scaled_b: (scale_bits[:, 0] | (scale_bits[:, 1] << 16), decoded_values(codes, scales, B_ORDER)),
        plain_a: (None, decoded_values(codes, ones, A_ORDER)),
        scaled_a: (scale_bits[:, 0] | (scale_bits[:, 1] << 16), decoded_values(codes, scales, A_ORDER)),
        raw_name: (None, raw_codes + raw_magic[None, :, None]),
    }
    # zero points: code - z exactly (the scales on the sums), or (code - 8) * s + o with o = (8 - z) * s
    # rounded once, in one fma rounded once (float64 holds the sum exactly)
    zeros, zero_words = sample_zero_points(dtype, len(words))
    # scales from 2^-4: (q - 8) * s + o with q = z leaves o's rounding, a multiple of ulp(s), which
    # is then a normal fp16 number (subnormal results are not emulated)
    scales = scales.clamp(min=2 ** -4)
    bits = scales.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    scale_words = bits[:, 0] | (bits[:, 1] << 16)
    try:
        subtrahends = zero_subtrahends(dtype, zero_words, source)
        offset_words = zero_offsets(dtype, zero_words, scale_words, source)
    except AssertionError as exc:   # a changed source can leave what is emulated exactly
        if source is None:
            raise
        return [f"zero points' subtrahends or offsets: {exc}"]
    offsets = ((8 - zeros.double()) * scales.double()).to(TORCH[dtype])      # rounded once
    found = [f"{zero_decode(dtype).offsets}: {int((got != want).sum())} offsets wrong"
             for got, want in [(offset_words, join(*offsets.double().T.numpy(), dtype))] if (got != want).any()]
    cases[zero_decode(dtype).unscaled] = (None, raw_codes.double() - zeros.double()[:, tile].unsqueeze(-1),
                                          subtrahends)
    cases[zero_decode(dtype).scaled] = (scale_words, decoded_values(codes, scales, A_ORDER).double() +
                                        offsets.double()[:, tile].unsqueeze(-1), offset_words)
    for name, (scale_words, values, *subtrahend_words) in cases.items():
        try:
            got = run(dtype, name, words, scale_words, source, *subtrahend_words)
        except AssertionError as exc:   # a changed source can leave what is emulated exactly (subnormals)
            if source is None:
                raise
            found.append(f"{name}: {exc}")
            continue
        want = expected_bits(values, dtype)
        for register in range(4):
            bad = np.flatnonzero(got[register] != want[register])
            if bad.size:
                i = bad[0]
                found.append(f"{name} register {register}: {bad.size} words wrong, e.g. {words[i]:08x} -> "
                             f"{got[register][i]:08x}, expected {want[register][i]:08x}")
    return found


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_entry_point_decodes_bit_exactly(dtype):
    assert decode_mismatches(dtype) == []


MUTATIONS = {   # (rendered text, replacement, dtype): one constant or order of the device code each
    "lop3 immediate": ("0xEA;", "0xE8;", "float16"),
    "fp16 magic": ("const unsigned MAGIC = 0x64006400u", "const unsigned MAGIC = 0x64016401u", "float16"),
    "fp16 low mask": ("lop3_and_or(q, 0x000f000fu, MAGIC)), SUB_LO", "lop3_and_or(q, 0x000f001fu, MAGIC)), SUB_LO",
                      "float16"),
    "fp16 high mask": ("lop3_and_or(q8, 0x00f000f0u, MAGIC)), MUL_HI", "lop3_and_or(q8, 0x00f000e0u, MAGIC)), MUL_HI",
                       "float16"),
    "fp16 zero point": ("0x64086408u", "0x64076408u", "float16"),
    "fp16 1/16": ("0x2c002c00u", "0x2c012c00u", "float16"),
    "fp16 -72": ("0xd480d480u", "0xd480d484u", "float16"),
    "fp16 shift": ("q8 = q >> 8", "q8 = q >> 4", "float16"),
    "fp16 raw high magic": ("MAGIC_HI = 0x54005400u", "MAGIC_HI = 0x64006400u", "float16"),
    "fp16 scales swapped": ("out[1] = __hmul2(out[1], s0)", "out[1] = __hmul2(out[1], s1)", "float16"),
    "fp16 A order": ("out[1] = p[2];\n  out[2] = p[1];", "out[1] = p[1];\n  out[2] = p[2];", "float16"),
    "fp16 offsets swapped": ("out[1] = __hfma2(p[2], s1, o1)", "out[1] = __hfma2(p[2], s1, o0)", "float16"),
    "bf16 offset order": ("out[2] = __hfma2(p[1], s0, o0)", "out[2] = __hfma2(p[3], s0, o0)", "bfloat16"),
    "fp16 offsets' 8": ("as_half2(0x48004800u), z), s)", "as_half2(0x47004800u), z), s)", "float16"),
    "bf16 offsets' 8": ("as___nv_bfloat162(0x41004100u), z), s)", "as___nv_bfloat162(0x41004180u), z), s)",
                        "bfloat16"),
    "fp16 zero magic": ("m = __hadd2(z, tilemarlin::as_half2(0x64006400u))",
                        "m = __hadd2(z, tilemarlin::as_half2(0x64006401u))", "float16"),
    "fp16 zero -64": ("0xd400d400u", "0xd400d380u", "float16"),
    "fp16 zero rows of -64": ("c[3] = __high2half2(h)", "c[3] = __low2half2(h)", "float16"),
    "bf16 zero rows": ("c[1] = __high2bfloat162(m)", "c[1] = __low2bfloat162(m)", "bfloat16"),
    "bf16 magic": ("const unsigned MAGIC = 0x43004300u", "const unsigned MAGIC = 0x43804380u", "bfloat16"),
    "bf16 zero point": ("0x43084308u", "0x43094308u", "bfloat16"),
    "bf16 shift": ("q >> 12, 0x000f000fu, MAGIC)), SUB", "q >> 16, 0x000f000fu, MAGIC)), SUB", "bfloat16"),
    "fp16 zero rows swapped": ("0x000f000fu, MAGIC)), c[1]);", "0x000f000fu, MAGIC)), c[0]);", "float16"),
    "fp16 zero bit-4 subtrahend": ("MUL_HI, c[2]);", "MUL_HI, c[0]);", "float16"),
    "bf16 zero rows swapped": ("q >> 4, 0x000f000fu, MAGIC)), c[0]);", "q >> 4, 0x000f000fu, MAGIC)), c[1]);",
                               "bfloat16"),
    "bf16 raw order": ("out[1] = tilemarlin::lop3_and_or(q >> 8,", "out[1] = tilemarlin::lop3_and_or(q >> 4,",
                       "bfloat16"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_changed_constant_or_order_is_caught(mutation):
    """The emulation reads what is rendered: a source with one constant or one order changed fails."""
    old, new, dtype = MUTATIONS[mutation]
    source = render_dequant(dtype)
    assert old in source, f"{old!r} is no longer in the rendered {dtype} decode; update the mutation"
    assert decode_mismatches(dtype, source.replace(old, new, 1)) != []


@pytest.mark.parametrize("dtype", DTYPES)
def test_constants_are_the_values_their_comments_claim(dtype):
    """Each `as_<vec>(0x....u);  // 1024 + 8`: both halves of the constant equal the comment's value."""
    claims = re.findall(r"as_\w+\((0x[0-9a-fA-F]+)u\);\s*//\s*([-+*/() \d.]+?)\s*\n", render_dequant(dtype))
    assert len(claims) == (4 if dtype == "float16" else 1)
    for bits, claim in claims:
        lo, hi = halves(np.array([int(bits, 16)], dtype=np.uint32), dtype)
        assert lo[0] == hi[0] == eval(claim, {"__builtins__": {}}), (bits, claim)


@pytest.mark.parametrize("dtype,vec", [("float16", "half2"), ("bfloat16", "__nv_bfloat162")])
def test_template_renders_per_dtype(dtype, vec):
    src = render_dequant(dtype)
    for name in (*dequant_function_names(dtype), *dequant_function_names(dtype, operand="a"), raw_decode(dtype)[0],
                 *zero_decode(dtype)[:3]):
        assert f"void {name}(" in src
    assert "lop3.b32" in src and vec in src
    assert "{{" not in src and "{%" not in src


def test_template_refuses_what_it_cannot_decode():
    with pytest.raises(ValueError, match="8-bit"):
        render_dequant("float16", 8)
    with pytest.raises(ValueError, match="float32"):
        render_dequant("float32")
