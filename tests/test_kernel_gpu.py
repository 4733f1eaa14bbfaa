"""Every schedule family's kernels against the fp32 reference, on a GPU.

Many knob settings per family (split-K among them), each on Llama-2-7B's down_proj and on one more
of its layers and groupings (group 128 or channelwise): one compiled kernel (M is dynamic) must match
the reference for every M, with inputs drawn from a seed fixed per case (printed on failure), the
output poisoned with NaN before each call, the comparison of tests/reference.py (relative norm and
every element), and any split-K workspace left zeroed. stream_wgmma runs only on sm_90a GPUs.
"""
import dataclasses

import pytest
import torch

from runtime.kernels import compile_many, compile_schedule
from schedules import stream_mma, stream_wgmma
from schedules.arch import current_arch, get_arch
from schedules.marlin_mma import Knobs
from schedules.problem import Problem
from schedules.quant import quantize_rtn, reference_matmul
from schedules.registry import Schedule
from tests.reference import assert_matches_reference, generator, seed_of

pytestmark = pytest.mark.gpu

LAYERS = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}
MS = (1, 3, 16, 17, 64, 100, 257, 1024)
KNOBS = {
    "small_m": Knobs(16, 256, 128, 1, 4, 1, 4, 1),
    "split3_scale_on_acc": Knobs(16, 128, 128, 1, 2, 2, 4, 3, True),
    "split4_wide_warps": Knobs(32, 256, 64, 1, 4, 1, 4, 4),
    "large_m": Knobs(64, 128, 128, 2, 2, 1, 3, 1),
    "large_m_split2": Knobs(64, 256, 128, 1, 4, 1, 4, 2),
}
STREAM_KNOBS = {
    "stream_m8": stream_mma.Knobs(1, 8, 8, 1, ahead=1),
    "stream_m16_split4": stream_mma.Knobs(2, 4, 4, 4, ahead=1),
    "stream_m32_split2": stream_mma.Knobs(4, 4, 4, 2, ahead=2),
    "stream_m8_ahead3": stream_mma.Knobs(1, 4, 4, 2, ahead=3),
    "stream_m8_fold": stream_mma.Knobs(1, 8, 8, 1, ahead=1, fold_zero_point=True),
    "stream_m16_fold_split4": stream_mma.Knobs(2, 4, 4, 4, ahead=1, fold_zero_point=True),
    "stream_m8_cluster8": stream_mma.Knobs(1, 4, 4, 8, ahead=1, cluster_reduce=True),
    "stream_m32_xl": stream_mma.Knobs(4, 4, 4, 2, ahead=2, x_ldmatrix=True),
    "stream_m16_xl_fold": stream_mma.Knobs(2, 4, 4, 1, ahead=1, x_ldmatrix=True, fold_zero_point=True),
    "stream_m16_fold_cluster4": stream_mma.Knobs(2, 4, 4, 4, ahead=1, fold_zero_point=True, cluster_reduce=True),
    "stream_m8_aw_fold": stream_mma.Knobs(1, 4, 4, 1, ahead=3, fold_zero_point=True, x_ldmatrix=True,
                                          async_weights=True),
    "stream_m16_aw_split4": stream_mma.Knobs(2, 8, 4, 4, ahead=2, x_ldmatrix=True, async_weights=True),
    # the warps' sums through a slice each: the o_proj M=1 winner's knobs, and with shared activation
    # and weight slots (which the slices must not overwrite while a warp still reads them) and a workspace
    "stream_m8_slices_cluster4": stream_mma.Knobs(1, 4, 4, 4, ahead=2, fold_zero_point=True, cluster_reduce=True,
                                                  sum_slices=True),
    "stream_m16_slices_aw_split4": stream_mma.Knobs(2, 8, 4, 4, ahead=2, x_ldmatrix=True, async_weights=True,
                                                    sum_slices=True),
    # launched with programmatic stream serialization (it waits for the previous kernel's writes first)
    "stream_m8_pdl_split4": stream_mma.Knobs(1, 4, 4, 4, ahead=2, fold_zero_point=True, pdl=True),
    # early_start: the next kernel launched early, weights asked of L2 before the wait (the M=1 winners' shape)
    "stream_m8_early_cluster8": stream_mma.Knobs(1, 4, 4, 8, ahead=1, fold_zero_point=True, cluster_reduce=True,
                                                 sum_slices=True, early_start=2),
    "stream_m8_early_late_trigger_cluster4": stream_mma.Knobs(1, 4, 8, 4, ahead=1, fold_zero_point=True,
                                                              cluster_reduce=True, sum_slices=True, early_start=2,
                                                              late_trigger=True),
    "stream_m8_early_pdl_split4": stream_mma.Knobs(1, 4, 8, 4, ahead=1, fold_zero_point=True, sum_slices=True,
                                                   pdl=True, early_start=4),
    # the cluster's sum where a row's 16 4-column chunks do not divide by the 3 ranks (o_proj M=1's
    # runner-up), and with two m-tiles
    "stream_m1_cluster3": stream_mma.Knobs(1, 4, 8, 3, ahead=1, fold_zero_point=True, cluster_reduce=True,
                                           sum_slices=True),
    "stream_m16_early_cluster4": stream_mma.Knobs(2, 4, 4, 4, ahead=1, fold_zero_point=True, cluster_reduce=True,
                                                  sum_slices=True, early_start=2),
    # four batches in flight through the cp.async slots, two m-tiles (the M = 16-32 winners' shape)
    "stream_m16_aw_ahead4_slices": stream_mma.Knobs(2, 4, 4, 1, ahead=4, fold_zero_point=True, x_ldmatrix=True,
                                                    async_weights=True, sum_slices=True, pdl=True),
    # each batch's sums folded during the next batch (two sets): through the slots (down_proj 16's
    # shape) and from register buffers, with a trailing partial trip
    "stream_m16_fold_lag_aw_cluster2": stream_mma.Knobs(2, 8, 4, 2, ahead=4, fold_zero_point=True,
                                                        cluster_reduce=True, x_ldmatrix=True, async_weights=True,
                                                        sum_slices=True, early_start=2, late_trigger=True,
                                                        fold_lag=True),
    "stream_m8_fold_lag_registers": stream_mma.Knobs(1, 4, 4, 1, ahead=2, fold_zero_point=True, fold_lag=True),
    # at most one block per SM (max_blocks: the activation slots padded), M = 8's split-2 cluster form
    "stream_m8_aw_cluster2_mb1": stream_mma.Knobs(1, 8, 4, 2, ahead=3, fold_zero_point=True, cluster_reduce=True,
                                                  x_ldmatrix=True, async_weights=True, sum_slices=True,
                                                  early_start=2, late_trigger=True, max_blocks=1),
}
SW = stream_wgmma.Knobs
STREAM_WGMMA_KNOBS = {
    # the TMA pipeline with a block barrier per k-tile: groups, warpgroups, split-K, stage counts
    "swg_m128_g2": SW(128, 2, 1, 64, 3),
    "swg_m64_g2_wg2": SW(64, 2, 2, 64, 4),
    "swg_m256_g1_wg2": SW(256, 1, 2, 64, 3),
    "swg_m64_split2": SW(64, 2, 1, 64, 3, split_k=2),
    "swg_m16_g4": SW(16, 4, 1, 64, 4),
    "swg_m128_g2_wg2": SW(128, 2, 2, 64, 4),
    "swg_m64_split4": SW(64, 2, 1, 64, 3, split_k=4),
    "swg_m8_s8_split4": SW(8, 1, 1, 64, 8, split_k=4),
    "swg_m16_g2_s6": SW(16, 2, 1, 64, 6),
    "swg_m32_cluster_split2": SW(32, 1, 2, 64, 4, split_k=2, cluster_reduce=True),
    "swg_m16_k128_split2": SW(16, 2, 1, 128, 6, split_k=2),
    "swg_m32_pdl_split2": SW(32, 1, 1, 64, 4, split_k=2, pdl=True),
    # stages released through mbarriers, and a producer warp (or, with setmaxnreg, warpgroup)
    "swg_m128_release_producer": SW(128, 1, 2, 64, 4, release_barriers=True, producer_warp=True),
    "swg_m64_release_producer_split2": SW(64, 1, 1, 64, 6, split_k=2, release_barriers=True, producer_warp=True),
    "swg_m256_release_producer_setmaxnreg": SW(256, 1, 2, 64, 4, release_barriers=True, producer_warp=True,
                                               setmaxnreg=True),
    "swg_m128_release_producer_setmaxnreg_s8": SW(128, 1, 2, 64, 8, release_barriers=True, producer_warp=True,
                                                  setmaxnreg=True),
    "swg_m16_producer_cluster_split4": SW(16, 1, 1, 64, 8, split_k=4, release_barriers=True, producer_warp=True,
                                          cluster_reduce=True),
    "swg_m64_k128_producer": SW(64, 1, 1, 128, 4, release_barriers=True, producer_warp=True),
    "swg_m128_g2_wg2_release": SW(128, 2, 2, 64, 4, release_barriers=True),
    "swg_m64_release_split4": SW(64, 2, 1, 64, 3, split_k=4, release_barriers=True),
    # the output tile through a shared tile of its own: the large-M form (setmaxnreg), a producer warp
    # with one and two warpgroups (block_k 128), block_m 8 (fewer 16-byte chunks than consumers), and
    # the block's own pipeline with two warpgroups
    "swg_m256_setmaxnreg_staged": SW(256, 1, 2, 64, 4, release_barriers=True, producer_warp=True, setmaxnreg=True,
                                     staged_store=True),
    "swg_m64_producer_staged_s6": SW(64, 1, 1, 64, 6, release_barriers=True, producer_warp=True, staged_store=True),
    "swg_m128_producer_k128_staged": SW(128, 1, 2, 128, 4, release_barriers=True, producer_warp=True,
                                        staged_store=True),
    "swg_m8_producer_staged": SW(8, 1, 1, 64, 8, release_barriers=True, producer_warp=True, staged_store=True),
    "swg_m128_wg2_staged": SW(128, 1, 2, 64, 4, staged_store=True),
    # a block_m that is not a power of two (wgmma n88): finer steps against wave quantization
    "swg_m88_producer_staged": SW(88, 1, 1, 64, 4, release_barriers=True, producer_warp=True, staged_store=True),
    # early_start: the next kernel launched early, weights and scales asked of L2 before the wait
    "swg_m16_producer_cluster_early": SW(16, 1, 1, 128, 6, split_k=2, release_barriers=True, producer_warp=True,
                                         cluster_reduce=True, early_start=2),
    "swg_m64_producer_pdl_early_staged": SW(64, 1, 1, 64, 6, release_barriers=True, producer_warp=True, pdl=True,
                                            staged_store=True, early_start=3),
    # output tiles in panels of M tiles (odd M: the last panel is shorter)
    "swg_m64_producer_panel3": SW(64, 1, 1, 64, 4, release_barriers=True, producer_warp=True, panel_m=3),
    "swg_m256_setmaxnreg_staged_panel2": SW(256, 1, 2, 64, 4, release_barriers=True, producer_warp=True,
                                            setmaxnreg=True, staged_store=True, panel_m=2),
    # split-K through the workspace and through a cluster at block 128 x 128, one and two warpgroups
    "swg_m16_producer_pdl_split4": SW(16, 1, 1, 64, 8, split_k=4, release_barriers=True, producer_warp=True,
                                      pdl=True),
    "swg_m128_wg2_k128_producer_cluster_split2": SW(128, 1, 2, 128, 4, split_k=2, release_barriers=True,
                                                    producer_warp=True, cluster_reduce=True),
    "swg_m128_k128_producer_cluster_split2_early": SW(128, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                      producer_warp=True, cluster_reduce=True, early_start=2),
    # the k-loop unrolled by the stages (6 stages: 2 k-tiles before it at K = 4096, 5 at 11008), with a
    # producer warp, split in a cluster, and the block's own pipeline, which refills a stage from inside
    # the k-loop; at 6 stages without a producer, 4 k-tiles before a rolled loop that refills its stages
    # at run-time indices
    "swg_m16_k128_producer_staged_unrolled": SW(16, 1, 1, 128, 6, release_barriers=True, producer_warp=True,
                                                pdl=True, staged_store=True, early_start=2, stage_unroll=True),
    "swg_m16_k128_producer_cluster_split2_unrolled": SW(16, 1, 1, 128, 6, split_k=2, release_barriers=True,
                                                        producer_warp=True, cluster_reduce=True, early_start=2,
                                                        stage_unroll=True),
    "swg_m32_s4_unrolled": SW(32, 1, 1, 64, 4, stage_unroll=True),
    "swg_m32_s6_unrolled": SW(32, 1, 1, 64, 6, stage_unroll=True),
    # ring = D: the wgmmas committed a k-step at a time with D k-steps of fragments (D = 8 and 2), with
    # a producer warp, split in a cluster, and two groups
    "swg_m16_k128_producer_staged_unrolled_ring": SW(16, 1, 1, 128, 6, release_barriers=True, producer_warp=True,
                                                     pdl=True, staged_store=True, early_start=2, stage_unroll=True,
                                                     ring=8),
    "swg_m16_k128_producer_cluster_split2_ring": SW(16, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                    producer_warp=True, cluster_reduce=True, early_start=2,
                                                    stage_unroll=True, ring=8),
    "swg_m64_g2_ring": SW(64, 2, 1, 64, 4, ring=2),
    "swg_m16_k128_producer_cluster_split2_ring2": SW(16, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                     producer_warp=True, cluster_reduce=True, early_start=2,
                                                     stage_unroll=True, ring=2),
    # group scales on each k-tile's sums (scale_on_acc), and block_m 32 with two groups, two k-tiles
    # per group, split 4 (43 k-tiles per split at down_proj)
    "swg_m16_k128_producer_staged_unrolled_sacc": SW(16, 1, 1, 128, 6, release_barriers=True, producer_warp=True,
                                                     pdl=True, staged_store=True, early_start=2, stage_unroll=True,
                                                     scale_on_acc=True),
    "swg_m16_k128_producer_cluster_split2_sacc": SW(16, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                    producer_warp=True, cluster_reduce=True, early_start=2,
                                                    stage_unroll=True, scale_on_acc=True),
    "swg_m32_g2_split4_sacc": SW(32, 2, 1, 64, 4, split_k=4, scale_on_acc=True),
    # ... with each k-tile's fold under the next one's wgmmas (fold_lag); at 6 stages, 16 k-tiles per
    # split leave 4 before the loop (two trips of a rolled loop), 43 one
    "swg_m16_k128_producer_cluster_split2_sacc_lag": SW(16, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                        producer_warp=True, cluster_reduce=True, early_start=2,
                                                        stage_unroll=True, scale_on_acc=True, fold_lag=True),
    "swg_m32_g2_split4_sacc_lag": SW(32, 2, 1, 64, 4, split_k=4, scale_on_acc=True, fold_lag=True),
    "swg_m16_k128_producer_cluster_split2_s6_sacc_lag": SW(16, 1, 1, 128, 6, split_k=2, release_barriers=True,
                                                           producer_warp=True, cluster_reduce=True, early_start=2,
                                                           stage_unroll=True, scale_on_acc=True, fold_lag=True),
    # uneven splits (the first k_tiles % split_k splits a k-tile longer): 8 in a cluster (down_proj's
    # 86 k-tiles: 11 and 10; the others even), 3 through the workspace (every layer uneven), 6 through
    # the workspace (15 and 14 k-tiles of 128 at down_proj; 6 and 5 elsewhere), and 4 at 8 stages
    # (down_proj's 22 and 21 k-tiles leave 6 and 5 before a rolled loop, the others 0)
    "swg_m16_k128_producer_cluster_split8_uneven_sacc_lag": SW(16, 1, 1, 128, 4, split_k=8, release_barriers=True,
                                                               producer_warp=True, cluster_reduce=True, early_start=2,
                                                               stage_unroll=True, scale_on_acc=True, fold_lag=True),
    "swg_m16_k64_producer_split3_uneven": SW(16, 1, 1, 64, 4, split_k=3, release_barriers=True, producer_warp=True,
                                             stage_unroll=True),
    "swg_m16_k128_producer_split6_uneven_s4_sacc_lag_pdl": SW(16, 1, 1, 128, 4, split_k=6, release_barriers=True,
                                                              producer_warp=True, pdl=True, early_start=2,
                                                              stage_unroll=True, scale_on_acc=True, fold_lag=True),
    "swg_m16_k128_producer_cluster_split4_s8_uneven_sacc_lag": SW(16, 1, 1, 128, 8, split_k=4, release_barriers=True,
                                                                  producer_warp=True, cluster_reduce=True,
                                                                  early_start=2, stage_unroll=True, scale_on_acc=True,
                                                                  fold_lag=True),
    # group scales on the sums (scale_on_acc) behind a producer warpgroup (setmaxnreg)
    "swg_m128_setmaxnreg_sacc": SW(128, 1, 2, 64, 4, release_barriers=True, producer_warp=True, setmaxnreg=True,
                                   stage_unroll=True, scale_on_acc=True),
}
# rotate: the lane quarters' shifted slab quarters, on every path that reads the words (groups 1 and
# 2, the block's own pipeline and the producer warp) and every way out (direct and staged stores, the
# cluster sum, the workspace, two warpgroups)
ROTATED = ("swg_m128_g2", "swg_m64_split2", "swg_m128_g2_wg2", "swg_m16_g2_s6", "swg_m256_g1_wg2", "swg_m8_s8_split4",
           "swg_m128_producer_k128_staged", "swg_m256_setmaxnreg_staged",
           "swg_m16_k128_producer_split6_uneven_s4_sacc_lag_pdl", "swg_m16_k128_producer_cluster_split2_s6_sacc_lag")
