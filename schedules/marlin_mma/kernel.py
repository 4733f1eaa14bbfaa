"""The Marlin-design W4A16 kernel as a TileLang program (mma.sync m16n8k16, any arch >= sm_80).

Why it looks the way it does:
- Weights arrive pre-permuted (layout.py): one 16-byte shared-memory load gives a lane the packed
  words of four 16x16 sub-tiles, each word decoding straight into the lane's B fragments.
- Global -> shared moves go through a `num_stages`-deep cp.async pipeline (T.Pipelined), so tile
  k+1..k+s-1 stream in while tile k is decoded and multiplied. TMA is switched off on purpose: the
  consumer here is hand-written register code, not T.gemm, and cp.async keeps one code path from
  sm_80 to sm_90a.
- Dequantization happens in registers (templates/dequant.cuh.j2): lop3 + magic numbers, then the
  group scale as one half2 multiply per pair. Channelwise scales are applied once, to the fp32 sums.
- A fragments come from ldmatrix.x4 on a swizzled shared tile (conflict-free); MMAs are m16n8k16
  with fp32 accumulators, warp_m/16 x warp_n/8 independent MMAs per k-step per warp.
- warps_k > 1 lets several warps share a block's k-steps (more MMAs in flight at small M); their sums
  meet in a shared fp32 tile. split_k > 1 spreads K over blocks: each block atomically adds its fp32
  partial into a zeroed workspace, and the last block of a tile to arrive (a per-tile counter) writes
  the output and zeroes the workspace and counter again, so the next call finds them ready. One
  launch, no host work, CUDA-graph safe.
"""
# No `from __future__ import annotations`: T.prim_func evaluates the annotations below.

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from templates import dequant_function_names, mma_operand_dtype, render_dequant

from ..epilogue import split_k_prelude, store_tile, w4a16_prim_func
from ..problem import Problem
from .knobs import Knobs
from .layout import SLAB_N


