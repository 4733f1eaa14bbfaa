"""The analytic cost model: the effects it must capture and the ranking built on it."""
from dataclasses import replace

import pytest
import torch

from schedules import marlin_mma
from schedules.arch import get_arch
from schedules.cost import GpuSpec, best_schedule, estimate_us, rank
from schedules.marlin_mma import Knobs
from schedules.problem import Problem
from schedules.registry import FAMILIES, SEARCHED, Schedule

H200 = get_arch("sm_90a")
SPEC = GpuSpec.for_arch(H200)
QKV = Problem.make(n=12288, k=4096)
O_PROJ = Problem.make(n=4096, k=4096)


def est(problem, m, **knobs):
    return estimate_us(problem, Schedule("marlin_mma", Knobs(**knobs)), m, SPEC)


def test_nominal_specs():
    assert (SPEC.sm_count, SPEC.hbm_bytes_per_s) == (132, 4.2e12)
    assert SPEC.mma_flops == pytest.approx(3.62e14)   # fitted to H200 timings
    a100 = GpuSpec.for_arch(get_arch("sm_80"))
    assert (a100.sm_count, a100.hbm_bytes_per_s, a100.mma_flops) == (108, 1.9e12, 3.1e14)


def test_decode_is_bandwidth_bound_near_the_floor():
    floor_us = QKV.weight_bytes() / SPEC.hbm_bytes_per_s * 1e6
    best = estimate_us(QKV, rank(QKV, 1, H200, SPEC)[0], 1, SPEC)
    assert floor_us < best < 4 * floor_us


def test_prefill_is_math_bound_near_the_floor():
    m = 4096
    pick = rank(QKV, m, H200, SPEC)[0]
    # the family's fitted rate (stream_wgmma reaches cuBLAS's, above the nominal wgmma rate)
    rate = (SPEC.wgmma_flops if pick.module.TRAITS.wgmma else SPEC.mma_flops) * pick.module.TRAITS.mma_efficiency
    floor_us = 2 * m * QKV.n * QKV.k / rate * 1e6
    best = estimate_us(QKV, pick, m, SPEC)
    assert floor_us < best < 2.5 * floor_us


def test_estimate_grows_with_m_and_pads_to_block_m():
    knobs = dict(block_m=64, block_n=64, block_k=64, warps_n=1, warps_k=4)
    times = [est(QKV, m, **knobs) for m in (1, 16, 64, 65, 128, 1024, 4096)]
    assert times == sorted(times)
    assert est(QKV, 17, **knobs) == pytest.approx(est(QKV, 64, **knobs), rel=0.05)   # same padded tile
    assert est(QKV, 65, **knobs) > 1.3 * est(QKV, 64, **knobs)                        # a second row of tiles


def test_split_k_fills_a_small_grid():
    # 4096 / 256 = 16 blocks cannot keep 132 SMs' worth of bytes in flight; split-K 4 gives 64.
    assert est(O_PROJ, 1, block_n=256, split_k=4) < 0.7 * est(O_PROJ, 1, block_n=256, split_k=1)


def test_split_k_costs_a_reduction_when_the_grid_is_full():
    assert est(QKV, 4096, block_m=128, block_n=128, warps_m=2, warps_n=2, split_k=4) > \
        est(QKV, 4096, block_m=128, block_n=128, warps_m=2, warps_n=2, split_k=1)


def test_deeper_pipeline_keeps_more_bytes_in_flight():
    # 192 blocks of 16x64: memory bound, and two stages leave too few bytes in flight
    knobs = dict(block_n=64, block_k=64, warps_n=1, warps_k=4)
    assert est(QKV, 1, num_stages=4, **knobs) < est(QKV, 1, num_stages=2, **knobs)


def test_scale_on_acc_pays_off_at_small_block_m():
    # Where the decode is on the critical path: 48 wide blocks leave most SMs idle.
    small = dict(block_n=256, block_k=64, warps_n=1, warps_k=4, num_stages=3)
    assert est(QKV, 16, scale_on_acc=True, **small) < est(QKV, 16, scale_on_acc=False, **small)
    large = dict(block_m=128, block_n=128, block_k=64, warps_m=2, warps_n=2, num_stages=3)
    assert est(QKV, 4096, scale_on_acc=True, **large) >= est(QKV, 4096, scale_on_acc=False, **large)