STREAM_WGMMA_KNOBS.update({f"{name}_rot": dataclasses.replace(STREAM_WGMMA_KNOBS[name], rotate=True)
                           for name in ROTATED})
# split_wait: the last split reads the others' slots after its k-loop: uneven splits (the last two
# long), even ones at block_k 64, and block_m 64 split in two
SPLIT_WAIT = ("swg_m16_k128_producer_split6_uneven_s4_sacc_lag_pdl_rot", "swg_m16_producer_pdl_split4",
              "swg_m64_release_producer_split2")
STREAM_WGMMA_KNOBS.update({f"{name}_wait": dataclasses.replace(STREAM_WGMMA_KNOBS[name], split_wait=True)
                           for name in SPLIT_WAIT})
SCHEDULES = {**{name: Schedule("marlin_mma", kb) for name, kb in KNOBS.items()},
             **{name: Schedule("stream_mma", kb) for name, kb in STREAM_KNOBS.items()},
             **{name: Schedule("stream_wgmma", kb) for name, kb in STREAM_WGMMA_KNOBS.items()}}
BF16_SCHEDULES = ("split3_scale_on_acc", "stream_m16_split4", "stream_m16_fold_split4", "stream_m16_aw_split4",
                  "swg_m128_g2", "swg_m256_g1_wg2", "swg_m256_setmaxnreg_staged", "swg_m32_g2_split4_sacc")


