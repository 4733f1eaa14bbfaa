"""The INT4 -> FP8 e4m3 decode for W4A8, run bit for bit on the CPU, and the k order it shares with
the activations.

The rendered template is executed by tests/test_dequant_template.py's `Device` (prmt and lop3 read
from their inline PTX). The expected bytes are torch's own float -> float8_e4m3fn conversion, and the
positions come from the PTX fragment of an 8-bit MMA's A operand and the marlin_mma layout's packing,
so no table, selector or order is typed in here.
"""
import numpy as np
import pytest
import torch

from schedules import marlin_mma
from schedules.marlin_mma.layout import LANES, SLAB_N, TILE_K, WORDS_PER_LANE, fp8_k_order
from templates import FP8_DECODE_UNIT, e4m3_bits, fp8_decode_name, render_dequant
from tests.test_dequant_template import Device, Pointer


def e4m3_of(values) -> np.ndarray:
    """torch's float8_e4m3fn bytes of `values`."""
    return torch.as_tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def decode(words, dtype="float16", source=None, offset=False) -> tuple[np.ndarray, np.ndarray]:
    """The decode's (offset: offset_decode's) two output registers for each 32-bit word."""
    device = Device(render_dequant(dtype) if source is None else source, dtype)
    frag = Pointer([None, None])
    device.call(fp8_decode_name(offset=offset), Pointer([np.asarray(words, dtype=np.uint32)]), frag)
    return frag.cells[0], frag.cells[1]


