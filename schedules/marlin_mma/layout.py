"""Weight-layout contract of the Marlin-design (mma.sync m16n8k16) family.

Derived from the B-operand fragment of ``mma.sync.m16n8k16.row.col`` (PTX ISA, "Matrix Fragments for
mma.m16n8k16"): lane l = 4*g + t (g = l // 4, t = l % 4) of a warp holds, for one n8 tile, the halves
b0, b1 = B[2t, g], B[2t+1, g] and b2, b3 = B[2t+8, g], B[2t+9, g].

One 16x16 (k x n) sub-tile is two n8 tiles, i.e. 8 values per lane, i.e. exactly one 32-bit word of
eight nibbles. The nibbles are ordered for the lop3 decode (templates/dequant.cuh.j2), which turns
nibbles (i, i+4) of a word into one half2 for i = 0..3:

    nibble i  ->  pair p = i % 4, element e = i // 4
    pair p    ->  n8 tile s = p // 2, register r = p % 2
    value     =   W[k = 2t + 8r + e, n = 8s + g]

so decoding a word yields the lane's B fragments of both n8 tiles in register order, with no shuffles.

Tiling in memory: W[K, N] is cut into slabs of 16 rows x 64 columns (four 16x16 sub-tiles j = 0..3).
A slab is stored as 32 lanes x 4 words (512 bytes), lane-major, so that one 16-byte load gives a lane
its words for all four sub-tiles and a warp reads a slab with 32 consecutive 16-byte accesses:

    packed[kt, slab * 128 + lane * 4 + j]    int32, shape [K / 16, 2 * N]

Scales are not permuted: [K / group, N] in natural order. A lane reads the few it needs from a
shared-memory row once per k-tile, whether it applies them to the weights or to the fp32 sums.

For 8-bit MMAs (W4A8: FP8 e4m3 activations) the same words serve. An 8-bit A register holds four
consecutive k of one row (lane l's k = 4t..4t+3 of row g or g + 8 in each 16-column half of the k32
step); the FP8 decode (templates.fp8_decode_name) puts row g's nibbles 0, 1, 4, 5 into one register
and row g + 8's 2, 3, 6, 7 into the other, that is k = 2t, 2t + 8, 2t + 1, 2t + 9 of the sub-tile.
The activations are stored in that k order instead (fp8_k_order): position 4t + j of each 16 columns
holds column FP8_K_ORDER[4t + j], so both operands meet at the same k and the words are not repacked.

Zero points other than 8 (w = s * (q - z)) travel beside the scales as they are, whole numbers in
the scales' dtype (exact): the scales tensor is then [2 * K / group, N], row 2g the scales of group g
and row 2g + 1 its zero points (stack_zero_points), so that one copy of two adjacent rows brings a
k-tile both. The decode subtracts magic + z where the symmetric one subtracts magic + 8 (exact), so a
word costs what a symmetric one does (templates/dequant.cuh.j2).
"""
from __future__ import annotations

import torch

TILE_K = 16          # rows of one sub-tile (the MMA's k)
SLAB_N = 64          # columns of one slab: four 16-column sub-tiles
WORDS_PER_LANE = 4   # one word per sub-tile of a slab
LANES = 32