# Zero points (w = s * (q - z): z off the codes in place of 8, then scaled in the decode, on the sums
# (scale_on_acc) or in the fold (fold_zero_point)): the forms that take them, each on down_proj at group 128 and on every other layer, grouped
# and channelwise in turn.
ZERO_POINT_SCHEDULES = ("stream_m16_split4", "swg_m128_release_producer", "stream_m8", "stream_m16_aw_split4",
                        "stream_m8_fold", "stream_m16_fold_split4", "stream_m8_fold_lag_registers",
                        "stream_m8_early_cluster8", "stream_m16_xl_fold",
                        "stream_m8_cluster8", "stream_m32_xl", "swg_m128_g2", "swg_m64_split4", "swg_m8_s8_split4",
                        "swg_m32_cluster_split2", "swg_m16_producer_cluster_early", "swg_m256_setmaxnreg_staged",
                        "swg_m16_k64_producer_split3_uneven", "swg_m64_producer_pdl_early_staged",
                        "swg_m16_k128_producer_cluster_split2_sacc_lag", "swg_m32_g2_split4_sacc")


def _zero_point_cases():
    """As _cases: each form on down_proj at group 128 and on one more (layer, group) pair (scales on the
    sums, code - z, take no channelwise scales)."""
    others = [(layer, group) for layer in LAYERS for group in (128, -1) if (layer, group) != ("down", 128)]
    cases = []
    for index, name in enumerate(ZERO_POINT_SCHEDULES):
        grouped_only = getattr(SCHEDULES[name].knobs, "scale_on_acc", False)
        options = [pair for pair in others if not (grouped_only and pair[1] == -1)]
        cases += [("down", 128, name), (*options[index % len(options)], name)]
    return cases


