"""The consumers' k-loop of stream_wgmma: wait for a stage, decode it, issue its wgmmas, free a stage.

Why it looks the way it does:
- A warpgroup decodes k-tile t + 1 into a second A fragment buffer while k-tile t's wgmmas run
  (wgmma.wait_group 1 after each issue; docs/performance.md, overlap). The loop is unrolled by two
  so that the buffers have constant register indices (with stage_unroll by a multiple of the stages,
  so that every stage index and barrier phase is a constant too). The k-tiles that do not fill a
  trip run before the loop: under a condition inside it, or after it, ptxas waited for every wgmma
  before the next (its warning C7513).
- The oldest stage is freed by a block barrier after the wgmma wait (then refilled at once), or with
  release barriers by an arrival on its "empty" mbarrier, a k-tile late: k-tile t - 1's wgmmas are
  done once t's are issued and waited down to one group.
- ring = D commits each k-step's wgmmas as a group of their own and decodes k-step u into slot u % D
  once the wgmmas that read it last are done: D k-steps of fragments instead of two stages', fewer
  registers, more blocks per SM (docs/performance.md, ring).
- fp8_rounded (W4A8 on this kernel, block_m <= 16): once a stage has landed the consumers round its
  activations to their FP8 values in place, fence them for the async proxy and meet before its
  wgmmas (schedules/fp8_rounding.py).
- scale_on_acc gives each k-tile's wgmmas sums of their own; ptxas serializes every wgmma (C7514)
  if sums are read with any wgmma in flight across the loop's back edge, so the fold waits for all
  of them, or with fold_lag folds k-tile t - 1's under k-tile t's wgmmas within the unrolled trip and
  waits for all once per trip (docs/performance.md, scale_on_acc and fold_lag).
"""
import math

import tilelang.language as T

from templates import FP8_DECODE_UNIT as DECODE_UNIT

from .decode import decode_stage, decode_step, fold_k_tile, read_w
from .producer import load_tma