def test_large_m_prefers_large_block_m():
    assert rank(QKV, 1, H200, SPEC)[0].knobs.block_m <= 16
    assert rank(QKV, 4096, H200, SPEC)[0].knobs.block_m >= 64
    # block_m=16 re-reads the weights 256 times and decodes them 256 times at M=4096
    best_16 = next(s for s in rank(QKV, 4096, H200, SPEC) if s.knobs.block_m <= 16)
    assert estimate_us(QKV, best_16, 4096, SPEC) > 1.3 * estimate_us(QKV, rank(QKV, 4096, H200, SPEC)[0], 4096, SPEC)


def test_rank_covers_the_valid_space_sorted():
    ranked = rank(QKV, 16, H200, SPEC)
    assert {(s.family, s.knobs) for s in ranked} == \
        {(name, knobs) for name in SEARCHED for knobs in FAMILIES[name].space(QKV, H200)}
    times = [estimate_us(QKV, s, 16, SPEC) for s in ranked]
    assert times == sorted(times)
    assert all(s.module.check(QKV, s.knobs, H200) is None for s in ranked)
    only_mma = rank(QKV, 16, H200, SPEC, families=["marlin_mma"])
    assert {s.knobs for s in only_mma} == set(marlin_mma.space(QKV, H200))
    assert only_mma == [s for s in ranked if s.family == "marlin_mma"]


def test_families_by_batch_size():
    # decode: bandwidth, where warps streaming weights without barriers win (measured on the H200);
    # large M on sm_90a: the wgmma family whose decode overlaps its wgmmas (0.85x of FP16 at M=4096
    # against marlin_mma's 0.49x)
    assert rank(QKV, 1, H200, SPEC)[0].family == "stream_mma"
    assert rank(QKV, 4096, H200, SPEC)[0].family == "stream_wgmma"
    assert {s.family for s in rank(QKV, 4096, H200, SPEC)} == set(SEARCHED)
    a100 = get_arch("sm_80")
    assert {s.family for s in rank(QKV, 4096, a100, GpuSpec.for_arch(a100))} == {"marlin_mma", "stream_mma"}


def test_activations_that_overflow_l2_are_reread():
    # down_proj: 22 MB of activations at M=1024 stay in the H200's L2; 90 MB at M=4096 do not, and
    # every column of blocks streams them from HBM again, which favours wide blocks.
    down = Problem.make(n=4096, k=11008)
    narrow = Schedule("marlin_mma", Knobs(block_m=128, block_n=64, block_k=64, warps_m=2, warps_n=1, num_stages=3))
    wide = Schedule("marlin_mma", Knobs(block_m=128, block_n=256, block_k=64, warps_m=2, warps_n=4, num_stages=3))
    huge_l2 = replace(SPEC, l2_bytes=1 << 30)
    for m, reread in ((1024, False), (4096, True)):
        fitted = rank(down, m, H200, SPEC)[0]
        assert (estimate_us(down, fitted, m, huge_l2) < estimate_us(down, fitted, m, SPEC)) == reread, m
    assert estimate_us(down, wide, 4096, SPEC) < estimate_us(down, narrow, 4096, SPEC)


def test_rank_depends_on_arch():
    a100 = get_arch("sm_80")
    # sm_80 has less shared memory per block: its space is a strict subset here
    assert {s.knobs for s in rank(QKV, 16, a100, GpuSpec.for_arch(a100))} < {s.knobs for s in rank(QKV, 16, H200, SPEC)}


def test_rank_rejects_unknown_family():
    with pytest.raises(ValueError, match="unknown schedule family"):
        rank(QKV, 16, H200, SPEC, families=["nope"])


def test_best_schedule():
    assert best_schedule(QKV, 16, H200) == rank(QKV, 16, H200, SPEC)[0]
    odd = Problem.make(n=96, k=4096)        # N is not a multiple of the 64-column slab
    with pytest.raises(ValueError, match=odd.name):
        best_schedule(odd, 16, H200)


@pytest.mark.gpu
def test_current_spec():
    spec = GpuSpec.current()
    assert spec.sm_count == torch.cuda.get_device_properties(0).multi_processor_count
    assert spec.mma_flops > 0


