"""W4A8 code generation without a GPU: stream_wgmma with FP8 activations, compiled by nvcc for sm_90a.

The PTX must show the design: 32-deep FP8 wgmmas (e4m3 x e4m3, fp32 sums) with the weights as the
register operand, decoded from the packed INT4 words by prmt byte lookups (no conversion instruction),
the FP8 activations filled by TMA in the 128-byte swizzle, group scales on the sums, and the token
scales read by the kernel; and the refusals where the W4A8 form cannot apply.
"""
import dataclasses
import re

import pytest

from schedules import marlin_mma, stream_mma, stream_wgmma
from schedules.arch import get_arch
from schedules.problem import Problem
from tests.test_codegen_stream import count, ptxas_output, ptxas_spills
from schedules.stream_wgmma.correction import batches
from schedules.stream_wgmma.plan import Plan
from tests.test_codegen_stream_wgmma import compiled_case

Knobs = stream_wgmma.Knobs
SM90 = get_arch("sm_90a")


def fp8(n, k, group=128):
    return Problem.make(n, k, group, act="fp8")


CASES = {
    # Llama-2-7B's qkv at small M: two splits through the workspace, group scales on the sums.
    "m16_split2_sacc": (fp8(12288, 4096), Knobs(16, 1, 1, 128, 6, split_k=2, release_barriers=True,
                                                producer_warp=True, scale_on_acc=True, rotate=True)),
    # a mid-M tile with the fold under the next k-tile's wgmmas, pdl and a staged store
    "m64_sacc_lag_staged": (fp8(4096, 11008), Knobs(64, 1, 2, 128, 4, release_barriers=True, producer_warp=True,
                                                     scale_on_acc=True, fold_lag=True, staged_store=True,
                                                     pdl=True)),
    # channelwise scales on the final sums (each k-tile's sums promoted times 1), four splits in a
    # cluster, bf16 output
    "m64_channelwise_cluster4_bf16": (Problem.make(4096, 4096, -1, dtype="bfloat16", act="fp8"),
                                      Knobs(64, 1, 1, 128, 4, split_k=4, release_barriers=True,
                                            producer_warp=True, cluster_reduce=True, scale_on_acc=True)),
    # the offset decode: 128 x 128 tiles of two warpgroups, and the largest tile with promoted sums,
    # 192 x 128, for group and channelwise scales (at down_proj's K, two splits through the workspace)
    "m128_wg2_offset": (fp8(22016, 4096), Knobs(128, 1, 2, 128, 4, pdl=True, early_start=2, staged_store=True,
                                                stage_unroll=True, scale_on_acc=True, rotate=True,
                                                offset_decode=True)),
    "m192_wg2_offset": (fp8(12288, 4096), Knobs(192, 1, 2, 128, 4, pdl=True, early_start=2, staged_store=True,
                                                scale_on_acc=True, rotate=True, offset_decode=True)),
    "m192_wg2_channelwise_split2_offset": (Problem.make(4096, 11008, -1, act="fp8"),
                                           Knobs(192, 1, 2, 128, 3, split_k=2, scale_on_acc=True, rotate=True,
                                                 offset_decode=True)),
    # 128 x 128 tiles behind a producer warpgroup that hands its registers to the consumers
    # (setmaxnreg), whose warpgroups meet at no barrier: qkv_proj M = 4096's form, and with the offset
    # decode at down_proj's K
    "m128_wg2_setmaxnreg": (fp8(12288, 4096), Knobs(128, 1, 2, 128, 4, release_barriers=True, producer_warp=True,
                                                    setmaxnreg=True, pdl=True, early_start=2, staged_store=True,
                                                    stage_unroll=True, scale_on_acc=True, rotate=True)),
    "m128_wg2_setmaxnreg_offset": (fp8(4096, 11008), Knobs(128, 1, 2, 128, 6, release_barriers=True,
                                                           producer_warp=True, setmaxnreg=True, stage_unroll=True,
                                                           scale_on_acc=True, rotate=True, offset_decode=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_are_valid_schedules(name):
    problem, knobs = CASES[name]
    assert stream_wgmma.check(problem, knobs, SM90) is None


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    return compiled_case(*CASES[request.param], tmp_path_factory)


def test_fp8_wgmma_takes_the_decoded_weights_from_registers(compiled):
    problem, knobs, _, ptx = compiled
    rs = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{knobs.block_m}k32\.f32\.e4m3\.e4m3\s+"
                    r"\{[^}]*\},\s*\{[^}]*\}", ptx)
    assert rs, "no register-A e4m3 wgmma of the expected shape"
    # the offset correction's 16-bit wgmmas: two parts per group and step of a batch, A (the scales)
    # from registers too
    ab = "f16" if problem.dtype == "float16" else "bf16"
    correction = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{knobs.block_m}k16\.f32\.{ab}\.{ab}\s+"
                            r"\{[^}]*\},\s*\{[^}]*\}", ptx)
    steps = batches(Plan(problem, knobs))[1] if knobs.offset_decode else 0
    assert len(correction) == 2 * knobs.groups * steps
    assert count(r"wgmma\.mma_async", ptx) == len(rs) + len(correction), "every wgmma has A in registers"


def test_the_decode_is_byte_lookups_or_with_offset_a_mask_a_shift_and_two_prmt(compiled):
    _, knobs, src, ptx = compiled
    # tm_decode_e4m3_a_u4: 7 prmt per word (offset_decode's tm_decode_e4m3_offset_a_u4: 2), two words
    # per k32 fragment; no float conversion or 16-bit multiply on the weights
    name = "tm_decode_e4m3_offset_a_u4" if knobs.offset_decode else "tm_decode_e4m3_a_u4"
    assert f"{name}(" in src
    words_per_stage = knobs.k_steps * knobs.groups
    assert count(r"\bprmt\.b32\b", ptx) >= (2 if knobs.offset_decode else 7) * words_per_stage
    assert count(r"\bcvt\.\w*e4m3", ptx) == 0
    assert count(r"\bmul\.f16x2|\bfma\.rn\.f16x2|\bmul\.bf16x2|\bfma\.rn\.bf16x2", ptx) == 0


def test_the_offset_correction_reads_the_k_tile_sums(compiled):
    problem, knobs, src, ptx = compiled
    # (the kernel takes them either way; TileLang leaves an unread one out of the device function)
    assert bool(re.search(r"const float\* (__restrict__ )?KS\b", src)) == knobs.offset_decode
    # offset_decode's B tile goes to the async proxy by a fence, then the consumers meet
    assert (count(r"fence\.proxy\.async\.shared::cta", ptx) >= 1) == knobs.offset_decode
    assert ("tm_consumers_sync" in src) == (knobs.offset_decode or knobs.staged_store)


def test_fp8_activations_arrive_by_tma_one_swizzle_atom_per_stage(compiled):
    problem, knobs, src, ptx = compiled
    assert count(r"cp\.async\.bulk\.tensor", ptx) > 0 and count(r"cp\.async\.cg", ptx) == 0
    assert re.search(r"tma_load\(A_desc[^;]*\(\(fp8_e4_t\*\)X_s\)", src)
    # 128 e4m3 per row of a stage: one 128-byte atom, so one activation box per k-tile
    assert len(re.findall(r"tma_load\(A_desc", src)) in (1, 2, 3)   # (the prologue's and the loops' copies)


def test_token_scales_are_read_and_applied(compiled):
    problem, knobs, src, ptx = compiled
    assert re.search(r"const float\* (__restrict__ )?TS\b", src), "the token scales are an argument"
    # each sum times its row's scale, the row clamped to M - 1 for the tile's rows past M
    assert re.search(r"TS\[min\(", src)


def test_register_buffers_stay_in_registers_and_nothing_spills(compiled, tmp_path):
    *_, ptx = compiled
    assert count(r"\bld\.local", ptx) == 0 and count(r"\bst\.local", ptx) == 0
    assert ptxas_spills(ptx, "sm_90a", tmp_path) == (0, 0)


def test_ptxas_keeps_the_fp8_wgmmas_asynchronous(compiled, tmp_path):
    *_, ptx = compiled
    out = ptxas_output(ptx, "sm_90a", tmp_path)
    assert "instructions are serialized" not in out, out


@pytest.mark.parametrize("problem,knobs,fragment", [
    (fp8(4096, 4096), Knobs(16, 1, 1, 64, 4, scale_on_acc=True), "block_k=128"),
    (fp8(4096, 4096), Knobs(16, 1, 1, 128, 4), "needs scale_on_acc"),
    (Problem.make(4096, 4096, -1, act="fp8"), Knobs(16, 1, 1, 128, 4, ring=2, scale_on_acc=True), "ring=0"),
    (Problem.make(4096, 4096, -1, act="fp8"), Knobs(16, 1, 1, 128, 4), "needs scale_on_acc"),
    (fp8(4096, 4096, 64), Knobs(16, 1, 1, 128, 4, scale_on_acc=True), "group"),
])
def test_check_names_what_fp8_cannot_take(problem, knobs, fragment):
    assert fragment in stream_wgmma.check(problem, knobs, SM90)


def test_only_stream_wgmma_runs_fp8_activations():
    problem = fp8(4096, 4096)
    assert "stream_wgmma only" in marlin_mma.check(problem, marlin_mma.Knobs(), SM90)
    assert "stream_wgmma only" in stream_mma.check(problem, stream_mma.Knobs(), SM90)
    assert marlin_mma.space(problem, SM90) == [] and stream_mma.space(problem, SM90) == []


def test_the_search_space_holds_only_fp8_forms():
    problem = fp8(4096, 4096)
    points = stream_wgmma.space(problem, SM90)
    assert points
    assert all(kb.block_k == 128 and kb.scale_on_acc and not kb.ring for kb in points)
    assert all(stream_wgmma.check(problem, kb, SM90) is None for kb in points[:: max(1, len(points) // 200)])
    assert not any(kb.block_k == 128 and kb.scale_on_acc for kb in stream_wgmma.space(problem, get_arch("sm_80")))


def test_fp8_with_zero_points_is_refused():
    with pytest.raises(ValueError, match="symmetric"):
        Problem.make(4096, 4096, 128, zero_points=True, act="fp8")
    with pytest.raises(ValueError, match="activations 'int8'"):
        Problem.make(4096, 4096, 128, act="int8")


def test_the_problem_names_its_activations():
    assert fp8(4096, 4096).name.endswith("_a8") and not Problem(4096, 4096).name.endswith("_a8")


def test_kernel_args_name_the_fp8_tensors():
    import torch

    problem, knobs = CASES["m16_split2_sacc"]
    k, n = problem.k, problem.n
    weight = torch.zeros(k // 16, 2 * n, dtype=torch.int32)
    scales = torch.zeros(k // 128, n, dtype=torch.float16)
    out = torch.zeros(3, n, dtype=torch.float16)
    a8 = torch.zeros(3, k).to(torch.float8_e4m3fn)
    sums = torch.zeros(3, k // 128)
    with pytest.raises(TypeError, match="triple"):
        stream_wgmma.kernel_args(problem, knobs, torch.zeros(3, k, dtype=torch.float16), weight, scales, out)
    with pytest.raises(TypeError, match="FP8 activations must be torch.float8_e4m3fn"):
        stream_wgmma.kernel_args(problem, knobs, (torch.zeros(3, k, dtype=torch.float16), torch.ones(3, 1), sums),
                                 weight, scales, out)
    with pytest.raises(ValueError, match=r"token scales must have shape \[3x1\]"):
        stream_wgmma.kernel_args(problem, knobs, (a8, torch.ones(4, 1), sums), weight, scales, out)
    # a kernel with offset_decode checks the sums; one without does not read them (None or not), so
    # the next check (this kernel's split-K workspace) is the one that fails
    offset = dataclasses.replace(knobs, offset_decode=True)
    with pytest.raises(ValueError, match=r"k-tile sums must have shape \[3x32\]"):
        stream_wgmma.kernel_args(problem, offset, (a8, torch.ones(3, 1), sums[:, :16]), weight, scales, out)
    for ignored in (sums[:, :16], None):
        with pytest.raises(TypeError, match="split-K workspace must be a torch.Tensor"):
            stream_wgmma.kernel_args(problem, knobs, (a8, torch.ones(3, 1), ignored), weight, scales, out)


def test_the_fallback_runs_an_fp8_problem_on_its_w4a16_twins_winner_in_fp8_form():
    """As for an FP8 problem no table held: its W4A16 twin's winner in the FP8 form where that form can
    run it (M = 16 and 256 here), else the nearest tuned winners' pick."""
    from runtime.fallback import fallback_schedule, for_problem
    from runtime.table import GpuKey, load_tuned_table, winners_for_arch
    from schedules.cost import GpuSpec

    table = load_tuned_table(GpuKey("NVIDIA H200", "sm_90a", 132))
    problem = fp8(12288, 4096)           # Llama-2-7B's qkv
    twin = Problem(12288, 4096)
    for bucket in (1, 16, 256, 4096):
        schedule, how = fallback_schedule(problem, bucket, SM90, GpuSpec.for_arch(SM90), winners_for_arch("sm_90a"),
                                          table)
        assert stream_wgmma.check(problem, schedule.knobs, SM90) is None
        winner = table.lookup(twin, bucket)
        if bucket in (16, 256):        # the twin's winner fits in FP8 form there (not at 1: stream_mma, nor
            assert "tuned winner of" in how, (bucket, how)   # at 4096: setmaxnreg, which FP8's sums refuse)
        if "tuned winner of" in how:
            assert twin.name in how and schedule == for_problem(problem, winner)
            assert (schedule.knobs.block_m, schedule.knobs.split_k) == (winner.knobs.block_m, winner.knobs.split_k)


def test_fp8_entries_are_keyed_by_their_activations():
    from runtime.table import _problem_dict

    assert _problem_dict(fp8(4096, 4096))["act"] == "fp8"
    assert "act" not in _problem_dict(Problem(4096, 4096))
    assert Problem(**_problem_dict(fp8(4096, 4096))) == fp8(4096, 4096)
