"""The producer side of the stream_wgmma pipeline: TMA fills each stage against its mbarrier.

Why it looks the way it does:
- One elected thread issues three TMA copies per k-tile (the activations as one or two [block_m,
  128-byte] boxes in the 128-byte swizzle, the block's packed words, its scale row, with zero points the scale
  and zero-point rows as one box) against the stage's "full"
  mbarrier: no copy instruction, address arithmetic or proxy fence is left in the consumers' k-loop.
- A stage is reused once its k-tile's wgmmas are done. Without release barriers a block barrier per
  k-tile says so, and one elected thread refills the freed stage right after it (load_tma). With
  release barriers every consumer thread arrives on the stage's "empty" mbarrier instead: warp 0
  (load_tma), or with producer_warp a warp of its own that does nothing else (produce, warp
  specialization), waits for it before the refill; the warpgroups no longer meet.
- The producer warp is told apart by a warp index made warp-uniform by a shuffle (WARP_INDEX):
  ptxas serializes every wgmma under a branch it cannot prove is taken by whole warps.
- early_start asks L2 for the block's first k-tiles before the wait for the previous kernel, so that
  the first TMA copies hit L2 (docs/performance.md, early_start).
"""
import tilelang.language as T

# The warp's index made warp-uniform by a shuffle (as CUTLASS does): ptxas serializes every wgmma
# under a branch it cannot prove is taken by whole warps (warning C7518: each wgmma waited for before
# the next), and a branch on threadIdx.x is such a branch.
WARP_INDEX = r"""
__device__ __forceinline__ int tm_warp_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 32, 0); }
"""


@T.macro
def copy_stage(plan, mem, tile, kt, by, bx, leaders):
    """K-tile kt's three copies into the stage of the block's k-tile number `tile`."""
    bm, bn, bk, steps, stages, group = plan.bm, plan.bn, plan.bk, plan.word_rows, plan.stages, plan.group
    A, B, S, X_s, W_s, S_s, full = mem.A, mem.B, mem.S, mem.X_s, mem.W_s, mem.S_s, mem.full
    if plan.atoms == 1:
        T.tma_copy(A[by * bm:(by + 1) * bm, kt * bk:(kt + 1) * bk], X_s[tile % stages, :, :],
                   barrier=full[tile % stages], leader_scope_threads=leaders)
    else:
        for h in range(plan.atoms):      # one box per 128-byte swizzle width (64 halves)
            T.tma_copy(A[by * bm:(by + 1) * bm, kt * bk + h * 64:kt * bk + (h + 1) * 64],
                       X_s[tile % stages, h, :, :], barrier=full[tile % stages], leader_scope_threads=leaders)
    T.tma_copy(B[kt * steps:(kt + 1) * steps, bx * 2 * bn:(bx + 1) * 2 * bn], W_s[tile % stages, :, :],
               barrier=full[tile % stages], leader_scope_threads=leaders)
    if plan.grouped:
        row = kt * bk // group * plan.scale_rows      # the group's scale row (and its zero-point row after it)
        T.tma_copy(S[row:row + plan.scale_rows, bx * bn:(bx + 1) * bn], S_s[tile % stages, :, :],
                   barrier=full[tile % stages], leader_scope_threads=leaders)


@T.macro
def load_tma(plan, mem, tile, k0, by, bx, tx):
    """Without a producer warp: k-tile `tile`'s three copies against the stage's barrier. With a block
    barrier per k-tile, one elected thread of the block issues them and every thread arrives (after
    that thread's own expect-tx, so the phase completes once all bytes have landed). With
    release_barriers only warp 0 produces: it waits until every thread has released the stage's
    previous k-tile, one lane issues, and lane 0 arrives."""
    stages, full, empty = plan.stages, mem.full, mem.empty
    if tile < plan.trips:
        kt = k0 + tile
        if plan.release:
            if tx < 32:
                if tile >= stages:
                    T.mbarrier_wait_parity(empty[tile % stages], (tile // stages - 1) % 2)
                copy_stage(plan, mem, tile, kt, by, bx, 32)
                T.call_extern("handle", "__syncwarp")     # the elected lane's expect-tx comes first
                if tx == 0:
                    T.barrier_arrive(full[tile % stages])
        else:
            copy_stage(plan, mem, tile, kt, by, bx, plan.threads)
            T.barrier_arrive(full[tile % stages])


@T.macro
def fill(plan, mem, k0, g, t, by, bx, tx):
    """The producer's k-tile t, number g of the block's sequence: wait for its stage's release (from
    the second round of the stages on), issue its copies, arrive."""
    stages = plan.stages
    if g >= stages:
        T.mbarrier_wait_parity(mem.empty[g % stages], (g // stages - 1) % 2)
    copy_stage(plan, mem, g, k0 + t, by, bx, 32)
    T.call_extern("handle", "__syncwarp")
    if tx == plan.consumers:
        T.barrier_arrive(mem.full[g % stages])


@T.macro
def produce(plan, mem, k0, count, by, bx, tx):
    """producer_warp: the extra warp fills every stage as soon as the consumers have released its
    previous k-tile; one lane issues the three copies, lane 0 arrives after the warp's expect-tx.
    With stage_unroll (not setmaxnreg's producer warpgroup) the loop runs whole rounds of the stages,
    so that every stage index in it is a constant."""
    stages = plan.stages
    if plan.kb.stage_unroll and not plan.kb.setmaxnreg:
        lead = count % stages   # k-tiles before the loop, which then runs whole rounds of the stages
        for t in T.unroll(lead):
            fill(plan, mem, k0, t, t, by, bx, tx)
        for t0 in T.serial(count // stages):
            for r in T.unroll(stages):
                fill(plan, mem, k0, lead + t0 * stages + r, lead + t0 * stages + r, by, bx, tx)
    else:
        for t in T.serial(count):
            fill(plan, mem, k0, t, t, by, bx, tx)


@T.macro
def start_early(plan, B, S, bx, k0):
    """early_start: let the next kernel launch, and ask L2 for the packed rows (8 * block_n bytes
    each, consecutive k-steps) and scale rows of this block's first k-tiles (from k-tile k0), a lane
    each."""
    steps, bn = plan.word_rows, plan.bn
    lane = T.get_thread_binding() % 32
    T.call_extern("handle", "tm_launch_dependents")
    if T.get_thread_binding() < 32:
        rows = plan.kb.early_start * steps
        if lane < rows:
            T.call_extern("handle", "tm_prefetch_l2", T.access_ptr(B[k0 * steps + lane, bx * 2 * bn], "r"),
                          8 * bn)
        elif plan.grouped and lane < rows + plan.kb.early_start * plan.scale_rows:
            j, r = (lane - rows) // plan.scale_rows, (lane - rows) % plan.scale_rows   # k-tile, scale or zero-point row
            T.call_extern("handle", "tm_prefetch_l2",
                          T.access_ptr(S[(k0 + j) * plan.bk // plan.group * plan.scale_rows + r, bx * bn], "r"),
                          2 * bn)
