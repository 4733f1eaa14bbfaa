"""Small-M W4A16 without shared-memory operands: weights stream from global memory straight into
registers and meet the activations in swapped tensor-core MMAs (C^T = W^T X^T).

Why it looks the way it does:
- At M <= 16 the kernel only has to move weight bytes as fast as HBM delivers them. A block-wide
  cp.async pipeline (marlin_mma) ends every k-tile in barriers, so one SM's warps wait on each other
  and pull a fraction of their share of the bandwidth. Here every warp streams its own batches of
  `unroll` k-steps with 16-byte loads that bypass L1 (`ld.global.nc.L1::no_allocate`, read once) and
  never waits for another warp until the very end. `ahead` register buffers keep the next batches'
  loads in flight while one is decoded: a warp then hides its own DRAM latency instead of relying
  on enough other warps (small layers have too few to fill the SMs).
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
- Group scales multiply the decoded weights (one half2 multiply per pair); with scale_on_acc they
  scale each batch's fp32 sums instead, and with fold_zero_point the MMA gets raw magic-number codes
  while the offsets (magic number and zero point) come off each batch's sums before the scale: the
  kernel is bound by the SM's instructions, not by HBM (docs/perf-notes.md v6, v7). A batch never
  crosses a group (check()), so each batch loads one scale row. Channelwise scales scale the final
  fp32 sums.
- The block's warps add their sums in a shared fp32 tile, then the common epilogue stores it, with
  split-K through a global workspace when the output has too few tiles to occupy the GPU, or
  (cluster_reduce, sm_90) through the distributed shared memory of a cluster of the splits.
- Every barrier is explicit (TileLang's automatic insertion is off): none inside the k-loop.
"""
# No `from __future__ import annotations`: T.prim_func evaluates the annotations below.

import tilelang.language as T

from templates import dequant_function_names, mma_operand_dtype, raw_decode, render_dequant

from ..epilogue import (CLUSTER_HELPERS, EARLY_START_HELPERS, split_k_prelude, store_tile,
                        w4a16_prim_func, wait_for_prior_grids)
from ..marlin_mma.layout import SLAB_N, TILE_K
from ..problem import Problem
from .knobs import MMA_N, Knobs

# Weights are read exactly once: 16-byte non-coherent loads that do not allocate in L1. Activations
# (x_ldmatrix) are read by every block of an SM for the same k-steps: their cp.async allocates in L1
# (.ca; TileLang's 16-byte cp.async is .cg, L2 only), and rows past M are zero-filled, not read.
STREAM_LOAD = r"""
__device__ __forceinline__ void tm_load_stream_16B(const void* src, void* dst) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(src));
}
__device__ __forceinline__ void tm_cp_async_l1_16B(void* dst, const void* src, bool row_exists) {
  unsigned slot = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(slot), "l"(src), "r"(row_exists ? 16 : 0) : "memory");
}
"""


