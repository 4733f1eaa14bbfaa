"""The warps' streams: each warp issues the loads of its own batches (weights, activations, the group's
scale row) `ahead` batches before it decodes them, and never waits for another warp. Weights go into
register buffers with 16-byte loads that bypass L1, or (async_weights) into the warp's shared slots
by cp.async like the activations (x_ldmatrix); early_start asks L2 for the first batches' weights
before the kernel waits for the previous one."""
# No `from __future__ import annotations`: TileLang macros evaluate their annotations.

import tilelang.language as T

from ..marlin_mma.layout import SLAB_N, TILE_K
from .knobs import MMA_N
from .plan import Plan

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


def batch_loads(plan: Plan, m):
    """A T.macro(bufs, buf, slot, batch, by, bx, lane, wk, g, t) that issues the loads of `batch` into
    register buffer `buf` (and, with x_ldmatrix, the activations into shared slot `slot` of warp wk);
    nothing waits for them there. `m` is the kernel's dynamic M."""
    bm, unroll, m_tiles = plan.bm, plan.unroll, plan.m_tiles
    per_w, per_x, per_s = plan.per_w, plan.per_x, plan.per_s
    group, x_index, scale_col = plan.problem.group, plan.x_index, plan.scale_col

    @T.macro
    def load(bufs, buf, slot, batch, by, bx, lane, wk, g, t):
        if batch < plan.batches:
            kt0 = batch * unroll
            for u in T.unroll(unroll):
                if plan.w_smem:
                    # The lane's own 16 bytes into its own place of the warp's slot.
                    T.ptx_cp_async(T.access_ptr(bufs.W_s[wk, slot, u * 128 + lane * 4], "w", 4),
                                   T.access_ptr(bufs.B[kt0 + u, bx * 128 + lane * 4], "r", 4), 4)
                else:
                    T.call_extern("handle", "tm_load_stream_16B",
                                  T.access_ptr(bufs.B[kt0 + u, bx * 128 + lane * 4], "r"),
                                  T.access_ptr(bufs.w[buf * per_w + u * 4], "w"))
                if not plan.x_smem:
                    # A lane's B fragment of row g: two 4-byte loads per k-step and m-tile. Rows past M
                    # repeat row M - 1 (L1 hits); they only feed outputs that are never stored.
                    for mi in T.unroll(m_tiles):
                        row = T.min(by * bm + mi * MMA_N + g, m - 1)
                        for h in T.unroll(2):
                            for v in T.vectorized(2):
                                bufs.x[buf * per_x + x_index(u, mi) + h * 2 + v] = bufs.A[
                                    row, (kt0 + u) * TILE_K + 2 * t + 8 * h + v]
            if plan.x_smem:
                # The batch's rows of A as 16-byte chunks, coalesced: 2 * unroll chunks per row. Rows past
                # M are zero-filled, not read: at M = 1 every warp of the GPU asked L2 for the same few
                # lines 8 times over (1.6-2x slower than at M = 8).
                for c in T.unroll(plan.x_chunks):
                    r = (c * 32 + lane) // (2 * unroll)
                    col = (c * 32 + lane) % (2 * unroll) * 8
                    T.call_extern("handle", "tm_cp_async_l1_16B", T.access_ptr(bufs.X_s[wk, slot, r, col], "w", 8),
                                  T.access_ptr(bufs.A[T.min(by * bm + r, m - 1), kt0 * TILE_K + col], "r", 8),
                                  by * bm + r < m)
            row = kt0 * TILE_K // group * plan.scale_rows     # the group's scale row (and zero-point row after it)
            if plan.grouped and plan.w_smem:
                # The block's scale row of the batch's group: 8 halves per lane, 8 lanes (with zero
                # points 8 more lanes bring the zero-point row).
                if lane < 8:
                    T.ptx_cp_async(T.access_ptr(bufs.S_s[wk, slot, lane * 8], "w", 8),
                                   T.access_ptr(bufs.S[row, bx * SLAB_N + lane * 8], "r", 8), 8)
                elif plan.zp and lane < 16:
                    T.ptx_cp_async(T.access_ptr(bufs.S_s[wk, slot, lane * 8], "w", 8),
                                   T.access_ptr(bufs.S[row + 1, bx * SLAB_N + (lane - 8) * 8], "r", 8), 8)
            elif plan.grouped:
                # Columns 16j + g and 16j + 8 + g of the slab: the scales of the lane's A rows.
                for v in T.unroll(8):
                    bufs.scale[buf * per_s + v] = bufs.S[row, bx * SLAB_N + scale_col(v, g)]
                    if plan.zp:
                        bufs.scale[buf * per_s + 8 + v] = bufs.S[row + 1, bx * SLAB_N + scale_col(v, g)]
        if plan.x_smem:
            T.ptx_commit_group()       # one group per batch, empty past the end, so waits count batches

    return load


def start_early(plan: Plan):
    """early_start: a T.macro(B, S, bx, lane, first) for before the wait for the previous kernel. Unless
    late_trigger, it lets the next kernel launch at once; each warp (its first batch `first`) asks L2
    for the weights and scale rows of its first early_start batches, which no earlier kernel writes."""
    kb, unroll, group = plan.knobs, plan.unroll, plan.problem.group

    @T.macro
    def start(B, S, bx, lane, first):
        if not kb.late_trigger:
            T.call_extern("handle", "tm_launch_dependents")
        for p in T.unroll(kb.early_start):
            batch = p * plan.workers + first
            if batch < plan.batches:
                # A batch is `unroll` rows of 512 bytes (one lane's 16 bytes each) and one scale row; a
                # lane each.
                if lane < unroll:
                    T.call_extern("handle", "tm_prefetch_l2", T.access_ptr(B[batch * unroll + lane, bx * 128], "r"),
                                  512)
                elif plan.grouped and lane == 31:
                    T.call_extern("handle", "tm_prefetch_l2",
                                  T.access_ptr(S[batch * unroll * TILE_K // group * plan.scale_rows, bx * SLAB_N], "r"),
                                  SLAB_N * 2)
                elif plan.zp and lane == 30:     # the zero-point row
                    T.call_extern("handle", "tm_prefetch_l2",
                                  T.access_ptr(S[batch * unroll * TILE_K // group * 2 + 1, bx * SLAB_N], "r"),
                                  SLAB_N * 2)

    return start
