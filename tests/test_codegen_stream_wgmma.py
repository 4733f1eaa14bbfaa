"""stream_wgmma code generation without a GPU: nvcc compiles each schedule for sm_90a, and the PTX must
show the family's design: wgmma with its A operand in registers (the decoded weights) and B from a
shared-memory descriptor (the activations), the stages filled by TMA against mbarriers, every register
buffer in registers, and what each k-loop waits on."""
import math
import os
import re

import pytest

from runtime.kernels import compile_schedule
from schedules import stream_wgmma
from schedules.arch import get_arch
from schedules.problem import Problem
from schedules.registry import Schedule
from tests.test_codegen_stream import assert_split_sums_move_vectors, braced, count, ptxas_output, ptxas_spills

Knobs = stream_wgmma.Knobs
SM90 = get_arch("sm_90a")

CASES = {
    # small M: wgmma n8, one warpgroup, eight stages of a TMA-fed weight stream, split-K.
    "m8_split4": (Problem(1024, 4096, 128), Knobs(8, 1, 1, 64, 8, split_k=4)),
    # an odd number of k-tiles per split (43): ptxas must keep the wgmmas asynchronous.
    "odd_k_tiles": (Problem(4096, 11008, 128), Knobs(32, 1, 2, 64, 4, split_k=4)),
    # ... the stages freed through per-stage mbarriers instead of a block barrier.
    "release": (Problem(1024, 1024, 128), Knobs(128, 2, 2, 64, 4, release_barriers=True)),
    # ... and refilled by a warp of their own (warp specialization), split-K epilogue with all threads.
    "producer_warp_split2": (Problem(1024, 4096, 128), Knobs(128, 1, 2, 64, 4, split_k=2, release_barriers=True,
                                                            producer_warp=True)),
    # ... with the producer a whole warpgroup that hands its registers to the consumers (setmaxnreg),
    # so that block_m 256 with two warpgroups keeps its wgmmas in flight.
    "producer_warpgroup_setmaxnreg": (Problem(1024, 4096, 128), Knobs(256, 1, 2, 64, 4, release_barriers=True,
                                                                     producer_warp=True, setmaxnreg=True)),
    # small M with a producer warp, the four splits of a tile adding up in a cluster's shared memory.
    "producer_cluster_split4": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 64, 8, split_k=4, release_barriers=True,
                                                               producer_warp=True, cluster_reduce=True)),
    # block_k 128: two 64-wide swizzled activation tiles per stage, eight k-steps per wait.
    "k128_producer_warp": (Problem(1024, 4096, 128), Knobs(64, 1, 1, 128, 4, release_barriers=True,
                                                          producer_warp=True)),
    # launched with programmatic stream serialization, split-K through the workspace.
    "pdl_split2": (Problem(1024, 4096, 128), Knobs(32, 1, 1, 64, 4, split_k=2, pdl=True)),
    # the output tile through the drained stages as 16-byte row chunks: the large-M form (a producer
    # warpgroup that hands over its registers), and channelwise with block_k 128 (two atoms per stage)
    "setmaxnreg_staged_store": (Problem(1024, 4096, 128), Knobs(256, 1, 2, 64, 4, release_barriers=True,
                                                               producer_warp=True, setmaxnreg=True, staged_store=True)),
    "k128_staged_store_channelwise": (Problem.make(4096, 1024, -1), Knobs(64, 1, 2, 128, 4, release_barriers=True,
                                                                       producer_warp=True, staged_store=True)),
    # the next kernel launched early, the first two k-tiles' weights and scales asked of L2 before the wait
    "producer_cluster_early_start": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 128, 6, split_k=2,
                                                                    release_barriers=True, producer_warp=True,
                                                                    cluster_reduce=True, early_start=2)),
    # block_m 88 (wgmma n88): tile heights between the powers of two, against wave quantization
    "producer_m88_staged": (Problem(1024, 4096, 128), Knobs(88, 1, 1, 64, 4, release_barriers=True,
                                                           producer_warp=True, staged_store=True)),
    # output tiles handed out in panels of 4 M tiles (the large-M form: setmaxnreg, staged store)
    "setmaxnreg_staged_panel4": (Problem(1024, 4096, 128), Knobs(256, 1, 2, 64, 4, release_barriers=True,
                                                                producer_warp=True, setmaxnreg=True,
                                                                staged_store=True, panel_m=4)),
    # split-K's sums with 16-byte accesses, all of a thread's loads in flight: through the workspace, and
    # bf16 channelwise at block 128 x 128 through a cluster of two (qkv M=128's winner split in two); and
    # three ranks, whose 4-column chunks do not divide a row of 64 columns
    "producer_split4": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 64, 8, split_k=4, release_barriers=True,
                                                       producer_warp=True, pdl=True)),
    "producer_cluster_bf16_channelwise": (Problem.make(1024, 4096, -1, dtype="bfloat16"),
                                          Knobs(128, 1, 2, 128, 4, split_k=2, release_barriers=True,
                                                producer_warp=True, cluster_reduce=True)),
    "producer_cluster_split3": (Problem(1024, 3072, 128), Knobs(16, 1, 1, 64, 8, split_k=3, release_barriers=True,
                                                               producer_warp=True, cluster_reduce=True)),
    # the consumers' and the producer warp's k-loops unrolled by the stages (32 k-tiles: 2 before the
    # loop, 5 trips of 6), in gate_up M=16's winner form, and in a cluster of two splits (qkv M=16's)
    "producer_stage_unroll": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 128, 6, release_barriers=True,
                                                             producer_warp=True, pdl=True, staged_store=True,
                                                             early_start=2, stage_unroll=True)),
    "producer_cluster_stage_unroll": (Problem(1024, 8192, 128), Knobs(16, 1, 1, 128, 6, split_k=2,
                                                                     release_barriers=True, producer_warp=True,
                                                                     cluster_reduce=True, early_start=2,
                                                                     stage_unroll=True)),
    # ... and the block's own TMA pipeline at 6 stages: 64 k-tiles leave 4 before the loop, whose rolled
    # trips refill their stages from the k-loop
    "s6_lead4_unrolled": (Problem(1024, 4096, 128), Knobs(32, 1, 1, 64, 6, stage_unroll=True)),
    # the wgmmas committed a k-step at a time (ring), in gate_up M=16's winner form and split in a cluster
    "producer_ring": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 128, 6, release_barriers=True, producer_warp=True,
                                                     pdl=True, staged_store=True, early_start=2, stage_unroll=True,
                                                     ring=8)),
    "producer_cluster_ring": (Problem(1024, 8192, 128), Knobs(16, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                             producer_warp=True, cluster_reduce=True,
                                                             early_start=2, stage_unroll=True, ring=8)),
    "bf16_channelwise_ring": (Problem.make(512, 1024, -1, dtype="bfloat16"), Knobs(32, 2, 1, 64, 4, ring=2)),
    "producer_cluster_ring2": (Problem(1024, 8192, 128), Knobs(16, 1, 1, 128, 4, split_k=2, release_barriers=True,
                                                              producer_warp=True, cluster_reduce=True,
                                                              early_start=2, stage_unroll=True, ring=2)),
    # group scales on each k-tile's sums (scale_on_acc): qkv M=16's winner form (split 2 in a cluster),
    # gate_up M=16's, and block_m 32 with two groups, two k-tiles per group and 43 k-tiles per split
    "producer_cluster_unrolled_sacc": (Problem(1024, 8192, 128), Knobs(16, 1, 1, 128, 4, split_k=2,
                                                                      release_barriers=True, producer_warp=True,
                                                                      cluster_reduce=True, early_start=2,
                                                                      stage_unroll=True, scale_on_acc=True)),
    "producer_staged_unrolled_sacc": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 128, 6, release_barriers=True,
                                                                     producer_warp=True, pdl=True, staged_store=True,
                                                                     early_start=2, stage_unroll=True,
                                                                     scale_on_acc=True)),
    "g2_odd_k_tiles_sacc": (Problem(4096, 11008, 128), Knobs(32, 2, 1, 64, 4, split_k=4, scale_on_acc=True)),
    # ... and each k-tile's sums folded under the next one's wgmmas (fold_lag): qkv M=16's form, and the
    # odd split (one k-tile before the loop, a trip of its own)
    "producer_cluster_unrolled_sacc_lag": (Problem(1024, 8192, 128), Knobs(16, 1, 1, 128, 4, split_k=2,
                                                                          release_barriers=True, producer_warp=True,
                                                                          cluster_reduce=True, early_start=2,
                                                                          stage_unroll=True, scale_on_acc=True,
                                                                          fold_lag=True)),
    "g2_odd_k_tiles_sacc_lag": (Problem(4096, 11008, 128), Knobs(32, 2, 1, 64, 4, split_k=4, scale_on_acc=True,
                                                                 fold_lag=True)),
    # ... and 6 stages at 16 k-tiles per split: four k-tiles before the loop of 6-k-tile trips, which
    # run as a loop of their own (two trips of two)
    "producer_cluster_lead4_sacc_lag": (Problem(4096, 4096, 128), Knobs(16, 1, 1, 128, 6, split_k=2,
                                                                       release_barriers=True, producer_warp=True,
                                                                       cluster_reduce=True, early_start=2,
                                                                       stage_unroll=True, scale_on_acc=True,
                                                                       fold_lag=True)),
    # uneven splits: down_proj's 86 k-tiles in 8 splits of 11 and 10 (4 stages, so that the k-loops stay
    # loops), and 64 k-tiles in 3 splits of 22, 21, 21 through the workspace
    "producer_cluster_uneven_split8_sacc_lag": (Problem(4096, 11008, 128),
                                                Knobs(16, 1, 1, 128, 4, split_k=8, release_barriers=True,
                                                      producer_warp=True, cluster_reduce=True, early_start=2,
                                                      stage_unroll=True, scale_on_acc=True, fold_lag=True)),
    "producer_uneven_split3": (Problem(1024, 4096, 128), Knobs(16, 1, 1, 64, 4, split_k=3, release_barriers=True,
                                                              producer_warp=True, stage_unroll=True)),
    # qkv 16's form with the weight words read conflict-free (rotate)
    "producer_cluster_sacc_lag_rotate": (Problem(1024, 4096, 128),
                                         Knobs(16, 1, 1, 128, 6, split_k=2, release_barriers=True, producer_warp=True,
                                               cluster_reduce=True, early_start=2, stage_unroll=True,
                                               scale_on_acc=True, fold_lag=True, rotate=True)),
    # down_proj 16's form with the last split reading the others' slots (split_wait): 86 k-tiles in 6
    # splits, the last two of 15; and 4 even splits of channelwise sums at block_m 32
    "producer_split_wait_uneven_split6": (Problem(4096, 11008, 128),
                                          Knobs(16, 1, 1, 128, 6, split_k=6, release_barriers=True, producer_warp=True,
                                                pdl=True, early_start=2, panel_m=4, stage_unroll=True,
                                                scale_on_acc=True, fold_lag=True, rotate=True, split_wait=True)),
    "producer_split_wait_split4_channelwise": (Problem.make(1024, 4096, -1),
                                               Knobs(32, 1, 1, 64, 4, split_k=4, release_barriers=True,
                                                     producer_warp=True, stage_unroll=True, split_wait=True)),
    # W4A8 on the W4A16 stream (fp8_rounded): each landed stage rounded to its FP8 values in place, in
    # qkv_proj 16's form (one warpgroup) and with two warpgroups in bf16 (block-barrier stages); up to
    # block_m 16 (knobs.check)
    "fp8_rounded_qkv16": (Problem(12288, 4096, 128, act="fp8_rounded"),
                          Knobs(16, 1, 1, 128, 6, split_k=2, release_barriers=True, producer_warp=True, pdl=True,
                                early_start=2, stage_unroll=True, scale_on_acc=True, fold_lag=True, rotate=True,
                                split_wait=True)),
    "fp8_rounded_bf16_wg2": (Problem(1024, 4096, 128, dtype="bfloat16", act="fp8_rounded"),
                             Knobs(16, 1, 2, 64, 4, split_k=2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_are_valid_schedules(name):
    problem, knobs = CASES[name]
    assert stream_wgmma.check(problem, knobs, SM90) is None


def test_scale_on_acc_needs_group_scales():
    knobs = Knobs(16, 1, 1, 128, 4, scale_on_acc=True)
    assert stream_wgmma.check(Problem(4096, 4096, 128), knobs, SM90) is None
    assert "channelwise" in stream_wgmma.check(Problem.make(4096, 4096, -1), knobs, SM90)


def test_not_offered_before_hopper():
    problem = Problem(4096, 4096, 128)
    assert stream_wgmma.space(problem, get_arch("sm_80")) == []
    assert "sm_90a" in stream_wgmma.check(problem, Knobs(), get_arch("sm_80"))
    assert stream_wgmma.space(problem, SM90)


@pytest.mark.parametrize("knobs,fragment", [
    (Knobs(block_m=20), "multiple of 8"),
    (Knobs(groups=3), "1, 2 or 4"),
    (Knobs(block_k=48), "multiple of 32"),
    (Knobs(block_k=32), "64-wide swizzled tiles"),
    (Knobs(stages=1), "no stage in flight"),
    (Knobs(block_m=256, groups=4), "registers"),
    (Knobs(producer_warp=True), "needs release_barriers"),
    (Knobs(256, 1, 2, 64, 4, release_barriers=True, producer_warp=True), "keep the wgmmas in flight"),
    (Knobs(128, 1, 2, 64, 4, split_k=2, release_barriers=True, producer_warp=True, setmaxnreg=True), "split_k=1"),
    (Knobs(128, 1, 1, 64, 4, release_barriers=True, producer_warp=True, setmaxnreg=True), "warpgroups=2"),
    (Knobs(128, 1, 2, 64, 4, setmaxnreg=True), "needs producer_warp"),
    (Knobs(64, 1, 1, 64, 4, split_k=16, cluster_reduce=True), "portable cluster"),
    (Knobs(128, 1, 2, 64, 4, split_k=2, release_barriers=True, producer_warp=True, staged_store=True), "split_k=1"),
    (Knobs(16, 1, 1, 64, 4, ring=8), "dividing the stage's 4"),
    (Knobs(16, 1, 1, 128, 4, ring=3), "dividing the stage's 8"),
    (Knobs(16, 1, 1, 128, 4, ring=1), "at least 2"),
    (Knobs(16, 1, 1, 128, 4, ring=8, scale_on_acc=True), "no ring"),
    # (scale_on_acc's second set of sums does not fit 256 rows even with the producer's registers)
    (Knobs(256, 1, 2, 64, 4, release_barriers=True, producer_warp=True, setmaxnreg=True, scale_on_acc=True),
     "would spill"),
    (Knobs(16, 1, 1, 128, 4, fold_lag=True), "needs scale_on_acc"),
    (Knobs(16, 1, 1, 64, 4, split_k=3), "do not split evenly"),
])
def test_check_names_the_problem(knobs, fragment):
    assert fragment in stream_wgmma.check(Problem(4096, 4096, 128), knobs, SM90)


KERNELS = [(problem, Schedule("stream_wgmma", knobs), SM90) for problem, knobs in CASES.values()]


def compiled_case(problem, knobs, tmp_path_factory):
    """(problem, knobs, CUDA source, PTX) of a stream_wgmma kernel built for sm_90a."""
    kernel = compile_schedule(problem, Schedule("stream_wgmma", knobs), SM90)
    ptx_path = tmp_path_factory.mktemp("ptx") / "kernel.ptx"
    kernel.export_ptx(str(ptx_path))
    return problem, knobs, kernel.get_kernel_source(), ptx_path.read_text()


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    return compiled_case(*CASES[request.param], tmp_path_factory)


def test_fp8_rounded_rounds_each_landed_stage_before_its_wgmmas(compiled):
    """Per k-tile: the stage's barrier wait, its 16-byte chunks rounded (mask 0xFF80FF80 in float16,
    0xFFF0FFF0 in bfloat16: schedules/fp8_rounding.py), a fence for the async proxy and the consumers'
    barrier, then the wgmmas."""
    problem, knobs, src, ptx = compiled
    masks = re.findall(r"\band\.b32\s+%r\d+, %r\d+, (-8323200|-983056);", ptx)
    if not problem.rounds_fp8:
        assert not masks and "tm_round_e4m3" not in src
        return
    assert set(masks) == {"-8323200" if problem.dtype == "float16" else "-983056"}
    body = src[src.index("__global__"):]
    calls = [m.start() for m in re.finditer(r"tm_round_e4m3_chunks<", body)]
    assert calls
    for call in calls:
        before, after = body[:call], body[call:]
        assert before.rindex(".wait(") > before.rfind("wgmma_rs")      # the stage has landed
        assert after.index("tm_consumers_sync(") < after.index("wgmma_rs")
    assert count(r"fence\.proxy\.async\.shared::cta", ptx) >= 1


def test_wgmma_takes_the_weights_from_registers(compiled):
    problem, knobs, src, ptx = compiled
    ab = "f16" if problem.dtype == "float16" else "bf16"
    # wgmma.mma_async...m64n{M}k16.f32.{ab}.{ab} {d...}, {a0, a1, a2, a3}, descB, ...: A is a register list.
    rs = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{knobs.block_m}k16\.f32\.{ab}\.{ab}\s+\{{[^}}]*\}},\s*\{{[^}}]*\}}", ptx)
    assert rs, "no register-A wgmma of the expected shape"
    assert count(r"wgmma\.mma_async", ptx) == len(rs), "every wgmma has its A in registers"
    assert count(r"wgmma\.commit_group", ptx) > 0 and count(r"wgmma\.wait_group", ptx) > 0
    if not knobs.ring and not knobs.scale_on_acc:     # (ring, scale_on_acc: their own tests)
        assert count(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx) > 0


