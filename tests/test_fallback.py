"""The untuned-shape fallback: twins' winners, else the nearest tuned winners that fit, the cost model
choosing between them (no GPU)."""
import dataclasses
import random

import pytest

from runtime.fallback import NEAREST, SAME_SHAPE, TunedWinner, distance, fallback_schedule, nearest_transfers, transferred, twins
from runtime.table import TunedTable, shipped_tables_dir, winners_for_arch
from schedules import stream_wgmma
from schedules.arch import get_arch
from schedules.cost import GpuSpec
from schedules.problem import Problem

SM90 = get_arch("sm_90a")
H200 = GpuSpec.for_arch(SM90)
# Llama-2-13B's layers: in no committed fp16 table (the bf16 twins are not offered here)
UNTUNED = [Problem(15360, 5120), Problem(5120, 5120), Problem(27648, 5120), Problem(5120, 13824)]


@pytest.fixture(scope="module")
def winners():
    found = winners_for_arch("sm_90a")
    assert len(found) >= 10, "the committed H200 table should give the fallback its candidates"
    return found


@pytest.mark.parametrize("problem", UNTUNED, ids=lambda p: p.name)
@pytest.mark.parametrize("bucket", [1, 16, 64, 1024])
def test_the_choice_is_a_valid_tuned_winner(winners, problem, bucket):
    schedule, how = fallback_schedule(problem, bucket, SM90, H200, winners)
    assert schedule in {w.schedule for w in winners} and "nearest layers and buckets" in how
    assert schedule.module.check(problem, schedule.knobs, SM90) is None
    assert schedule in nearest_transfers(problem, bucket, SM90, winners)


def test_the_choice_does_not_depend_on_the_order_of_the_winners(winners):
    shuffled = list(winners)
    random.Random(0).shuffle(shuffled)
    for problem in UNTUNED:
        assert transferred(problem, 16, SM90, H200, winners) == transferred(problem, 16, SM90, H200, shuffled)


def test_winners_that_cannot_run_the_problem_are_never_chosen(winners):
    odd = Problem(192, 320, 64)        # N = 192 and K = 320: few tiles divide them
    chosen = transferred(odd, 1, SM90, H200, winners)
    fits = [w.schedule for w in winners if w.schedule.module.check(odd, w.schedule.knobs, SM90) is None]
    assert (chosen is None) == (not fits) and (chosen is None or chosen in fits)


def test_the_nearest_tuned_layer_and_bucket_come_first():
    """Same bucket before a bucket away, a near shape before a far one; another dtype or zero-point
    setting costs half a step, other activations a step."""
    from schedules import stream_mma
    from schedules.registry import Schedule

    problem = Problem(5120, 5120)
    near, far, other = (Schedule("stream_mma", stream_mma.Knobs(1, w, 4, 8, ahead=2)) for w in (4, 8, 2))
    winners = [TunedWinner(Problem(4096, 4096), 16, far), TunedWinner(Problem(4096, 4096), 32, other),
               TunedWinner(Problem(5120, 4096), 16, near)]
    assert distance(problem, 16, winners[2]) < distance(problem, 16, winners[0]) < distance(problem, 16, winners[1])
    assert nearest_transfers(problem, 16, SM90, winners) == [near, far][:NEAREST]
    assert transferred(problem, 16, SM90, H200, winners) in (near, far)
    # all but the same layer and bucket: its winner as it is, whatever the cost model would prefer
    twin_like = Problem(5120, 5376)
    assert distance(twin_like, 16, winners[2]) > SAME_SHAPE
    assert distance(Problem(5120, 4352), 16, winners[2]) <= SAME_SHAPE
    assert transferred(Problem(5120, 4352), 16, SM90, H200, winners) == near
    bf16 = Problem(5120, 5120, dtype="bfloat16")
    assert distance(bf16, 16, winners[2]) == pytest.approx(distance(problem, 16, winners[2]) + 0.5)
    assert distance(Problem(5120, 5120, act="fp8"), 16, winners[2]) == pytest.approx(
        distance(problem, 16, winners[2]) + 1.0)



@pytest.mark.parametrize("faster", ["near", "far"])
def test_beyond_the_same_shape_the_cost_model_picks_between_the_two_nearest(monkeypatch, faster):
    """The two nearest winners, nearest first, and the one the cost model estimates faster runs; all
    but the same shape, the nearest runs whatever the estimates, even where it also won farther away."""
    import runtime.fallback as fallback
    from schedules import stream_mma
    from schedules.registry import Schedule

    near, far = (Schedule("stream_mma", stream_mma.Knobs(1, w, 4, 8, ahead=2)) for w in (4, 8))
    winners = [TunedWinner(Problem(4096, 4096), 16, far), TunedWinner(Problem(5120, 4096), 16, near),
               TunedWinner(Problem(5120, 4096), 64, near)]
    fast = {"near": near, "far": far}[faster]
    monkeypatch.setattr(fallback, "estimate_us", lambda problem, schedule, bucket, gpu: 1.0 if schedule == fast else 2.0)
    assert nearest_transfers(Problem(5120, 5120), 16, SM90, winners) == [near, far]
    assert transferred(Problem(5120, 5120), 16, SM90, H200, winners) == fast
    assert transferred(Problem(5120, 4352), 16, SM90, H200, winners) == near