def build(problem: Problem, knobs: Knobs):
    """The TileLang prim_func for `problem` with `knobs` (checked by knobs.check beforehand).

    Arguments of the kernel, in order: A [M, K], packed B [K/16, 2N] int32, packed scales
    [K/group, N], C [M, N]; with split_k > 1 also a fp32 workspace [M, N] and int32 tile counters
    [>= ceil(M/block_m) * N/block_n], both zero before the first call (the kernel leaves them zero).
    """
    n, k, group, dtype = problem.n, problem.k, problem.group, problem.dtype
    kb = knobs
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    bm, bn, bk = kb.block_m, kb.block_n, kb.block_k
    warps_n, warps_k = kb.warps_n, kb.warps_k
    m_tiles = kb.warp_m // 16               # 16-row MMA tiles per warp
    slabs = kb.warp_n // SLAB_N             # 64-column slabs per warp
    steps = bk // 16 // warps_k             # k-steps of 16 per warp per block tile
    unit = kb.split_unit_tiles(problem)     # k-tiles per split-K work unit (a whole group)
    units = k // (bk * unit)
    grouped = not problem.channelwise
    scale_weights = grouped and not kb.scale_on_acc
    split = kb.split_k > 1
    mma_dtype = mma_operand_dtype(dtype)
    decode, decode_scaled = dequant_function_names(dtype, problem.bits)
    prelude = render_dequant(dtype, problem.bits) + split_k_prelude(bm, bn, kb.split_k, kb.threads, n,
                                                                    problem.channelwise, cluster=False)
    acc_len = m_tiles * slabs * 8 * 4        # per slab: 8 n8 tiles x 4 fp32 accumulators
    grid_n = n // bn
    max_iters = -(-units // kb.split_k) * unit
    store = store_tile(bm, bn, grid_n, kb.split_k, dtype, problem.channelwise)

    def acc_col(lane, wn, sj, t8, e):
        """Block-tile column of accumulator element e of n8 tile t8 in slab sj (mma C fragment)."""
        return wn * kb.warp_n + sj * SLAB_N + t8 * 8 + (lane % 4) * 2 + e % 2

    def acc_index(mi, sj, t8, e):
        return ((mi * slabs + sj) * 8 + t8) * 4 + e

    @T.macro
    def body(A, B, S, C, ws, counters):
        # M tiles vary fastest: blocks that share a weight tile run together and read it from HBM once.
        with T.Kernel(T.ceildiv(m, bm), grid_n, kb.split_k, threads=kb.threads, prelude=prelude) as (by, bx, bz):
            A_s = T.alloc_shared((bm, bk), dtype)
            B_s = T.alloc_shared((bk // 16, bn * 2), "int32")
            S_s = T.alloc_shared((1, bn), dtype)
            C_s = T.alloc_shared((bm, bn), "float32")
            a_frag = T.alloc_local((m_tiles * 8,), dtype)
            b_words = T.alloc_local((4,), "int32")
            b_frag = T.alloc_local((8,), dtype)
            scale = T.alloc_local((slabs * 8,), dtype)
            acc = T.alloc_local((acc_len,), "float32")
            total = T.alloc_local((acc_len if kb.scale_on_acc else 1,), "float32")
            T.annotate_layout({A_s: make_swizzled_layout(A_s)})

            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            wk = warp % warps_k
            wn = (warp // warps_k) % warps_n
            wm = warp // (warps_k * warps_n)
            # This block's k-tiles: whole groups, spread over the splits as evenly as they go.
            # T.Pipelined needs a constant trip count: splits one unit short of the longest run one
            # idle iteration, reloading their last tile (an L2 hit) and skipping the math.
            tile0 = (bz * units // kb.split_k) * unit
            iters = ((bz + 1) * units // kb.split_k) * unit - tile0

            for i in T.serial(acc_len):
                acc[i] = T.float32(0)
                if kb.scale_on_acc:
                    total[i] = T.float32(0)

            for ko in T.Pipelined(max_iters, num_stages=kb.num_stages):
                kt = tile0 + T.min(ko, iters - 1)
                T.copy(A[by * bm, kt * bk], A_s, disable_tma=True)
                T.copy(B[kt * (bk // 16), bx * bn * 2], B_s, disable_tma=True)
                if grouped:
                    T.copy(S[kt * bk // group, bx * bn], S_s, disable_tma=True)
                if ko < iters:
                    if scale_weights:
                        # The lane's B columns: 16j + 8s + g in each of its slabs.
                        for sj in T.unroll(slabs):
                            for v in T.unroll(8):
                                scale[sj * 8 + v] = S_s[0, (wn * slabs + sj) * SLAB_N + (v // 2) * 16 + (v % 2) * 8 + lane // 4]
                    for st in T.unroll(steps):
                        kk = st * warps_k + wk
                        for mi in T.unroll(m_tiles):
                            T.ptx_ldmatrix(False, 4,
                                           T.access_ptr(A_s[wm * kb.warp_m + mi * 16 + lane % 16, kk * 16 + (lane // 16) * 8], "r"),
                                           T.access_ptr(a_frag[mi * 8], "w"))
                        for sj in T.unroll(slabs):
                            for v in T.vectorized(4):
                                b_words[v] = B_s[kk, (wn * slabs + sj) * 128 + lane * 4 + v]
                            for j in T.unroll(4):
                                if scale_weights:
                                    T.call_extern("handle", decode_scaled, T.access_ptr(b_words[j], "r"),
                                                  T.access_ptr(scale[sj * 8 + 2 * j], "r"), T.access_ptr(b_frag[0], "w"))
                                else:
                                    T.call_extern("handle", decode, T.access_ptr(b_words[j], "r"),
                                                  T.access_ptr(b_frag[0], "w"))
                                for mi in T.unroll(m_tiles):
                                    for s in T.unroll(2):
                                        T.ptx_mma("float32", "m16n8k16", "row", "col", mma_dtype, mma_dtype, "fp32",
                                                  a_frag.data, mi * 8, b_frag.data, s * 4,
                                                  acc.data, acc_index(mi, sj, j * 2 + s, 0), False)
                    if kb.scale_on_acc:
                        # At the last k-tile of a group, fold the group's sums into the total, scaled.
                        if (tile0 + ko + 1) % unit == 0:
                            for mi in T.unroll(m_tiles):
                                for sj in T.unroll(slabs):
                                    for t8 in T.unroll(8):
                                        for e in T.unroll(4):
                                            i = acc_index(mi, sj, t8, e)
                                            total[i] = total[i] + acc[i] * T.cast(S_s[0, acc_col(lane, wn, sj, t8, e)], "float32")
                                            acc[i] = T.float32(0)

            sums = total if kb.scale_on_acc else acc
            # Warps meet in a shared fp32 tile: each k-group of warps adds its sums in turn.
            for i, j in T.Parallel(bm, bn):
                C_s[i, j] = T.float32(0)
            for r in T.serial(warps_k):
                T.sync_threads()
                if wk == r:
                    for mi in T.unroll(m_tiles):
                        for sj in T.unroll(slabs):
                            for t8 in T.unroll(8):
                                for e in T.unroll(4):
                                    row = wm * kb.warp_m + mi * 16 + lane // 4 + 8 * (e // 2)
                                    col = acc_col(lane, wn, sj, t8, e)
                                    C_s[row, col] = C_s[row, col] + sums[acc_index(mi, sj, t8, e)]
            T.sync_threads()

            store(C_s, C, S, ws, counters, m, by, bx, tx)

    return w4a16_prim_func(body, m, tiles, n, k, k // group, dtype, workspace=split)