def test_the_stages_fill_by_tma(compiled):
    problem, knobs, src, ptx = compiled
    # Three tile copies per k-tile (activations with the 128-byte swizzle, words, scales), waited
    # for on the stage's mbarrier; no cp.async, and wgmma needs no proxy fence after TMA (fp8_rounded's
    # own writes to the stage do).
    assert count(r"cp\.async\.bulk\.tensor", ptx) > 0 and count(r"mbarrier\.try_wait", ptx) > 0
    assert count(r"cp\.async\.cg", ptx) == 0 and (count(r"fence\.proxy\.async", ptx) == 0) != problem.rounds_fp8
    # (channelwise scales are read once, by the epilogue)
    assert count(r"ld\.global\.nc", ptx) == 0 or problem.channelwise
    assert not re.search(r"= S\[", k_loop(src))


def test_register_buffers_stay_in_registers(compiled):
    *_, ptx = compiled
    assert count(r"\bld\.local", ptx) == 0 and count(r"\bst\.local", ptx) == 0


def test_ptxas_spills_nothing(compiled, tmp_path):
    *_, ptx = compiled
    assert ptxas_spills(ptx, "sm_90a", tmp_path) == (0, 0)


def test_ptxas_keeps_the_wgmmas_asynchronous(compiled, tmp_path):
    # ptxas waits for every wgmma before the next ("Potential Performance Loss: wgmma.mma_async
    # instructions are serialized ...") when it cannot prove a warpgroup runs them together, when a
    # non-wgmma instruction writes their accumulators in flight, or when registers run short.
    *_, ptx = compiled
    out = ptxas_output(ptx, "sm_90a", tmp_path)
    assert "instructions are serialized" not in out, out


