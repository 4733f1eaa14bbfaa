"""Hopper W4A16 with the weights as wgmma's register operand: C^T = W^T X^T, packed weights decoded
straight into A fragments, activations from shared memory (sm_90a).

Why it looks the way it does:
- mma.sync tops out near half of the H200's wgmma rate, which is why marlin_mma stays near 0.5x of
  FP16 at large M. wgmma takes its A operand from registers (the `.rs` form), with per warp of the
  warpgroup the same per-thread layout as mma.m16n8k16's A for that warp's 16 rows, and one 32-bit
  word of marlin_mma's packed layout decodes into exactly such a fragment (stream_mma's decode).
  So decoded weights never touch shared memory: no 2-byte stores of decoded values (hopper_wgmma's
  cost, perf-notes v5) and no repacking.
- Three ways to feed it, one knob each; the search runs only the last (perf-notes v13: 1.2-2.6x
  faster than the others). (1) Registers: activations by 16-byte cp.async from all threads into
  wgmma's unswizzled core-matrix layout [stage][k / 8][row][8 halves] (an 8-row x 16-byte core
  matrix is 128 contiguous bytes), packed words loaded from global memory `ahead` k-tiles early into
  registers. (2) `smem_weights`: the words and scale rows travel with the activations through the
  stages by cp.async. (3) `tma`: one elected thread fills each stage with three TMA copies against
  the stage's mbarrier, the activations in the 128-byte swizzle that wgmma reads through a K-major
  SW128 descriptor; no copy instruction, address arithmetic or proxy fence is left in the k-loop.
- Without overlap a warpgroup decodes a stage, issues its wgmmas and waits for them; the other
  blocks on the SM fill the tensor cores meanwhile. With overlap it decodes stage t + 1 into a
  second fragment buffer while stage t's wgmmas run (wgmma.wait_group 1).
- Group scales multiply the decoded weights (the k-tile lies in one group: check()); channelwise
  scales multiply the final sums. Without split-K every thread stores its fragment straight to C;
  with split-K the block's tile meets the other splits' through the common epilogue.
- Every barrier is explicit: one per k-tile, after the stage has landed (cp.async) or after the
  wgmma wait that frees the oldest stage (tma; with release_barriers per-stage mbarriers instead).
"""
# No `from __future__ import annotations`: T.prim_func evaluates the annotations below.

import math
import operator

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from templates import dequant_function_names, mma_operand_dtype, render_dequant

from ..epilogue import (CLUSTER_HELPERS, EARLY_START_HELPERS, SPLIT_K_HELPERS, split_k_prelude, store_tile,
                        store_tile_split_wait, w4a16_prim_func, wait_for_prior_grids)
from ..marlin_mma.layout import SLAB_N
from ..problem import Problem
from .knobs import CORE_ROWS, PRODUCER_REGISTERS, WARPGROUP, Knobs

# A lane's packed words of one k-step: 1, 2 or 4 consecutive 32-bit words. Every M tile of the
# grid reads the same weights, so they may stay in the caches (no L1::no_allocate here).
WEIGHT_LOADS = r"""
__device__ __forceinline__ void tm_ldg_words4(const void* src, void* dst) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(src));
}
__device__ __forceinline__ void tm_ldg_words2(const void* src, void* dst) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(d[0]), "=r"(d[1]) : "l"(src));
}
__device__ __forceinline__ void tm_ldg_words1(const void* src, void* dst) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(d[0]) : "l"(src));
}
"""
# The warp's index made warp-uniform by a shuffle (as CUTLASS does): ptxas serializes every wgmma
# under a branch it cannot prove is taken by whole warps (warning C7518: each wgmma waited for before
# the next), and a branch on threadIdx.x is such a branch.
WARP_INDEX = r"""
__device__ __forceinline__ int tm_warp_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 32, 0); }
"""