def as_bytes(registers: np.ndarray) -> np.ndarray:
    """[words] uint32 -> [words, 4] bytes, byte 0 first (the lowest k position of the register)."""
    return registers.astype("<u4").view(np.uint8).reshape(-1, 4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_code_decodes_to_its_e4m3_value_exactly(dtype):
    """A word of eight equal codes decodes to eight equal bytes, whatever the order: code - 8 in e4m3."""
    codes = np.arange(16, dtype=np.uint32)
    words = codes * np.uint32(0x11111111)
    low, high = decode(words, dtype)
    expected = e4m3_of(codes.astype(np.int64) - 8)
    for register in (low, high):
        assert (as_bytes(register) == expected[:, None]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_with_offset_every_code_decodes_to_the_byte_of_its_value_over_512(dtype):
    """offset_decode: the code c as the e4m3 value c * 2^-9, whose byte is c itself (subnormal below 8)."""
    codes = np.arange(16, dtype=np.uint32)
    low, high = decode(codes * np.uint32(0x11111111), dtype, offset=True)
    expected = e4m3_of(codes / FP8_DECODE_UNIT)
    assert list(expected) == list(range(16))
    for register in (low, high):
        assert (as_bytes(register) == expected[:, None]).all()


def test_the_templates_byte_tables_are_e4m3():
    assert [e4m3_bits(v) for v in range(-8, 8)] == list(e4m3_of(np.arange(-8, 8)))
    with pytest.raises(ValueError, match="exactly"):
        e4m3_bits(17)


def fragment_from_lanes(words_by_lane: list[np.ndarray], offset: bool = False) -> np.ndarray:
    """The 16 x 32 A tile (rows = n, columns = k positions) of one k32 step of an 8-bit MMA, from each
    lane's decoded registers: the PTX fragment of 8-bit A (m16n8k32, and each warp's 16 rows of wgmma's
    m64nNk32) gives lane 4g + t registers a0 (row g, columns 4t..4t+3), a1 (row g + 8, the same
    columns), a2 and a3 (the same rows, columns 16 + 4t..); a0, a1 come from the first k16 sub-tile's
    word and a2, a3 from the second's."""
    tile = np.zeros((16, 32), dtype=np.uint8)
    for lane, (first, second) in enumerate(words_by_lane):
        g, t = lane // 4, lane % 4
        for half, word in enumerate((first, second)):
            row_g, row_g8 = decode([word], offset=offset)
            tile[g, 16 * half + 4 * t:16 * half + 4 * t + 4] = as_bytes(row_g)[0]
            tile[g + 8, 16 * half + 4 * t:16 * half + 4 * t + 4] = as_bytes(row_g8)[0]
    return tile


@pytest.mark.parametrize("offset", [False, True])
def test_the_decoded_fragment_times_the_reordered_activations_is_the_product(offset):
    """Packed real codes, decoded lane by lane into the 8-bit A fragment, multiplied by activations
    stored in fp8_k_order: exactly x @ (W - 8) for the sub-tile's 16 columns, in integers (offset_decode:
    x @ W / 512, the kernel adding -8 times x's sums back)."""
    generator = torch.Generator().manual_seed(20261203)
    k, n = 2 * TILE_K, SLAB_N
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=generator)
    scales = torch.ones(1, n, dtype=torch.float16)
    packed, _ = marlin_mma.pack(codes, scales)
    words = packed.view(torch.int32).numpy().view(np.uint32)
    x = torch.randint(-3, 4, (5, k), generator=generator).to(torch.float64)
    stored_x = x[:, fp8_k_order(k)]
    for subtile in range(WORDS_PER_LANE):          # the slab's four 16-column sub-tiles
        lanes = [(words[0, lane * WORDS_PER_LANE + subtile], words[1, lane * WORDS_PER_LANE + subtile])
                 for lane in range(LANES)]
        tile = fragment_from_lanes(lanes, offset)
        weights = torch.from_numpy(tile.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(torch.float64)
        columns = slice(16 * subtile, 16 * subtile + 16)
        w = codes[:, columns].to(torch.float64)
        expected = x @ (w / FP8_DECODE_UNIT if offset else w - 8)
        assert torch.equal(stored_x @ weights.T, expected), f"sub-tile {subtile}"


def test_the_activation_order_is_a_permutation_within_each_16_columns():
    order = fp8_k_order(64)
    assert sorted(order.tolist()) == list(range(64))
    assert ((order // TILE_K) == (torch.arange(64) // TILE_K)).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_k_order(40)


@pytest.mark.parametrize("offset,old,new", [
    (False, "0x4e4c4a48u", "0x4e4c4a40u"), (False, "0x32103210u", "0x32013201u"), (False, "0x3120u", "0x2130u"),
    (False, "0x77777777u", "0xf7777777u"),
    (True, "0x0F0F0F0Fu, 0u);        // nibbles 0", "0x0F0F0F07u, 0u);        // nibbles 0"),
    (True, "0x6240u", "0x6241u"), (True, "0x7351u", "0x7315u"), (True, "q >> 4", "q >> 5")],
    ids=["table entry", "pick", "row gather", "index mask", "offset mask", "offset row g gather",
         "offset row g + 8 gather", "offset shift"])
def test_a_changed_constant_is_caught(offset, old, new):
    source = render_dequant("float16")
    assert source.count(old) == 1
    mutated = source.replace(old, new)
    words = np.random.default_rng(7).integers(0, 2 ** 32, 512, dtype=np.uint64).astype(np.uint32)
    assert any(not np.array_equal(a, b)
               for a, b in zip(decode(words, source=mutated, offset=offset), decode(words, offset=offset)))


@pytest.mark.parametrize("offset,prmt", [(False, 7), (True, 2)], ids=["lookup", "offset"])
def test_what_nvcc_makes_of_a_word_for_sm90(offset, prmt):
    """What the decode costs per word of eight codes, in the PTX nvcc makes of it for sm_90a: the table
    lookup's byte gather, four table lookups and two picks, or offset_decode's two byte gathers; two
    masks either way, no conversion instruction."""
    import re

    from tilelang.contrib import nvcc

    probe = render_dequant("float16") + (
        'extern "C" __global__ void probe(const unsigned* words, unsigned* out) {\n'
        f"  {fp8_decode_name(offset=offset)}(words + threadIdx.x, out + 2 * threadIdx.x);\n}}\n")
    ptx = bytes(nvcc.compile_cuda(probe, target_format="ptx", arch="sm_90a")).decode()
    body = ptx[ptx.index(".entry probe"):]
    assert len(re.findall(r"\bprmt\.b32\b", body)) == prmt
    assert len(re.findall(r"\blop3\.b32\b", body)) == 2
    assert not re.search(r"\bcvt\.\w*(e4m3|f16|f32)", body)


# --- the activations' side: per-token FP8 and the product W4A8 kernels must match --------------------

def test_per_token_fp8_scales_are_the_smallest_powers_of_two_that_fit_each_row():
    from schedules.quant import FP8_E4M3_MAX, quantize_fp8_per_token

    generator = torch.Generator().manual_seed(5)
    a = torch.randn(7, 256, generator=generator).to(torch.float16) * torch.logspace(-3, 3, 7).unsqueeze(1).half()
    a[3] = 0
    a[5, 7] = 448.0      # exactly 448 s for s = 1: not 2
    a8, scales = quantize_fp8_per_token(a)
    assert a8.dtype == torch.float8_e4m3fn and scales.shape == (7, 1) and scales.dtype == torch.float32
    rows = [0, 1, 2, 4, 5, 6]
    exponents = torch.log2(scales[rows, 0])
    assert torch.equal(exponents, exponents.round())
    amax = a[rows].float().abs().amax(dim=1)
    assert (amax <= FP8_E4M3_MAX * scales[rows, 0]).all() and (amax > FP8_E4M3_MAX / 2 * scales[rows, 0]).all()
    assert scales[5].item() == 1
    assert scales[3].item() == 1 and not a8[3].float().any()
    back = a8.float() * scales
    assert torch.equal(a.float() / scales * scales, a.float())          # a / s is exact
    assert ((back - a.float()).abs() <= a.float().abs() / 16 + scales * 2.0 ** -9).all()   # 3 mantissa bits


def test_w4a8_reference_is_near_the_w4a16_one_and_not_equal():
    from schedules.quant import quantize_rtn, reference_matmul, reference_w4a8, relative_error

    generator = torch.Generator().manual_seed(6)
    a = torch.randn(17, 512, generator=generator).half()
    codes, scales = quantize_rtn(torch.randn(512, 128, generator=generator), 128)
    w4a16, w4a8 = reference_matmul(a, codes, scales), reference_w4a8(a, codes, scales)
    assert 0 < relative_error(w4a8, w4a16) < 0.06


def _round_pairs(pairs: torch.Tensor, dropped: int) -> torch.Tensor:
    """stream_mma's fp8_rounded on int64 words of two 16-bit activations (schedules/stream_mma/batch.py,
    tm_round_e4m3_word in schedules/fp8_rounding.py), in 32-bit unsigned arithmetic."""
    bias = ((1 << (dropped - 1)) - 1) * 0x00010001
    kept = ((0xFFFF << dropped) & 0xFFFF) * 0x00010001
    return ((pairs + bias + ((pairs >> dropped) & 0x00010001)) & kept) & 0xFFFFFFFF


@pytest.mark.parametrize("dtype, dropped", [(torch.float16, 7), (torch.bfloat16, 4)])
@pytest.mark.parametrize("exponent", [-9, -1, 0, 6])
def test_rounding_the_mantissa_is_e4m3_of_x_over_a_power_of_two_scale(dtype, dropped, exponent):
    """Every finite 16-bit value, paired with another in one word: each half rounds on its own, and to
    what W4A8 gives it, e4m3(x / s) * s for a power-of-two token scale s, wherever |x / s| is a normal
    e4m3 number (2^-6 .. 448) and x a normal number of its dtype; elsewhere within e4m3's subnormal step
    (2^-9 s) or float16's rounded one (2^-17) of it."""
    patterns = torch.arange(0, 1 << 16, dtype=torch.int64)
    partners = patterns[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(exponent + 20))]
    rounded = _round_pairs(patterns | partners << 16, dropped)
    low, high = rounded & 0xFFFF, rounded >> 16
    alone = _round_pairs(partners, dropped)
    values = patterns.to(torch.int32).to(torch.int16).view(dtype).float()
    finite = torch.isfinite(values) & torch.isfinite(partners.to(torch.int32).to(torch.int16).view(dtype).float())
    assert torch.equal(high[finite], alone[finite])          # no carry crosses into the other half
    got = low.to(torch.int32).to(torch.int16).view(dtype).float()
    scale = 2.0 ** exponent
    ratio = values.abs() / scale
    normal = finite & (ratio >= 2.0 ** -6) & (ratio <= 448) & (values.abs() >= torch.finfo(dtype).tiny)
    e4m3 = (values / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(got[normal], e4m3[normal])
    small = finite & (ratio < 448) & ~normal
    assert small.any()
    assert ((got[small] - e4m3[small]).abs() <= values[small].abs() / 8 + 2.0 ** -9 * scale + 2.0 ** -17).all()
