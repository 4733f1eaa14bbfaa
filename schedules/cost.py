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
  or wgmma), plus the INT4 decode in ALU instructions per weight (the family's TRAITS, schedules/family.py), scaled by the SMs
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
from .registry import family as family_module

MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED = 1024      # shared memory the driver keeps per block
SCALE_ON_ACC_OPS = 2.0    # per fp32 sum per group: a scaled add and the reset of the group's sum


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
    # and two `gen tune` runs): the model's first pick is on average 1.12x
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
    traits = schedule.module.TRAITS
    bm, bn, bk, stages = kb.block_m, kb.block_n, kb.block_k, kb.num_stages
    split = kb.split_k
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
    act_size = 1 if problem.fp8 else 2         # bytes per activation
    act_tile = bm * bk * act_size
    act_bytes = m * problem.k * act_size
    from_hbm = problem.weight_bytes() + act_bytes * (1 if act_bytes <= gpu.l2_bytes // 2 else n_tiles)
    to_sms = per_wave * k_tiles * (weight_tile + act_tile)          # per wave
    in_flight = per_wave * (stages - 1) * (weight_tile + act_tile)
    hbm_rate = min(gpu.hbm_bytes_per_s, in_flight / (gpu.latency_us * 1e-6))
    mem_s = max(from_hbm * per_wave / blocks / hbm_rate, to_sms / gpu.l2_bytes_per_s,
                to_sms * crowding / (active_sms * gpu.sm_bytes_per_s * traits.pull_scale))

    busy = active_sms / gpu.sm_count * min(1.0, warps_per_sm / traits.warps_to_fill_sm) / crowding
    mma_rate = (gpu.wgmma_flops if traits.wgmma else gpu.mma_flops) * traits.mma_efficiency
    if problem.fp8:
        mma_rate *= 2        # FP8 tensor cores: twice the 16-bit rate (H100 / H200 datasheets)
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
    wave_s *= measured_factor(schedule.family, kb, m, problem.fp8)

    out_s = m * problem.n * 2 / gpu.hbm_bytes_per_s
    # Split-K: every split adds an fp32 partial into the workspace; the last one reads it back and
    # zeroes it for the next call. Inside a cluster the partials only cross distributed shared memory.
    if split > 1 and kb.uses_workspace:
        reduce_s = (split + 2) * m_pad * problem.n * 4 / gpu.hbm_bytes_per_s
    elif split > 1:
        reduce_s = split * m_pad * problem.n * 4 / gpu.l2_bytes_per_s
    else:
        reduce_s = 0.0
    return (waves * wave_s + out_s + reduce_s) * 1e6 + gpu.launch_us


def measured_factor(family: str, knobs, m: int, fp8: bool = False) -> float:
    """The measured corrections to the terms above at M = m: the family's KNOB_FACTORS (with FP8
    activations, its FP8_KNOB_FACTORS in place of the rows they name) for the techniques and shape
    knobs that `knobs` has and, for stream_mma above M = 8, m_tiles ** 0.25
    (wider M tiles cost more than the weight bytes they save: more registers and loads per warp).
    With stream_mma's shape rows, `gen modelcheck` puts the best of its top 6 at 1.005x of the
    measured best (1.112x without them)."""
    factor = 1.0
    for name, value, knob_factor in _factor_rows(family, m, fp8):
        if getattr(knobs, name) == value if value is not None else getattr(knobs, name):
            factor *= knob_factor
    if family != "stream_mma":
        return factor
    if m > 8:
        factor *= knobs.m_tiles ** 0.25
    return factor


@functools.lru_cache(maxsize=None)
def _factor_rows(family: str, m: int, fp8: bool) -> tuple[tuple[str, object, float], ...]:
    """KNOB_FACTORS of `family` at M = m (with FP8 activations, FP8_KNOB_FACTORS' rows in place of the
    same keys') as (knob, value, factor): a knob name applies when the knob is on (value None), a
    (name, value) pair when the knob has that value. Built once per family, M and activation type:
    the ranking calls measured_factor for every candidate of the space."""
    module = family_module(family)
    factors = {**module.KNOB_FACTORS, **module.FP8_KNOB_FACTORS} if fp8 else module.KNOB_FACTORS
    rows = []
    for key, by_m in factors.items():
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


def best_schedule(problem: Problem, m: int, arch: Arch, gpu: GpuSpec | None = None,
                  exclude: frozenset = frozenset()) -> Schedule:
    """The cost model's pick for `problem` at M = m, other than the schedules in `exclude`; `gpu`
    defaults to the nominal GPU of `arch`."""
    ranked = [s for s in rank(problem, m, arch, gpu or GpuSpec.for_arch(arch)) if s not in exclude]
    if not ranked:
        raise ValueError(f"no schedule can run {problem.name} on {arch.name}")
    return ranked[0]
