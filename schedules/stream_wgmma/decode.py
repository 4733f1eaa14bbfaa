"""The stream_wgmma decode: packed words from a stage straight into wgmma's register A fragments.

Why it looks the way it does:
- wgmma's `.rs` form takes A from registers with, per warp of the warpgroup, mma.m16n8k16's A
  layout for that warp's 16 rows, and one 32-bit word of marlin_mma's packed layout decodes into
  exactly such a fragment (lop3 and the magic-number trick, templates/dequant.cuh.j2): decoded
  weights never touch shared memory, and nothing is repacked.
- The words come from the stage that TMA filled, a lane's `groups` words of a k-step side by side
  (one 4-, 8- or 16-byte load); with rotate each lane quarter reads the next slab quarter, so that a
  warp's load touches every bank once (plan.slab_quarter).
- Group scales multiply the decoded weights (a k-tile lies in one group: knobs.check), two scales
  per lane and group (its rows g and g + 8). scale_on_acc decodes unscaled instead and scales each
  k-tile's fp32 sums as they join the running sums (fold_k_tile): one FFMA per sum and k-tile instead
  of four HMUL2 per word (docs/performance.md, scale_on_acc). Channelwise scales multiply the final
  sums (plan.output_value).
- FP8 activations (W4A8): a 32-deep wgmma's A fragment is two words' decodes (tm_decode_e4m3_a_u4:
  the codes - 8 as e4m3, exact, unscaled), k 0-15 from word 2u and 16-31 from word 2u + 1; group
  scales always go on the sums (knobs.fp8_reason), the token scales on the final sums (store.py).
- Zero points: z comes with the scales (a second row of the stage's scale box, exact integers in
  the activations' dtype). With scale_on_acc the decode takes it off in place of 8, code - z
  (exact), from subtrahends (magic + z, ...) each k-tile makes once per group and row pair; otherwise
  each k-tile makes the rows' offsets o = (8 - z) * s once and the decode adds them, w = (q - 8) * s +
  o, an HFMA2 per pair where the symmetric decode has its HMUL2. Either way a word costs what a
  symmetric one does: asymmetric weights cost the zero points' bytes (3 % more at group 128) and a
  few instructions per group.
"""
import tilelang.language as T

from .plan import slab_quarter


@T.macro
def read_w(plan, mem, tile, wg, wq, lane, sb):
    """The lane's words and scales of k-tile `tile` from its stage into registers (the scales from
    sc[sb])."""
    g, stages, W_s, S_s, w, sc = plan.g, plan.stages, mem.W_s, mem.S_s, mem.w, mem.sc
    word = (wg * g + wq * g // 4) * 128 + lane * 4 + slab_quarter(wq, lane, 0, g, plan.kb.rotate)
    for u in T.unroll(plan.word_rows):
        for v in T.vectorized(g):
            w[u * g + v] = W_s[tile % stages, u, word + v]
    if plan.grouped:
        for i in T.unroll(g):
            for h in T.unroll(2):
                sc[sb + 2 * i + h] = S_s[tile % stages, 0, plan.weight_col(0, wg, wq, lane, i, h)]
                if plan.zp:
                    sc[plan.z_at + 2 * i + h] = S_s[tile % stages, 1, plan.weight_col(0, wg, wq, lane, i, h)]
            if plan.zp and plan.sacc:
                T.call_extern("handle", plan.zero.subtrahends, T.access_ptr(sc[plan.z_at + 2 * i], "r"),
                              T.access_ptr(sc[plan.zp_at + i * plan.per_zero], "w"))
            elif plan.zp:
                T.call_extern("handle", plan.zero.offsets, T.access_ptr(sc[plan.z_at + 2 * i], "r"),
                              T.access_ptr(sc[sb + 2 * i], "r"), T.access_ptr(sc[plan.zp_at + 2 * i], "w"))


@T.macro
def decode_step(plan, mem, abuf, u):
    """Decode k-step u of the words into its fragment slot of A buffer `abuf`."""
    g, a_len, w, sc, a = plan.g, plan.a_len, mem.w, mem.sc, mem.a
    for i in T.unroll(g):
        if plan.fp8:
            # The k32 fragment's first two registers from word 2u (k 0-15), the last two from 2u + 1.
            for h in T.unroll(2):
                T.call_extern("handle", plan.decode, T.access_ptr(w[(2 * u + h) * g + i], "r"),
                              T.access_ptr(a[abuf * a_len + (plan.fragment_slot(u) * g + i) * 8 + 4 * h], "w"))
        elif plan.zp and plan.sacc:
            T.call_extern("handle", plan.zero.unscaled, T.access_ptr(w[u * g + i], "r"),
                          T.access_ptr(sc[plan.zp_at + i * plan.per_zero], "r"),
                          T.access_ptr(a[abuf * a_len + (plan.fragment_slot(u) * g + i) * 8], "w"))
        elif plan.zp:
            T.call_extern("handle", plan.zero.scaled, T.access_ptr(w[u * g + i], "r"),
                          T.access_ptr(sc[2 * i], "r"), T.access_ptr(sc[plan.zp_at + 2 * i], "r"),
                          T.access_ptr(a[abuf * a_len + (plan.fragment_slot(u) * g + i) * 8], "w"))
        elif plan.grouped and not plan.sacc:
            T.call_extern("handle", plan.decode_scaled, T.access_ptr(w[u * g + i], "r"),
                          T.access_ptr(sc[2 * i], "r"),
                          T.access_ptr(a[abuf * a_len + (plan.fragment_slot(u) * g + i) * 8], "w"))
        else:
            T.call_extern("handle", plan.decode, T.access_ptr(w[u * g + i], "r"),
                          T.access_ptr(a[abuf * a_len + (plan.fragment_slot(u) * g + i) * 8], "w"))


@T.macro
def decode_stage(plan, mem, abuf):
    """Decode the stage's words into A fragment buffer `abuf`."""
    for u in T.unroll(plan.steps):
        decode_step(plan, mem, abuf, u)


@T.macro
def zero_sums(plan, mem):
    """The running sums start at zero; with scale_on_acc so do both k-tile sets, so that the first
    k-tile's fold of the other set adds zero, and their scales (W4A8's channelwise scales, which
    multiply the output: ones, never read from the stages)."""
    acc, sc = mem.acc, mem.sc
    for i in T.unroll(plan.acc_all):
        acc[i] = T.float32(0)
    if plan.sacc:
        for i in T.unroll(2 * plan.per_s):
            sc[i] = T.cast(0 if plan.grouped else 1, plan.dtype)


@T.macro
def fold_k_tile(plan, mem, p, sums=0):
    """scale_on_acc: a finished k-tile's sums (set `sums`) times its group scales (set p of sc), added
    to the running sums: element j of group i lies on weight row g + 8 * (j % 4 // 2)."""
    bm, acc, sc = plan.bm, mem.acc, mem.sc
    base = plan.acc_len * (1 + sums)
    T.warpgroup_fence_operand(acc, base, num_regs=plan.acc_len)
    for i in T.unroll(plan.g):
        for j in T.unroll(bm // 2):
            k = i * (bm // 2) + j
            acc[k] = acc[k] + acc[base + k] * T.cast(sc[p * plan.per_s + 2 * i + j % 4 // 2], "float32")
