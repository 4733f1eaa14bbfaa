"""Hopper W4A16 with the weights as wgmma's register operand: C^T = W^T X^T, packed weights decoded
straight into A fragments, activations from shared memory (sm_90a).

Why it looks the way it does:
- mma.sync tops out near half of the H200's wgmma rate, which is why marlin_mma stays near 0.5x of
  FP16 at large M. wgmma takes its A operand from registers (the `.rs` form), and one packed word
  decodes into exactly such a fragment (decode.py): decoded weights never touch shared memory.
- The stages fill by TMA against one mbarrier each (producer.py): activations in the 128-byte
  swizzle that wgmma reads through a K-major SW128 descriptor, packed words and scale rows beside
  them, so the k-loop has no copy instruction, address arithmetic or proxy fence (docs/performance.md,
  register-operand wgmma and the mainloops that fed it). With producer_warp a warp of its own refills
  the stages that the consumers release (warp specialization); with setmaxnreg it is a whole
  warpgroup that hands its registers to the consumers, so that 256-row tiles can have one.
- A warpgroup decodes k-tile t + 1 while k-tile t's wgmmas run (mainloop.py).
- Without split-K every thread stores its fragment to C (or through staged_store's shared tile);
  with split-K the block's tile meets the other splits' through the common epilogue (store.py,
  schedules/epilogue.py). A block's k-tile count is a constant of its pipeline: uneven splits run
  one copy of the pipeline per count.
- Every barrier is explicit (the package's PASS_CONFIGS turn TileLang's own pipelining off).

This file puts the pieces together: the buffers, the two forms of the pipeline (a producer warp or
none; a producer warpgroup with setmaxnreg) and the block's tile, split and epilogue.
"""
import functools

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from templates import render_dequant

from ..epilogue import CLUSTER_HELPERS, EARLY_START_HELPERS, w4a8_prim_func, w4a16_prim_func
from ..fp8_rounding import ROUND_CHUNKS
from ..problem import Problem
from .correction import FENCE_ASYNC_SHARED, K_TILES_PER_STEP, add_offset_correction
from .decode import zero_sums
from .knobs import PRODUCER_REGISTERS, WARPGROUP, Knobs
from .mainloop import consume, finish_sums
from .plan import ATOM_OFFSET, LEADING_OFFSET, SW128, Buffers, Plan, panel_tile
from .producer import WARP_INDEX, load_tma, produce, start_early
from .store import CONSUMERS_SYNC, COPY16, acc_to_shared, store_sums


def device_code(plan: Plan) -> str:
    """The kernel's own device functions: the decode, and the helpers its knobs call."""
    kb = plan.kb
    return render_dequant(plan.dtype, plan.bits) + (CLUSTER_HELPERS if plan.cluster else "") + \
        (WARP_INDEX if kb.producer_warp else "") + (COPY16 if kb.staged_store else "") + \
        (CONSUMERS_SYNC if kb.staged_store or plan.offset or plan.round_fp8 else "") + \
        (ROUND_CHUNKS if plan.round_fp8 else "") + \
        (FENCE_ASYNC_SHARED if plan.offset else "") + (EARLY_START_HELPERS if kb.early_start else "") + \
        plan.split_k_prelude


