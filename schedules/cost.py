"""An analytic cost model: ranks the candidates before any are compiled, and picks a schedule at run
time for a shape that was never tuned.

It only has to order candidates roughly (the search measures the top ones), so it models the few
effects that decide W4A16 kernels and nothing else:
- Bytes: the grids run M tiles fastest, so the blocks that share a weight tile run together and HBM
  delivers each weight byte once (L2 serves the other M tiles). Activations are re-read by every
  column of blocks: from L2 while they fit in half of it, else from HBM each time. Everything a
  block loads also crosses L2 and the SM's load pipe.
- Bandwidth is capped by the HBM rate and by Little's law (the bytes the resident blocks keep in
  flight, (num_stages - 1) tiles each, over the DRAM latency), which is why small grids and shallow
  pipelines cannot saturate HBM; L2 and the active SMs' load pipes cap the on-chip traffic.
- Math: MMAs on padded tiles (ceil(M / block_m) * block_m rows) at the family's MMA rate (mma.sync
  or wgmma), plus the INT4 decode in ALU instructions per weight (FamilyTraits), scaled by the SMs
  in use and by whether enough warps are resident to keep the tensor cores busy.
- Waves: blocks per SM from shared memory and threads; a partial last wave costs a whole wave.
- Per k-tile a fixed cost (barriers draining the warps' MMA chains), fitted on the H200.
- Per wave a pipeline fill (one DRAM latency and num_stages tile loads before the math starts);
  per call the split-K reduction through the fp32 workspace, the output write, and the launch.

Knobs protocol: a family's Knobs provide block_m, block_n, block_k, num_stages, threads and
shared_bytes(problem); split_k (1), scale_on_acc (False) and warps_m (1) are optional.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .arch import Arch, current_arch
from .problem import Problem
from .registry import FAMILIES, SEARCHED, Schedule

MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED = 1024      # shared memory the driver keeps per block
SCALE_ON_ACC_OPS = 2.0    # per fp32 sum per group: a scaled add and the reset of the group's sum


@dataclass(frozen=True)
class FamilyTraits:
    """What the cost model needs to know about a family beyond its knobs."""

    wgmma: bool = False             # MMAs by wgmma (sm_90a) rather than mma.sync
    decode_ops: float = 1.0         # ALU instructions per decoded weight
    scale_ops: float = 0.5          # and per weight to apply its group scale
    warps_to_fill_sm: int = 8       # resident warps per SM that keep the tensor cores issuing
    mma_efficiency: float = 1.0     # the share of the arch's MMA rate the family's kernels reach
    pull_scale: float = 1.0         # per-SM pull rate relative to GpuSpec.sm_bytes_per_s (fitted on
                                    # warps that wait for their own loads; TMA's copies do not)
    decode_under_mma: bool = False  # the decode of one stage runs while the tensor cores work on
                                    # the previous one (asynchronous wgmma), rather than before it
    k_tile_scale: float = 1.0       # per-k-tile cost relative to GpuSpec.k_tile_us (barrier waits,
                                    # the chain from a landed stage to its issued MMAs)
    fill_stages: int = 0            # stages whose loads the pipeline fill waits for (0: all of them)


TRAITS = {
    # lop3 + magic-number subtract: one instruction per weight (one of each per half2 pair); the
    # group scale one hmul2 per pair. mma.sync needs warps on all four SM partitions, two deep.
    "marlin_mma": FamilyTraits(),
    # One shared load and a lop3 decode per 8 weights, then per weight an address, a 2-byte store
    # to shared memory and a multiply by the scale; one consumer warpgroup keeps wgmma busy.
    # Its decode into shared memory does not overlap the wgmma (perf-notes v5): fitted on 290 H200
    # timings of `gen tune` (session 2) it costs as much as ~22 ALU instructions per weight.
    "hopper_wgmma": FamilyTraits(wgmma=True, decode_ops=22.0, scale_ops=1.0, warps_to_fill_sm=4),
    # Fitted on ~700 H200 sweep timings and 140 tune timings of stream_mma (perf-notes v6): with the
    # per-SM pull and per-k-tile costs of marlin_mma and one ALU instruction per weight, estimates
    # are within 17 % on average (a pull without barriers fitted no better). Across all three
    # families the model's pick is 1.045x the best measured one on the session-2 tune.
    # Session 6 (perf-notes v24): its pull per SM 1.5x marlin_mma's, which takes the estimates'
    # bias over 2904 H200 timings from +0.22 (log) to 0 and its first pick from 1.104x to 1.098x.
    "stream_mma": FamilyTraits(decode_ops=1.0, pull_scale=1.5),
    # The stream decode into wgmma's register operand, as searched: TMA fills the stages (no warp
    # waits for its own loads) and a stage is decoded under the previous stage's wgmmas. Refitted in
    # session 5 on 1831 H200 timings (the table's and the sweeps' of sessions 4-5, 52 layer-buckets,
    # M = 1-4096, all three searched families; perf-notes v21): across families the model's first
    # pick among the measured candidates is 1.19x the measured best on average (1.34x before), the
    # best of the plan's top 6 1.15x (1.23x), stream_wgmma's estimates unbiased. Its pull per SM is
    # 3x marlin_mma's, its decode two ALU instructions per weight (under the wgmmas), and its k-tiles
    # cost nothing beyond their loads, decode and wgmmas (no block barrier waits for them).
    # Session 27 (v52): its fill waits for two stages' loads, not all (the time over K of the M = 16
    # winners is F + k-tiles x t with F 2.6-3.9 us): over the table's 1258 timings the first pick goes
    # from 1.155x to 1.12x of the measured best, a cold first round reaches 43 winners of 52 (42).
    "stream_wgmma": FamilyTraits(wgmma=True, decode_ops=2.0, scale_ops=0.5, warps_to_fill_sm=8,
                                 mma_efficiency=1.0, pull_scale=3.0, decode_under_mma=True, k_tile_scale=0.0,
                                 fill_stages=2),
}


@dataclass(frozen=True)
class GpuSpec:
    """Throughputs of one GPU, whole-chip unless named per SM."""

    name: str
    sm_count: int
    hbm_bytes_per_s: float
    mma_flops: float                  # dense fp16 mma.sync rate with fp32 accumulation
    launch_us: float                  # fixed cost of one kernel in a CUDA graph
    wgmma_flops: float = 0.0          # dense fp16 wgmma rate (0: the arch has no wgmma)
    shared_bytes_per_sm: int = 228 * 1024
    l2_bytes: int = 50 * 2**20
    l2_bytes_per_s: float = 8e12
    sm_bytes_per_s: float = 100e9     # the most one SM's loads can pull from L2/HBM
    latency_us: float = 0.8           # DRAM round trip seen by an asynchronous copy
    k_tile_us: float = 0.0            # per k-tile per block: the pipeline's barriers and bookkeeping
    alu_ops_per_s: float = 3e13       # integer / fp16 ALU instructions (per lane) per second

    @classmethod
    def for_arch(cls, arch: Arch) -> "GpuSpec":
        """Nominal numbers of the reference GPU of `arch` (H200 for sm_90a, A100 for sm_80)."""
        try:
            return _NOMINAL[arch.name]
        except KeyError:
            raise ValueError(f"no nominal GPU numbers for {arch.name}; known: {sorted(_NOMINAL)}") from None

    @classmethod
    def current(cls, device=None) -> "GpuSpec":
        """This process's GPU: the nominal numbers of its arch, rescaled to its SM count and L2.

        Per-SM rates (MMA, ALU) scale with the SM count; HBM bandwidth stays nominal (torch does
        not report it), which only matters across GPUs, never for ranking on one.
        """
        import torch

        base = cls.for_arch(current_arch(device))
        props = torch.cuda.get_device_properties(device)
        scale = props.multi_processor_count / base.sm_count
        return replace(base, name=props.name, sm_count=props.multi_processor_count,
                       mma_flops=base.mma_flops * scale, wgmma_flops=base.wgmma_flops * scale,
                       alu_ops_per_s=base.alu_ops_per_s * scale,
                       l2_bytes=getattr(props, "L2_cache_size", base.l2_bytes) or base.l2_bytes,
                       shared_bytes_per_sm=getattr(props, "shared_memory_per_multiprocessor", base.shared_bytes_per_sm))


_NOMINAL = {
    # wgmma measures ~6.6e14 FLOP/s on the H200. The per-SM pull rate, ALU rate, mma.sync rate,
    # latency and launch cost are fitted to ~1300 marlin_mma timings on the H200 (two hand sweeps
    # and two `gen tune` runs, docs/perf-notes.md v4): the model's first pick is on average 1.12x
    # slower than the measured best (1.30x with the first fit, more with datasheet-style guesses),
    # and the best of its top 12 1.02x. A block's warps are latency-bound, so one SM pulls far less
    # than its load pipes could; k_tile_us (0.16-0.32 all fit) makes deep k-tiles win at small M,
    # as the hand sweeps found (block_k=128 beat 64 by ~9 %).
    "sm_90a": GpuSpec("H200 (nominal)", 132, 4.2e12, 3.62e14, 1.95, wgmma_flops=6.6e14,
                      shared_bytes_per_sm=228 * 1024, l2_bytes=60 * 2**20, l2_bytes_per_s=8e12,
                      sm_bytes_per_s=23.7e9, latency_us=0.73, alu_ops_per_s=1.16e13, k_tile_us=0.2),
    "sm_80": GpuSpec("A100 (nominal)", 108, 1.9e12, 3.1e14, 2.5, shared_bytes_per_sm=164 * 1024,
                     l2_bytes=40 * 2**20, l2_bytes_per_s=4.5e12, sm_bytes_per_s=90e9, latency_us=0.7,
                     alu_ops_per_s=1.5e13),
    "sm_86": GpuSpec("A10 (nominal)", 72, 0.6e12, 1.25e14, 2.5, shared_bytes_per_sm=100 * 1024,
                     l2_bytes=6 * 2**20, l2_bytes_per_s=2e12, sm_bytes_per_s=60e9, latency_us=0.7,
                     alu_ops_per_s=0.9e13),
    "sm_89": GpuSpec("L40S (nominal)", 142, 0.864e12, 3.6e14, 2.5, shared_bytes_per_sm=100 * 1024,
                     l2_bytes=96 * 2**20, l2_bytes_per_s=4e12, sm_bytes_per_s=80e9, latency_us=0.7,
                     alu_ops_per_s=2.4e13),
}


def estimate_us(problem: Problem, schedule: Schedule, m: int, gpu: GpuSpec) -> float:
    """Estimated microseconds of one call with `m` rows (see the module docstring for the model)."""
    kb = schedule.knobs
    traits = TRAITS.get(schedule.family, FamilyTraits())
    bm, bn, bk, stages = kb.block_m, kb.block_n, kb.block_k, kb.num_stages
    split = getattr(kb, "split_k", 1)
    m_tiles = -(-m // bm)
    m_pad = m_tiles * bm
    n_tiles = problem.n // bn
    blocks = n_tiles * m_tiles * split

    per_sm = max(1, min(gpu.shared_bytes_per_sm // (kb.shared_bytes(problem) + SMEM_RESERVED),
                        MAX_THREADS_PER_SM // kb.threads, MAX_BLOCKS_PER_SM))
    waves = -(-blocks // (gpu.sm_count * per_sm))
    per_wave = -(-blocks // waves)             # blocks resident at once, spread evenly over the waves
    active_sms = min(gpu.sm_count, per_wave)
    warps_per_sm = -(-per_wave // gpu.sm_count) * kb.threads // 32
    # What one SM does (its pull, its decode and MMAs) is paid on the busiest SM, which runs
    # ceil(blocks / SMs) blocks in all: 344 blocks on 132 SMs put 3 on 80 of them and 2 on the rest,
    # 15 % over the even share that the waves below assume.
    crowding = max(1.0, -(-blocks // gpu.sm_count) / (waves * per_wave / active_sms))

    # One block's k-loop: k_tiles tiles (the longest split's), each a weight tile (+ its scale row)
    # and an activation tile.
    k_tiles = -(-problem.k // (bk * split))
    k_block = k_tiles * bk
    weight_tile = bk * bn * problem.bits / 8 + (0 if problem.channelwise else bn * 2 * bk / problem.group)
    act_tile = bm * bk * 2
    act_bytes = m * problem.k * 2
    from_hbm = problem.weight_bytes() + act_bytes * (1 if act_bytes <= gpu.l2_bytes // 2 else n_tiles)
    to_sms = per_wave * k_tiles * (weight_tile + act_tile)          # per wave
    in_flight = per_wave * (stages - 1) * (weight_tile + act_tile)
    hbm_rate = min(gpu.hbm_bytes_per_s, in_flight / (gpu.latency_us * 1e-6))
    mem_s = max(from_hbm * per_wave / blocks / hbm_rate, to_sms / gpu.l2_bytes_per_s,
                to_sms * crowding / (active_sms * gpu.sm_bytes_per_s * traits.pull_scale))

    busy = active_sms / gpu.sm_count * min(1.0, warps_per_sm / traits.warps_to_fill_sm) / crowding
    mma_rate = (gpu.wgmma_flops if traits.wgmma else gpu.mma_flops) * traits.mma_efficiency
    mma_s = per_wave * 2 * bm * bn * k_block / (mma_rate * busy)
    if getattr(kb, "fold_zero_point", False):
        # Raw codes into the MMA: 5 of the decode's 9 instructions per word, and per batch of
        # 16 * unroll rows a subtract, a scaled add and a reset per fp32 sum (a guess until fitted).
        ops_per_weight = traits.decode_ops * 5 / 9 + 3 * bm / (16 * kb.unroll)
    elif problem.channelwise:        # scales multiply the final sums: nothing per weight
        ops_per_weight = traits.decode_ops
    elif getattr(kb, "scale_on_acc", False):
        ops_per_weight = traits.decode_ops + SCALE_ON_ACC_OPS * bm / problem.group
    else:
        ops_per_weight = traits.decode_ops + traits.scale_ops
    # Warps that share block columns (warps_m > 1) each decode the same weights.
    decoded = per_wave * bn * k_block * getattr(kb, "warps_m", 1)
    decode_s = decoded * ops_per_weight / (gpu.alu_ops_per_s * busy)
    math_s = max(mma_s, decode_s) if traits.decode_under_mma else mma_s + decode_s
    # Pipeline fill: before the steady state a block waits one latency and num_stages tile loads
    # (the family's fill_stages) at its share of the bandwidth, with no math to overlap them.
    filled = traits.fill_stages or stages
    fill_s = gpu.latency_us * 1e-6 + filled * (weight_tile + act_tile) * per_wave / hbm_rate
    # Every k-tile ends in block-wide barriers that drain the warps' MMA chains: a fixed cost per
    # tile that favours deep tiles (block_k) the more the fewer warps hide it.
    wave_s = max(mem_s, math_s + k_tiles * gpu.k_tile_us * traits.k_tile_scale * 1e-6) + fill_s
    wave_s *= measured_factor(schedule.family, kb, m)

    out_s = m * problem.n * 2 / gpu.hbm_bytes_per_s
    # Split-K: every split adds an fp32 partial into the workspace; the last one reads it back and
    # zeroes it for the next call. Inside a cluster the partials only cross distributed shared memory.
    if split > 1 and getattr(kb, "uses_workspace", True):
        reduce_s = (split + 2) * m_pad * problem.n * 4 / gpu.hbm_bytes_per_s
    elif split > 1:
        reduce_s = split * m_pad * problem.n * 4 / gpu.l2_bytes_per_s
    else:
        reduce_s = 0.0
    return (waves * wave_s + out_s + reduce_s) * 1e6 + gpu.launch_us


# Measured effects of optional techniques that the terms above do not capture (the kernels are bound
# by the SM's instructions and latencies, not by bytes): per family, the median time ratio with /
# without the knob over otherwise equal configurations per M and layer class, H200 sweeps
# (docs/perf-notes.md v7-v9, v13, v16, v23). A knob name (applies when the knob is on) or a (knob,
# value) pair -> rows of (M up to, factor); the first matching row applies.
KNOB_FACTORS = {
    "stream_mma": {
        "fold_zero_point": ((16, 0.95), (None, 1.35)),
        "cluster_reduce": ((None, 0.97),),
        # The penalties up to M = 8 (1.4x at M <= 2) were measured while rows past M repeated row M-1
        # and every warp fetched them from L2 (perf-notes v35); zero-filled and through L1 they are gone.
        "x_ldmatrix": ((None, 0.93),),
        "async_weights": ((8, 0.95), (None, 0.92)),
        # Session 7 (v25), medians of 16 pairs each at M = 1 and 8.
        "sum_slices": ((None, 0.95),),
        "pdl": ((None, 0.98),),
        # Session 8 (v28): median of 60 pairs at M = 1-32 (0.94-1.46x); worst where one wave of blocks
        # fills the GPU (the next kernel's early blocks crowd the SMs that free first). Session 31
        # (v57): the committed table's pairs since then (stream_mma with and without early_start, the
        # other knobs equal): with late_trigger 0.943 (25 pairs) up to M = 8 and 0.99 (25) at M = 16-32,
        # without it 0.95 (3) and 0.973 (14). With 1.06 and 0.96 the cold tune's first round kept the
        # early_start-free variant of every stream_mma point, and its M = 1-4 winners at o / down
        # were stream_wgmma kernels 3-5 % slower than the table's stream_mma ones (es2, lt). Refitted
        # below M = 32 (`gen modelcheck`, the committed and the cold table: stream_mma's first pick
        # 1.126 -> 1.087x of the measured best, best of its top 6 1.044 -> 1.005).
        "early_start": ((8, 0.95), (32, 0.975), (None, 1.06)),
        # Session 9 (v30): with early_start, 13 pairs at M = 1-8 against early_start alone.
        "late_trigger": ((8, 0.99), (32, 1.015), (None, 0.96)),
        # Session 22 (v47): same-run pairs with the fold without lag, 13 at M = 1-16 (median 1.02,
        # 0.99-1.09) and 2 at M = 32 (o_proj: 0.94 at ahead 4, 0.90 at ahead 2).
        "fold_lag": ((16, 1.02), (None, 0.93)),
        # Session 12 (v36): a least-squares fit of the shape knobs (one factor per value and M range,
        # a free offset per layer and M) on 1300 stream_mma timings at M <= 32 of sessions 10-12,
        # relative to ahead 2, unroll 4, 4 warps, one m-tile, one split. Deeper pipelines pay once the
        # weights go through the warps' cp.async slots (async_weights), which the terms above do not see.
        ("ahead", 1): ((8, 1.2), (16, 1.23), (None, 1.27)),
        ("ahead", 3): ((8, 0.95), (16, 0.84), (None, 0.85)),
        ("ahead", 4): ((8, 0.91), (16, 0.71), (None, 0.82)),
        # One fold and one scale row per group instead of two: cheaper than the terms say up to M = 32.
        ("unroll", 8): ((8, 0.8), (16, 0.85), (32, 0.82), (None, 1.0)),
        ("warps", 8): ((8, 0.82), (None, 1.04)),
        ("m_tiles", 2): ((8, 1.0), (None, 0.93)),
        ("split_k", 2): ((8, 0.83), (None, 1.07)),
        ("split_k", 4): ((8, 0.82), (None, 1.0)),
        ("split_k", 6): ((8, 0.73), (None, 1.0)),
        ("split_k", 8): ((8, 0.65), (None, 0.8)),
    },
    "stream_wgmma": {
        # Release barriers alone: 1.15-1.45x slower below M=256 (warp 0 waits for the release before
        # it refills). The producer warp, which needs them, takes that back and more: 0.93-0.98x of
        # the plain TMA pipeline from M=64 on, even at M <= 16 (0.71-1.21x, median 1.0); the rows
        # multiply to about that (1.25 x 0.7 = 0.88 where the fit of v21 wanted the warp a little
        # stronger than the medians, since it wins the latency-bound N = 4096 layers by 14-17 %).
        "release_barriers": ((None, 1.25),),
        "producer_warp": ((16, 0.8), (None, 0.7)),
        # Session 6 (v23), medians over otherwise equal pairs: 128-deep k-tiles pay where one chain
        # per SM is the limit (M = 32-256); the producer warpgroup's register hand-over costs at
        # small tiles; the cluster's reduction beats the workspace by more than its bytes say.
        # (session 7: times the residual medians below)
        ("block_k", 128): ((16, 0.86), (64, 0.88), (128, 0.78), (256, 0.89), (None, 0.9)),
        "setmaxnreg": ((64, 1.4), (None, 1.0)),
        "cluster_reduce": ((None, 0.96),),
        # Two warpgroups (or two 16-column groups per warp) side by side cost more than the model's
        # terms say up to M=256 (medians 1.04-1.15x, 1.09-1.27x), where one short chain per block
        # wins; above, where the tensor pipe is the limit, the wider block is level or better.
        ("warpgroups", 2): ((16, 1.1), (64, 1.22), (256, 1.3), (None, 1.4)),
        ("groups", 2): ((8, 1.03), (16, 1.11), (64, 1.42), (256, 1.28), (None, 1.08)),
        # Session 7, on every H200 timing of sessions 5-7 (tables and sweeps): per pair of schedules
        # that differ in one knob only, the measured time ratio over the model's ratio (with the rows
        # above); the medians per M range, 8-166 pairs each, are these rows (and the extra factor
        # in the warpgroups, groups and block_k rows). The model had more stages, deeper k-tiles
        # and taller M tiles too expensive and wider blocks too cheap (perf-notes v27). In-sample:
        # the tune's first round then measures a stream_wgmma within 1.04x of the best (was 1.10x).
        # Session 23 (v48): the scale_on_acc kernel over the same kernel without it, same run, over the
        # model's ratio (its fold term already makes block_m 16 0.93x, 32 level, 64 1.13x): 8 pairs at
        # M = 16-64, 0.82-1.31, median 1.05 (it pays at 6-8 stages, loses at 4).
        "scale_on_acc": ((None, 1.05),),
        # Session 24 (v49): fold_lag over scale_on_acc alone, 25 same-run pairs at M = 16 (0.59-1.48).
        "fold_lag": ((None, 0.98),),
        ("stages", 6): ((None, 0.93),),
        ("stages", 8): ((None, 0.88),),
        # Session 27 (v52): where both families were measured at M = 4-8, stream_wgmma's best took
        # 1.23-1.69x stream_mma's (the table's timings), 1.14x at o_proj 1-8 (session 26's cold tune);
        # the fill of two stages (fill_stages) alone would have ranked it first at qkv / gate_up 1.
        ("block_m", 8): ((8, 1.15), (None, 1.0)),
        ("block_m", 128): ((64, 1.0), (256, 0.91), (None, 0.85)),
        ("block_m", 256): ((64, 1.0), (256, 0.82), (None, 0.74)),
        # Session 12 (v36): 176-row tiles (fewer waves where 22016 columns leave the last one short,
        # v33) measured 0.69-0.94x of the model's estimate at M = 512-1024 (medians per layer, 2-4
        # timings each, against the other tiles of the same layer and M); unmeasured beyond.
        ("block_m", 176): ((256, 1.0), (1024, 0.77), (None, 1.0)),
        # Session 8 (v28): medians of 23 pairs, every staged variant of a committed winner.
        "staged_store": ((64, 0.985), (256, 0.965), (None, 0.975)),
        # Session 8 (v28): medians of every pair with and without the knob in the session's tunes
        # (pdl 18 and 49 pairs, early_start 31 and 61, at M <= 64 and above).
        "pdl": ((64, 0.99), (None, 0.996)),
        "early_start": ((64, 0.976), (None, 0.99)),
        # Session 9 (v30): medians of 4 pairs per M (every large-M winner with and without panels);
        # at M <= 1024 a block-256 grid has at most 4 M tiles, so panels only add instructions.
        ("panel_m", 2): ((1024, 1.007), (2048, 1.0), (None, 0.95)),
        ("panel_m", 4): ((1024, 1.005), (2048, 1.0), (None, 0.952)),
        # Session 16 (v40): medians of the pairs at M = 16-64 and 128-256 (every winner with and
        # without the knob); unmeasured above.
        "stage_unroll": ((64, 0.95), (256, 0.985), (None, 1.0)),
        # Session 19 (v44): medians of the pairs at M = 16-32, 64 and 128-256 (every block_k 128
        # winner with and without the ring); unmeasured above.
        ("ring", 8): ((32, 1.04), (64, 1.01), (256, 0.98), (None, 1.0)),
        # Session 31 (v57): the workspace splits with split_wait over the same kernels with the
        # counter, same run: 8 pairs at M = 16-64, 0.87-0.99, median 0.92. Above M = 64 no winner
        # splits through the workspace, so no pair: level.
        "split_wait": ((64, 0.92), (None, 1.0)),
    },
}


def measured_factor(family: str, knobs, m: int) -> float:
    """The measured corrections to the terms above at M = m: the KNOB_FACTORS of the techniques and
    shape knobs that `knobs` has and, for stream_mma above M = 8, m_tiles ** 0.25 (session 3, perf-notes
    v12: wider M tiles cost more than the weight bytes they save, more registers and loads per warp).
    stream_mma's shape rows were refitted in session 12 (v36): `gen modelcheck` on its timings, best
    of the top 6 1.005x of the measured best (1.112x before)."""
    factor = 1.0
    for name, value, knob_factor in _factor_rows(family, m):
        if getattr(knobs, name) == value if value is not None else getattr(knobs, name):
            factor *= knob_factor
    if family != "stream_mma":
        return factor
    if m > 8:
        factor *= knobs.m_tiles ** 0.25
    return factor


@functools.lru_cache(maxsize=None)
def _factor_rows(family: str, m: int) -> tuple[tuple[str, object, float], ...]:
    """KNOB_FACTORS of `family` at M = m as (knob, value, factor): a knob name applies when the knob is
    on (value None), a (name, value) pair when the knob has that value. Built once per family and M:
    the ranking calls measured_factor for every candidate of the space."""
    rows = []
    for key, by_m in KNOB_FACTORS.get(family, {}).items():
        name, value = key if isinstance(key, tuple) else (key, None)
        rows.append((name, value, next(f for up_to, f in by_m if up_to is None or m <= up_to)))
    return tuple(rows)


@functools.lru_cache(maxsize=256)
def _candidates(problem: Problem, arch: Arch, families: tuple[str, ...]) -> tuple[Schedule, ...]:
    """Every valid schedule of `families` in name order (the space is M-independent, so it is built
    once; rank's stable sort then breaks ties by name without a name per candidate and bucket)."""
    schedules = (Schedule(name, knobs) for name in families for knobs in FAMILIES[name].space(problem, arch))
    return tuple(sorted(schedules, key=lambda s: s.name))


def rank(problem: Problem, m: int, arch: Arch, gpu: GpuSpec, families=None) -> list[Schedule]:
    """All valid candidates of `families` (registry.SEARCHED by default), fastest estimate first."""
    names = tuple(sorted(SEARCHED)) if families is None else tuple(families)
    for name in names:
        if name not in FAMILIES:
            raise ValueError(f"unknown schedule family {name!r}; known: {sorted(FAMILIES)}")
    candidates = _candidates(problem, arch, names)
    # Stable on name order: ties never depend on how the space was enumerated.
    return sorted(candidates, key=lambda s: estimate_us(problem, s, m, gpu))


def best_schedule(problem: Problem, m: int, arch: Arch, gpu: GpuSpec | None = None) -> Schedule:
    """The cost model's pick for `problem` at M = m; `gpu` defaults to the nominal GPU of `arch`."""
    ranked = rank(problem, m, arch, gpu or GpuSpec.for_arch(arch))
    if not ranked:
        raise ValueError(f"no schedule can run {problem.name} on {arch.name}")
    return ranked[0]
