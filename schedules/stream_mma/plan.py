"""What one stream_mma kernel's problem and knobs fix before any code is written: the batches and their
round-robin over the warps, the register and shared-slot sizes, where each sum and operand lives,
and which decode and fold the kernel uses. kernel.py, stream.py and batch.py read it."""
from __future__ import annotations

from dataclasses import dataclass

from templates import dequant_function_names, mma_operand_dtype, raw_decode, zero_decode

from ..fp8_rounding import round_pair_call
from ..marlin_mma.layout import TILE_K
from ..problem import Problem
from .knobs import MMA_N, Knobs


class Plan:
    """The build-time constants of one kernel (the knobs' own fields are read from `knobs`)."""

    def __init__(self, problem: Problem, knobs: Knobs):
        kb = self.knobs = knobs
        self.problem, self.dtype = problem, problem.dtype
        # Zero points: each batch's zero-point row comes with its scale row, and the decode takes z off
        # the codes where the symmetric one takes 8; channelwise ones are then one group like any other.
        self.zp = problem.zero_points
        self.grouped = not problem.channelwise or self.zp
        self.scale_rows = 2 if self.zp else 1     # rows of a batch's scales (and zero points) in S
        self.m_tiles, self.unroll, self.warps, self.ahead = kb.m_tiles, kb.unroll, kb.warps, kb.ahead
        self.bm, self.bn = kb.block_m, kb.block_n
        self.grid_n = problem.n // self.bn
        self.split = kb.uses_workspace           # split-K through the global workspace
        self.cluster = kb.cluster_reduce

        # The stream: batches of `unroll` k-steps go round-robin over all warps of all splits of an
        # output tile, `trips` per warp.
        self.batches = kb.batches(problem)
        self.workers = kb.split_k * self.warps
        self.trips = -(-self.batches // self.workers)
        self.x_smem = kb.x_ldmatrix
        self.w_smem = kb.async_weights       # implies x_smem (check): every load of the k-loop is a cp.async
        # Per register buffer: the weight words, activation halves and scale halves of one batch.
        self.per_w = self.unroll * 4
        self.per_x = self.unroll * self.m_tiles * 4
        self.per_s = 8 * self.scale_rows      # the lane's 8 scales, then with zero points their 8 z
        self.w_bufs = 1 if self.w_smem else self.ahead   # async_weights: the shared slots hold the batches in flight
        self.x_bufs = 1 if self.x_smem else self.ahead   # x_ldmatrix: activations wait in shared memory instead
        self.x_cols = TILE_K * self.unroll + 8   # padded rows: ldmatrix's 8 row addresses hit 8 bank groups
        # 16-byte cp.async per lane per batch of activations
        self.x_chunks = MMA_N * self.m_tiles * TILE_K * self.unroll // 8 // 32

        # fp8_rounded: each batch's activation fragments rounded to e4m3's 3 mantissa bits before its MMAs
        self.round_fp8 = problem.rounds_fp8
        self.round_fp8_name = round_pair_call(self.dtype)

        # The decode and the sums.
        self.mma_dtype = mma_operand_dtype(self.dtype)
        self.decode, self.decode_scaled = dequant_function_names(self.dtype, problem.bits, operand="a")
        self.zero = zero_decode(self.dtype, problem.bits)
        self.decode_raw, lo_magic, hi_magic = raw_decode(self.dtype, problem.bits)
        self.fold = kb.fold_zero_point
        # fold_zero_point: the MMA sees (lo_magic + code) on pairs 0/2 (k % 16 < 8) and (hi_magic + code)
        # on pairs 1/3, so every product carries an offset that does not depend on the weight column: per
        # row of M it is lo_off * sum(x, k % 16 < 8) + hi_off * sum(x, k % 16 >= 8) with the zero point 8
        # included, which one more MMA per k-step computes from a constant A fragment. With zero points
        # its rows g + 8 sum the activations instead, the zero point is not included (each column has
        # its own), and the fold takes z times that sum off as well.
        zero = 0 if self.zp else 8
        self.lo_off, self.hi_off = lo_magic + zero, hi_magic + zero
        # zero points without fold_zero_point: the offsets o = (8 - z) * s of a batch's four sub-tiles
        self.zero_offsets_len = 8 if self.zp and not kb.fold_zero_point else 0
        # fold_zero_point folds each batch's fp32 sums, less the offsets, into a running total (also
        # channelwise, so that no sum grows to K * 1032 * |x|); otherwise the decode applies the scales.
        self.scale_weights = self.grouped and not self.fold
        self.acc_len = 4 * self.m_tiles * 4
        self.off_len = self.m_tiles * 4
        # fold_lag: batch b's sums are folded while batch b + 1's MMAs run, from a second set of sums (and
        # of offsets and scales); the unroll by `ahead` (even: check()) makes each batch's set a constant.
        self.lag = kb.fold_lag
        self.sets = 2 if self.lag else 1

    def acc_index(self, j, mi):
        """First of the 4 sums of word j against m-tile mi, in a set of acc_len sums."""
        return (j * self.m_tiles + mi) * 4

    @staticmethod
    def sums_position(j, mi, e, g, t):
        """Where sum e of a lane's C^T fragment (16 columns j of the slab, m-tile mi) goes in the block
        tile: row (of M) 2t + e % 2 of the m-tile, column (weight column) 16j + g, + 8 for e >= 2."""
        return mi * MMA_N + 2 * t + e % 2, j * 16 + g + 8 * (e // 2)

    def x_index(self, u, mi):
        """First of the 4 halves (b0..b3) of k-step u, m-tile mi: m-tile-major, so that one ldmatrix.x4
        fills two consecutive k-steps."""
        return (mi * self.unroll + u) * 4

    @staticmethod
    def scale_col(v, g):
        """Column, within the block, of a lane's scale v: 16 (v // 2) + g, + 8 for odd v (the lane's A
        rows of each 16-column group)."""
        return (v // 2) * 16 + (v % 2) * 8 + g


@dataclass
class Buffers:
    """The kernel's tensors, the thread's registers and the block's shared memory, as one argument of
    the macros that read and write them (kernel.py allocates them; those that the knobs leave unused
    are None)."""

    A: object                 # activations [M, K]
    B: object                 # packed weights [K/16, 2N] int32
    S: object                 # scales [K/group, N]
    w: object                 # `ahead` register buffers of weight words (one with async_weights)
    x: object                 # activation B fragments (one buffer with x_ldmatrix)
    scale: object             # the lane's group scales, per register buffer
    a: object                 # one decoded word: the A fragments of four 16x16 W^T tiles
    a_off: object             # fold_zero_point: the constant A fragment of the offsets
    zero_offsets: object      # zero points without fold_zero_point: the batch's offsets (8 - z) * s
    acc: object               # the MMAs' fp32 sums (two sets with fold_lag)
    off: object               # fold_zero_point: the offsets' sums per m-tile (two sets with fold_lag)
    total: object             # fold_zero_point: the folded batches' running total
    lag_scale: object         # fold_lag: the scales of the batch whose sums wait to be folded
    W_s: object               # async_weights: the warps' weight slots
    S_s: object               # async_weights: the warps' scale slots
    X_s: object               # x_ldmatrix: the warps' activation slots
    C_s: object               # the block's fp32 tile, where the warps' sums meet
    P_s: object               # sum_slices: a slice of that tile per warp
