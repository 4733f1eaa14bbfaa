"""The marlin_mma weight layout, tested apart from any kernel."""
import pytest
import torch

from schedules import marlin_mma
from schedules.marlin_mma import layout


@pytest.mark.parametrize("k,n", [(16, 64), (128, 192), (4096, 256), (11008, 128)])
def test_pack_unpack_round_trip(k, n):
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    packed = layout.pack_weight(codes)
    assert packed.dtype == torch.int32 and packed.shape == (k // 16, 2 * n)
    assert torch.equal(layout.unpack_weight(packed), codes)


def test_every_nibble_lands_in_its_mma_fragment_slot():
    """Word j of lane l in slab (kt, s) must hold, at nibble i, W[16kt + 2t + 8r + e, 64s + 16j + 8q + g]
    with g = l // 4, t = l % 4, pair p = i % 4, e = i // 4, q = p // 2, r = p % 2 (layout.py)."""
    k, n = 32, 128
    # Codes that spell out their own coordinates modulo 16, in two passes (rows, then columns).
    rows = (torch.arange(k).unsqueeze(1) % 16).expand(k, n).to(torch.uint8)
    cols = (torch.arange(n).unsqueeze(0) % 16).expand(k, n).to(torch.uint8)
    for codes, coord in ((rows, "k"), (cols, "n")):
        words = layout.pack_weight(codes.contiguous()).to(torch.int64) & 0xFFFFFFFF
        for kt in range(k // 16):
            for slab in range(n // 64):
                for lane in (0, 5, 17, 31):
                    for j in range(4):
                        word = int(words[kt, slab * 128 + lane * 4 + j])
                        for i in range(8):
                            g, t, p, e = lane // 4, lane % 4, i % 4, i // 4
                            kk = 16 * kt + 2 * t + 8 * (p % 2) + e
                            nn = 64 * slab + 16 * j + 8 * (p // 2) + g
                            want = (kk if coord == "k" else nn) % 16
                            assert (word >> (4 * i)) & 0xF == want, (coord, kt, slab, lane, j, i)


def test_a_lane_reads_one_contiguous_16_byte_vector_per_slab():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed = layout.pack_weight(codes)
    for lane in range(32):
        vec = packed[0, lane * 4:(lane + 1) * 4]
        # The vector alone rebuilds the lane's 32 values: nothing else of the slab is needed.
        single = torch.zeros_like(packed)
        single[0, lane * 4:(lane + 1) * 4] = vec
        mask = layout.unpack_weight(single) != 0
        assert (layout.unpack_weight(packed)[mask] == codes[mask]).all()


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
    qw, qs = marlin_mma.pack(codes, torch.ones(2, 64, dtype=torch.float16))
    back_codes, back_scales = marlin_mma.unpack(qw, qs)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, qs)
