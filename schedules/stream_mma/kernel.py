"""Small-M W4A16 as per-warp weight streams: each warp moves its own batches of packed weights from
global memory into registers, decodes them there and meets the activations in swapped tensor-core
MMAs (C^T = W^T X^T); the warps of a block meet only at the end.

Why it looks the way it does:
- At M <= 16 the kernel only has to move weight bytes as fast as HBM delivers them. A block-wide
  cp.async pipeline (marlin_mma) ends every k-tile in barriers, so one SM's warps wait on each other
  and pull a fraction of their share of the bandwidth. Here every warp streams its own batches of
  `unroll` k-steps and never waits for another warp until the very end, `ahead` batches in flight
  while one is decoded: a warp hides its own DRAM latency instead of relying on enough other warps
  (small layers have too few to fill the SMs).
- Weights arrive by 16-byte loads that bypass L1 (`ld.global.nc.L1::no_allocate`, read once) into
  `ahead` register buffers, or (async_weights) by cp.async into the warp's own shared slots. ptxas
  tracks all of a loop's global loads into registers on one scoreboard, so the first decode after
  the next batch's loads waits for those too; cp.async groups are waited for one batch at a time.
- Operands are swapped: W^T is the MMA's A (16 weight columns x 16 k), the activations X^T its B
  (16 k x 8 rows of M). One 32-bit packed word of marlin_mma's layout is exactly a lane's A fragment
  of one 16x16 W^T tile (the decode only reorders its four outputs), so one word feeds one m16n8k16
  MMA per 8 rows of M: half the MMAs of the unswapped form, and M=1 pads to 8 rows, not 16.
- A lane's activation fragment (row g, k 2t..2t+1 and 2t+8..2t+9) is two 4-byte loads from global
  memory (L1/L2 hits: every block reads the same rows), or with x_ldmatrix one ldmatrix.x4 per two
  k-steps from the warp's own shared slots, filled by coalesced 16-byte cp.async (fewer load-pipe
  wavefronts at M >= 16). Rows past M only feed output columns that are never stored: the register
  loads repeat row M-1 (L1 hits), the shared slots are zero-filled (at M = 1 eight copies of one
  row, fetched by L2-only cp.async, were eight requests for the same lines from every warp); their
  copies allocate in L1, since the blocks of an SM read the same k-steps of A.
- W4A8 at small M (fp8_rounded problems) runs here too: each batch's activation registers are rounded
  to their FP8 values before its MMAs (schedules/fp8_rounding.py).
- Group scales multiply the decoded weights (one half2 multiply per pair), or with fold_zero_point
  the MMA gets raw magic-number codes while the offsets (magic number and zero point) come off each
  batch's sums before the scale: the kernel is bound by the SM's instructions, not by HBM
  (docs/performance.md, fold_zero_point). A batch never crosses a group (check()), so each batch
  loads one scale row. Channelwise scales scale the final fp32 sums.
- The block's warps add their sums in a shared fp32 tile, then the common epilogue stores it, with
  split-K through a global workspace when the output has too few tiles to occupy the GPU, or
  (cluster_reduce, sm_90) through the distributed shared memory of a cluster of the splits.
- Every barrier is explicit (TileLang's automatic insertion is off, PASS_CONFIGS in __init__.py): none
  inside the k-loop.

Where it is written: plan.py (the build-time constants and index maps), stream.py (the warps' loads
and early_start's prefetch), batch.py (one batch: slots to registers, decode, swapped MMAs, fold of
the sums), this file (the kernel: registers, the k-loop, the warps' sums, the store).
"""
# No `from __future__ import annotations`: T.prim_func evaluates the annotations below.

import tilelang.language as T

from templates import render_dequant

from ..epilogue import (CLUSTER_HELPERS, EARLY_START_HELPERS, split_k_prelude, store_tile,
                        w4a16_prim_func, wait_for_prior_grids)
from ..fp8_rounding import ROUND_PAIR
from ..marlin_mma.layout import SLAB_N
from ..problem import Problem
from .batch import batch_compute, sums_fold
from .knobs import Knobs
from .plan import Buffers, Plan
from .stream import STREAM_LOAD, batch_loads, start_early