def _cases():
    """Each knob form on down_proj at group 128 (K = 11008: the uneven k-tile and split counts the
    forms above are written for) and on one more (layer, group) pair, rotating through the other
    seven so that every pair meets many forms. Scales on the sums need groups: no channelwise there."""
    others = [(layer, group) for layer in LAYERS for group in (128, -1) if (layer, group) != ("down", 128)]
    cases = []
    for index, name in enumerate(SCHEDULES):
        grouped_only = getattr(SCHEDULES[name].knobs, "scale_on_acc", False)
        options = [pair for pair in others if not (grouped_only and pair[1] == -1)]
        cases += [("down", 128, name), (*options[index % len(options)], name)]
    return cases


CASES = _cases()
ZERO_POINT_CASES = _zero_point_cases()


def problem_of(layer, group, dtype="float16", zero_points=False):
    k, n = LAYERS[layer]
    return Problem.make(n=n, k=k, group=group, dtype=dtype, zero_points=zero_points)


@pytest.fixture(scope="session")
def arch():
    return current_arch()


@pytest.fixture(scope="session", autouse=True)
def precompiled(arch, request):
    """Compile the selected cases (-k) in parallel once; the tests then load kernels from the disk cache."""
    selected = {item.callspec.params.get("name") for item in request.session.items if hasattr(item, "callspec")}
    jobs = [(problem_of(layer, group), SCHEDULES[name]) for layer, group, name in CASES if name in selected
            and SCHEDULES[name].module.check(problem_of(layer, group), SCHEDULES[name].knobs, arch) is None]
    jobs += [(problem_of("o", 128, "bfloat16"), SCHEDULES[name]) for name in BF16_SCHEDULES if name in selected]
    jobs += [(problem_of(layer, group, zero_points=True), SCHEDULES[name]) for layer, group, name in ZERO_POINT_CASES
             if name in selected and SCHEDULES[name].module.check(problem_of(layer, group, zero_points=True),
                                                                  SCHEDULES[name].knobs, arch) is None]
    jobs += [(problem_of("o", 128, "bfloat16", True), SCHEDULES[name]) for name in ZERO_POINT_SCHEDULES[:2]
             if name in selected]
    errors = {job: err for job, err in compile_many(jobs, arch).items() if err}
    assert not errors, errors