def test_an_fp8_layers_failed_kernel_is_excluded_in_the_form_it_ran():
    """W4A16 winners run an FP8 problem in its form (128-deep k-tiles, scales on the sums): the one that
    failed its check is that form, and the fallback passes it by."""
    from runtime.fallback import for_problem
    from schedules.registry import Schedule

    fp8 = Problem(4096, 4096, act="fp8")
    base = stream_wgmma.Knobs(block_m=64, block_k=64, stages=4, split_k=1)
    winners = [TunedWinner(Problem(4096, 4096), 256, Schedule("stream_wgmma", base)),
               TunedWinner(Problem(4096, 4096), 128, Schedule("stream_wgmma", dataclasses.replace(base, stages=6)))]
    forms = [for_problem(fp8, w.schedule) for w in winners]
    assert all(form not in (w.schedule for w in winners) for form in forms)
    first, _ = fallback_schedule(fp8, 256, SM90, H200, winners)
    second, _ = fallback_schedule(fp8, 256, SM90, H200, winners, exclude=frozenset({first}))
    assert first in forms and second in forms and second != first

def test_without_a_fitting_winner_the_whole_space_is_ranked(monkeypatch):
    import runtime.fallback as fallback

    monkeypatch.setattr(fallback, "best_schedule", lambda problem, m, arch, gpu, exclude: "ranked")
    assert fallback_schedule(UNTUNED[0], 1, SM90, H200, ()) == ("ranked", "the cost model's pick of the whole search space")


def test_a_schedule_that_failed_its_check_is_never_chosen_again():
    """Replacing a kernel that failed its first-run check: excluded from the twins, the transfers and
    the whole space's ranking (on an arch without tuned winners, the ranking alone)."""
    import time


    sm80, problem = get_arch("sm_80"), Problem(n=128, k=256, group=128)
    start = time.perf_counter()
    first, how = fallback_schedule(problem, 1, sm80, GpuSpec.for_arch(sm80), ())
    second, _ = fallback_schedule(problem, 1, sm80, GpuSpec.for_arch(sm80), (), exclude=frozenset({first}))
    assert "whole search space" in how and second != first, (first, second, time.perf_counter() - start)
    tuned = TunedWinner(problem, 1, first)
    assert fallback_schedule(problem, 1, sm80, GpuSpec.for_arch(sm80), (tuned,))[0] == first
    assert fallback_schedule(problem, 1, sm80, GpuSpec.for_arch(sm80), (tuned,), exclude=frozenset({first}))[0] == second


@pytest.fixture(scope="module")
def shipped():
    return TunedTable.read(shipped_tables_dir() / "nvidia-h200_sm_90a_132sm.json")


def test_twins_differ_in_dtype_or_zero_points_nearest_first():
    p = Problem(4096, 4096, 128, "bfloat16", zero_points=True)
    assert [(t.dtype, t.zero_points) for t in twins(p)] == [
        ("float16", True), ("bfloat16", False), ("float16", False)]
    assert all((t.n, t.k, t.group, t.bits) == (p.n, p.k, p.group, p.bits) for t in twins(p))


@pytest.mark.parametrize("bucket", [1, 16, 64, 256, 4096])
def test_a_bf16_shape_runs_its_fp16_twins_tuned_winner(shipped, winners, bucket):
    """Same loads, tiles and splits; only the decode differs: the fp16 winner, not the cost model's
    pick among all winners (which ran bf16 o_proj at M = 64 in 12.6 us where this one takes 7.4)."""
    fp16 = Problem(4096, 4096)
    schedule, how = fallback_schedule(Problem(4096, 4096, dtype="bfloat16"), bucket, SM90, H200, winners, shipped)
    assert schedule == shipped.lookup(fp16, bucket) and fp16.name in how


