"""Where stream_wgmma's sums go after the k-loop.

Why it looks the way it does:
- split_k 1: every consumer thread stores its accumulator fragment to C as 2-byte elements
  (acc_to_global; the fragment is C^T's, so a warp store covers 4 rows x 16 bytes), or with
  staged_store through a shared tile of its own in C's row-major order, leaving as 16-byte chunks of
  whole rows: 8x fewer store instructions and no half-written 32-byte sectors (docs/performance.md,
  staged_store).
- split_k > 1: the block's fp32 tile goes to shared memory (acc_to_shared) and meets the other
  splits' through the common split-K epilogue of schedules/epilogue.py: a thread-block cluster's
  distributed shared memory (cluster_reduce), the fp32 workspace with a tile counter, or the
  workspace slots that the last split reads (split_wait).
"""
import tilelang.language as T

# staged_store: a 16-byte copy (the output tile's rows leave shared memory as whole 16-byte chunks).
COPY16 = r"""
__device__ __forceinline__ void tm_copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""
# staged_store: the named barrier (1; 0 is __syncthreads') that the consumer warpgroups alone meet at
# (the producer warp or warpgroup is elsewhere), with a memory clobber so that the compiler keeps the
# shared-memory stores and loads on their side of it (TileLang's partial barrier has none).
CONSUMERS_SYNC = r"""
__device__ __forceinline__ void tm_consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory");
}
"""


@T.macro
def acc_to_shared(plan, mem, C_s, wg, wq, lane):
    """split_k > 1: the lane's fp32 sums into the block's tile C_s."""
    acc = mem.acc
    for i in T.unroll(plan.g):
        for c in T.unroll(plan.bm // 8):
            for e in T.unroll(4):
                row, col, k = plan.fragment_element(0, 0, wg, wq, lane, i, c, e)
                C_s[row, col] = acc[k]


@T.macro
def acc_to_global(plan, mem, by, bx, wg, wq, lane):
    """The lane's sums to C (2-byte fragment stores, rows past m skipped)."""
    acc, C, S = mem.acc, mem.C, mem.S
    for i in T.unroll(plan.g):
        for c in T.unroll(plan.bm // 8):
            for e in T.unroll(4):
                row, col, k = plan.fragment_element(by, bx, wg, wq, lane, i, c, e)
                if row < plan.m:
                    C[row, col] = plan.output_value(acc[k], S, col)


@T.macro
def acc_to_global_staged(plan, mem, by, bx, tx, wg, wq, lane):
    """staged_store: the consumers put their sums (as the output dtype) into a padded tile of
    their own in C's row-major order (a warp's 2-byte stores span 4 rows 16 bytes wide, 8 banks
    apart), then store whole rows of 16-byte chunks. Only rows < m are converted: under that
    predicate ptxas keeps the conversions after the final wgmma wait; unconditional, it hoisted some
    above it and read accumulators still being written (tests/test_sass.py checks the order).
    TileLang may place Y_s over the drained activation stages (its liveness-based merge did on
    down_proj m128 two warpgroups, not on m256 setmaxnreg), which the other warpgroup's last wgmmas
    may still be reading: the consumers meet before anyone writes."""
    bm, bn, m, consumers = plan.bm, plan.bn, plan.m, plan.consumers
    acc, Y_s, C, S = mem.acc, mem.Y_s, mem.C, mem.S
    T.call_extern("handle", "tm_consumers_sync", consumers)
    for i in T.unroll(plan.g):
        for c in T.unroll(bm // 8):
            for e in T.unroll(4):
                row, col, k = plan.fragment_element(0, 0, wg, wq, lane, i, c, e)     # within the tile
                if by * bm + row < m:
                    Y_s[row, col] = plan.output_value(acc[k], S, bx * bn + col)
    T.call_extern("handle", "tm_consumers_sync", consumers)
    for r in T.unroll(plan.out_rounds):
        chunk = r * consumers + tx
        row = chunk // (bn // 8)
        col = chunk % (bn // 8) * 8
        if chunk < plan.out_chunks and by * bm + row < m:
            T.call_extern("handle", "tm_copy16", T.access_ptr(C[by * bm + row, bx * bn + col], "w", 8),
                          T.access_ptr(Y_s[row, col], "r", 8))


@T.macro
def store_sums(plan, mem, by, bx, tx, wg, wq, lane):
    """A consumer thread's part of storing the block's tile (split_k 1)."""
    if plan.kb.staged_store:
        acc_to_global_staged(plan, mem, by, bx, tx, wg, wq, lane)
    else:
        acc_to_global(plan, mem, by, bx, wg, wq, lane)
