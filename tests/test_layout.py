"""The marlin_mma weight layout, tested apart from any kernel.

The expectation is built here from its definitions, not from layout.py's index maps:

* PTX ISA, "Matrix Fragments for mma.m16n8k16", B operand (.f16/.bf16): lane l = 4g + t holds, of one
  k16 x n8 tile, b0, b1 = B[2t, g], B[2t + 1, g] and b2, b3 = B[2t + 8, g], B[2t + 9, g], in two
  32-bit registers (b0 b1) and (b2 b3). A 16 x 16 sub-tile is two n8 tiles: four registers, eight halves.
* the decode (templates/dequant.cuh.j2) makes register i (i = 0..3) of nibbles i (low half) and
  i + 4 (high half) of one 32-bit word;
* the slab order (layout.py's docstring): W[K, N] in slabs of 16 rows x 64 columns, four sub-tiles j,
  stored lane-major so that lane l's words for j = 0..3 are one 16-byte vector,
  packed[kt, slab * 128 + 4 * l + j].
"""
import pytest
import torch

from schedules import marlin_mma
from schedules.marlin_mma import layout
from tests.reference import generator, seed_of


def b_fragment(lane: int) -> list[tuple[int, int]]:
    """(k, n) of halves b0..b3 that `lane` holds of one k16 x n8 B tile (PTX ISA)."""
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def expected_lane_vector(codes: torch.Tensor, kt: int, slab: int, lane: int) -> list[int]:
    """The four unsigned 32-bit words lane `lane` must find at packed[kt, slab * 128 + 4 * lane : + 4]."""
    words = []
    for j in range(4):
        # the lane's halves of both n8 tiles of sub-tile j, in register order
        halves = [(k, n + 8 * tile) for tile in (0, 1) for k, n in b_fragment(lane)]
        word = 0
        for h, (k, n) in enumerate(halves):
            register, high = divmod(h, 2)
            nibble = register + 4 * high
            word |= int(codes[16 * kt + k, 64 * slab + 16 * j + n]) << (4 * nibble)
        words.append(word)
    return words


def check_lane_vector(vector: torch.Tensor, codes: torch.Tensor, kt: int, slab: int, lane: int) -> None:
    """Assert that the 16-byte `vector` (four int32) is what `lane` must read in slab (kt, slab)."""
    got = [int(w) & 0xFFFFFFFF for w in vector]
    want = expected_lane_vector(codes, kt, slab, lane)
    assert got == want, (f"slab (kt={kt}, slab={slab}), lane {lane}: words "
                         f"{[f'{w:08x}' for w in got]}, expected {[f'{w:08x}' for w in want]}")