def test_a_twin_winner_runs_as_it_is_where_it_fits(shipped, winners):
    """o_proj's M = 64 and M = 1 winners serve its zero-point twin as they are: tiles, splits and
    pipeline, and the scales on the sums (scale_on_acc takes zero points as code - z). The table is
    the shipped one's fp16 entries, so that the fp16 winner is the only twin."""
    from runtime.table import TunedTable

    fp16_only = TunedTable()
    for (problem, bucket), entry in shipped.items():
        if problem.dtype == "float16":
            fp16_only.record(problem, bucket, entry.schedule, entry.us)
    zero_points = Problem(4096, 4096, zero_points=True)
    assert shipped.lookup(Problem(4096, 4096), 64).knobs.scale_on_acc
    for bucket in (64, 1):
        schedule, how = fallback_schedule(zero_points, bucket, SM90, H200, winners, fp16_only)
        assert schedule == shipped.lookup(Problem(4096, 4096), bucket)
        assert "tuned winner of n4096_k4096_g128_float16_w4" in how
        assert schedule.module.check(zero_points, schedule.knobs, SM90) is None


def test_a_twin_winner_that_cannot_run_the_problem_or_failed_its_check_is_passed_by(winners):
    """marlin_mma decodes the zero point 8 only: its winner for the symmetric twin cannot serve the
    zero-point problem, and the next twin's (bf16) can; excluded (it failed its first-run check),
    that one is passed by too."""
    from runtime.table import TunedTable
    from schedules.marlin_mma import Knobs
    from schedules.registry import Schedule

    zero_points = Problem(4096, 4096, zero_points=True)
    marlin = Schedule("marlin_mma", Knobs())
    bf16_winner = TunedTable.read(shipped_tables_dir() / "nvidia-h200_sm_90a_132sm.json").lookup(Problem(4096, 4096), 16)
    table = TunedTable()
    table.record(Problem(4096, 4096), 16, marlin, 1.0)
    table.record(dataclasses.replace(zero_points, dtype="bfloat16"), 16, bf16_winner, 1.0)
    schedule, how = fallback_schedule(zero_points, 16, SM90, H200, winners, table)
    assert schedule == bf16_winner and "bfloat16" in how
    schedule, how = fallback_schedule(zero_points, 16, SM90, H200, winners, table, exclude=frozenset({bf16_winner}))
    assert schedule not in (marlin, bf16_winner) and "nearest" in how


def test_a_twin_winner_runs_in_the_form_the_problem_takes():
    """FP8 activations take 128-deep k-tiles, no ring and the scales on the sums; channelwise scales
    take no scale_on_acc: a winner transfers in that form, its tiles, splits and pipeline unchanged."""
    from runtime.fallback import for_problem
    from schedules.registry import Schedule

    winner = Schedule("stream_wgmma", stream_wgmma.Knobs(64, 1, 1, 64, 6, split_k=2, scale_on_acc=True, fold_lag=True))
    channelwise = for_problem(Problem.make(4096, 4096, -1), winner)
    assert channelwise.knobs == dataclasses.replace(winner.knobs, scale_on_acc=False, fold_lag=False)
    fp8 = for_problem(Problem(4096, 4096, act="fp8"), Schedule("stream_wgmma", dataclasses.replace(
        winner.knobs, scale_on_acc=False, fold_lag=False)))
    assert fp8.knobs == dataclasses.replace(winner.knobs, block_k=128, fold_lag=False)
    assert for_problem(Problem(4096, 4096, zero_points=True), winner) == winner


def test_a_shape_left_out_leaves_in_every_form_and_nothing_else_goes(shipped, winners):
    """gen bench's tilemarlin_untuned and `gen modelcheck --fallback` serve a tuned shape as if nobody
    had tuned it: Llama-2-7B's o_proj (4096x4096, tuned in fp16, bf16, with zero points and W4A8) leaves
    the table and the winners in all its forms; every other entry stays, and the fallback then
    chooses from the other shapes' winners (no twin is left to take)."""
    from gen.dev.fallback_check import left_out

    o_proj = Problem(4096, 4096)
    rest, kept = left_out(shipped, winners, o_proj, whole_shape=True)
    same_shape = [p for (p, _), _ in shipped.items() if (p.n, p.k, p.group) == (4096, 4096, 128)]
    assert {p.dtype for p in same_shape} == {"float16", "bfloat16"} and any(p.zero_points for p in same_shape)
    assert len(rest.items()) == len(shipped.items()) - len(same_shape)
    assert all((p.n, p.k) != (4096, 4096) for (p, _), _ in rest.items())
    assert all((w.problem.n, w.problem.k) != (4096, 4096) for w in kept)
    assert len(kept) == len(winners) - sum((w.problem.n, w.problem.k, w.problem.group) == (4096, 4096, 128)
                                           for w in winners)
    _, how = fallback_schedule(o_proj, 16, SM90, H200, kept, rest)
    assert "nearest" in how

    only_fp16, _ = left_out(shipped, winners, o_proj, whole_shape=False)
    assert len(only_fp16.items()) == len(shipped.items()) - 13
    assert only_fp16.lookup(Problem(4096, 4096, dtype="bfloat16"), 16) is not None