@T.macro
def buffers(plan, A, B, S, C, ws, counters, TS, KS):
    """The block's shared stages, barriers and per-thread registers."""
    stages, bm, bn, dtype = plan.stages, plan.bm, plan.bn, plan.dtype
    x_shape = (stages, bm, plan.bk) if plan.atoms == 1 else (stages, plan.atoms, bm, 64)
    X_s = T.alloc_shared(x_shape, plan.x_dtype)
    T.annotate_layout({X_s: make_swizzled_layout(X_s)})
    full = T.alloc_barrier([1 if plan.release else plan.threads] * stages)
    empty = T.alloc_barrier([plan.consumers] * stages) if plan.release else None
    W_s = T.alloc_shared((stages, plan.word_rows, 2 * bn), "int32")
    S_s = T.alloc_shared((stages, plan.scale_rows, bn), dtype)
    w = T.alloc_local((plan.per_w,), "int32")
    sc = T.alloc_local((plan.sc_len,), dtype)
    a = T.alloc_local((plan.kb.ring * plan.g * 8 if plan.kb.ring else 2 * plan.a_len,), dtype)
    acc = T.alloc_local((plan.acc_all,), "float32")
    desc = T.alloc_wgmma_desc()
    # offset_decode's correction (correction.py): its B tile and descriptor
    KS_s = T.alloc_shared((2 * bm * K_TILES_PER_STEP,), dtype) if plan.offset else None
    ks_desc = T.alloc_wgmma_desc() if plan.offset else None
    Y_s = T.alloc_shared((bm, bn + 8), dtype) if plan.kb.staged_store else None   # padded: see store.py
    return Buffers(A, B, S, C, ws, counters, X_s, full, empty, W_s, S_s, w, sc, a, acc, desc, Y_s, TS, KS, KS_s,
                   ks_desc)


@T.macro
def pipeline(plan, mem, k0, by, bx, tx, wg, wq, lane, count):
    """The block's `count` k-tiles from k-tile k0 (a constant: trips, or trips + 1 for the longer
    splits of an uneven split_k): with producer_warp the extra warp produces while the warpgroups
    consume (warp specialization); without, the block fills stages - 1 stages and its k-loop
    refills each freed one."""
    if plan.producer:
        if plan.in_producer_warp():
            produce(plan, mem, k0, count, by, bx, tx)
        else:
            zero_sums(plan, mem)
            start_sums(plan, mem, by, bx, tx, wg, wq, lane, k0, count)
            consume(plan, mem, k0, by, bx, tx, wg, wq, lane, count)
    else:
        for p in T.unroll(plan.stages - 1):
            load_tma(plan, mem, p, k0, by, bx, tx)
        start_sums(plan, mem, by, bx, tx, wg, wq, lane, k0, count)
        consume(plan, mem, k0, by, bx, tx, wg, wq, lane, plan.trips)


@T.macro
def start_sums(plan, mem, by, bx, tx, wg, wq, lane, k0, count):
    """offset_decode: the running sums start at the decode's offset correction for the block's k-tiles
    (correction.py), its loads and wgmmas under the pipeline's first copies."""
    if plan.offset:
        add_offset_correction(plan, mem, by, bx, tx, wg, wq, lane, k0, count)


@T.macro
def pipeline_setmaxnreg(plan, mem, by, bx, tx, wg, wq, lane):
    """setmaxnreg: the producer warpgroup drops to PRODUCER_REGISTERS and its first warp produces;
    the consumers take the registers it left and store their own sums. The two branches never
    meet again: code after a join would be held to the registers at the kernel's entry (the
    block's average), which made ptxas spill the accumulators and serialize the wgmmas."""
    if plan.in_producer_warp():
        T.set_max_nreg(PRODUCER_REGISTERS, 0)
        if T.call_extern("int32", "tm_warp_index") == plan.consumers // 32:
            produce(plan, mem, 0, plan.trips, by, bx, tx)
    else:
        T.set_max_nreg(plan.kb.max_registers, 1)
        zero_sums(plan, mem)
        start_sums(plan, mem, by, bx, tx, wg, wq, lane, 0, plan.trips)
        consume(plan, mem, 0, by, bx, tx, wg, wq, lane, plan.trips)
        finish_sums(plan, mem, by, lane)
        store_sums(plan, mem, by, bx, tx, wg, wq, lane)