def build(problem: Problem, knobs: Knobs):
    """The TileLang prim_func for `problem` with `knobs` (checked by knobs.check beforehand).

    Arguments as marlin_mma's: A [M, K], packed B [K/16, 2N] int32, scales [K/group, N], C [M, N];
    with split_k > 1 also a zeroed fp32 workspace [M, N] and int32 tile counters.
    """
    n, k, group, dtype = problem.n, problem.k, problem.group, problem.dtype
    kb = knobs
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    bm, bn = kb.block_m, kb.block_n
    m_tiles, slabs, unroll, warps, ahead = kb.m_tiles, kb.slabs, kb.unroll, kb.warps, kb.ahead
    batches = kb.batches(problem)
    workers = kb.split_k * warps
    trips = -(-batches // workers)
    grouped = not problem.channelwise
    sacc = kb.scale_on_acc
    fold = kb.fold_zero_point
    # Each batch's fp32 sums are folded into a running total: with the group scale (scale_on_acc), or
    # less the offsets (fold_zero_point; also channelwise, so that no sum grows to K * 1032 * |x|).
    batch_sums = (grouped and sacc) or fold
    scale_weights = grouped and not batch_sums
    acc_len = slabs * 4 * m_tiles * 4
    # fold_lag: batch b's sums are folded while batch b + 1's MMAs run, from a second set of sums (and of
    # offsets and scales); the unroll by `ahead` (even: check()) makes each batch's set a constant.
    lag = kb.fold_lag
    sets = 2 if lag else 1
    off_len = m_tiles * 4
    split = kb.uses_workspace            # split-K through the global workspace
    cluster = kb.cluster_reduce
    grid_n = n // bn
    mma_dtype = mma_operand_dtype(dtype)
    decode, decode_scaled = dequant_function_names(dtype, problem.bits, operand="a")
    decode_raw, lo_magic, hi_magic = raw_decode(dtype, problem.bits)
    # fold_zero_point: the MMA sees (lo_magic + code) on pairs 0/2 (k % 16 < 8) and (hi_magic + code)
    # on pairs 1/3, so every product carries an offset that does not depend on the weight column: per
    # row of M it is lo_off * sum(x, k % 16 < 8) + hi_off * sum(x, k % 16 >= 8) with the zero point 8
    # included, which one more MMA per k-step computes from a constant A fragment.
    lo_off, hi_off = lo_magic + 8, hi_magic + 8
    prelude = (render_dequant(dtype, problem.bits) + STREAM_LOAD
               + (CLUSTER_HELPERS if cluster else "") + (EARLY_START_HELPERS if kb.early_start else "")
               + split_k_prelude(bm, bn, kb.split_k, kb.threads, problem.n, problem.channelwise, cluster))
    wait_prior = wait_for_prior_grids(cluster, kb.pdl)
    store = store_tile(bm, bn, grid_n, kb.split_k, dtype, problem.channelwise, cluster=cluster)

    def acc_index(sj, j, mi):
        return ((sj * 4 + j) * m_tiles + mi) * 4

    def sums_position(sj, j, mi, e, g, t):
        """Where sum e of a lane's C^T fragment (16 columns of slab sj, m-tile mi) goes in the block
        tile: row (of M) 2t + e % 2 of the m-tile, column (weight column) 16j + g, + 8 for e >= 2."""
        return mi * MMA_N + 2 * t + e % 2, sj * SLAB_N + j * 16 + g + 8 * (e // 2)

    def x_index(u, mi):
        """First of the 4 halves (b0..b3) of k-step u, m-tile mi: m-tile-major, so that one ldmatrix.x4
        fills two consecutive k-steps."""
        return (mi * unroll + u) * 4

    def scale_col(sj, v, g):
        """Column, within the block, of a lane's scale v of slab sj: 16 (v // 2) + g, + 8 for odd v (the
        lane's A rows of each 16-column group)."""
        return sj * SLAB_N + (v // 2) * 16 + (v % 2) * 8 + g

    x_smem = kb.x_ldmatrix
    w_smem = kb.async_weights                # implies x_smem (check): every load of the k-loop is a cp.async
    per_w, per_x, per_s = unroll * slabs * 4, unroll * m_tiles * 4, slabs * 8
    w_bufs = 1 if w_smem else ahead          # async_weights: the shared slots hold the batches in flight
    x_bufs = 1 if x_smem else ahead          # x_ldmatrix: activations wait in shared memory instead
    x_cols = TILE_K * unroll + 8             # padded rows: ldmatrix's 8 row addresses hit 8 bank groups
    x_chunks = MMA_N * m_tiles * TILE_K * unroll // 8 // 32      # 16-byte cp.async per lane per batch

    @T.macro
    def load(A, B, S, w, x, scale, X_s, W_s, S_s, buf, slot, batch, by, bx, lane, wk, g, t):
        """Issue the loads of `batch` into register buffer `buf` (and, with x_ldmatrix, the activations
        into shared slot `slot` of this warp); nothing waits for them here."""
        if batch < batches:
            kt0 = batch * unroll
            for u in T.unroll(unroll):
                for sj in T.unroll(slabs):
                    if w_smem:
                        # The lane's own 16 bytes into its own place of the warp's slot.
                        T.ptx_cp_async(T.access_ptr(W_s[wk, slot, (u * slabs + sj) * 128 + lane * 4], "w", 4),
                                       T.access_ptr(B[kt0 + u, (bx * slabs + sj) * 128 + lane * 4], "r", 4), 4)
                    else:
                        T.call_extern("handle", "tm_load_stream_16B",
                                      T.access_ptr(B[kt0 + u, (bx * slabs + sj) * 128 + lane * 4], "r"),
                                      T.access_ptr(w[buf * per_w + (u * slabs + sj) * 4], "w"))
                if not x_smem:
                    for mi in T.unroll(m_tiles):
                        row = T.min(by * bm + mi * MMA_N + g, m - 1)
                        for h in T.unroll(2):
                            for v in T.vectorized(2):
                                x[buf * per_x + x_index(u, mi) + h * 2 + v] = A[row, (kt0 + u) * TILE_K + 2 * t + 8 * h + v]
            if x_smem:
                # The batch's rows of A as 16-byte chunks, coalesced: 2 * unroll chunks per row. Rows past
                # M are zero-filled, not read: at M = 1 every warp of the GPU asked L2 for the same few
                # lines 8 times over (1.6-2x slower than at M = 8, perf-notes v35).
                for c in T.unroll(x_chunks):
                    r = (c * 32 + lane) // (2 * unroll)
                    col = (c * 32 + lane) % (2 * unroll) * 8
                    T.call_extern("handle", "tm_cp_async_l1_16B", T.access_ptr(X_s[wk, slot, r, col], "w", 8),
                                  T.access_ptr(A[T.min(by * bm + r, m - 1), kt0 * TILE_K + col], "r", 8),
                                  by * bm + r < m)
            if grouped and w_smem:
                # The block's scale row of the batch's group: 8 halves per lane, slabs * 8 lanes.
                if lane < slabs * 8:
                    T.ptx_cp_async(T.access_ptr(S_s[wk, slot, lane * 8], "w", 8),
                                   T.access_ptr(S[kt0 * TILE_K // group, bx * slabs * SLAB_N + lane * 8], "r", 8), 8)
            elif grouped:
                # Columns 16j + g and 16j + 8 + g of each slab: the scales of the lane's A rows.
                for sj in T.unroll(slabs):
                    for v in T.unroll(8):
                        scale[buf * per_s + sj * 8 + v] = S[kt0 * TILE_K // group, bx * slabs * SLAB_N + scale_col(sj, v, g)]
        if x_smem:
            T.ptx_commit_group()       # one group per batch, empty past the end, so waits count batches

    @T.macro
    def offsets(x, a_off, off, xb, u, ob):
        """fold_zero_point: k-step u's activations against the constant A fragment, into the offsets'
        sums (set `ob`)."""
        for mi in T.unroll(m_tiles):
            T.ptx_mma("float32", "m16n8k16", "row", "col", mma_dtype, mma_dtype, "fp32",
                      a_off.data, 0, x.data, xb + x_index(u, mi), off.data, ob + mi * 4, False)

    @T.macro
    def accumulate(a, x, acc, xb, u, sj, j, mi, ab):
        """Word j of slab sj (decoded into a) against k-step u of m-tile mi, into its sum (set `ab`)."""
        T.ptx_mma("float32", "m16n8k16", "row", "col", mma_dtype, mma_dtype, "fp32",
                  a.data, j * 8, x.data, xb + x_index(u, mi), acc.data, ab + acc_index(sj, j, mi), False)

    @T.macro
    def fold_sums(acc, off, total, scale, ab, ob, sb):
        """Add one batch's sums (set ab / ob) less the offsets, times its group's scales (from sb), to the
        running total."""
        for sj in T.unroll(slabs):
            for j in T.unroll(4):
                for mi in T.unroll(m_tiles):
                    for e in T.unroll(4):
                        i = acc_index(sj, j, mi) + e
                        part = acc[ab + i] - off[ob + mi * 4 + e] if fold else acc[ab + i]
                        if grouped:
                            total[i] = total[i] + part * T.cast(scale[sb + sj * 8 + 2 * j + e // 2], "float32")
                        else:
                            total[i] = total[i] + part

    @T.macro
    def compute(w, x, scale, a, a_off, acc, off, total, lag_scale, X_s, W_s, S_s, buf, slot, batch, lane, wk):
        """Decode and multiply the batch in register buffer `buf` (activations, and with async_weights
        the weights and scales too: shared slot `slot`); with fold_lag, fold the previous batch's sums."""
        wb, sb = (0, 0) if w_smem else (buf * per_w, buf * per_s)
        cur = buf % 2 if lag else 0           # this batch's set of sums; the previous batch's is 1 - cur
        ab, ob = cur * acc_len, cur * off_len
        xb = 0 if x_smem else buf * per_x        # x_ldmatrix: one x buffer, filled here
        if x_smem:
            T.ptx_wait_group(ahead - 1)                # this batch's chunks have landed ...
            T.call_extern("handle", "__syncwarp")      # ... for every lane of the warp
        if batch < batches:
            if w_smem:
                for i in T.unroll(per_w // 4):
                    for v in T.vectorized(4):
                        w[i * 4 + v] = W_s[wk, slot, i * 128 + lane * 4 + v]
                if grouped:
                    for sj in T.unroll(slabs):
                        for v in T.unroll(8):
                            scale[sj * 8 + v] = S_s[wk, slot, scale_col(sj, v, lane // 4)]
            if x_smem:
                # Matrices: rows of m-tile mi x k 0-7, 8-15 of step u, then of step u + 1: b0b1, b2b3 twice.
                for mi in T.unroll(m_tiles):
                    for u in T.unroll(unroll // 2):
                        T.ptx_ldmatrix(False, 4,
                                       T.access_ptr(X_s[wk, slot, mi * MMA_N + lane % 8, u * 32 + (lane // 8) * 8], "r"),
                                       T.access_ptr(x[xb + x_index(2 * u, mi)], "w"))
            if batch_sums and not lag:        # fold_lag zeroes a set right after folding it
                for i in T.unroll(acc_len):
                    acc[i] = T.float32(0)
                if fold:
                    for i in T.unroll(off_len):
                        off[i] = T.float32(0)
            for u in T.unroll(unroll):
                if fold:
                    offsets(x, a_off, off, xb, u, ob)
                for sj in T.unroll(slabs):
                    for j in T.unroll(4):
                        if fold:
                            T.call_extern("handle", decode_raw, T.access_ptr(w[wb + (u * slabs + sj) * 4 + j], "r"),
                                          T.access_ptr(a[j * 8], "w"))
                        elif scale_weights:
                            T.call_extern("handle", decode_scaled, T.access_ptr(w[wb + (u * slabs + sj) * 4 + j], "r"),
                                          T.access_ptr(scale[sb + sj * 8 + 2 * j], "r"), T.access_ptr(a[j * 8], "w"))
                        else:
                            T.call_extern("handle", decode, T.access_ptr(w[wb + (u * slabs + sj) * 4 + j], "r"),
                                          T.access_ptr(a[j * 8], "w"))
                        for mi in T.unroll(m_tiles):
                            accumulate(a, x, acc, xb, u, sj, j, mi, ab)
            if batch_sums and not lag:
                # The batch lies in one group: its sums (less the offsets) take the group's scale once.
                fold_sums(acc, off, total, scale, 0, 0, sb)
            if lag and grouped:
                # The scales outlive the batch's buffer (the next load refills it): kept with its sums.
                for v in T.unroll(per_s):
                    lag_scale[cur * per_s + v] = scale[sb + v]
        if lag:
            # The previous batch's sums: its MMAs were issued a batch ago, so the fold does not wait for
            # them and runs under this batch's (a batch past the end folds the last one, or zeros).
            fold_sums(acc, off, total, lag_scale, (1 - cur) * acc_len, (1 - cur) * off_len, (1 - cur) * per_s)
            for i in T.unroll(acc_len):
                acc[(1 - cur) * acc_len + i] = T.float32(0)
            for i in T.unroll(off_len):
                off[(1 - cur) * off_len + i] = T.float32(0)
        if x_smem:
            T.call_extern("handle", "__syncwarp")      # the slot is read before a later batch refills it

    @T.macro
    def body(A, B, S, C, ws, counters):
        # cluster_reduce: the split_k blocks of an output tile form one cluster (along the grid's z).
        with T.Kernel(T.ceildiv(m, bm), grid_n, kb.split_k, threads=kb.threads, prelude=prelude,
                      cluster_dims=(1, 1, kb.split_k) if cluster else None) as (by, bx, bz):
            tx = T.get_thread_binding()
            lane = tx % 32
            wk = tx // 32
            g = lane // 4
            t = lane % 4
            # Batches go round-robin over all warps of all splits of this output tile.
            first = bz * warps + wk
            if kb.early_start:
                if not kb.late_trigger:
                    T.call_extern("handle", "tm_launch_dependents")
                for p in T.unroll(kb.early_start):
                    batch = p * workers + first
                    if batch < batches:
                        # A batch is `unroll` rows of 512 bytes per slab (one lane's 16 bytes each) and
                        # one scale row; a lane each.
                        if lane < unroll * slabs:
                            T.call_extern("handle", "tm_prefetch_l2",
                                          T.access_ptr(B[batch * unroll + lane // slabs,
                                                         (bx * slabs + lane % slabs) * 128], "r"), 512)
                        elif grouped and lane == 31:
                            T.call_extern("handle", "tm_prefetch_l2",
                                          T.access_ptr(S[batch * unroll * TILE_K // group, bx * slabs * SLAB_N], "r"),
                                          slabs * SLAB_N * 2)
            wait_prior()
            if kb.occupancy:
                # Cap registers so that occupancy // warps blocks fit per SM: warps hide latency.
                T.annotate_min_blocks_per_sm(kb.occupancy // warps)
            C_s = T.alloc_shared((bm, bn), "float32")
            P_s = T.alloc_shared((warps, bm, bn) if kb.sum_slices else (1, 1, 1), "float32")
            # `ahead` register buffers: batch it + ahead - 1 loads while batch it is decoded.
            w = T.alloc_local((w_bufs * per_w,), "int32")
            W_s = T.alloc_shared((warps, ahead, per_w * 32) if w_smem else (1, 1, 4), "int32")
            S_s = T.alloc_shared((warps, ahead, slabs * SLAB_N) if w_smem else (1, 1, 8), dtype)
            x = T.alloc_local((x_bufs * per_x,), dtype)
            X_s = T.alloc_shared((warps + kb.pad_warps, ahead if x_smem else 1, bm, x_cols), dtype)
            scale = T.alloc_local((w_bufs * per_s,), dtype)
            a = T.alloc_local((32,), dtype)
            acc = T.alloc_local((acc_len * sets,), "float32")
            total = T.alloc_local((acc_len if batch_sums else 1,), "float32")
            # fold_zero_point: the offsets' sums per m-tile (a C fragment: rows g and g + 8 alike)
            # and the constant A fragment that computes them.
            off = T.alloc_local((off_len * sets,), "float32")
            lag_scale = T.alloc_local((2 * per_s if lag else 1,), dtype)
            a_off = T.alloc_local((8,), dtype)

            for i in T.serial(acc_len * sets):
                acc[i] = T.float32(0)
            if batch_sums:
                for i in T.serial(acc_len):
                    total[i] = T.float32(0)
            for i in T.unroll(off_len * sets):
                off[i] = T.float32(0)
            if lag:
                for i in T.unroll(2 * per_s):
                    lag_scale[i] = T.cast(0, dtype)    # folded with zero sums before the first batch
            for i in T.unroll(8):
                # A registers 0-3 meet k % 16 < 8, registers 4-7 meet k % 16 >= 8.
                a_off[i] = T.cast(lo_off if i < 4 else hi_off, dtype)

            for p in T.unroll(ahead - 1):
                load(A, B, S, w, x, scale, X_s, W_s, S_s, p, p, p * workers + first, by, bx, lane, wk, g, t)
            # The loop is unrolled by `ahead`, so that every register buffer has constant indices and
            # none is ever copied: copying a buffer whose loads are in flight would wait for them
            # (the reason `ahead` > 1 never paid before, perf-notes v11). Batches past the end are no-ops.
            for it0 in T.serial(-(-trips // ahead)):
                for r in T.unroll(ahead):
                    it = it0 * ahead + r
                    load(A, B, S, w, x, scale, X_s, W_s, S_s, (r + ahead - 1) % ahead, (it + ahead - 1) % ahead,
                         (it + ahead - 1) * workers + first, by, bx, lane, wk, g, t)
                    compute(w, x, scale, a, a_off, acc, off, total, lag_scale, X_s, W_s, S_s, r, it % ahead,
                            it * workers + first, lane, wk)
            if lag:
                # The last trip's last batch (r = ahead - 1, odd) left its sums in set 1; set 0 is folded.
                fold_sums(acc, off, total, lag_scale, acc_len, off_len, per_s)

            if kb.late_trigger:
                T.call_extern("handle", "tm_launch_dependents")     # the weight stream is done
            # The block's warps add their sums into one shared tile, a warp at a time or (sum_slices)
            # through a slice each (the first barrier also keeps a warp from writing shared memory while
            # another still reads activation slots that may share it).
            T.sync_threads()
            sums = total if batch_sums else acc
            if kb.sum_slices:
                # Every warp stores its sums into its own slice at once, then each thread adds one
                # element's slices: two barriers instead of warps + 1, no zeroing.
                for sj in T.unroll(slabs):
                    for j in T.unroll(4):
                        for mi in T.unroll(m_tiles):
                            for e in T.unroll(4):
                                row, col = sums_position(sj, j, mi, e, g, t)
                                P_s[wk, row, col] = sums[acc_index(sj, j, mi) + e]
                T.sync_threads()
                for i, j in T.Parallel(bm, bn):
                    C_s[i, j] = sum(P_s[r, i, j] for r in range(warps))
            else:
                for i, j in T.Parallel(bm, bn):
                    C_s[i, j] = T.float32(0)
                for r in T.serial(warps):
                    T.sync_threads()
                    if wk == r:
                        for sj in T.unroll(slabs):
                            for j in T.unroll(4):
                                for mi in T.unroll(m_tiles):
                                    for e in T.unroll(4):
                                        row, col = sums_position(sj, j, mi, e, g, t)
                                        C_s[row, col] = C_s[row, col] + sums[acc_index(sj, j, mi) + e]
            T.sync_threads()
            store(C_s, C, S, ws, counters, m, by, bx, tx)

    return w4a16_prim_func(body, m, tiles, n, k, group, dtype, workspace=split)


PASS_CONFIGS = {
    # Hand-written register code throughout: no warp specialization, no TMA.
    "tl.disable_warp_specialized": True,
    "tl.disable_tma_lower": True,
    # Every barrier is written out: TileLang cannot see that x_ldmatrix's shared slots are private
    # to a warp and would put two block-wide barriers into every batch (the __syncwarp suffices).
    "tl.disable_thread_storage_sync": True,
}