def run_and_check(problem, schedule, arch, ms=MS):
    fam, knobs = schedule.module, schedule.knobs
    # (whether the family is offered at all is check()'s answer too: space() would enumerate ~80k
    # stream_wgmma points, 15 s per case)
    reason = fam.check(problem, knobs, arch)
    if reason and not arch.hopper and fam.check(problem, knobs, get_arch("sm_90a")) is None:
        pytest.skip(f"{schedule.name} needs sm_90a: {reason}")
    assert reason is None, reason
    kernel = compile_schedule(problem, schedule, arch)
    dtype = torch.float16 if problem.dtype == "float16" else torch.bfloat16
    seed = seed_of(problem.name, schedule.name)   # W from seed, A of each M from seed + M
    w = torch.randn(problem.k, problem.n, device="cuda", dtype=dtype, generator=generator(seed))
    codes, scales = quantize_rtn(w, -1 if problem.channelwise else problem.group, dtype=problem.dtype)
    # zero points drawn over the whole code range 0..15
    zeros = torch.randint(0, 16, scales.shape, device="cuda", generator=generator(seed + 1)) \
        if problem.zero_points else None
    weight, packed_scales = fam.pack(codes, scales, zeros)
    ws_elems, n_counters = fam.workspace_elems(problem, knobs, max(ms))
    workspace = torch.zeros(max(ws_elems, 1), device="cuda", dtype=torch.float32)
    counters = torch.zeros(max(n_counters, 1), device="cuda", dtype=torch.int32)
    for m in ms:
        context = f"{problem.name} {schedule.name} M={m} seed={seed} (W: seed, A: seed + M)"
        a = torch.randn(m, problem.k, device="cuda", dtype=dtype, generator=generator(seed + m))
        out = torch.full((m, problem.n), float("nan"), device="cuda", dtype=dtype)
        kernel(*fam.kernel_args(problem, knobs, a, weight, packed_scales, out, workspace, counters))
        assert_matches_reference(out, reference_matmul(a, codes, scales, zeros=zeros), context=context)
        assert not workspace.any() and not counters.any(), f"{context}: split-K must leave its workspace zeroed"