def test_prepared_stream_knobs_are_estimated_cheaper_where_they_should_be():
    # fold_zero_point removes decode instructions; cluster_reduce keeps split-K partials on chip.
    from schedules import stream_mma

    o_proj = Problem.make(n=4096, k=4096)
    base = stream_mma.Knobs(1, 4, 4, 8, ahead=1)
    fold = stream_mma.Knobs(1, 4, 4, 8, ahead=1, fold_zero_point=True)
    cluster = stream_mma.Knobs(1, 4, 4, 8, ahead=1, cluster_reduce=True)
    t = lambda kb, m: estimate_us(o_proj, Schedule("stream_mma", kb), m, SPEC)
    assert t(fold, 1) <= t(base, 1) and t(cluster, 1) < t(base, 1)
    assert t(cluster, 64) < t(base, 64)


def test_blocks_that_crowd_some_sms_cost_the_busiest_sm():
    """qkv at M = 16, one 64-row tile per block: 192 blocks put 2 on 60 SMs and 1 on 72, so the
    unsplit kernel takes as long as two tiles per SM; split in two (384 blocks, 3 on 120 SMs) each
    SM does at most 1.5 tiles. Measured on the H200: 14.8 against 10.7 us (H200; docs/performance.md); an even
    share of the blocks had it the other way round (12.1 against 13.7 us estimated)."""
    from schedules.stream_wgmma import Knobs as SWK
    base = dict(block_m=16, groups=1, warpgroups=1, block_k=128, stages=6, release_barriers=True, producer_warp=True,
                early_start=2, stage_unroll=True)
    whole = Schedule("stream_wgmma", SWK(**base, pdl=True, staged_store=True))
    halves = Schedule("stream_wgmma", SWK(**base, split_k=2, cluster_reduce=True))
    assert estimate_us(QKV, halves, 16, SPEC) < 0.95 * estimate_us(QKV, whole, 16, SPEC)
    # an even grid is not crowded: 264 blocks (2 per SM) cost twice 132 blocks' per-SM work, not more
    even = Problem.make(n=264 * 64, k=4096)
    half = Problem.make(n=132 * 64, k=4096)
    assert estimate_us(even, whole, 16, SPEC) < 2.1 * estimate_us(half, whole, 16, SPEC)


def test_a_tma_pipeline_fill_waits_for_its_first_stages_only(monkeypatch):
    # stream_wgmma's blocks wait for two stages' loads before their math starts; the later stages land
    # under it (time = F + k-tiles x t over K, F 2.6-3.9 us at M = 16 on the H200).
    from schedules import stream_wgmma
    from schedules.stream_wgmma import Knobs as SW
    down = Problem.make(n=4096, k=11008)
    kb = dict(block_m=16, groups=1, block_k=128, split_k=6, release_barriers=True, producer_warp=True, pdl=True)
    two = stream_wgmma.TRAITS
    assert two.fill_stages == 2
    streams = [Schedule("stream_wgmma", SW(stages=stages, **kb)) for stages in (4, 6, 8)]
    fills_two = [estimate_us(down, stream, 16, SPEC) for stream in streams]
    monkeypatch.setattr(stream_wgmma, "TRAITS", replace(two, fill_stages=0))     # every stage in the fill
    for stream, estimate in zip(streams, fills_two):
        assert estimate < estimate_us(down, stream, 16, SPEC)


def test_fp8_activations_take_their_own_two_warpgroup_rows():
    """Two warpgroups cost W4A16 1.4x above M = 1024 but gained with FP8 activations (W4A8) there;
    only FP8 problems take that row, and with it the M = 4096 ranking puts a 128 x 128 tile first."""
    from schedules import stream_wgmma
    from schedules.cost import measured_factor

    one = stream_wgmma.Knobs(block_m=128, groups=1, warpgroups=1, block_k=128, stages=4, scale_on_acc=True)
    two = replace(one, warpgroups=2)

    def ratio(m, fp8):
        return measured_factor("stream_wgmma", two, m, fp8) / measured_factor("stream_wgmma", one, m, fp8)

    assert ratio(4096, False) == pytest.approx(1.4) and ratio(4096, True) == pytest.approx(0.93)
    assert ratio(256, False) == ratio(256, True) == pytest.approx(1.3)
    first = rank(Problem.make(n=12288, k=4096, act="fp8"), 4096, H200, SPEC, families=("stream_wgmma",))[0]
    assert (first.knobs.block_m, first.knobs.block_n, first.knobs.warpgroups) == (128, 128, 2)