@T.macro
def body(plan, A, B, S, C, ws, counters, TS=None, KS=None):
    """One block: its output tile (by, bx) and split bz, the split's k-tiles from k0, the pipeline, and
    the epilogue of its form (TS, KS: W4A8's token scales and k-tile sums)."""
    kb, m, bm, trips, extra, short = plan.kb, plan.m, plan.bm, plan.trips, plan.extra, plan.short
    producer = plan.producer
    # cluster_reduce: the split_k blocks of an output tile form one cluster (along the grid's z).
    with T.Kernel(T.ceildiv(m, bm), plan.grid_n, kb.split_k, threads=plan.threads, prelude=device_code(plan),
                  cluster_dims=(1, 1, kb.split_k) if plan.cluster else None) as (grid_y, grid_x, bz):
        if kb.panel_m:
            # Blocks launch in blockIdx order (x fastest): the launch index picks the tile, once
            # per block (as inline expressions the epilogue recomputed the divisions per store).
            m_tiles = T.ceildiv(m, bm)
            tile_m, tile_n = panel_tile(grid_x * m_tiles + grid_y, m_tiles, plan.grid_n, kb.panel_m, T.min,
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
            start_early(plan, B, S, bx, k0)
        plan.wait_prior()
        mem = buffers(plan, A, B, S, C, ws, counters, TS, KS)

        tx = T.get_thread_binding()
        wg = tx // WARPGROUP        # along N
        wq = tx // 32 % 4
        lane = tx % 32
        T.initialize_wgmma_descriptor(mem.desc, mem.X_s.access_ptr("r"), SW128, LEADING_OFFSET, ATOM_OFFSET)
        if not producer:    # (the producer warp's consumers zero their own sums)
            zero_sums(plan, mem)

        if kb.setmaxnreg:    # (split_k 1: the epilogue is the consumers' own, inside)
            pipeline_setmaxnreg(plan, mem, by, bx, tx, wg, wq, lane)
        elif extra:
            # Two copies of the pipeline, one per count, so that each loop's trip count stays a constant.
            if (bz >= short) if kb.split_wait else (bz < extra):
                pipeline(plan, mem, k0, by, bx, tx, wg, wq, lane, trips + 1)
            else:
                pipeline(plan, mem, k0, by, bx, tx, wg, wq, lane, trips)
        else:
            pipeline(plan, mem, k0, by, bx, tx, wg, wq, lane, trips)
        if not kb.setmaxnreg:
            if producer:
                if not plan.in_producer_warp():      # wgmma's warpgroup instructions, not for the producer warp
                    finish_sums(plan, mem, by, lane)
            else:
                finish_sums(plan, mem, by, lane)

        if kb.split_k > 1:
            C_s = T.alloc_shared((bm, plan.bn), "float32")
            # TileLang may place C_s over the activation stages, which the other warpgroup's
            # last wgmmas can still be reading.
            T.sync_threads()
            if producer:
                if not plan.in_producer_warp():
                    acc_to_shared(plan, mem, C_s, wg, wq, lane)
            else:
                acc_to_shared(plan, mem, C_s, wg, wq, lane)
            T.sync_threads()
            if kb.split_wait:
                plan.store_split_wait(C_s, C, S, ws, m, by, bx, bz, tx)
            else:
                plan.store_split(C_s, C, S, ws, counters, m, by, bx, tx)
        elif kb.setmaxnreg:
            pass
        elif producer:
            if not plan.in_producer_warp():
                store_sums(plan, mem, by, bx, tx, wg, wq, lane)
        else:
            store_sums(plan, mem, by, bx, tx, wg, wq, lane)


def build(problem: Problem, knobs: Knobs):
    """The TileLang prim_func for `problem` with `knobs` (checked by knobs.check beforehand).

    Arguments as marlin_mma's: A [M, K], packed B [K/16, 2N] int32, scales [K/group, N] (with zero
    points [2K/group, N], each group's zero-point row after its scale row), C [M, N];
    with split_k > 1 through the workspace also a zeroed fp32 workspace and int32 tile counters.
    With FP8 activations (epilogue.w4a8_prim_func) A is float8_e4m3fn in layout.fp8_k_order and
    their token scales [M, 1] fp32 come after it (offset_decode: then their k-tile sums [M, K / 128]).
    """
    plan = Plan(problem, knobs)
    make = w4a8_prim_func if problem.fp8 else w4a16_prim_func
    extra = {"sums": knobs.offset_decode} if problem.fp8 else {}
    return make(functools.partial(body, plan), plan.m, plan.tiles, problem.n, problem.k, problem.scale_rows,
                problem.dtype, workspace=knobs.uses_workspace, slots=knobs.workspace_slots, **extra)
