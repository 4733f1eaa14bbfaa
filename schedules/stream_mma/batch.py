"""One batch of a warp: its slots read into registers, its weight words decoded into A fragments, the
swapped MMAs (C^T = W^T X^T: one word is a lane's A fragments of four 16x16 W^T tiles, the activations
the B operand, 8 rows of M per m16n8k16), and the fold of its sums into the running total."""
# No `from __future__ import annotations`: TileLang macros evaluate their annotations.

import tilelang.language as T

from ..marlin_mma.layout import SLAB_N
from .knobs import MMA_N
from .plan import Plan


def batch_compute(plan: Plan):
    """A T.macro(bufs, buf, slot, batch, lane, wk) that decodes and multiplies the batch in register
    buffer `buf` (activations, and with async_weights the weights and scales too: shared slot `slot`),
    and folds its sums (with fold_lag: the previous batch's)."""
    ahead, acc_len, off_len, per_s = plan.ahead, plan.acc_len, plan.off_len, plan.per_s
    read_slots, multiply, fold_sums = slot_reads(plan), swapped_mmas(plan), sums_fold(plan)

    @T.macro
    def compute(bufs, buf, slot, batch, lane, wk):
        wb, sb = (0, 0) if plan.w_smem else (buf * plan.per_w, buf * per_s)
        cur = buf % 2 if plan.lag else 0           # this batch's set of sums; the previous batch's is 1 - cur
        ab, ob = cur * acc_len, cur * off_len
        xb = 0 if plan.x_smem else buf * plan.per_x        # x_ldmatrix: one x buffer, filled here
        if plan.x_smem:
            T.ptx_wait_group(ahead - 1)                # this batch's chunks have landed ...
            T.call_extern("handle", "__syncwarp")      # ... for every lane of the warp
        if batch < plan.batches:
            read_slots(bufs, slot, lane, wk, xb)
            if plan.round_fp8:      # fp8_rounded: each register of two activations (schedules/fp8_rounding.py)
                for i in T.unroll(plan.per_x // 2):
                    T.call_extern("handle", plan.round_fp8_name, T.access_ptr(bufs.x[xb + 2 * i], "rw"))
            if plan.fold and not plan.lag:    # fold_lag zeroes a set right after folding it
                for i in T.unroll(acc_len):
                    bufs.acc[i] = T.float32(0)
                for i in T.unroll(off_len):
                    bufs.off[i] = T.float32(0)
            multiply(bufs, wb, sb, xb, ab, ob)
            if plan.fold and not plan.lag:
                # The batch lies in one group: its sums (less the offsets) take the group's scale once.
                fold_sums(bufs, bufs.scale, 0, 0, sb)
            if plan.lag and plan.grouped:
                # The scales outlive the batch's buffer (the next load refills it): kept with its sums.
                for v in T.unroll(per_s):
                    bufs.lag_scale[cur * per_s + v] = bufs.scale[sb + v]
        if plan.lag:
            # The previous batch's sums: its MMAs were issued a batch ago, so the fold does not wait for
            # them and runs under this batch's (a batch past the end folds the last one, or zeros).
            fold_sums(bufs, bufs.lag_scale, (1 - cur) * acc_len, (1 - cur) * off_len, (1 - cur) * per_s)
            for i in T.unroll(acc_len):
                bufs.acc[(1 - cur) * acc_len + i] = T.float32(0)
            for i in T.unroll(off_len):
                bufs.off[(1 - cur) * off_len + i] = T.float32(0)
        if plan.x_smem:
            T.call_extern("handle", "__syncwarp")      # the slot is read before a later batch refills it

    return compute


def slot_reads(plan: Plan):
    """A T.macro(bufs, slot, lane, wk, xb) that moves a landed batch from warp wk's shared slot `slot`
    into registers: with async_weights the weight words and scales, with x_ldmatrix the activations'
    B fragments (into x from xb)."""
    per_w, unroll, x_index, scale_col = plan.per_w, plan.unroll, plan.x_index, plan.scale_col

    @T.macro
    def read(bufs, slot, lane, wk, xb):
        if plan.w_smem:
            for i in T.unroll(per_w // 4):
                for v in T.vectorized(4):
                    bufs.w[i * 4 + v] = bufs.W_s[wk, slot, i * 128 + lane * 4 + v]
            if plan.grouped:
                for v in T.unroll(8):
                    bufs.scale[v] = bufs.S_s[wk, slot, scale_col(v, lane // 4)]
                    if plan.zp:
                        bufs.scale[8 + v] = bufs.S_s[wk, slot, SLAB_N + scale_col(v, lane // 4)]
        if plan.x_smem:
            # Matrices: rows of m-tile mi x k 0-7, 8-15 of step u, then of step u + 1: b0b1, b2b3 twice.
            for mi in T.unroll(plan.m_tiles):
                for u in T.unroll(unroll // 2):
                    T.ptx_ldmatrix(False, 4,
                                   T.access_ptr(bufs.X_s[wk, slot, mi * MMA_N + lane % 8, u * 32 + (lane // 8) * 8],
                                                "r"),
                                   T.access_ptr(bufs.x[xb + x_index(2 * u, mi)], "w"))

    return read


def swapped_mmas(plan: Plan):
    """A T.macro(bufs, wb, sb, xb, ab, ob) that decodes every weight word of a batch (from w at wb,
    its scales from sb) into A fragments and multiplies them with the activations (x at xb) into the
    set of sums at ab; with fold_zero_point also the offsets' MMAs, into the set of offsets at ob."""
    mma_dtype, unroll, m_tiles = plan.mma_dtype, plan.unroll, plan.m_tiles
    x_index, acc_index = plan.x_index, plan.acc_index

    @T.macro
    def offsets(x, a_off, off, xb, u, ob):
        """fold_zero_point: k-step u's activations against the constant A fragment, into the offsets'
        sums (set `ob`)."""
        for mi in T.unroll(m_tiles):
            T.ptx_mma("float32", "m16n8k16", "row", "col", mma_dtype, mma_dtype, "fp32",
                      a_off.data, 0, x.data, xb + x_index(u, mi), off.data, ob + mi * 4, False)

    @T.macro
    def accumulate(a, x, acc, xb, u, j, mi, ab):
        """Word j (decoded into a) against k-step u of m-tile mi, into its sum (set `ab`)."""
        T.ptx_mma("float32", "m16n8k16", "row", "col", mma_dtype, mma_dtype, "fp32",
                  a.data, j * 8, x.data, xb + x_index(u, mi), acc.data, ab + acc_index(j, mi), False)

    def word(bufs, wb, u, j):
        """Pointer to word j of k-step u in the weight buffer at wb."""
        return T.access_ptr(bufs.w[wb + u * 4 + j], "r")

    @T.macro
    def decode(bufs, wb, sb, u, j):
        """The word's A fragments into a: raw magic-number codes (fold_zero_point), codes less 8 times the
        group's scales plus the zero points' offsets (zero points: scales from sb, offsets in
        zero_offsets), codes less 8 times the group's scales (scales from sb), or without the scales
        (channelwise: they scale the final sums)."""
        if plan.fold:
            T.call_extern("handle", plan.decode_raw, word(bufs, wb, u, j), T.access_ptr(bufs.a[j * 8], "w"))
        elif plan.zp:
            T.call_extern("handle", plan.zero.scaled, word(bufs, wb, u, j), T.access_ptr(bufs.scale[sb + 2 * j], "r"),
                          T.access_ptr(bufs.zero_offsets[2 * j], "r"), T.access_ptr(bufs.a[j * 8], "w"))
        elif plan.scale_weights:
            T.call_extern("handle", plan.decode_scaled, word(bufs, wb, u, j),
                          T.access_ptr(bufs.scale[sb + 2 * j], "r"), T.access_ptr(bufs.a[j * 8], "w"))
        else:
            T.call_extern("handle", plan.decode, word(bufs, wb, u, j), T.access_ptr(bufs.a[j * 8], "w"))

    @T.macro
    def multiply(bufs, wb, sb, xb, ab, ob):
        if plan.zero_offsets_len:
            # The batch's offsets, once: a sub-tile's two rows' z sit 8 after their scales.
            for j in T.unroll(4):
                T.call_extern("handle", plan.zero.offsets, T.access_ptr(bufs.scale[sb + 8 + 2 * j], "r"),
                              T.access_ptr(bufs.scale[sb + 2 * j], "r"),
                              T.access_ptr(bufs.zero_offsets[2 * j], "w"))
        for u in T.unroll(unroll):
            if plan.fold:
                offsets(bufs.x, bufs.a_off, bufs.off, xb, u, ob)
            for j in T.unroll(4):
                decode(bufs, wb, sb, u, j)
                for mi in T.unroll(m_tiles):
                    accumulate(bufs.a, bufs.x, bufs.acc, xb, u, j, mi, ab)

    return multiply


def sums_fold(plan: Plan):
    """fold_zero_point: a T.macro(bufs, scale, ab, ob, sb) that adds one batch's sums (set ab) less the
    offsets (set ob), times its group's scales (`scale` from sb; channelwise: none), to the running
    total; with zero points the offsets (magic numbers only) in elements 0-1 of each m-tile, and the
    batch's activation sums in elements 2-3, times the zero points (`scale` from sb + 8), come off."""
    m_tiles, acc_index = plan.m_tiles, plan.acc_index

    @T.macro
    def fold_sums(bufs, scale, ab, ob, sb):
        for j in T.unroll(4):
            for mi in T.unroll(m_tiles):
                for e in T.unroll(4):
                    i = acc_index(j, mi) + e
                    if plan.zp:
                        # The offsets' sums of this row of M in elements 0-1, its activations' sum in 2-3:
                        # (raw - magic - z) x s, z times the sum off in one FFMA (nvcc left a - b * c
                        # as a multiply and a subtraction)
                        part = T.call_extern("float32", "__fmaf_rn", -bufs.off[ob + mi * 4 + 2 + e % 2],
                                             T.cast(scale[sb + 8 + 2 * j + e // 2], "float32"),
                                             bufs.acc[ab + i] - bufs.off[ob + mi * 4 + e % 2])
                        bufs.total[i] = bufs.total[i] + part * T.cast(scale[sb + 2 * j + e // 2], "float32")
                    elif plan.grouped:
                        part = bufs.acc[ab + i] - bufs.off[ob + mi * 4 + e]
                        bufs.total[i] = bufs.total[i] + part * T.cast(scale[sb + 2 * j + e // 2], "float32")
                    else:
                        bufs.total[i] = bufs.total[i] + (bufs.acc[ab + i] - bufs.off[ob + mi * 4 + e])

    return fold_sums