def _subtile_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(k, n) inside a 16x16 sub-tile of nibble i of lane l, as two [32, 8] index tensors."""
    lane = torch.arange(LANES).unsqueeze(1)
    nib = torch.arange(8).unsqueeze(0)
    g, t = lane // 4, lane % 4
    pair, elem = nib % 4, nib // 4
    k = 2 * t + 8 * (pair % 2) + elem
    n = 8 * (pair // 2) + g
    return k, n


# Position 4t + j of a 16-column block of FP8 activations holds column 2t + (0, 8, 1, 9)[j].
FP8_K_ORDER = tuple(2 * t + (0, 8, 1, 9)[j] for t in range(4) for j in range(4))


def fp8_k_order(k: int) -> torch.Tensor:
    """The column of the activations stored at each of the k positions of their FP8 copy (int64 [k])."""
    if k % TILE_K:
        raise ValueError(f"K={k} must be a multiple of {TILE_K} for the marlin_mma layout")
    position = torch.arange(k)
    return position - position % TILE_K + torch.tensor(FP8_K_ORDER)[position % TILE_K]


def check_packable(k: int, n: int) -> None:
    if k % TILE_K:
        raise ValueError(f"K={k} must be a multiple of {TILE_K} for the marlin_mma layout")
    if n % SLAB_N:
        raise ValueError(f"N={n} must be a multiple of {SLAB_N} for the marlin_mma layout")


def packed_shapes(k: int, n: int, scale_rows: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (packed weight, scales) for W[K, N] with `scale_rows` rows of scales (and zero
    points: Problem.scale_rows)."""
    return (k // TILE_K, 2 * n), (scale_rows, n)


def stack_zero_points(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Scales [G, N] and zero points [G, N] (whole numbers 0..15) -> [2G, N] in the scales' dtype:
    each group's scale row, then its zero-point row."""
    if scales.shape != zeros.shape or scales.dim() != 2:
        raise ValueError(f"scales {tuple(scales.shape)} and zero points {tuple(zeros.shape)} must be the same [G, N]")
    check_zero_points(zeros, scales)
    rows = (scales, zeros.to(scales.dtype))
    return torch.stack(rows, dim=1).reshape(2 * scales.shape[0], scales.shape[1]).contiguous()


def check_zero_points(zeros: torch.Tensor, scales: torch.Tensor) -> None:
    """A ValueError for zero points of another shape than the scales, or naming the first that is not a
    whole number in 0..15 (the decode takes them off the codes exactly)."""
    if zeros.shape != scales.shape:
        raise ValueError(f"zero points {tuple(zeros.shape)} must have the scales' shape {tuple(scales.shape)}")
    bad = (~((zeros >= 0) & (zeros <= 15) & (zeros == zeros.round()))).nonzero()
    if len(bad):
        group, column = bad[0].tolist()
        raise ValueError(f"zero point {zeros[group, column].item()} at group {group}, column {column}: "
                         "4-bit zero points are whole numbers in 0..15")


def split_zero_points(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of stack_zero_points: [2G, N] -> (scales [G, N], zero points [G, N], in the scales'
    dtype)."""
    if stacked.dim() != 2 or stacked.shape[0] % 2:
        raise ValueError(f"stacked scales and zero points must be [2G, N], got {tuple(stacked.shape)}")
    return stacked[0::2].contiguous(), stacked[1::2].contiguous()


def pack_weight(codes: torch.Tensor) -> torch.Tensor:
    """INT4 codes [K, N] (values 0..15, any integer dtype) -> packed int32 [K / 16, 2 * N]."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [K, N], got shape {tuple(codes.shape)}")
    k, n = codes.shape
    check_packable(k, n)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("INT4 codes must lie in [0, 15]")
    km, nm = _subtile_map()
    km, nm = km.to(codes.device), nm.to(codes.device)
    # [kt, 16, nt, 16] -> [kt, nt, 16, 16] -> per-lane nibbles [kt, nt, 32, 8]
    tiles = codes.to(torch.int64).reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3)
    nibbles = tiles[:, :, km, nm]
    shifts = torch.arange(0, 32, 4, device=codes.device)
    words = (nibbles << shifts).sum(dim=-1)                      # [kt, nt, 32], fits in 32 bits
    words = words.reshape(k // 16, n // SLAB_N, WORDS_PER_LANE, LANES).transpose(2, 3)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # to signed int32
    return words.reshape(k // 16, 2 * n).to(torch.int32).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The exact inverse of :func:`pack_weight`: packed int32 [K / 16, 2 * N] -> codes uint8 [K, N]."""
    if packed.dim() != 2 or packed.dtype != torch.int32 or packed.shape[1] % (2 * SLAB_N):
        raise ValueError(f"expected packed int32 [K/16, 2N] with N a multiple of {SLAB_N}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    kt, n2 = packed.shape
    n = n2 // 2
    words = packed.to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(kt, n // SLAB_N, LANES, WORDS_PER_LANE).transpose(2, 3).reshape(kt, n // 16, LANES)
    shifts = torch.arange(0, 32, 4, device=packed.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF              # [kt, nt, 32, 8]
    km, nm = _subtile_map()
    tiles = torch.empty(kt, n // 16, 16, 16, dtype=torch.int64, device=packed.device)
    tiles[:, :, km.to(packed.device), nm.to(packed.device)] = nibbles
    return tiles.permute(0, 2, 1, 3).reshape(kt * 16, n).to(torch.uint8)