@pytest.mark.parametrize("layer,group,name", CASES)
def test_kernel_matches_reference(layer, group, name, arch):
    run_and_check(problem_of(layer, group), SCHEDULES[name], arch)


@pytest.mark.parametrize("layer,group,name", ZERO_POINT_CASES)
def test_zero_point_kernel_matches_reference(layer, group, name, arch):
    run_and_check(problem_of(layer, group, zero_points=True), SCHEDULES[name], arch)


BF16_ZERO_POINT_SCHEDULES = ZERO_POINT_SCHEDULES[:2] + ("stream_m8_fold", "swg_m32_g2_split4_sacc")


@pytest.mark.parametrize("name", BF16_ZERO_POINT_SCHEDULES)
def test_bf16_zero_point_kernel_matches_reference(name, arch):
    run_and_check(problem_of("o", 128, "bfloat16", True), SCHEDULES[name], arch, ms=(1, 17, 257))


@pytest.mark.parametrize("name", BF16_SCHEDULES)
def test_bf16_kernel_matches_reference(name, arch):
    run_and_check(problem_of("o", 128, "bfloat16"), SCHEDULES[name], arch, ms=(1, 17, 257))


@pytest.mark.parametrize("name", ("split3_scale_on_acc", "stream_m16_split4", "stream_m8_cluster8", "swg_m64_split2"))
def test_repeated_calls_stay_correct_under_cuda_graph_replay(name, arch):
    """The split-K counters reset themselves, so a captured kernel replays correctly with new inputs."""
    problem, schedule = problem_of("o", 128), SCHEDULES[name]
    knobs = schedule.knobs
    if schedule.module.check(problem, knobs, arch):
        pytest.skip(schedule.module.check(problem, knobs, arch))
    kernel = compile_schedule(problem, schedule, arch)
    seed = seed_of("graph replay", problem.name, name)
    gen = generator(seed)
    w = torch.randn(problem.k, problem.n, device="cuda", dtype=torch.float16, generator=gen)
    codes, scales = quantize_rtn(w, 128)
    fam = schedule.module
    weight, packed_scales = fam.pack(codes, scales)
    a = torch.randn(17, problem.k, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty(17, problem.n, device="cuda", dtype=torch.float16)
    ws_elems, n_counters = fam.workspace_elems(problem, knobs, 17)
    workspace = torch.zeros(ws_elems, device="cuda")
    counters = torch.zeros(n_counters, device="cuda", dtype=torch.int32)
    args = fam.kernel_args(problem, knobs, a, weight, packed_scales, out, workspace, counters)
    kernel(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(*args)
    for replay in range(3):
        a.copy_(torch.randn(a.shape, device="cuda", dtype=a.dtype, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        assert_matches_reference(out, reference_matmul(a, codes, scales),
                                 context=f"{name}: replay {replay}, inputs drawn in turn from seed={seed}")
