"""Large-M W4A16 on Hopper: TMA pipeline, dequantization into shared memory, wgmma, warp specialization.

At large M the weights are reused block_m times per load, so the decode cost per MMA shrinks and the
tensor-core rate decides. mma.sync cannot reach wgmma's rate on sm_90a; this family lets TileLang's
Hopper path do what it does best (T.Pipelined + T.copy + T.gemm becomes a warp-specialized TMA/wgmma
pipeline with a producer warpgroup) and adds one step between the loads and the MMA: the consumer
warpgroups decode the packed tile (marlin_mma's layout, so one packed copy of the weights serves
both families) into an fp16 [block_n, block_k] tile in shared memory, scaled, for wgmma to read,
a whole 32-bit word at a time with the same lop3 template as marlin_mma.
Channelwise scales are applied to the fp32 sums instead.
"""
# No `from __future__ import annotations`: T.prim_func evaluates the annotations below.
import tilelang.language as T

from templates import dequant_function_names, render_dequant

from ..marlin_mma.layout import SLAB_N
from ..problem import Problem
from .knobs import Knobs


def unpacked_position(row, col, pair, elem):
    """(n, k) in the tile of value (pair, elem) of the packed word at [row, col]: marlin_mma.layout's
    map (col = slab * 128 + lane * 4 + j, lane = 4g + t; value W[2t + 8r + e, 8s + g] of sub-tile j
    with s = pair // 2, r = pair % 2). Works on ints and on TileLang expressions alike."""
    lane = (col % 128) // 4
    n = (col // 128) * SLAB_N + (col % 4) * 16 + 8 * (pair // 2) + lane // 4
    k = row * 16 + 2 * (lane % 4) + 8 * (pair % 2) + elem
    return n, k


def build(problem: Problem, knobs: Knobs):
    n, k, group, dtype = problem.n, problem.k, problem.group, problem.dtype
    kb = knobs
    m = T.dynamic("m")
    bm, bn, bk = kb.block_m, kb.block_n, kb.block_k
    grouped = not problem.channelwise
    decode, _ = dequant_function_names(dtype, problem.bits)

    @T.prim_func
    def w4a16_gemm_wgmma(A: T.Tensor((m, k), dtype), B: T.Tensor((k // 16, 2 * n), "int32"),
                         S: T.Tensor((k // group, n), dtype), C: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(m, bm), n // bn, threads=kb.threads, prelude=render_dequant(dtype, problem.bits)) as (by, bx):
            A_s = T.alloc_shared((bm, bk), dtype)
            Bq_s = T.alloc_shared((bk // 16, bn * 2), "int32")
            S_s = T.alloc_shared((1, bn), dtype)
            W_s = T.alloc_shared((bn, bk), dtype)
            C_f = T.alloc_fragment((bm, bn), "float32")
            frag = T.alloc_local((8,), dtype)
            T.clear(C_f)
            for ko in T.Pipelined(k // bk, num_stages=kb.num_stages):
                T.copy(A[by * bm, ko * bk], A_s)
                T.copy(B[ko * (bk // 16), bx * bn * 2], Bq_s)
                if grouped:
                    T.copy(S[ko * bk // group, bx * bn], S_s)
                # One packed word per iteration: one shared load, the lop3 decode of eight values,
                # eight scaled stores into the fp16 tile that wgmma reads.
                for row, col in T.Parallel(bk // 16, bn * 2):
                    T.call_extern("handle", decode, T.access_ptr(Bq_s[row, col], "r"), T.access_ptr(frag[0], "w"))
                    for pair in T.unroll(4):
                        for elem in T.unroll(2):
                            nn, kk = unpacked_position(row, col, pair, elem)
                            value = frag[2 * pair + elem]
                            W_s[nn, kk] = value * S_s[0, nn] if grouped else value
                T.gemm(A_s, W_s, C_f, transpose_B=True)
            if not grouped:
                for i, j in T.Parallel(bm, bn):
                    C_f[i, j] = C_f[i, j] * T.cast(S[0, bx * bn + j], "float32")
            T.copy(C_f, C[by * bm, bx * bn])

    return w4a16_gemm_wgmma


PASS_CONFIGS: dict = {}