@T.macro
def wgmma_step(plan, mem, abuf, tile, u, base=0, accumulate=1):
    """K-step u's wgmmas, one m64n{bm}k16 per group, A from its fragment slot of buffer `abuf`, into
    the sums from acc[base] (accumulate 0: overwriting them)."""
    g, ab = plan.g, plan.ab
    for i in T.unroll(g):
        T.ptx_wgmma_rs("float32", plan.wgmma_shape, True, ab, ab, "fp32",
                       mem.a.data, abuf * plan.a_len + (plan.fragment_slot(u) * g + i) * 8,
                       mem.desc.data, tile % plan.stages * plan.stage_units + plan.x_offset(u),
                       mem.acc.data, base + i * (plan.bm // 2), accumulate, 1, 1)


@T.macro
def mma_stage(plan, mem, abuf, tile, sums=0):
    """Issue (not wait for) the stage's wgmmas: per k-step one m64n{bm}k16 per group (scale_on_acc:
    into the k-tile's own set of sums, acc[acc_len * (1 + sums):], which the first k-step overwrites)."""
    sacc = plan.sacc
    base = plan.acc_len * (1 + sums) if sacc else 0
    T.warpgroup_fence_operand(mem.acc, base, num_regs=plan.acc_len)
    T.warpgroup_arrive()
    for u in T.unroll(plan.steps):
        # (k-step 0 overwrites the k-tile's sums through the predicate, not peeled off the loop: peeled,
        # nvcc left the A fragments in local memory at block_m 32)
        wgmma_step(plan, mem, abuf, tile, u, base, u > 0 if sacc else 1)
    T.warpgroup_commit_batch()


@T.macro
def round_stage(plan, mem, tile):
    """fp8_rounded: the consumers round the landed stage's activations to their FP8 values in place and
    fence them for the async proxy (schedules/fp8_rounding.py), then meet, so that no wgmma reads the
    stage before every chunk of it is rounded."""
    T.call_extern("handle", plan.round_stage,
                  mem.X_s.access_ptr("rw", offset=tile % plan.stages * plan.stage_units * 8))
    T.call_extern("handle", "tm_consumers_sync", plan.consumers)


@T.macro
def mma_ring(plan, mem, tile):
    """ring = D: the stage's k-steps one commit group each, k-step u decoded into fragment slot
    u % D once the wgmmas that read it last (D groups back) are done: D k-steps of wgmmas in
    flight with D k-steps of fragments (two whole buffers hold 2 * steps). D divides `steps`, so
    the slots are constants; since D <= steps, every wgmma of the previous k-tile is done when
    this returns."""
    T.warpgroup_fence_operand(mem.acc, num_regs=plan.acc_len)
    for u in T.unroll(plan.steps):
        T.warpgroup_wait(plan.kb.ring - 1)
        decode_step(plan, mem, 0, u)
        T.warpgroup_arrive()
        wgmma_step(plan, mem, 0, tile, u)
        T.warpgroup_commit_batch()


@T.macro
def consume_k_tile(plan, mem, k0, by, bx, tx, wg, wq, lane, g, t, r, first=True, last=True):
    """K-tile t (number g of the block's sequence) into A fragment buffer r % 2: wait for its stage's
    barrier phase, decode, issue the wgmmas; then free the oldest stage: a block barrier after the
    wgmma wait (and the next copy, issued by one elected thread), or with release_barriers an
    arrival on the stage's "empty" barrier (warp 0 refills it, or with producer_warp the producer
    warp). first / last: whether it opens / closes its unrolled trip (fold_lag waits for all wgmmas
    once per trip)."""
    stages, sacc, release, empty = plan.stages, plan.sacc, plan.release, mem.empty
    T.mbarrier_wait_parity(mem.full[g % stages], g // stages % 2)
    if plan.round_fp8:
        round_stage(plan, mem, g)
    read_w(plan, mem, g, wg, wq, lane, r % 2 * plan.per_s if sacc else 0)
    if plan.kb.ring:
        mma_ring(plan, mem, g)
    elif plan.lag:
        # K-tile t - 1's sums are folded after the wait that completes it, under k-tile t's wgmmas.
        # ptxas allows that only within the unrolled trip (across the loop's back edge it serialized
        # every wgmma, C7514), so each trip ends with a wait for all and the fold of its last k-tile.
        decode_stage(plan, mem, r % 2)
        mma_stage(plan, mem, r % 2, g, r % 2)
        if first:
            if release and t >= 1:
                T.barrier_arrive(empty[(g - 1) % stages])     # done since the last trip's end
        else:
            T.warpgroup_wait(1)
            if release:
                T.barrier_arrive(empty[(g - 1) % stages])
            fold_k_tile(plan, mem, (r + 1) % 2, (r + 1) % 2)
        if last:
            T.warpgroup_wait(0)
            fold_k_tile(plan, mem, r % 2, r % 2)
    elif sacc:
        # Decoded under k-tile t - 1's wgmmas, as below; but its sums are read before this k-tile's
        # wgmmas overwrite them, after a wait for all (ptxas serializes every wgmma when sums are read
        # with any wgmma in flight, its C7514). Before the first k-tile they and its scales are zeros.
        decode_stage(plan, mem, r % 2)
        T.warpgroup_wait(0)
        if release and t >= 1:
            T.barrier_arrive(empty[(g - 1) % stages])     # its stage at once, before the fold
        fold_k_tile(plan, mem, (r + 1) % 2)
        mma_stage(plan, mem, r % 2, g)
    else:
        decode_stage(plan, mem, r % 2)
        mma_stage(plan, mem, r % 2, g)
        T.warpgroup_wait(1)
    if not release:
        T.sync_threads()
    elif not sacc:
        # This thread is done with k-tile t - 1 and its stage.
        if t >= 1:
            T.barrier_arrive(empty[(g - 1) % stages])
    if not plan.producer:
        load_tma(plan, mem, t + stages - 1, k0, by, bx, tx)


@T.macro
def consume(plan, mem, k0, by, bx, tx, wg, wq, lane, count):
    """The consumers' k-loop over the block's `count` k-tiles from k-tile k0, unrolled by two so that
    the fragment buffers have constant register indices (with stage_unroll by a multiple of `stages`
    too). The k-tiles that do not fill a trip run before the loop (an odd one in buffer 1): under a
    condition inside the loop, or after it, ptxas waited for every wgmma before the next (its warning
    C7513, found on down_proj with 43 k-tiles per split)."""
    # stage_unroll: a trip covers a multiple of `stages` k-tiles, so k-tile t's stage is a constant
    per_trip = math.lcm(2, plan.stages) if plan.kb.stage_unroll else 2
    lead = count % per_trip      # k-tiles before the loop
    # From four lead k-tiles on, all but an odd one run as a loop of two-k-tile trips (stage index at
    # run time) that nvcc keeps rolled: peeled straight-line, each k-tile past the first cost ptxas
    # ~15 registers (qkv 16 at 6 stages, lead 4: 150 against 112), 2 blocks per SM instead of 3.
    looped = lead // 2 * 2 if lead >= 4 else 0
    peeled = lead - looped
    for r in T.unroll(peeled):  # buffer (r + lead) % 2: k-tile `lead`, the loop's first, takes buffer 0
        consume_k_tile(plan, mem, k0, by, bx, tx, wg, wq, lane, r, r, r + lead, r == 0, r == peeled - 1)
    for t0 in T.unroll(looped // 2, unroll_factor=1):
        for r in T.unroll(2):
            t = peeled + t0 * 2 + r
            consume_k_tile(plan, mem, k0, by, bx, tx, wg, wq, lane, t, t, r, r == 0, r == 1)
    for t0 in T.serial(count // per_trip):
        for r in T.unroll(per_trip):
            t = lead + t0 * per_trip + r
            consume_k_tile(plan, mem, k0, by, bx, tx, wg, wq, lane, t, t, r, r == 0, r == per_trip - 1)


@T.macro
def finish_sums(plan, mem, by, lane):
    """After the k-loop: wait for the last wgmmas, whose sums the epilogues read (scale_on_acc: fold
    the last k-tile's, whose scales are set 1: the loop's k-tiles come in pairs, and a lone lead one
    takes buffer 1). W4A8: then each sum times its row's token scale (offset_decode: and 512, the
    decode's 2^-9; its offset correction is in the sums from the start, kernel.start_sums), so that
    every epilogue (and split-K's sum of partial tiles, linear in them) stores finished values."""
    T.warpgroup_wait(0)
    T.warpgroup_fence_operand(mem.acc, num_regs=plan.acc_len)
    if plan.sacc and not plan.lag:      # (fold_lag folded it at its trip's end)
        fold_k_tile(plan, mem, 1)
    if plan.fp8:
        scale_by_tokens(plan, mem, by, lane)


@T.macro
def scale_by_tokens(plan, mem, by, lane):
    """The lane's sums times their rows' token scales (offset_decode: times 512 too): rows 8c + 2t + e
    of the tile (e = 0, 1) hold elements c * 4 + 2h + e of each group (schedules/stream_wgmma/
    plan.fragment_element); rows past M read the last row's scale (their sums are never stored)."""
    bm, acc, TS = plan.bm, mem.acc, mem.TS
    for c in T.unroll(bm // 8):
        for e in T.unroll(2):
            row = T.min(by * bm + 8 * c + 2 * (lane % 4) + e, plan.m - 1)
            for i in T.unroll(plan.g):
                for h in T.unroll(2):
                    k = i * (bm // 2) + c * 4 + 2 * h + e
                    if plan.offset:
                        acc[k] = acc[k] * (TS[row, 0] * DECODE_UNIT)
                    else:
                        acc[k] = acc[k] * TS[row, 0]
