"""What the pieces of one stream_wgmma kernel share: its sizes, derived once from (problem, knobs)
(Plan), its buffers (Buffers), and the maps from a lane's registers to weight columns, output rows
and shared-memory offsets.

Why the maps look the way they do:
- A 64-column slab's k-step is 128 packed words, lane l's word for the slab's 16-column quarter q at
  4 l + q (marlin_mma's layout), and one word decodes into the lane's share of an m64k16 A fragment
  (rows g and g + 8 of 16 weight columns). The wgmma does not mind which weight columns a lane
  brings: its rows of A are then other columns, and its rows of the sums the same ones (weight_col
  says which), since every row of A*B is that row of A times B. rotate uses that freedom to read
  the words from shared memory without bank conflicts (slab_quarter).
- wgmma computes C^T = W^T X^T: its accumulator holds, per group and 8 rows of M, rows g / g + 8 of
  the warp's 16 weight columns at columns (rows of M) 2t and 2t + 1 (fragment_element).
- The activations of a stage are [block_m, 64] tiles in TMA's 128-byte swizzle, wgmma's canonical
  K-major SW128 layout: 8-row atoms of 1024 bytes, a k-step 32 bytes into the atom (x_offset).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import tilelang.language as T

from templates import dequant_function_names, fp8_decode_name, mma_operand_dtype, zero_decode

from ..epilogue import split_k_prelude, store_tile, store_tile_split_wait, wait_for_prior_grids
from ..fp8_rounding import round_chunks_call
from ..marlin_mma.layout import SLAB_N
from ..problem import Problem
from .knobs import Knobs

# The wgmma descriptor of a stage's activations: the 128-byte swizzle (layout type 1), leading byte
# offset 1 (unused by a swizzled K-major operand), stride byte offset one 8-row atom (1024 bytes), in
# 16-byte units; a k-step is 32 bytes into the atom.
SW128, LEADING_OFFSET, ATOM_OFFSET, STEP_UNITS = 1, 1, 1024 // 16, 2


def panel_tile(launch, m_tiles, n_tiles, panel, minimum=min, div=operator.floordiv, mod=operator.mod):
    """(M tile, N tile) of the block launched `launch`-th, with the tiles handed out in panels of
    `panel` M tiles (the last panel may be shorter): within a panel the M tiles go fastest, then the
    N tiles. Integers, or TileLang expressions with minimum=T.min and C's division (every operand is
    non-negative, so truncating is flooring and needs no sign fix-ups); a bijection onto the grid
    (tests/test_codegen_stream_wgmma.py)."""
    per_panel = panel * n_tiles
    first = div(launch, per_panel) * panel           # the panel's first M tile
    rows = minimum(panel, m_tiles - first)
    within = mod(launch, per_panel)
    return first + mod(within, rows), div(within, rows)


# A warp that reads one slab quarter for all its lanes hits 8 banks, four lanes each: 4-way conflicts,
# 4 wavefronts per 32-bit load (2 per 64-bit load at groups 2). rotate: the lanes of each 8-lane
# quarter of the warp take the warp's quarter (pair of quarters at groups 2) shifted by that lane
# quarter's number, so that one load touches every bank once.
def slab_quarter(wq, lane, i, groups: int, rotate: bool):
    """The 16-column quarter (within its 64-column slab) of lane `lane` of warp `wq`'s group i (ints or
    TileLang expressions)."""
    quarters = 4 // groups                # a warp's share of the slab, in steps of `groups` quarters
    if rotate and quarters > 1:
        return groups * ((wq % quarters + lane // 8) % quarters) + i
    return (wq * groups + i) % 4


class Plan:
    """One kernel's constants, and the epilogue macros of schedules/epilogue.py configured for it.
    The macros take it as their first argument and read it as plan.<name>."""

    def __init__(self, problem: Problem, knobs: Knobs):
        kb = self.kb = knobs
        self.n, self.group, self.dtype, self.bits = problem.n, problem.group, problem.dtype, problem.bits
        self.m = T.dynamic("m")              # rows of A and C, known at launch
        self.tiles = T.dynamic("tiles")      # split-K tile counters
        self.bm, self.bn, self.bk, self.g = kb.block_m, kb.block_n, kb.block_k, kb.groups
        # W4A8 (problem.fp8): FP8 e4m3 activations, 32-deep wgmmas whose A fragment is two words
        self.fp8 = problem.fp8
        self.x_dtype = "float8_e4m3fn" if self.fp8 else problem.dtype     # the activations' type in A and X_s
        self.word_rows = kb.k_steps          # 16-deep rows of packed words per k-tile
        self.steps, self.stages = kb.mma_steps(problem), kb.stages      # wgmma k-steps per k-tile
        self.threads = kb.threads
        self.consumers = kb.consumer_threads    # the warpgroups; with producer_warp one warp (or warpgroup) more
        # K-tiles per split; the first `extra` splits take one more, with split_wait the last ones (uneven
        # splits: with the producer warp only, where each block's count is a constant of one of two
        # copies of the pipeline, see kernel.body)
        self.trips, self.extra = kb.k_tiles(problem) // kb.split_k, kb.longer_splits(problem)
        # split_wait: the short splits come first, so that the last split (which waits) is a long one
        self.short = kb.split_k - self.extra if kb.split_wait else 0
        # Zero points: every k-tile's stage brings its group's zero-point row beside the scale row, and
        # the decode takes z off the codes where the symmetric one takes 8 (code - z, then scaled unless
        # scale_on_acc); channelwise ones are then one group like any other, their scales in the decode
        # rather than on the final sums.
        self.zp = problem.zero_points
        self.grouped = not problem.channelwise or self.zp
        self.scale_rows = 2 if self.zp else 1      # rows of a k-tile's scales (and zero points) in S
        self.grid_n = problem.n // self.bn
        self.ab = "e4m3" if self.fp8 else mma_operand_dtype(problem.dtype)
        self.decode, self.decode_scaled = dequant_function_names(problem.dtype, problem.bits, operand="a")
        # offset_decode: the codes as e4m3 bytes, the offset corrected from the start (correction.py)
        self.offset = kb.offset_decode
        if self.fp8:
            self.decode = fp8_decode_name(problem.bits, offset=self.offset)
        self.zero = zero_decode(problem.dtype, problem.bits)
        self.cluster = kb.cluster_reduce     # the splits add their tiles through distributed shared memory
        self.release = kb.release_barriers   # stages freed by per-stage barriers, not a block barrier
        self.producer = kb.producer_warp     # ... and refilled by a warp of their own
        # scale_on_acc: acc holds the running sums, then one k-tile's wgmma sums; sc two sets of scales
        # (by the k-tile's parity), since k-tile t - 1's fold comes after k-tile t's words and scales
        # are read. fold_lag: two sets of k-tile sums by parity, k-tile t's folded while k-tile t + 1's
        # wgmmas run.
        self.sacc, self.lag = kb.scale_on_acc, kb.fold_lag
        self.per_w = self.word_rows * self.g     # packed words per lane and stage
        self.per_s = 2 * self.g              # group scales per lane and stage: rows g and g + 8 of each group
        # sc holds per_s scales, then with scale_on_acc the other k-tile's; with zero points then from
        # zp_at the k-tile's subtrahends (scale_on_acc, templates.zero_decode: `per_zero` halves per
        # group) or offsets (per_s, as the scales), and from z_at its zero points (per_s)
        self.zp_at = self.per_s * (2 if self.sacc else 1)
        self.per_zero = self.zero.halves if self.sacc else 2
        self.z_at = self.zp_at + self.g * self.per_zero
        self.sc_len = self.z_at + self.per_s if self.zp else self.zp_at
        # decoded 16-bit units per lane and stage: 4 registers per wgmma k-step and group (16 halves,
        # or 32 e4m3 from two words)
        self.a_len = self.steps * self.g * 8
        self.acc_len = self.g * self.bm // 2  # fp32 sums: `groups` wgmma m64n{bm} accumulators
        self.acc_all = self.acc_len * (3 if self.lag else 2 if self.sacc else 1)
        self.wgmma_shape = f"m64n{self.bm}k{32 if self.fp8 else 16}"
        x_bytes = 1 if self.fp8 else 2
        self.atoms = self.bk * x_bytes // 128    # [block_m, 128-byte] swizzled tiles per stage, along K
        self.stage_units = self.bm * self.bk * x_bytes // 16
        # fp8_rounded: each landed stage's activations rounded to their FP8 values in place by the
        # consumers (schedules/fp8_rounding.py), who then meet before its wgmmas
        self.round_fp8 = problem.rounds_fp8
        self.round_stage = round_chunks_call(problem.dtype, self.stage_units, self.consumers)
        self.out_chunks = self.bm * self.bn // 8     # 16-byte chunks of the output tile (staged_store)
        self.out_rounds = -(-self.out_chunks // self.consumers)
        self.split_k_prelude = split_k_prelude(self.bm, self.bn, kb.split_k, self.threads, problem.n,
                                               not self.grouped, self.cluster, kb.split_wait)
        self.wait_prior = wait_for_prior_grids(self.cluster, kb.pdl)
        self.store_split = store_tile(self.bm, self.bn, self.grid_n, kb.split_k, self.dtype, not self.grouped,
                                      cluster=self.cluster) if kb.split_k > 1 else None
        self.store_split_wait = store_tile_split_wait(self.bm, self.bn, kb.split_k, problem.n, not self.grouped) \
            if kb.split_wait else None

    def weight_col(self, bx, wg, wq, lane, i, h):
        """Output column of a lane's fragment row h (g or g + 8) of group i."""
        g = self.g
        slab = (wq * g + i) // 4
        return (bx * self.bn + wg * SLAB_N * g + slab * SLAB_N + slab_quarter(wq, lane, i, g, self.kb.rotate) * 16 +
                lane // 4 + 8 * h)

    def fragment_element(self, by, bx, wg, wq, lane, i, c, e):
        """(row of C, column of C, index in acc) of a lane's accumulator element e of row block c of
        group i: the wgmma's C^T fragment, transposed back."""
        row = by * self.bm + 8 * c + 2 * (lane % 4) + e % 2
        return row, self.weight_col(bx, wg, wq, lane, i, e // 2), i * (self.bm // 2) + c * 4 + e

    def fragment_slot(self, u):
        """K-step u's fragments within their buffer (ring = D: slot u % D of D)."""
        return u % self.kb.ring if self.kb.ring else u

    def x_offset(self, u):
        """K-step u's activations from its stage's start, in 16-byte units: a k-step is 32 bytes
        (16 halves or 32 e4m3), four to a 128-byte swizzle atom; the steps of a second atom (fp16
        block_k 128) start block_m rows of 128 bytes later."""
        return u // 4 * (self.bm * 64 * 2 // 16) + u % 4 * STEP_UNITS

    def output_value(self, total, S, col):
        """An output element from its fp32 sum: group scales are in the sums already, channelwise ones
        come here."""
        return T.cast(total if self.grouped else total * T.cast(S[0, col], "float32"), self.dtype)

    def in_producer_warp(self):
        """producer_warp: whether this thread's warp is the producer (a warp-uniform condition)."""
        return T.call_extern("int32", "tm_warp_index") >= self.consumers // 32


@dataclass
class Buffers:
    """A block's tensors (A [M, K], packed B, scales S, C, and for split-K the workspace and tile
    counters), shared stages (X_s activations, W_s packed words, S_s scale rows, Y_s staged_store's
    tile), stage barriers and registers (w words, sc scales, a A fragments, acc sums, desc the wgmma
    descriptor), and W4A8's, handed to the macros as one argument."""
    A: object
    B: object
    S: object
    C: object
    ws: object
    counters: object
    X_s: object
    full: object
    empty: object
    W_s: object
    S_s: object
    w: object
    sc: object
    a: object
    acc: object
    desc: object
    Y_s: object
    TS: object = None     # W4A8: the activations' token scales [M, 1] fp32
    KS: object = None     # W4A8: the activations' k-tile sums [M, K / 128] fp32 (correction.py)
    KS_s: object = None   # ... the correction's B tile and its descriptor
    ks_desc: object = None