def build(problem: Problem, knobs: Knobs):
    """The TileLang prim_func for `problem` with `knobs` (checked by knobs.check beforehand).

    Arguments as marlin_mma's: A [M, K], packed B [K/16, 2N] int32, scales [K/group, N] (with zero
    points [2K/group, N], each group's zero-point row after its scale row), C [M, N];
    with split_k > 1 also a zeroed fp32 workspace [M, N] and int32 tile counters.
    """
    plan = Plan(problem, knobs)
    kb = knobs
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    bm, bn, warps, ahead = plan.bm, plan.bn, plan.warps, plan.ahead
    prelude = (render_dequant(problem.dtype, problem.bits) + STREAM_LOAD + (ROUND_PAIR if plan.round_fp8 else "")
               + (CLUSTER_HELPERS if plan.cluster else "") + (EARLY_START_HELPERS if kb.early_start else "")
               + split_k_prelude(bm, bn, kb.split_k, kb.threads, problem.n, not plan.grouped, plan.cluster))
    wait_prior = wait_for_prior_grids(plan.cluster, kb.pdl)
    store = store_tile(bm, bn, plan.grid_n, kb.split_k, problem.dtype, not plan.grouped, cluster=plan.cluster)
    start, load, compute, fold_sums = start_early(plan), batch_loads(plan, m), batch_compute(plan), sums_fold(plan)
    allocate, clear, sum_warps = buffers(plan), registers_cleared(plan), warp_sums(plan)

    @T.macro
    def body(A, B, S, C, ws, counters):
        # cluster_reduce: the split_k blocks of an output tile form one cluster (along the grid's z).
        with T.Kernel(T.ceildiv(m, bm), plan.grid_n, kb.split_k, threads=kb.threads, prelude=prelude,
                      cluster_dims=(1, 1, kb.split_k) if plan.cluster else None) as (by, bx, bz):
            tx = T.get_thread_binding()
            lane = tx % 32
            wk = tx // 32
            g = lane // 4
            t = lane % 4
            # Batches go round-robin over all warps of all splits of this output tile.
            first = bz * warps + wk
            if kb.early_start:
                start(B, S, bx, lane, first)
            wait_prior()
            bufs = allocate(A, B, S)
            clear(bufs)

            for p in T.unroll(ahead - 1):
                load(bufs, p, p, p * plan.workers + first, by, bx, lane, wk, g, t)
            # The loop is unrolled by `ahead`, so that every register buffer has constant indices and
            # none is ever copied: copying a buffer whose loads are in flight would wait for them, and
            # `ahead` would buy nothing. Batches past the end are no-ops.
            for it0 in T.serial(-(-plan.trips // ahead)):
                for r in T.unroll(ahead):
                    it = it0 * ahead + r
                    load(bufs, (r + ahead - 1) % ahead, (it + ahead - 1) % ahead,
                         (it + ahead - 1) * plan.workers + first, by, bx, lane, wk, g, t)
                    compute(bufs, r, it % ahead, it * plan.workers + first, lane, wk)
            if plan.lag:
                # The last trip's last batch (r = ahead - 1, odd) left its sums in set 1; set 0 is folded.
                fold_sums(bufs, bufs.lag_scale, plan.acc_len, plan.off_len, plan.per_s)

            if kb.late_trigger:
                T.call_extern("handle", "tm_launch_dependents")     # the weight stream is done
            sum_warps(bufs, wk, g, t)
            T.sync_threads()
            store(bufs.C_s, C, S, ws, counters, m, by, bx, tx)

    return w4a16_prim_func(body, m, tiles, problem.n, problem.k, problem.scale_rows, problem.dtype,
                           workspace=plan.split)


def buffers(plan: Plan):
    """A T.macro(A, B, S) that allocates the block's shared memory and the thread's registers and
    returns them with the tensors as Buffers (None for those that the knobs leave unused)."""
    kb, dtype, warps, ahead, w_smem = plan.knobs, plan.dtype, plan.warps, plan.ahead, plan.w_smem

    @T.macro
    def allocate(A, B, S):
        C_s = T.alloc_shared((plan.bm, plan.bn), "float32")
        P_s = T.alloc_shared((warps, plan.bm, plan.bn), "float32") if kb.sum_slices else None
        # `ahead` register buffers: batch it + ahead - 1 loads while batch it is decoded.
        w = T.alloc_local((plan.w_bufs * plan.per_w,), "int32")
        W_s = T.alloc_shared((warps, ahead, plan.per_w * 32), "int32") if w_smem else None
        S_s = T.alloc_shared((warps, ahead, plan.scale_rows * SLAB_N), dtype) if w_smem else None
        x = T.alloc_local((plan.x_bufs * plan.per_x,), dtype)
        X_s = T.alloc_shared((warps + kb.pad_warps(plan.problem), ahead, plan.bm, plan.x_cols), dtype) \
            if plan.x_smem else None
        scale = T.alloc_local((plan.w_bufs * plan.per_s,), dtype)
        a = T.alloc_local((32,), dtype)
        acc = T.alloc_local((plan.acc_len * plan.sets,), "float32")
        total = T.alloc_local((plan.acc_len,), "float32") if plan.fold else None
        off = T.alloc_local((plan.off_len * plan.sets,), "float32")
        lag_scale = T.alloc_local((2 * plan.per_s,), dtype) if plan.lag else None
        a_off = T.alloc_local((8,), dtype)
        zero_offsets = T.alloc_local((plan.zero_offsets_len,), dtype) if plan.zero_offsets_len else None
        return Buffers(A=A, B=B, S=S, w=w, x=x, scale=scale, a=a, a_off=a_off, zero_offsets=zero_offsets, acc=acc,
                       off=off, total=total, lag_scale=lag_scale, W_s=W_s, S_s=S_s, X_s=X_s, C_s=C_s, P_s=P_s)

    return allocate


def registers_cleared(plan: Plan):
    """A T.macro(bufs) that zeroes the sums and sets fold_zero_point's constant A fragment."""
    acc_len, off_len, sets, per_s = plan.acc_len, plan.off_len, plan.sets, plan.per_s

    @T.macro
    def clear(bufs):
        for i in T.serial(acc_len * sets):
            bufs.acc[i] = T.float32(0)
        if plan.fold:
            for i in T.serial(acc_len):
                bufs.total[i] = T.float32(0)
        for i in T.unroll(off_len * sets):
            bufs.off[i] = T.float32(0)
        if plan.lag:
            for i in T.unroll(2 * per_s):
                bufs.lag_scale[i] = T.cast(T.float32(0), plan.dtype)   # folded with zero sums before the first batch
        for i in T.unroll(8):
            # A registers 0-3 meet k % 16 < 8, registers 4-7 meet k % 16 >= 8; registers 2, 3, 6 and 7
            # are the fragment's rows g + 8, which with zero points sum the activations themselves.
            # (Converted from float: an int's conversion to bf16 rounds in CUDA's type, truncates in cutlass's.)
            if plan.zp:
                bufs.a_off[i] = T.cast(T.float32(1 if i % 4 >= 2 else plan.lo_off if i < 4 else plan.hi_off),
                                       plan.dtype)
            else:
                bufs.a_off[i] = T.cast(T.float32(plan.lo_off if i < 4 else plan.hi_off), plan.dtype)

    return clear


def warp_sums(plan: Plan):
    """A T.macro(bufs, wk, g, t) after the k-loop: the block's warps add their sums into the shared
    tile C_s, a warp at a time or (sum_slices) through a slice each; C_s is complete once the threads
    synchronize after it."""
    kb, m_tiles, warps = plan.knobs, plan.m_tiles, plan.warps
    acc_index, sums_position = plan.acc_index, plan.sums_position

    @T.macro
    def sum_warps(bufs, wk, g, t):
        # The first barrier also keeps a warp from writing shared memory while another still reads
        # activation slots that may share it.
        T.sync_threads()
        sums = bufs.total if plan.fold else bufs.acc
        if kb.sum_slices:
            # Every warp stores its sums into its own slice at once, then each thread adds one
            # element's slices: two barriers instead of warps + 1, no zeroing.
            for j in T.unroll(4):
                for mi in T.unroll(m_tiles):
                    for e in T.unroll(4):
                        row, col = sums_position(j, mi, e, g, t)
                        bufs.P_s[wk, row, col] = sums[acc_index(j, mi) + e]
            T.sync_threads()
            for i, j in T.Parallel(plan.bm, plan.bn):
                bufs.C_s[i, j] = sum(bufs.P_s[r, i, j] for r in range(warps))
        else:
            for i, j in T.Parallel(plan.bm, plan.bn):
                bufs.C_s[i, j] = T.float32(0)
            for r in T.serial(warps):
                T.sync_threads()
                if wk == r:
                    for j in T.unroll(4):
                        for mi in T.unroll(m_tiles):
                            for e in T.unroll(4):
                                row, col = sums_position(j, mi, e, g, t)
                                bufs.C_s[row, col] = bufs.C_s[row, col] + sums[acc_index(j, mi) + e]

    return sum_warps