# staged_store: a 16-byte copy (the output tile's rows leave shared memory as whole 16-byte chunks).
COPY16 = r"""
__device__ __forceinline__ void tm_copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""
# staged_store, stream_k: the named barrier (1; 0 is __syncthreads') that the consumer warpgroups alone
# meet at (the producer warp or warpgroup is elsewhere), with a memory clobber so that the compiler
# keeps the shared-memory stores and loads on their side of it (TileLang's partial barrier has none).
CONSUMERS_SYNC = r"""
__device__ __forceinline__ void tm_consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory");
}
"""


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


# A 64-column slab's k-step is 128 words, lane l's word for the slab's 16-column quarter q at 4 l + q
# (marlin_mma's layout). A warp that reads one quarter for all its lanes hits 8 banks, four lanes each:
# 4-way conflicts, 4 wavefronts per 32-bit load (2 per 64-bit load at groups 2). rotate: the lanes of
# each 8-lane quarter of the warp take the warp's quarter (pair of quarters at groups 2) shifted by that
# lane quarter's number, so that one load touches every bank once. The wgmma does not mind which weight
# columns a lane brings: its rows of A are then other columns, and its rows of the sums the same ones
# (weight_col says which), since every row of A*B is that row of A times B.
def slab_quarter(wq, lane, i, groups: int, rotate: bool):
    """The 16-column quarter (within its 64-column slab) of lane `lane` of warp `wq`'s group i (ints or
    TileLang expressions)."""
    quarters = 4 // groups                # a warp's share of the slab, in steps of `groups` quarters
    if rotate and quarters > 1:
        return groups * ((wq % quarters + lane // 8) % quarters) + i
    return (wq * groups + i) % 4


def build(problem: Problem, knobs: Knobs):
    """The TileLang prim_func for `problem` with `knobs` (checked by knobs.check beforehand).

    Arguments as marlin_mma's: A [M, K], packed B [K/16, 2N] int32, scales [K/group, N], C [M, N];
    with split_k > 1 also a zeroed fp32 workspace [M, N] and int32 tile counters.
    """
    n, group, dtype = problem.n, problem.group, problem.dtype
    kb = knobs
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    bm, bn, bk, g = kb.block_m, kb.block_n, kb.block_k, kb.groups
    steps, stages, ahead, prefetch, overlap = kb.k_steps, kb.stages, kb.ahead, kb.prefetch, kb.overlap
    threads = kb.threads
    consumers = kb.consumer_threads     # threads of the warpgroups; with producer_warp one warp (or warpgroup) more
    # K-tiles per split; the first `extra` splits take one more, with split_wait the last ones (uneven
    # splits: the producer warp's tma pipeline only, where each block's count is a constant of one of
    # two branches, see body())
    trips, extra = kb.k_tiles(problem) // kb.split_k, kb.longer_splits(problem)
    grouped = not problem.channelwise
    split = kb.uses_workspace
    grid_n = n // bn
    ab = mma_operand_dtype(dtype)
    decode, decode_scaled = dequant_function_names(dtype, problem.bits, operand="a")
    cluster = kb.cluster_reduce          # the splits add their tiles through distributed shared memory
    prelude = render_dequant(dtype, problem.bits) + WEIGHT_LOADS + (SPLIT_K_HELPERS if kb.stream_k else "") + \
        (CLUSTER_HELPERS if cluster else "") + (WARP_INDEX if kb.producer_warp else "") + \
        (COPY16 if kb.staged_store else "") + (CONSUMERS_SYNC if kb.staged_store or kb.stream_k else "") + \
        (EARLY_START_HELPERS if kb.early_start else "") + \
        split_k_prelude(bm, bn, kb.split_k, threads, n, problem.channelwise, cluster, kb.split_wait)
    wait_prior = wait_for_prior_grids(cluster, kb.pdl)
    store = store_tile(bm, bn, grid_n, kb.split_k, dtype, problem.channelwise, cluster=cluster) \
        if kb.split_k > 1 else None
    if kb.split_wait:
        store_waiting = store_tile_split_wait(bm, bn, kb.split_k, n, problem.channelwise)
    # split_wait: the short splits come first, so that the last split (which waits) is a long one
    short = kb.split_k - extra if kb.split_wait else 0
    load_words = f"tm_ldg_words{g}"
    w_smem = kb.smem_weights
    bufs = 1 if w_smem else ahead + 1    # register buffers of packed words (and scales)
    unrolled = math.lcm(bufs, 2) if overlap else bufs    # k-tiles per unrolled trip
    per_w = steps * g               # packed words per lane and stage
    per_s = 2 * g                   # group scales per lane and stage: rows g and g + 8 of each group
    a_len = steps * g * 8           # decoded halves per lane and stage
    acc_len = g * bm // 2           # fp32 sums: `groups` wgmma m64n{bm} accumulators
    kc8 = bk // 8                   # 16-byte chunks per activation row and stage
    chunks = bm * kc8
    w_chunks = steps * bn // 2      # 16-byte chunks of packed words per stage (2 * bn words per k-step)
    w_rounds = -(-w_chunks // threads)
    rounds = -(-chunks // threads)
    wgmma_shape = f"m64n{bm}k16"
    tma = kb.tma
    release = kb.release_barriers       # stages freed by per-stage barriers, not a block barrier
    producer = kb.producer_warp         # ... and refilled by a warp of its own
    persistent = kb.persistent          # blocks that loop over the tiles (0: one block per tile)
    ksplit = 2 if kb.k_split else 1     # consumer warpgroups that share a block's k-tiles (same columns)
    stream_k = kb.stream_k              # blocks that share all tiles' k-tiles evenly (0: one block per tile)
    # scale_on_acc: acc holds the running sums, then one k-tile's wgmma sums; sc two sets of scales (by
    # the k-tile's parity), since k-tile t - 1's fold comes after k-tile t's words and scales are read.
    sacc = kb.scale_on_acc
    # fold_lag: two sets of k-tile sums by parity, k-tile t's folded while k-tile t + 1's wgmmas run.
    lag = kb.fold_lag
    acc_all = acc_len * (3 if lag else 2 if sacc else 1)

    def in_producer_warp():
        """producer_warp: whether this thread's warp is the producer (a warp-uniform condition)."""
        return T.call_extern("int32", "tm_warp_index") >= consumers // 32
    atoms = bk // 64                # tma: [block_m, 64] swizzled tiles per stage, side by side along K
    if tma:
        # TMA writes each [block_m, 64] tile with the 128-byte swizzle: wgmma's canonical K-major SW128
        # layout, 8-row atoms of 1024 bytes (stride byte offset), a k-step 32 bytes into the atom.
        layout_type, lbo, sbo = 1, 1, 1024 // 16
        stage_units, step_units = bm * bk * 2 // 16, 2
    else:
        # The K-major, unswizzled core-matrix tile, in 16-byte units: core matrices adjacent along K are
        # bm rows apart (leading byte offset), along M 8 rows (stride byte offset).
        layout_type, lbo, sbo = 0, bm, CORE_ROWS
        stage_units, step_units = kc8 * bm, 2 * bm

    def weight_col(bx, wg, wq, lane, i, h):
        """Output column of a lane's fragment row h (g or g + 8) of group i."""
        slab = (wq * g + i) // 4
        return (bx * bn + wg * SLAB_N * g + slab * SLAB_N + slab_quarter(wq, lane, i, g, kb.rotate) * 16 +
                lane // 4 + 8 * h)

    @T.macro
    def load_x(A, B, S, X_s, W_s, S_s, tile, k0, by, bx, tx):
        """Issue the cp.async of k-tile `tile`'s activations (with smem_weights also its packed words and
        scale row) into its stage, as one commit group (empty past the last tile, so that wait counts
        stay uniform)."""
        if tile < trips:
            for r in T.unroll(rounds):
                c = r * threads + tx
                # 8 consecutive rows per chunk column: each 8-lane phase fills one 128-byte core matrix.
                row = c % CORE_ROWS + c // (CORE_ROWS * kc8) * CORE_ROWS
                kc = c // CORE_ROWS % kc8
                if c < chunks:
                    T.ptx_cp_async(T.access_ptr(X_s[tile % stages, kc, row, 0], "w", 8),
                                   T.access_ptr(A[T.min(by * bm + row, m - 1), (k0 + tile) * bk + kc * 8], "r", 8), 8)
            if w_smem:
                kt = k0 + tile
                # The block's 2 * bn words of each k-step, contiguous in global memory.
                for r in T.unroll(w_rounds):
                    c = r * threads + tx
                    if c < w_chunks:
                        u = c // (bn // 2)
                        col = c % (bn // 2) * 4
                        T.ptx_cp_async(T.access_ptr(W_s[tile % stages, u, col], "w", 4),
                                       T.access_ptr(B[kt * steps + u, bx * 2 * bn + col], "r", 4), 4)
                if grouped:
                    if tx < bn // 8:
                        T.ptx_cp_async(T.access_ptr(S_s[tile % stages, 0, tx * 8], "w", 8),
                                       T.access_ptr(S[kt * bk // group, bx * bn + tx * 8], "r", 8), 8)
        T.ptx_commit_group()

    @T.macro
    def read_w(W_s, S_s, w, sc, tile, wg, wq, lane, sb):
        """smem_weights: the lane's words and scales of k-tile `tile` from its stage into buffer 0 (the
        scales from sc[sb])."""
        word = (wg * g + wq * g // 4) * 128 + lane * 4 + slab_quarter(wq, lane, 0, g, kb.rotate)
        for u in T.unroll(steps):
            for v in T.vectorized(g):
                w[u * g + v] = W_s[tile % stages, u, word + v]
        if grouped:
            for i in T.unroll(g):
                for h in T.unroll(2):
                    sc[sb + 2 * i + h] = S_s[tile % stages, 0, weight_col(0, wg, wq, lane, i, h)]

    @T.macro
    def load_w(B, S, w, sc, buf, tile, k0, bx, wg, wq, lane):
        """Load k-tile `tile`'s packed words (and group scales) into register buffer `buf`."""
        if tile < trips:
            kt = k0 + tile
            word = ((bx * bn // SLAB_N + wg * g + wq * g // 4) * 128 + lane * 4 +
                    slab_quarter(wq, lane, 0, g, kb.rotate))
            for u in T.unroll(steps):
                T.call_extern("handle", load_words, T.access_ptr(B[kt * steps + u, word], "r"),
                              T.access_ptr(w[buf * per_w + u * g], "w"))
            if grouped:
                for i in T.unroll(g):
                    for h in T.unroll(2):
                        sc[buf * per_s + 2 * i + h] = S[kt * bk // group, weight_col(bx, wg, wq, lane, i, h)]

    def fragment_slot(u):
        """K-step u's fragments within their buffer (ring = D: slot u % D of D)."""
        return u % kb.ring if kb.ring else u

    @T.macro
    def decode_step(w, sc, a, buf, abuf, u):
        """Decode k-step u of register buffer `buf` into its fragment slot of A buffer `abuf`."""
        for i in T.unroll(g):
            if grouped and not sacc:
                T.call_extern("handle", decode_scaled, T.access_ptr(w[buf * per_w + u * g + i], "r"),
                              T.access_ptr(sc[buf * per_s + 2 * i], "r"),
                              T.access_ptr(a[abuf * a_len + (fragment_slot(u) * g + i) * 8], "w"))
            else:
                T.call_extern("handle", decode, T.access_ptr(w[buf * per_w + u * g + i], "r"),
                              T.access_ptr(a[abuf * a_len + (fragment_slot(u) * g + i) * 8], "w"))

    @T.macro
    def decode_stage(w, sc, a, buf, abuf):
        """Decode register buffer `buf` into A fragment buffer `abuf`."""
        for u in T.unroll(steps):
            decode_step(w, sc, a, buf, abuf, u)

    @T.macro
    def zero_sums(acc, sc):
        """The running sums start at zero; with scale_on_acc so do both k-tile sets and their scales, so
        that the first k-tile's fold of the other set adds zero."""
        for i in T.unroll(acc_all):
            acc[i] = T.float32(0)
        if sacc:
            for i in T.unroll(2 * per_s):
                sc[i] = T.cast(0, dtype)

    def x_offset(u):
        """K-step u's activations from its stage's start, in 16-byte units (tma with block_k 128: the
        steps of the second 64-wide tile start block_m rows of 128 bytes later)."""
        if tma:
            return u // 4 * (bm * 64 * 2 // 16) + u % 4 * step_units
        return u * step_units

    @T.macro
    def wgmma_step(a, abuf, acc, desc, tile, u, base=0, accumulate=1):
        """K-step u's wgmmas, one m64n{bm}k16 per group, A from its fragment slot of buffer `abuf`, into
        the sums from acc[base] (accumulate 0: overwriting them)."""
        for i in T.unroll(g):
            T.ptx_wgmma_rs("float32", wgmma_shape, True, ab, ab, "fp32",
                           a.data, abuf * a_len + (fragment_slot(u) * g + i) * 8,
                           desc.data, tile % stages * stage_units + x_offset(u),
                           acc.data, base + i * (bm // 2), accumulate, 1, 1)

    @T.macro
    def mma_stage(a, abuf, acc, desc, tile, sums=0):
        """Issue (not wait for) the stage's wgmmas: per k-step one m64n{bm}k16 per group (scale_on_acc:
        into the k-tile's own set of sums, acc[acc_len * (1 + sums):], which the first k-step overwrites)."""
        base = acc_len * (1 + sums) if sacc else 0
        T.warpgroup_fence_operand(acc, base, num_regs=acc_len)
        T.warpgroup_arrive()
        for u in T.unroll(steps):
            # (k-step 0 overwrites the k-tile's sums through the predicate, not peeled off the loop: peeled,
            # nvcc left the A fragments in local memory at block_m 32)
            wgmma_step(a, abuf, acc, desc, tile, u, base, u > 0 if sacc else 1)
        T.warpgroup_commit_batch()

    @T.macro
    def fold_k_tile(acc, sc, p, sums=0):
        """scale_on_acc: a finished k-tile's sums (set `sums`) times its group scales (set p of sc), added
        to the running sums: element j of group i lies on weight row g + 8 * (j % 4 // 2)."""
        base = acc_len * (1 + sums)
        T.warpgroup_fence_operand(acc, base, num_regs=acc_len)
        for i in T.unroll(g):
            for j in T.unroll(bm // 2):
                k = i * (bm // 2) + j
                acc[k] = acc[k] + acc[base + k] * T.cast(sc[p * per_s + 2 * i + j % 4 // 2], "float32")

    @T.macro
    def mma_ring(w, sc, a, acc, desc, tile):
        """ring = D: the stage's k-steps one commit group each, k-step u decoded into fragment slot
        u % D once the wgmmas that read it last (D groups back) are done: D k-steps of wgmmas in
        flight with D k-steps of fragments (two whole buffers hold 2 * steps). D divides `steps`, so
        the slots are constants; since D <= steps, every wgmma of the previous k-tile is done when
        this returns."""
        T.warpgroup_fence_operand(acc, num_regs=acc_len)
        for u in T.unroll(steps):
            T.warpgroup_wait(kb.ring - 1)
            decode_step(w, sc, a, 0, 0, u)
            T.warpgroup_arrive()
            wgmma_step(a, 0, acc, desc, tile, u)
            T.warpgroup_commit_batch()

    @T.macro
    def copy_stage(A, B, S, X_s, W_s, S_s, full, tile, kt, by, bx, leaders):
        if atoms == 1:
            T.tma_copy(A[by * bm:(by + 1) * bm, kt * bk:(kt + 1) * bk], X_s[tile % stages, :, :],
                       barrier=full[tile % stages], leader_scope_threads=leaders)
        else:
            for h in range(atoms):      # one box per 128-byte swizzle width
                T.tma_copy(A[by * bm:(by + 1) * bm, kt * bk + h * 64:kt * bk + (h + 1) * 64],
                           X_s[tile % stages, h, :, :], barrier=full[tile % stages], leader_scope_threads=leaders)
        T.tma_copy(B[kt * steps:(kt + 1) * steps, bx * 2 * bn:(bx + 1) * 2 * bn], W_s[tile % stages, :, :],
                   barrier=full[tile % stages], leader_scope_threads=leaders)
        if grouped:
            T.tma_copy(S[kt * bk // group:kt * bk // group + 1, bx * bn:(bx + 1) * bn], S_s[tile % stages, :, :],
                       barrier=full[tile % stages], leader_scope_threads=leaders)

    @T.macro
    def load_tma(A, B, S, X_s, W_s, S_s, full, empty, tile, k0, by, bx, tx):
        """tma: k-tile `tile`'s three tile copies (activations, packed words, scale row) against the
        stage's barrier. With a block barrier per k-tile, one elected thread of the block issues them
        and every thread arrives (after that thread's own expect-tx, so the phase completes once all
        bytes have landed). With release_barriers only warp 0 produces: it waits until every thread
        has released the stage's previous k-tile, one lane issues, and lane 0 arrives."""
        if tile < trips:
            kt = k0 + tile
            if release:
                if tx < 32:
                    if tile >= stages:
                        T.mbarrier_wait_parity(empty[tile % stages], (tile // stages - 1) % 2)
                    copy_stage(A, B, S, X_s, W_s, S_s, full, tile, kt, by, bx, 32)
                    T.call_extern("handle", "__syncwarp")     # the elected lane's expect-tx comes first
                    if tx == 0:
                        T.barrier_arrive(full[tile % stages])
            else:
                copy_stage(A, B, S, X_s, W_s, S_s, full, tile, kt, by, bx, threads)
                T.barrier_arrive(full[tile % stages])

    @T.macro
    def fill(A, B, S, X_s, W_s, S_s, full, empty, k0, g, t, by, bx, tx):
        """The producer's k-tile t, number g of the block's sequence: wait for its stage's release (from
        the second round of the stages on), issue its copies, arrive."""
        if g >= stages:
            T.mbarrier_wait_parity(empty[g % stages], (g // stages - 1) % 2)
        copy_stage(A, B, S, X_s, W_s, S_s, full, g, k0 + t, by, bx, 32)
        T.call_extern("handle", "__syncwarp")
        if tx == consumers:
            T.barrier_arrive(full[g % stages])

    @T.macro
    def produce(A, B, S, X_s, W_s, S_s, full, empty, k0, g0, count, by, bx, tx):
        """producer_warp: the extra warp fills every stage as soon as the consumers have released its
        previous k-tile; one lane issues the three copies, lane 0 arrives after the warp's expect-tx.
        K-tile t (of `count`, from k-tile k0) of this tile is number g0 + t of the block's sequence
        (g0 > 0 only for persistent and stream_k blocks), which picks its stage and barrier phase."""
        if kb.stage_unroll and not kb.setmaxnreg:   # (g0 = 0 and count = trips, a constant: see check())
            lead = count % stages   # k-tiles before the loop, which then runs whole rounds of the stages
            for t in T.unroll(lead):
                fill(A, B, S, X_s, W_s, S_s, full, empty, k0, t, t, by, bx, tx)
            for t0 in T.serial(count // stages):
                for r in T.unroll(stages):
                    fill(A, B, S, X_s, W_s, S_s, full, empty, k0, lead + t0 * stages + r, lead + t0 * stages + r,
                         by, bx, tx)
        else:
            for t in T.serial(count):
                fill(A, B, S, X_s, W_s, S_s, full, empty, k0, g0 + t, t, by, bx, tx)

    @T.macro
    def stage_ready():
        """This thread's cp.async group of the stage has landed; make it visible to wgmma (the async
        proxy) and wait for every thread's."""
        T.ptx_wait_group(prefetch - 1)
        T.fence_proxy_async()
        T.sync_threads()

    @T.macro
    def consume_k_tile(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane, g, t, r,
                       first=True, last=True):
        """K-tile t (number g of the block's sequence) of the tma pipeline into A fragment buffer r % 2:
        wait for its stage's barrier phase, decode, issue the wgmmas; then free the oldest stage: a
        block barrier after the wgmma wait (and the next copy, issued by one elected thread), or with
        release_barriers an arrival on the stage's "empty" barrier (warp 0 refills it, or with
        producer_warp the producer warp). first / last: whether it opens / closes its unrolled trip
        (fold_lag waits for all wgmmas once per trip)."""
        T.mbarrier_wait_parity(full[g % stages], g // stages % 2)
        read_w(W_s, S_s, w, sc, g, wg, wq, lane, r % 2 * per_s if sacc else 0)
        if kb.ring:
            mma_ring(w, sc, a, acc, desc, g)
        elif lag:
            # K-tile t - 1's sums are folded after the wait that completes it, under k-tile t's wgmmas.
            # ptxas allows that only within the unrolled trip (across the loop's back edge it serialized
            # every wgmma, C7514), so each trip ends with a wait for all and the fold of its last k-tile.
            decode_stage(w, sc, a, 0, r % 2)
            mma_stage(a, r % 2, acc, desc, g, r % 2)
            if first:
                if release and t >= 1:
                    T.barrier_arrive(empty[(g - 1) % stages])     # done since the last trip's end
            else:
                T.warpgroup_wait(1)
                if release:
                    T.barrier_arrive(empty[(g - 1) % stages])
                fold_k_tile(acc, sc, (r + 1) % 2, (r + 1) % 2)
            if last:
                T.warpgroup_wait(0)
                fold_k_tile(acc, sc, r % 2, r % 2)
        elif sacc:
            # Decoded under k-tile t - 1's wgmmas, as below; but its sums are read before this k-tile's
            # wgmmas overwrite them, after a wait for all (ptxas serializes every wgmma when sums are read
            # with any wgmma in flight, its C7514). Before the first k-tile they and its scales are zeros.
            decode_stage(w, sc, a, 0, r % 2)
            T.warpgroup_wait(0)
            if release and t >= 1:
                T.barrier_arrive(empty[(g - 1) % stages])     # its stage at once, before the fold
            fold_k_tile(acc, sc, (r + 1) % 2)
            mma_stage(a, r % 2, acc, desc, g)
        else:
            decode_stage(w, sc, a, 0, r % 2)
            mma_stage(a, r % 2, acc, desc, g)
            T.warpgroup_wait(1 if overlap else 0)
        if not release:
            T.sync_threads()
        elif not sacc:
            # This thread is done with k-tile t (with overlap: its previous one, ksplit earlier in the
            # block's sequence) and its stage.
            if t >= (1 if overlap else 0):
                T.barrier_arrive(empty[(g - (ksplit if overlap else 0)) % stages])
        if not producer:
            load_tma(A, B, S, X_s, W_s, S_s, full, empty, t + stages - 1, k0, by, bx, tx)

    @T.macro
    def consume_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, g0, by, bx, tx, wg, wq, lane,
                    count):
        """The consumers' k-loop of the tma pipeline (k-tile t is number g0 + t of the block's
        sequence), unrolled by two so that the fragment buffers have constant register indices (with
        stage_unroll by a multiple of `stages` too). The k-tiles that do not fill a trip run before
        the loop (an odd one in buffer 1): under a condition inside the loop, or after it, ptxas
        waited for every wgmma before the next (its warning C7513, found on down_proj with 43 k-tiles
        per split)."""
        mine = count // ksplit          # k-tiles of this warpgroup; with k_split its own are kw, kw + 2, ...
        if stream_k:
            mine = count                # this segment's k-tiles, a runtime multiple of two: no peel
        if ksplit > 1:
            g0 = g0 + tx // (WARPGROUP * kb.warpgroups)
        # stage_unroll: a trip covers a multiple of `stages` k-tiles, so k-tile t's stage is a constant
        per_trip = math.lcm(unrolled, stages) if kb.stage_unroll else unrolled
        lead = 0 if stream_k else mine % per_trip      # k-tiles before the loop
        # From four lead k-tiles on, all but an odd one run as a loop of two-k-tile trips (stage index at
        # run time) that nvcc keeps rolled: peeled straight-line, each k-tile past the first cost ptxas
        # ~15 registers (qkv 16 at 6 stages, lead 4: 150 against 112), 2 blocks per SM instead of 3.
        looped = lead // 2 * 2 if lead >= 4 else 0
        peeled = lead - looped
        for r in T.unroll(peeled):  # buffer (r + lead) % 2: k-tile `lead`, the loop's first, takes buffer 0
            consume_k_tile(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane,
                           g0 + r * ksplit, r, r + lead, r == 0, r == peeled - 1)
        for t0 in T.unroll(looped // 2, unroll_factor=1):
            for r in T.unroll(2):
                t = peeled + t0 * 2 + r
                consume_k_tile(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq,
                               lane, g0 + t * ksplit if ksplit > 1 else g0 + t, t, r, r == 0, r == 1)
        for t0 in T.serial(mine // per_trip):
            for r in T.unroll(per_trip):
                t = lead + t0 * per_trip + r
                consume_k_tile(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq,
                               lane, g0 + t * ksplit if ksplit > 1 else g0 + t, t, r, r == 0, r == per_trip - 1)

    @T.macro
    def pipeline_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane,
                     count):
        """tma: the block's `count` k-tiles from k-tile k0 (a constant: trips, or trips + 1 for the
        first splits of an uneven split_k); the stages fill by TMA and a thread waits for its stage's
        barrier phase; with producer_warp the extra warp produces while the warpgroups consume (warp
        specialization)."""
        if producer:
            if in_producer_warp():
                produce(A, B, S, X_s, W_s, S_s, full, empty, k0, 0, count, by, bx, tx)
            else:
                zero_sums(acc, sc)
                consume_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, 0, by, bx, tx, wg, wq, lane,
                            count)
        else:
            for p in T.unroll(stages - 1):
                load_tma(A, B, S, X_s, W_s, S_s, full, empty, p, k0, by, bx, tx)
            consume_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, 0, by, bx, tx, wg, wq, lane,
                        trips)

    @T.macro
    def pipeline_smem(A, B, S, X_s, W_s, S_s, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane):
        """smem_weights: weights and scales arrive with the activations by cp.async; a stage is decoded
        once it has landed, with overlap while the previous stage's wgmmas still run (unrolled by two,
        so that the fragment buffers have constant indices)."""
        for p in T.unroll(prefetch):
            load_x(A, B, S, X_s, W_s, S_s, p, k0, by, bx, tx)
        for t0 in T.serial(-(-trips // unrolled)):
            for r in T.unroll(unrolled):
                t = t0 * unrolled + r
                if t < trips:
                    stage_ready()
                    read_w(W_s, S_s, w, sc, t, wg, wq, lane, 0)
                    decode_stage(w, sc, a, 0, r % 2)
                    mma_stage(a, r % 2, acc, desc, t)
                    # After the wgmmas: a cp.async before them would need a second proxy fence.
                    load_x(A, B, S, X_s, W_s, S_s, t + prefetch, k0, by, bx, tx)
                    # overlap: k-tile t - 1's wgmmas are done, its A buffer is free for t + 1.
                    T.warpgroup_wait(1 if overlap else 0)

    @T.macro
    def pipeline_registers(A, B, S, X_s, W_s, S_s, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane):
        """Activations by cp.async, weights by global loads into registers: k-tile t's words wait in
        register buffer t % bufs. The loop is unrolled so that every buffer index is a constant and no
        buffer is ever copied (a copy of a buffer whose loads are in flight would wait for them);
        k-tiles past the end are skipped."""
        for p in T.unroll(prefetch):
            load_x(A, B, S, X_s, W_s, S_s, p, k0, by, bx, tx)
        for p in T.unroll(ahead + (1 if overlap else 0)):
            load_w(B, S, w, sc, p, p, k0, bx, wg, wq, lane)
        if overlap:
            decode_stage(w, sc, a, 0, 0)
        for t0 in T.serial(-(-trips // unrolled)):
            for r in T.unroll(unrolled):
                t = t0 * unrolled + r
                if t < trips:
                    stage_ready()
                    if overlap:
                        mma_stage(a, r % 2, acc, desc, t)
                        load_x(A, B, S, X_s, W_s, S_s, t + prefetch, k0, by, bx, tx)
                        # Into the buffer of k-tile t, decoded in the previous iteration.
                        load_w(B, S, w, sc, r % bufs, t + 1 + ahead, k0, bx, wg, wq, lane)
                        T.warpgroup_wait(1)    # k-tile t - 1's wgmmas are done: its A buffer is free
                        if t + 1 < trips:
                            decode_stage(w, sc, a, (r + 1) % bufs, (r + 1) % 2)
                    else:
                        load_w(B, S, w, sc, (r + ahead) % bufs, t + ahead, k0, bx, wg, wq, lane)
                        decode_stage(w, sc, a, r % bufs, 0)
                        mma_stage(a, 0, acc, desc, t)
                        load_x(A, B, S, X_s, W_s, S_s, t + prefetch, k0, by, bx, tx)
                        T.warpgroup_wait(0)

    # wgmma accumulator: per group i and 8 rows of M (c), rows g / g + 8 of the warp's 16 weight
    # columns, columns (rows of M) 2t and 2t + 1.
    def fragment_element(by, bx, wg, wq, lane, i, c, e):
        """(row of C, column of C, index in acc) of a lane's accumulator element e of row block c of
        group i: the wgmma's C^T fragment, transposed back."""
        row = by * bm + 8 * c + 2 * (lane % 4) + e % 2
        return row, weight_col(bx, wg, wq, lane, i, e // 2), i * (bm // 2) + c * 4 + e

    def output_value(total, S, col):
        """An output element from its fp32 sum: group scales are in the sums already, channelwise ones
        come here."""
        return T.cast(total if grouped else total * T.cast(S[0, col], "float32"), dtype)

    @T.macro
    def finish_sums(acc, sc):
        """After the k-loop: wait for the last wgmmas, whose sums the epilogues read (scale_on_acc: fold
        the last k-tile's, whose scales are set 1: the loop's k-tiles come in pairs, and a lone lead one
        takes buffer 1)."""
        T.warpgroup_wait(0)
        T.warpgroup_fence_operand(acc, num_regs=acc_len)
        if sacc and not lag:      # (fold_lag folded it at its trip's end)
            fold_k_tile(acc, sc, 1)

    @T.macro
    def acc_to_shared(acc, C_s, wg, wq, lane):
        for i in T.unroll(g):
            for c in T.unroll(bm // 8):
                for e in T.unroll(4):
                    row, col, k = fragment_element(0, 0, wg, wq, lane, i, c, e)
                    C_s[row, col] = acc[k]

    @T.macro
    def shared_to_acc_add(acc, C_s, wg, wq, lane):
        """k_split: add the other k warpgroup's sums, stored by acc_to_shared, to this thread's."""
        for i in T.unroll(g):
            for c in T.unroll(bm // 8):
                for e in T.unroll(4):
                    row, col, k = fragment_element(0, 0, wg, wq, lane, i, c, e)
                    acc[k] = acc[k] + C_s[row, col]

    @T.macro
    def acc_to_global(acc, C, S, by, bx, wg, wq, lane, zero):
        """The lane's sums to C (2-byte fragment stores, rows past m skipped); with a `zero` buffer
        (stream_k's workspace, else None) the same elements of it are zeroed for the next call."""
        for i in T.unroll(g):
            for c in T.unroll(bm // 8):
                for e in T.unroll(4):
                    row, col, k = fragment_element(by, bx, wg, wq, lane, i, c, e)
                    if row < m:
                        C[row, col] = output_value(acc[k], S, col)
                        if zero is not None:
                            zero[row, col] = T.float32(0)

    out_chunks = bm * bn // 8          # 16-byte chunks of the output tile
    out_rounds = -(-out_chunks // consumers)

    @T.macro
    def acc_to_global_staged(acc, Y_s, C, S, by, bx, tx, wg, wq, lane):
        """staged_store: the consumers put their sums (as the output dtype) into a padded tile of
        their own in C's row-major order (a warp's 2-byte stores span 4 rows 16 bytes wide, 8 banks
        apart), then store whole rows of 16-byte chunks: 8x fewer store instructions than
        acc_to_global's 2-byte ones, and no half-written 32-byte sectors. Only rows < m are
        converted: under that predicate ptxas keeps the conversions after the final wgmma wait;
        unconditional, it hoisted some above it and read accumulators still being written
        (perf-notes v26; tests/test_sass.py checks the order). TileLang may place Y_s over the drained
        activation stages (its liveness-based merge did on down_proj m128 two warpgroups, not on m256
        setmaxnreg), which the other warpgroup's last wgmmas may still be reading: the consumers
        meet before anyone writes."""
        T.call_extern("handle", "tm_consumers_sync", consumers)
        for i in T.unroll(g):
            for c in T.unroll(bm // 8):
                for e in T.unroll(4):
                    row, col, k = fragment_element(0, 0, wg, wq, lane, i, c, e)     # within the tile
                    if by * bm + row < m:
                        Y_s[row, col] = output_value(acc[k], S, bx * bn + col)
        T.call_extern("handle", "tm_consumers_sync", consumers)
        for r in T.unroll(out_rounds):
            chunk = r * consumers + tx
            row = chunk // (bn // 8)
            col = chunk % (bn // 8) * 8
            if chunk < out_chunks and by * bm + row < m:
                T.call_extern("handle", "tm_copy16", T.access_ptr(C[by * bm + row, bx * bn + col], "w", 8),
                              T.access_ptr(Y_s[row, col], "r", 8))

    @T.macro
    def store_sums(acc, Y_s, C, S, by, bx, tx, wg, wq, lane):
        """A consumer thread's part of storing the block's tile (split_k 1)."""
        if kb.staged_store:
            acc_to_global_staged(acc, Y_s, C, S, by, bx, tx, wg, wq, lane)
        else:
            acc_to_global(acc, C, S, by, bx, wg, wq, lane, None)

    @T.macro
    def pipeline_tma_setmaxnreg(A, B, S, C, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, by, bx, tx, wg, wq, lane,
                                Y_s):
        """setmaxnreg: the producer warpgroup drops to PRODUCER_REGISTERS and its first warp produces;
        the consumers take the registers it left and store their own sums. The two branches never
        meet again: code after a join would be held to the registers at the kernel's entry (the
        block's average), which made ptxas spill the accumulators and serialize the wgmmas."""
        if in_producer_warp():
            T.set_max_nreg(PRODUCER_REGISTERS, 0)
            if T.call_extern("int32", "tm_warp_index") == consumers // 32:
                produce(A, B, S, X_s, W_s, S_s, full, empty, 0, 0, trips, by, bx, tx)
        else:
            T.set_max_nreg(kb.max_registers, 1)
            for i in T.unroll(acc_len):
                acc[i] = T.float32(0)
            consume_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, 0, 0, by, bx, tx, wg, wq, lane,
                        trips)
            finish_sums(acc, sc)
            store_sums(acc, Y_s, C, S, by, bx, tx, wg, wq, lane)

    @T.macro
    def buffers():
        """The block's shared stages, barriers and per-thread registers."""
        x_shape = ((stages, bm, bk) if atoms == 1 else (stages, atoms, bm, 64)) if tma else (stages, kc8, bm, 8)
        X_s = T.alloc_shared(x_shape, dtype)
        full = empty = None
        if tma:
            T.annotate_layout({X_s: make_swizzled_layout(X_s)})
            full = T.alloc_barrier([1 if release else threads] * stages)
            empty = T.alloc_barrier([consumers // ksplit] * stages) if release else None
        W_s = T.alloc_shared((stages + kb.pad_stages, steps, 2 * bn) if w_smem else (1, 1, 4), "int32")
        S_s = T.alloc_shared((stages, 1, bn) if w_smem else (1, 1, 8), dtype)
        w = T.alloc_local((bufs * per_w,), "int32")
        sc = T.alloc_local((bufs * per_s * (2 if sacc else 1),), dtype)
        a = T.alloc_local((kb.ring * g * 8 if kb.ring else (2 if overlap else 1) * a_len,), dtype)
        acc = T.alloc_local((acc_all,), "float32")
        desc = T.alloc_wgmma_desc()
        if kb.staged_store:
            Y_s = T.alloc_shared((bm, bn + 8), dtype)     # 16 bytes of padding per row: see acc_to_global_staged
            return X_s, full, empty, W_s, S_s, w, sc, a, acc, desc, Y_s
        return X_s, full, empty, W_s, S_s, w, sc, a, acc, desc, None

    @T.macro
    def start_early(B, S, bx, k0):
        """early_start: let the next kernel launch, and ask L2 for the packed rows (8 * block_n bytes
        each, consecutive k-steps) and scale rows of this block's first k-tiles (from k-tile k0), a lane
        each."""
        lane = T.get_thread_binding() % 32
        T.call_extern("handle", "tm_launch_dependents")
        if T.get_thread_binding() < 32:
            rows = kb.early_start * steps
            if lane < rows:
                T.call_extern("handle", "tm_prefetch_l2", T.access_ptr(B[k0 * steps + lane, bx * 2 * bn], "r"),
                              8 * bn)
            elif grouped and lane < rows + kb.early_start:
                T.call_extern("handle", "tm_prefetch_l2",
                              T.access_ptr(S[(k0 + lane - rows) * bk // group, bx * bn], "r"), 2 * bn)

    @T.macro
    def body(A, B, S, C, ws, counters):
        # cluster_reduce: the split_k blocks of an output tile form one cluster (along the grid's z).
        with T.Kernel(T.ceildiv(m, bm), grid_n, kb.split_k, threads=threads, prelude=prelude,
                      cluster_dims=(1, 1, kb.split_k) if cluster else None) as (grid_y, grid_x, bz):
            if kb.panel_m:
                # Blocks launch in blockIdx order (x fastest): the launch index picks the tile, once
                # per block (as inline expressions the epilogue recomputed the divisions per store).
                m_tiles = T.ceildiv(m, bm)
                tile_m, tile_n = panel_tile(grid_x * m_tiles + grid_y, m_tiles, grid_n, kb.panel_m, T.min,
                                            T.truncdiv, T.truncmod)
                by = T.alloc_var("int32", init=tile_m)
                bx = T.alloc_var("int32", init=tile_n)
            else:
                by, bx = grid_y, grid_x
            if kb.split_wait and extra:
                k0 = bz * trips + T.max(bz - short, 0)          # the split's first k-tile
            else:
                k0 = bz * trips + T.min(bz, extra) if extra else bz * trips
            if kb.early_start:
                start_early(B, S, bx, k0)
            wait_prior()
            X_s, full, empty, W_s, S_s, w, sc, a, acc, desc, Y_s = buffers()

            tx = T.get_thread_binding()
            wg = tx // WARPGROUP % kb.warpgroups if kb.k_split else tx // WARPGROUP    # along N
            wq = tx // 32 % 4
            lane = tx % 32
            T.initialize_wgmma_descriptor(desc, X_s.access_ptr("r"), layout_type, lbo, sbo)
            if not producer:    # (the producer warp's consumers zero their own sums)
                zero_sums(acc, sc)

            if kb.setmaxnreg:    # (split_k 1: the epilogue is the consumers' own, inside)
                pipeline_tma_setmaxnreg(A, B, S, C, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, by, bx, tx,
                                        wg, wq, lane, Y_s)
            elif tma and extra:
                # Two copies of the pipeline, one per count, so that each loop's trip count stays a constant.
                if (bz >= short) if kb.split_wait else (bz < extra):
                    pipeline_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq,
                                 lane, trips + 1)
                else:
                    pipeline_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq,
                                 lane, trips)
            elif tma:
                pipeline_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane,
                             trips)
            elif w_smem:
                pipeline_smem(A, B, S, X_s, W_s, S_s, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane)
            else:
                pipeline_registers(A, B, S, X_s, W_s, S_s, w, sc, a, acc, desc, k0, by, bx, tx, wg, wq, lane)
            if kb.setmaxnreg:
                pass
            elif producer:
                if not in_producer_warp():      # wgmma's warpgroup instructions, not for the producer warp
                    finish_sums(acc, sc)
            else:
                finish_sums(acc, sc)

            if kb.split_k > 1:
                C_s = T.alloc_shared((bm, bn), "float32")
                # TileLang may place C_s over the activation stages, which the other warpgroup's
                # last wgmmas can still be reading.
                T.sync_threads()
                if producer:
                    if not in_producer_warp():
                        acc_to_shared(acc, C_s, wg, wq, lane)
                else:
                    acc_to_shared(acc, C_s, wg, wq, lane)
                T.sync_threads()
                if kb.split_wait:
                    store_waiting(C_s, C, S, ws, m, by, bx, bz, tx)
                else:
                    store(C_s, C, S, ws, counters, m, by, bx, tx)
            elif kb.setmaxnreg:
                pass
            elif kb.k_split:
                # The second k warpgroup's sums join the first's through shared memory.
                R_s = T.alloc_shared((bm, bn), "float32")
                T.sync_threads()                # every stage is consumed: R_s may lie over them
                second = tx // (WARPGROUP * kb.warpgroups) == 1
                if second:
                    acc_to_shared(acc, R_s, wg, wq, lane)
                T.sync_threads()
                if tx < consumers // 2:
                    shared_to_acc_add(acc, R_s, wg, wq, lane)
                    acc_to_global(acc, C, S, by, bx, wg, wq, lane, None)
            elif producer:
                if not in_producer_warp():
                    store_sums(acc, Y_s, C, S, by, bx, tx, wg, wq, lane)
            else:
                store_sums(acc, Y_s, C, S, by, bx, tx, wg, wq, lane)

    @T.macro
    def body_persistent(A, B, S, C, ws, counters):
        """persistent: P blocks loop over the output tiles pid, pid + P, ... (M tiles fastest). k-tile
        g = round * trips + t of a block's sequence uses stage g % stages in phase g // stages, so the
        producer warp fills the next tile's stages while the warpgroups store this one."""
        with T.Kernel(persistent, threads=threads, prelude=prelude) as pid:
            X_s, full, empty, W_s, S_s, w, sc, a, acc, desc, Y_s = buffers()
            tx = T.get_thread_binding()
            wg = tx // WARPGROUP
            wq = tx // 32 % 4
            lane = tx % 32
            m_tiles = T.ceildiv(m, bm)
            my_tiles = T.ceildiv(m_tiles * grid_n - pid, persistent)
            tile_at = T.alloc_local((2,), "int32")     # this tile's M and N tile, computed once per tile
            T.initialize_wgmma_descriptor(desc, X_s.access_ptr("r"), layout_type, lbo, sbo)
            if in_producer_warp():
                for i in T.serial(my_tiles):
                    tile_at[0] = (pid + i * persistent) % m_tiles
                    tile_at[1] = (pid + i * persistent) // m_tiles
                    produce(A, B, S, X_s, W_s, S_s, full, empty, 0, i * trips, trips, tile_at[0], tile_at[1], tx)
            else:
                for i in T.serial(my_tiles):
                    tile_at[0] = (pid + i * persistent) % m_tiles
                    tile_at[1] = (pid + i * persistent) // m_tiles
                    for j in T.unroll(acc_len):
                        acc[j] = T.float32(0)
                    consume_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, 0, i * trips,
                                tile_at[0], tile_at[1], tx, wg, wq, lane, trips)
                    T.warpgroup_wait(0)
                    T.warpgroup_fence_operand(acc, num_regs=acc_len)
                    if overlap:     # the tile's last k-tile is done too: release its stage
                        T.barrier_arrive(empty[(i * trips + trips - 1) % stages])
                    acc_to_global(acc, C, S, tile_at[0], tile_at[1], wg, wq, lane, None)

    half = kb.k_tiles(problem) // 2     # stream_k: a unit is two k-tiles, so every segment is even

    @T.macro
    def partial_to_workspace(acc, C, S, ws, counters, flag, tile, contributors, by, bx, tx, wg, wq, lane):
        """stream_k: a segment that covers part of its tile adds its fp32 sums into the zeroed
        workspace, and the consumers count the block in on the tile's counter (the producer warp runs
        on and never joins their barriers); the tile's last contributor writes it out and zeroes the
        workspace and the counter for the next call, as split-K does with a fixed count."""
        for i in T.unroll(g):
            for c in T.unroll(bm // 8):
                for e in T.unroll(4):
                    row, col, k = fragment_element(by, bx, wg, wq, lane, i, c, e)
                    if row < m:
                        T.atomic_add(ws[row, col], acc[k])
        T.call_extern("handle", "__threadfence")
        T.call_extern("handle", "tm_consumers_sync", consumers)
        if tx == 0:
            flag[0] = T.call_extern("int32", "tm_split_k_arrive", T.access_ptr(counters[tile], "rw"), contributors)
        T.call_extern("handle", "tm_consumers_sync", consumers)
        if flag[0] == 1:
            # Every sum read back (into acc, whose own share is in them) before the first store: loads
            # and stores in turn wait for one L2 round trip per element (perf-notes v31).
            for i in T.unroll(g):
                for c in T.unroll(bm // 8):
                    for e in T.unroll(4):
                        row, col, k = fragment_element(by, bx, wg, wq, lane, i, c, e)
                        if row < m:
                            acc[k] = T.call_extern("float32", "__ldcg", T.access_ptr(ws[row, col], "r"))
            acc_to_global(acc, C, S, by, bx, wg, wq, lane, ws)
            if tx == 0:
                counters[tile] = 0
        # flag is read before the next segment's partial may set it again
        T.call_extern("handle", "tm_consumers_sync", consumers)

    @T.macro
    def segment(seg, tile, begin, end, m_tiles):
        """stream_k: seg[1:7] for the block's segment of `tile` (seg[0], the stage sequence, stays)."""
        seg[1] = tile
        seg[2] = T.truncmod(tile, m_tiles)
        seg[3] = T.truncdiv(tile, m_tiles)
        seg[4] = T.max(begin, tile * half)                          # first unit
        seg[5] = (T.min(end, tile * half + half) - seg[4]) * 2      # k-tiles
        seg[6] = T.if_then_else(seg[5] == 2 * half, 1, 0)
        seg[4] = (seg[4] - tile * half) * 2                         # first k-tile within the tile

    @T.macro
    def body_stream_k(A, B, S, C, ws, counters):
        """stream_k: P blocks share the U = tiles * half units (two k-tiles each; tiles in grid order, M
        tiles fastest) evenly: block b takes units [b U / P, (b + 1) U / P), one segment per tile it
        touches. Wave quantization goes: every block has the same work whatever the tile count (qkv
        at M=128 has 96 tiles of 128 x 128 for 132 SMs). As with persistent blocks, k-tile number g of
        the block's sequence picks stage g % stages, so the producer warp fills the next segment's
        stages while the consumers store this one's."""
        with T.Kernel(stream_k, threads=threads, prelude=prelude) as pid:
            X_s, full, empty, W_s, S_s, w, sc, a, acc, desc, Y_s = buffers()
            flag = T.alloc_shared((1,), "int32")
            tx = T.get_thread_binding()
            wg = tx // WARPGROUP
            wq = tx // 32 % 4
            lane = tx % 32
            m_tiles = T.ceildiv(m, bm)
            units = m_tiles * grid_n * half
            begin = T.truncdiv(pid * units, stream_k)
            end = T.truncdiv((pid + 1) * units, stream_k)
            first_tile = T.truncdiv(begin, half)
            segments = T.if_then_else(end > begin, T.truncdiv(end - 1, half) - first_tile + 1, 0)
            # Per segment, computed once (inline, every use would divide again): the stage sequence
            # number of its first k-tile, its tile, M tile, N tile, first k-tile, k-tile count, and
            # whether it covers the whole tile. Producer and consumers walk the segments in loops of
            # their own, as persistent blocks do (one loop around both branches made ptxas serialize
            # the wgmmas, C7515).
            seg = T.alloc_local((7,), "int32")
            T.initialize_wgmma_descriptor(desc, X_s.access_ptr("r"), layout_type, lbo, sbo)
            seg[0] = 0
            if in_producer_warp():
                for i in T.serial(segments):
                    segment(seg, first_tile + i, begin, end, m_tiles)
                    produce(A, B, S, X_s, W_s, S_s, full, empty, seg[4], seg[0], seg[5], seg[2], seg[3], tx)
                    seg[0] = seg[0] + seg[5]
            else:
                for i in T.serial(segments):
                    segment(seg, first_tile + i, begin, end, m_tiles)
                    for j in T.unroll(acc_len):
                        acc[j] = T.float32(0)
                    consume_tma(A, B, S, X_s, W_s, S_s, full, empty, w, sc, a, acc, desc, seg[4], seg[0], seg[2],
                                seg[3], tx, wg, wq, lane, seg[5])
                    T.warpgroup_wait(0)
                    T.warpgroup_fence_operand(acc, num_regs=acc_len)
                    if overlap:     # the segment's last k-tile is done too: release its stage
                        T.barrier_arrive(empty[(seg[0] + seg[5] - 1) % stages])
                    if seg[6] == 1:
                        acc_to_global(acc, C, S, seg[2], seg[3], wg, wq, lane, None)
                    else:
                        # Blocks whose units meet this tile: the block of its first unit to that of its last.
                        first_block = T.truncdiv((seg[1] * half + 1) * stream_k - 1, units)
                        last_block = T.truncdiv((seg[1] * half + half) * stream_k - 1, units)
                        partial_to_workspace(acc, C, S, ws, counters, flag, seg[1], last_block - first_block + 1,
                                             seg[2], seg[3], tx, wg, wq, lane)
                    seg[0] = seg[0] + seg[5]

    return w4a16_prim_func(body_stream_k if stream_k else body_persistent if persistent else body, m, tiles, n,
                           problem.k, group, dtype, workspace=split, slots=kb.workspace_slots)


PASS_CONFIGS = {
    # Hand-written pipeline: no warp specialization, no TMA lowering, every barrier explicit.
    "tl.disable_warp_specialized": True,
    "tl.disable_tma_lower": True,
    "tl.disable_thread_storage_sync": True,
}