def check_every_slot(packed: torch.Tensor, codes: torch.Tensor) -> None:
    k, n = codes.shape
    for kt in range(k // 16):
        for slab in range(n // 64):
            for lane in range(32):
                start = slab * 128 + 4 * lane
                check_lane_vector(packed[kt, start:start + 4], codes, kt, slab, lane)


def coded_weights(k: int, n: int) -> dict[str, torch.Tensor]:
    """Codes that spell out their row, their column (modulo 16), and seeded random ones."""
    rows = (torch.arange(k).unsqueeze(1) % 16).expand(k, n)
    cols = (torch.arange(n).unsqueeze(0) % 16).expand(k, n)
    rand = torch.randint(0, 16, (k, n), generator=generator(seed_of("layout", k, n), "cpu"))
    return {name: c.to(torch.uint8).contiguous() for name, c in (("rows", rows), ("cols", cols), ("random", rand))}


@pytest.mark.parametrize("k,n", [(16, 64), (128, 192), (4096, 256), (11008, 128)])
def test_pack_unpack_round_trip(k, n):
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=generator(seed_of("round trip", k, n), "cpu"))
    packed = layout.pack_weight(codes)
    assert packed.dtype == torch.int32 and packed.shape == (k // 16, 2 * n)
    assert torch.equal(layout.unpack_weight(packed), codes)


@pytest.mark.parametrize("pattern", ["rows", "cols", "random"])
def test_every_lane_reads_its_mma_fragments_as_one_16_byte_vector(pattern):
    """Every slot of every slab: lane l's 16 bytes hold exactly its B fragments of the four sub-tiles."""
    codes = coded_weights(64, 192)[pattern]
    check_every_slot(layout.pack_weight(codes), codes)


def test_the_slot_check_rejects_a_wrong_vector():
    """The checker above fails on what a wrong layout would put in a slot."""
    codes = coded_weights(32, 128)["random"]
    packed = layout.pack_weight(codes)
    kt, slab, lane = 1, 1, 13
    at = slab * 128 + 4 * lane
    right = packed[kt, at:at + 4]
    check_lane_vector(right, codes, kt, slab, lane)
    one_nibble_off = right.clone()
    one_nibble_off[2] ^= 0x10
    wrong = {
        "all zeros": torch.zeros_like(right),
        "the next lane's (same g, other t)": packed[kt, at + 4:at + 8],
        "the lane 4 on's (same t, other g)": packed[kt, at + 16:at + 20],
        "the same lane's of the other slab": packed[kt, at - 128:at - 124],
        "the same lane's of another k-tile": packed[kt - 1, at:at + 4],
        "sub-tiles in another order": right.flip(0),
        "one nibble off": one_nibble_off,
    }
    for what, vector in wrong.items():
        with pytest.raises(AssertionError, match=f"lane {lane}: words"):
            check_lane_vector(vector, codes, kt, slab, lane)
            pytest.fail(f"the checker accepted {what}")


def test_the_slot_check_rejects_a_misplaced_layout():
    """Whole-layout mistakes that a round trip cannot see (pack and unpack wrong the same way) fail it."""
    codes = coded_weights(32, 128)["random"]
    kt, n2 = codes.shape[0] // 16, 2 * codes.shape[1]
    lanes = layout.pack_weight(codes).view(kt, n2 // 128, 32, 4)
    swaps = {"lanes rotated by one (t)": lanes.roll(1, dims=2), "lanes rotated by four (g)": lanes.roll(4, dims=2),
             "sub-tiles reversed in every lane": lanes.flip(3), "slabs swapped": lanes.flip(1)}
    for what, wrong in swaps.items():
        with pytest.raises(AssertionError, match="lane"):
            check_every_slot(wrong.reshape(kt, n2), codes)
            pytest.fail(f"the checker accepted {what}")


def test_unpacking_one_lane_vector_fills_exactly_that_lanes_fragment_positions():
    """unpack_weight reads a lane's 32 values from its vector alone and puts them where the fragments
    say: with every other word zeroed and codes 1..15, the non-zero positions are the lane's."""
    codes = coded_weights(16, 64)["random"] % 15 + 1
    packed = layout.pack_weight(codes)
    for lane in range(32):
        single = torch.zeros_like(packed)
        single[0, 4 * lane:4 * lane + 4] = packed[0, 4 * lane:4 * lane + 4]
        mask = torch.zeros_like(codes, dtype=torch.bool)
        for j in range(4):
            for tile in (0, 1):
                for k, n in b_fragment(lane):
                    mask[k, 16 * j + 8 * tile + n] = True
        assert int(mask.sum()) == 32
        assert torch.equal(layout.unpack_weight(single), torch.where(mask, codes, 0)), lane


@pytest.mark.parametrize("shape,msg", [((16, 100), "multiple of 64"), ((24, 64), "multiple of 16")])
def test_pack_rejects_shapes_the_layout_cannot_tile(shape, msg):
    with pytest.raises(ValueError, match=msg):
        layout.pack_weight(torch.zeros(shape, dtype=torch.uint8))


def test_pack_rejects_codes_out_of_range():
    codes = torch.zeros(16, 64, dtype=torch.int32)
    codes[3, 7] = 16
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        layout.pack_weight(codes)


def test_family_pack_checks_scales_fit_the_codes():
    codes = torch.zeros(256, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        marlin_mma.pack(codes, torch.ones(3, 64, dtype=torch.float16))
    codes = torch.randint(0, 16, (256, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    scales = torch.rand(2, 64, generator=torch.Generator().manual_seed(4)).half() + 0.01
    qw, qs = marlin_mma.pack(codes, scales)
    back_codes, back_scales = marlin_mma.unpack(qw, qs)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