def test_setmaxnreg_moves_the_registers_to_the_consumers(compiled, tmp_path):
    _, knobs, src, ptx = compiled
    if not knobs.setmaxnreg:
        assert "setmaxnreg" not in ptx
        return
    assert knobs.threads == 384 and "__launch_bounds__(384, 1)" in src
    assert count(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{stream_wgmma.knobs.PRODUCER_REGISTERS};", ptx) == 1
    assert count(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{knobs.max_registers};", ptx) == 1
    assert 40 * 128 + knobs.max_registers * 256 <= 65536       # or the consumers' setmaxnreg.inc never returns
    # ptxas ignores setmaxnreg (C7508) when it cannot tell the registers at the kernel's entry.
    assert "ignored" not in ptxas_output(ptx, "sm_90a", tmp_path)


def test_tma_boxes_are_one_swizzle_atom_wide(compiled):
    _, knobs, src, ptx = compiled
    # One activation box per 64 columns of a stage (the 128-byte swizzle spans 64 halves), each
    # block_m rows of 128 bytes after the previous; the wgmma descriptors step into the second one.
    copies = re.findall(r"tl::tma_load\(A_desc, [^;]*;", src)     # (in the prologue and the loop)
    assert copies
    if knobs.block_k == 128:
        # (the copy loop's variable is h, or h_1 where the pipeline has two of them)
        assert all(re.search(rf"\(h(_\d+)? \* {knobs.block_m * 64}\)", c) and re.search(r"\(h(_\d+)? \* 64\)", c)
                   for c in copies)
        # (scale_on_acc issues k-step 0 on its own, then u + 1)
        assert re.search(rf"\(\(?u(_\d+)?( \+ 1\))? >> 2\) \* {knobs.block_m * 8}\b", src)
    else:
        assert all("h *" not in c for c in copies)


def test_a_stage_is_released_by_every_consumer_thread(compiled):
    _, knobs, src, _ = compiled
    empty_counts = {int(c) for c in re.findall(r"empty\[\d+\]\.init\((\d+)\);", src)}
    if not knobs.release_barriers:
        return
    assert empty_counts == {knobs.consumer_threads}


def test_split_k_through_the_cluster_or_the_workspace(compiled):
    _, knobs, src, ptx = compiled
    remote = count(r"ld\.shared::cluster", ptx)
    atomics = count(r"\b(red|atom)\.global", ptx)
    if knobs.split_k == 1:
        assert remote == 0 and atomics == 0
    elif knobs.cluster_reduce:     # partial tiles read from the other blocks' shared memory, nothing global
        assert remote > 0 and count(r"barrier\.cluster\.arrive", ptx) >= 2 and atomics == 0
        assert not knobs.uses_workspace
    elif knobs.split_wait:         # fp32 workspace slots: plain stores, polled by the last split
        assert remote == 0 and atomics == 0 and knobs.uses_workspace
    else:                          # fp32 workspace: vector reductions and the tile's arrival counter
        assert remote == 0 and atomics > 0 and knobs.uses_workspace


def test_split_k_sums_move_whole_vectors(compiled):
    _, knobs, _, ptx = compiled
    assert_split_sums_move_vectors(knobs, ptx)


def test_barriers_in_the_k_loops(compiled):
    """What each pipeline's k-loops wait on (each barrier counted once per k-tile of the loop text)."""
    problem, knobs, src, _ = compiled
    loops = k_loops(src)
    consumers = [loop for loop in loops if "wgmma_rs" in loop]
    assert consumers, "no k-loop issues wgmmas"
    syncs = r"__syncthreads\(\)"
    empty_wait, empty_arrive = r"empty\[[^\]]+\]\.wait\(", r"empty\[[^\]]+\]\.arrive\(\)"
    # TMA writes through the async proxy; fp8_rounded's rounding writes the stage through the generic one
    # (its own fence, and TileLang's before the wgmmas)
    assert all(("fence_proxy_async" in loop) == problem.rounds_fp8 for loop in consumers)
    if not knobs.release_barriers:
        assert all(count(syncs, loop) == 1 for loop in consumers)         # frees the oldest stage for its TMA
        return
    assert all(count(syncs, loop) == 0 for loop in loops), "a block barrier is left in a k-loop"
    assert all(count(empty_arrive, loop) >= 1 for loop in consumers)
    if knobs.producer_warp:      # the consumers only wait for full stages; the producer for empty ones
        producers = [loop for loop in loops if "tma_load" in loop and "wgmma_rs" not in loop]
        assert producers and all(count(empty_wait, loop) == 1 for loop in producers)
        assert all("tma_load" not in loop and count(empty_wait, loop) == 0 for loop in consumers)
    else:                        # warp 0 waits for the release before it refills
        assert all(count(empty_wait, loop) == 1 for loop in consumers)


def k_loops(src: str) -> list[str]:
    """The kernel's loops over k-tiles: its outermost loops that nvcc is not asked to unroll (nor
    any loop inside an unrolled one, such as the k-tiles that stage_unroll runs before its loop, nor
    the rolled loop of those k-tiles past three, `#pragma unroll 1`: see
    test_lead_k_tiles_past_three_run_as_a_rolled_loop)."""
    body = src[src.index("__global__ void __launch_bounds__"):]
    loops, end = [], 0
    for found in re.finditer(r"for \(int \w+ = 0;", body):
        if found.start() < end:
            continue
        loop = braced(body, found.start())
        end = found.start() + len(loop)
        if not re.search(r"#pragma unroll( 1)?$", body[:found.start()].rstrip()):
            loops.append(loop)
    assert loops, "no k-loop found"
    return loops


def k_loop(src: str) -> str:
    """The kernel's main loop over k-tiles (the first of k_loops)."""
    return k_loops(src)[0]


def test_a_cluster_kernel_waits_for_the_previous_kernel_before_it_reads(compiled):
    # TileLang's launcher lets a cluster kernel start before the previous kernel's writes are visible
    # (programmatic stream serialization, schedules/epilogue.py): griddepcontrol.wait comes first.
    # (or, with pdl, one that asked for that launch: TileLang's pdl_sync, cudaGridDependencySynchronize)
    _, knobs, src, ptx = compiled
    if not (knobs.cluster_reduce or knobs.pdl):
        assert "griddepcontrol" not in ptx
        return
    assert count(r"griddepcontrol\.wait", ptx) == 1
    body = src[src.index("w4a16_gemm_kernel("):]
    first_read = min(i for i in (body.find("tma_load"), body.find("cp_async"), body.find("A["), body.find("C["))
                     if i >= 0)
    wait = "tm_wait_for_prior_grids();" if knobs.cluster_reduce else "cudaGridDependencySynchronize();"
    assert -1 < body.find(wait) < first_read


def test_early_start_prefetches_weights_before_the_wait_and_launches_dependents(compiled):
    problem, knobs, _, ptx = compiled
    prefetches = count(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)
    if not knobs.early_start:
        assert prefetches == 0 and "launch_dependents" not in ptx
        return
    assert prefetches == 2 and not problem.channelwise    # a weight row and a scale row, a lane each
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    assert all(m.start() < wait for m in re.finditer(r"cp\.async\.bulk\.prefetch", ptx))
    assert not re.search(r"ld\.global|cp\.async\.bulk\.tensor", ptx[:wait])


@pytest.mark.parametrize("panel", [2, 3, 4, 8])
def test_panels_hand_out_every_tile_once(panel):
    from schedules.stream_wgmma.plan import panel_tile

    for m_tiles in range(1, 20):
        for n_tiles in (1, 3, 96):
            order = [panel_tile(i, m_tiles, n_tiles, panel) for i in range(m_tiles * n_tiles)]
            assert sorted(order) == [(mt, nt) for mt in range(m_tiles) for nt in range(n_tiles)]
            # consecutive launches stay within one panel of M tiles until its N tiles are done
            first_panel = order[:min(panel, m_tiles) * n_tiles]
            assert {mt for mt, _ in first_panel} == set(range(min(panel, m_tiles)))


def test_panel_order_is_computed_once_per_block(compiled):
    # one division by the (dynamic) rows of the last panel; divisions by constants become multiplies,
    # and the epilogue reads the block's tile from a variable instead of recomputing it per store
    _, knobs, src, ptx = compiled
    divisions = count(r"\b(div|rem)\.[su]32", ptx)
    if knobs.panel_m:
        assert divisions == 1 and "blockIdx.y" in src[:src.index("tl::tma_load(")]
    else:
        assert divisions == 0


def test_split_wait_has_the_last_split_read_the_others_slots(compiled):
    problem, knobs, src, _ = compiled
    calls = lambda name: len(re.findall(rf"\b{name}\(\(", src))     # calls, not the definitions
    if not knobs.split_wait:
        assert "tm_split_k_sum_slots" not in src
        return
    # the other splits put their tiles into their slots (no atomics, no counter), the last one reads
    # them after its k-loop and stores
    assert calls("tm_split_k_sum_slots") == 1 and calls("tm_split_k_put") == 1
    assert calls("tm_workspace_add") == calls("tm_split_k_arrive") == calls("tm_workspace_store") == 0
    assert "atomicAdd" not in src
    put = src[src.index("tm_split_k_put(("):]
    assert "(((int64_t)((int)blockIdx.z)) * ((int64_t)m))" in put[:put.index(";")]    # split z's slot: rows z * m
    assert re.findall(r"if \(\(\(int\)blockIdx\.z\) < (\d+)\)", src[:src.index("tm_split_k_put((")])[-1] == \
        str(knobs.split_k - 1)
    # uneven splits: the short ones come first, so the last (waiting) split is a long one
    extra = knobs.longer_splits(problem)
    if extra:
        short = knobs.split_k - extra
        assert f"max((((int)blockIdx.z) - {short}), 0)" in src
        assert f"if ({short} <= ((int)blockIdx.z))" in src


def test_fp8_rounded_is_refused_past_block_m_16_and_by_marlin_mma():
    from schedules import marlin_mma

    rounded = Problem(1024, 4096, 128, act="fp8_rounded")
    assert stream_wgmma.check(rounded, Knobs(16, 1, 1, 128, 4), SM90) is None
    assert "block_m=16" in stream_wgmma.check(rounded, Knobs(32, 1, 1, 128, 4), SM90)
    assert "stream_mma's and stream_wgmma's" in marlin_mma.check(rounded, marlin_mma.Knobs(), SM90)


def test_split_wait_is_refused_where_it_cannot_apply():
    problem = Problem(1024, 4096, 128)
    released = dict(release_barriers=True)
    for knobs in (Knobs(16, 1, 1, 128, 4, split_k=2, split_wait=True, **released),          # no producer warp
                  Knobs(16, 1, 1, 128, 4, producer_warp=True, split_wait=True, **released),  # no split
                  Knobs(16, 1, 1, 128, 4, split_k=2, producer_warp=True, cluster_reduce=True, split_wait=True,
                        **released)):
        assert "split_wait" in stream_wgmma.check(problem, knobs, SM90)
    # a thread's (slot, chunk) pairs are bits of one 64-bit word: at block_m 128 (13 chunks of 4 columns
    # for each of 160 threads) 4 slots fit, 5 do not
    assert "at most 64" in stream_wgmma.check(problem, Knobs(128, 1, 1, 64, 4, split_k=6, producer_warp=True,
                                                              split_wait=True, **released), SM90)
    assert stream_wgmma.check(problem, Knobs(128, 1, 1, 64, 4, split_k=5, producer_warp=True, split_wait=True,
                                             **released), SM90) is None
    knobs = Knobs(16, 1, 1, 128, 4, split_k=3, producer_warp=True, split_wait=True, **released)
    assert stream_wgmma.check(problem, knobs, SM90) is None and knobs.name.endswith("_wait")
    plain = Knobs(16, 1, 1, 128, 4, split_k=3, producer_warp=True, **released)
    assert knobs.shared_bytes(problem) == plain.shared_bytes(problem)
    # the workspace: a slot of [m, N] per split but the last (the counters stay, unused)
    assert stream_wgmma.workspace_elems(problem, knobs, 5) == (2 * 5 * 1024, 1 * 16)
    assert stream_wgmma.workspace_elems(problem, plain, 5) == (5 * 1024, 1 * 16)


def test_early_start_is_refused_where_it_cannot_apply():
    problem = Problem(1024, 4096, 128)
    producer = dict(release_barriers=True, producer_warp=True)
    assert "pdl or cluster_reduce" in stream_wgmma.check(problem, Knobs(16, 1, 1, 64, 4, early_start=1, **producer),
                                                         SM90)
    assert "32 lanes" in stream_wgmma.check(problem, Knobs(16, 1, 1, 128, 4, pdl=True, early_start=4, **producer), SM90)
    assert stream_wgmma.check(problem, Knobs(16, 1, 1, 128, 4, pdl=True, early_start=2, **producer), SM90) is None


def test_staged_store_leaves_in_16_byte_chunks(compiled):
    """staged_store: the tile goes into shared memory (2-byte stores in C's order), the consumers meet
    at their own named barrier (the producer warp does not come), and C is written with 16-byte
    stores only; without it each thread stores its fragment's 2-byte elements (split_k 1) to C."""
    _, knobs, src, ptx = compiled
    if knobs.split_k > 1:
        assert not knobs.staged_store
        return
    wide, narrow = count(r"st\.global\.v4\.(u|b)32", ptx), count(r"st\.global\.(u|b)16", ptx)
    if knobs.staged_store:
        assert wide > 0 and narrow == 0
        assert count(r"st\.shared\.(u|b)16", ptx) > 0
        # once before the tile is written (TileLang may place it over the activation stages), once after
        assert count(rf"tm_consumers_sync\({knobs.consumer_threads}\)", src) == 2
        assert count(r"bar\.sync\s+1,", ptx) == 2
    else:
        assert narrow > 0 and wide == 0 and "tm_copy16" not in src


def test_stage_unroll_makes_every_stage_index_a_constant(compiled):
    """stage_unroll: the consumers' k-loop covers a multiple of `stages` k-tiles per trip, each with its
    stage's barrier named by a constant (a trip's unrolled index), so no k-tile divides by `stages`."""
    problem, knobs, src, _ = compiled
    loop = k_loops(src)[1] if knobs.producer_warp else k_loop(src)     # (the producer's loop comes first)
    waits = re.findall(r"full\[([^\]]+)\]\.wait", loop)
    if not knobs.stage_unroll:      # a trip of two k-tiles: the stage is computed from the trip number
        assert waits and any("t0" in index for index in waits), waits
        return
    trips = re.search(r"for \(int (t0\w*) = 0; \1 < (\d+); \+\+\1\)", loop)
    per_trip = math.lcm(2, knobs.stages)
    assert trips and int(trips.group(2)) == problem.k // knobs.block_k // knobs.split_k // per_trip
    assert re.search(rf"for \(int (r\w*) = 0; \1 < {per_trip}; \+\+\1\)", loop)
    assert waits and all("t0" not in index for index in waits), waits


def test_lead_k_tiles_past_three_run_as_a_rolled_loop(compiled):
    """stage_unroll: the k-tiles short of a whole trip run before the loop; from four on, all but an odd
    one as a loop of two-k-tile trips that nvcc keeps rolled (peeled, each cost ptxas ~15 registers:
    at 6 stages and 16 k-tiles per split 150 against 112, 2 blocks per SM instead of 3)."""
    problem, knobs, src, _ = compiled
    rolled = re.findall(r"#pragma unroll 1\s+for \(int (t0\w*) = 0; \1 < (\d+); \+\+\1\)", src)
    if not knobs.stage_unroll:
        assert not rolled
        return
    splits = {knobs.k_tiles(problem) // knobs.split_k, -(-knobs.k_tiles(problem) // knobs.split_k)}
    leads = sorted(k % math.lcm(2, knobs.stages) for k in splits)
    assert sorted(int(trips) for _, trips in rolled) == [lead // 2 for lead in leads if lead >= 4]
    for name, _ in rolled:      # (each k-tile's stage from the trip number, at run time)
        body = src[src.index(f"for (int {name} = 0;"):]
        assert re.search(rf"full\[[^\]]*{name}[^\]]*\]\.wait", body[:body.index("wgmma")])


def test_stage_unroll_makes_the_producers_stage_indices_constant(compiled):
    """stage_unroll with a producer warp: its loop runs whole rounds of the stages (the k-tiles short
    of a round before it), so its waits for released stages name them by constants too."""
    problem, knobs, src, _ = compiled
    if not knobs.producer_warp or knobs.setmaxnreg:
        return
    producer = k_loops(src)[0]
    assert "tma_load" in producer and "wgmma_rs" not in producer
    waits = re.findall(r"empty\[([^\]]+)\]\.wait", producer)
    assert waits
    if knobs.stage_unroll:
        assert re.search(rf"for \(int (r\w*) = 0; \1 < {knobs.stages}; \+\+\1\)", producer)
        assert all("t0" not in index for index in waits), waits
    else:
        assert all(re.search(r"[a-z]", index) for index in waits), waits     # the k-tile number, at run time


def test_ring_keeps_d_k_steps_of_wgmmas_in_flight_with_d_k_steps_of_fragments(compiled, tmp_path):
    """ring = D: one commit group per k-step, each decode waiting until only D - 1 groups are pending
    (the k-step that read its fragment slot last is done); at block_m 16 D = 8 leaves ~70 registers
    (five blocks of 160 threads per SM), D = 2 ~54 (seven, where shared memory allows)."""
    problem, knobs, src, ptx = compiled
    if not knobs.ring:
        return
    waits = count(rf"wgmma\.wait_group\.sync\.aligned\s+{knobs.ring - 1};", ptx)
    commits = count(r"wgmma\.commit_group", ptx)
    assert waits >= knobs.k_steps and commits >= knobs.k_steps and commits == waits
    if knobs.block_m == 16 and knobs.groups == 1:
        out = ptxas_output(ptx, "sm_90a", tmp_path)
        used = int(re.search(r"Used (\d+) registers", out).group(1))
        assert used <= {8: 72, 4: 72, 2: 56}[knobs.ring], out


def test_scale_on_acc_scales_each_k_tiles_sums(compiled, tmp_path):
    """scale_on_acc: the words decode unscaled, and each k-tile's sums (its first wgmma overwriting them)
    join the running sums by one fma each with its group's scale, after a wait for every wgmma (ptxas
    serializes all of them if sums are read with any in flight across the loop's back edge), or
    with fold_lag after the wait that completes that k-tile, under the next one's wgmmas, and a wait
    for all once per unrolled trip; fewer registers than the scaled decode's ~98 at block_m 16 (with
    fold_lag's second set ~107)."""
    problem, knobs, src, ptx = compiled
    if not knobs.scale_on_acc:
        return
    loops = [loop for loop in k_loops(src) if "wgmma" in loop]      # (not the producer warp's)
    assert loops and all("tm_dequant_scaled" not in loop and "tm_dequant_a_" in loop for loop in loops)
    tiles_per_loop = count(r"wgmma\.commit_group", ptx)
    full_waits = count(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)
    if knobs.fold_lag:
        # (one full wait per trip and one after the loop: fewer than the k-tiles once a trip has 4)
        assert count(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx) > 0 and 1 <= full_waits <= tiles_per_loop
    else:
        assert full_waits >= tiles_per_loop
    sums = knobs.groups * knobs.block_m // 2
    assert count(r"fma\.rn\.f32", ptx) >= sums * tiles_per_loop
    if knobs.block_m == 16 and knobs.groups == 1:
        # (an uneven split's two copies of the pipeline: 126 at down_proj's 8 splits, fp8_rounded's stage
        # pass: 115; still 3 blocks per SM)
        uneven = knobs.longer_splits(problem) or problem.rounds_fp8
        out = ptxas_output(ptx, "sm_90a", tmp_path)
        bound = (128 if uneven else 112) if knobs.fold_lag else 80
        assert int(re.search(r"Used (\d+) registers", out).group(1)) <= bound, out


def test_uneven_splits_run_one_pipeline_per_count(compiled):
    # The first k_tiles % split_k splits take one k-tile more; each count is a constant of its own copy of
    # the pipeline, so the split's first k-tile is the only runtime term.
    problem, knobs, src, _ = compiled
    extra = knobs.longer_splits(problem)
    # (split_wait: the last ones, see test_split_wait_has_the_last_split_read_the_others_slots)
    branch = f"if ({knobs.split_k - extra} <= ((int)blockIdx.z)) {{" if knobs.split_wait else \
        f"if (((int)blockIdx.z) < {extra}) {{"
    assert (branch in src) == bool(extra)


def test_split_wait_twins_are_the_product_over_its_axis(monkeypatch):
    # space() adds split_wait to the workspace splits instead of enumerating the product over the axis
    # (twice the points for check() to refuse): the same points either way, here on a narrowed grid.
    from schedules.knob_space import valid_points
    down = Problem(4096, 11008, 128)
    narrow = {"block_m": (16, 64), "groups": (1, 2), "block_k": (128,), "stages": (4, 6),
              "split_k": (1, 2, 6), "release_barriers": (True,), "producer_warp": (False, True),
              "cluster_reduce": (False, True), "pdl": (False, True), "early_start": (0,), "panel_m": (0,),
              "stage_unroll": (True,), "ring": (0,), "fold_lag": (False,)}
    for name, values in narrow.items():
        monkeypatch.setitem(stream_wgmma.AXES, name, values)
    product = [kb for kb in valid_points(stream_wgmma.AXES, stream_wgmma.from_axes, stream_wgmma.check, down, SM90)
               if not (kb.longer_splits(down) and kb.cluster_reduce)]
    space = stream_wgmma.space(down, SM90)
    assert sorted(kb.name for kb in space) == sorted(kb.name for kb in product)
    waiting = [kb for kb in space if kb.split_wait]
    assert waiting and all(kb.split_k > 1 and not kb.cluster_reduce and kb.producer_warp for kb in waiting)
    monkeypatch.setitem(stream_wgmma.AXES, "split_wait", (False,))
    assert not any(kb.split_wait for kb in stream_wgmma.space(down, SM90))
    monkeypatch.setitem(stream_wgmma.AXES, "split_wait", (True,))
    assert stream_wgmma.space(down, SM90) == waiting     # (in space()'s order already)


def test_the_search_space_keeps_uneven_splits_out_of_clusters():
    # Uneven splits are valid with the producer warp. The searched space holds them only through the
    # workspace (down_proj 16's winner: 86 k-tiles of 128 in 6 splits); in a cluster only even
    # ones, which at block_k 128 split down_proj's 86 k-tiles 1 or 2 ways.
    down = Problem(4096, 11008, 128)
    uneven = Knobs(16, 1, 1, 128, 4, split_k=4, release_barriers=True, producer_warp=True, cluster_reduce=True)
    assert stream_wgmma.check(down, uneven, SM90) is None
    space = stream_wgmma.space(down, SM90)
    assert space and not any(kb.longer_splits(down) and kb.cluster_reduce for kb in space)
    assert {kb.split_k for kb in space if kb.block_k == 128 and kb.cluster_reduce} == {2}
    assert {kb.split_k for kb in space if kb.block_k == 128 and kb.uses_workspace} == {2, 4, 6, 8}
    assert any(kb.split_k == 6 and kb.longer_splits(down) == 2 and not kb.cluster_reduce for kb in space)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("rotate", [False, True])
def test_rotate_reads_each_bank_once_per_wavefront_and_keeps_every_column(groups, rotate):
    from schedules.stream_wgmma.plan import slab_quarter

    phase = 32 // groups          # lanes per 128-byte wavefront of a groups-word (4 * groups bytes) load
    worst = 0
    for wq in range(4):
        for start in range(0, 32, phase):
            banks = [(lane * 4 + slab_quarter(wq, lane, 0, groups, rotate) + v) % 32
                     for lane in range(start, start + phase) for v in range(groups)]
            worst = max(worst, max(banks.count(b) for b in banks))
    # without rotate a warp's 32-bit loads meet four lanes in a bank (groups 1), its 64-bit ones two
    assert worst == (1 if rotate or groups == 4 else 4 // groups)
    # every column of the warpgroup's slabs, at every lane's k-offset (lane % 4), exactly once
    seen = sorted(((wq * groups + i) // 4 * 64 + slab_quarter(wq, lane, i, groups, rotate) * 16 + lane // 4 + 8 * h,
                   lane % 4) for wq in range(4) for lane in range(32) for i in range(groups) for h in range(2))
    assert seen == [(col, k) for col in range(64 * groups) for k in range(4)]


def test_rotate_is_refused_where_a_warp_reads_the_whole_slab():
    problem = Problem(1024, 4096, 128)
    assert "groups 4" in stream_wgmma.check(problem, Knobs(16, 4, 1, 64, 4, rotate=True), SM90)
    assert stream_wgmma.check(problem, Knobs(16, 2, 1, 64, 4, rotate=True), SM90) is None


def test_every_tvm_function_a_tma_kernel_calls_is_there_without_tilelang():
    """A TMA kernel's host code builds its tensor maps through a function that only TileLang's native
    library registers: after the store loads its native libraries, in a process that never imports
    TileLang's Python, every `__tvm_` function the kernel's library names must resolve."""
    from tests.test_kernel_store import _compiler_modules, _fresh_python

    problem, knobs = CASES["release"]
    library = compile_schedule(problem, Schedule("stream_wgmma", knobs), SM90).folder / "kernel.so"
    names = sorted({n.decode() for n in re.findall(rb"__tvm_[A-Za-z_]+", library.read_bytes())
                    if not n.startswith(b"__tvm_ffi_") and not n.endswith(b"_packed")})
    assert "__tvm_tensormap_create_tiled" in names
    result = _fresh_python(f"""
        import json, sys
        import tvm_ffi
        from runtime.kernels import _tvm_runtime
        _tvm_runtime()
        missing = [n for n in {names!r} if tvm_ffi.get_global_func(n, allow_missing=True) is None]
        print(json.dumps({{"missing": missing, "modules": sorted(sys.modules)}}))
    """, os.environ.get("TILEMARLIN_CACHE_DIR", ""))
    assert result["missing"] == []
    assert _compiler_modules(result["modules"]) == []
