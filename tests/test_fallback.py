"""The untuned-shape fallback: the tuned winners that fit, ranked by the cost model (no GPU)."""
import random

import pytest

from runtime.fallback import fallback_schedule, transferred
from runtime.table import winners_for_arch
from schedules.arch import get_arch
from schedules.cost import GpuSpec
from schedules.problem import Problem

SM90 = get_arch("sm_90a")
H200 = GpuSpec.for_arch(SM90)
# Llama-2-13B's layers: in no committed table
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
    assert schedule in winners and "tuned winners" in how
    assert schedule.module.check(problem, schedule.knobs, SM90) is None


def test_the_choice_does_not_depend_on_the_order_of_the_winners(winners):
    shuffled = list(winners)
    random.Random(0).shuffle(shuffled)
    for problem in UNTUNED:
        assert transferred(problem, 16, SM90, H200, winners) == transferred(problem, 16, SM90, H200, shuffled)


def test_winners_that_cannot_run_the_problem_are_never_chosen(winners):
    odd = Problem(192, 320, 64)        # N = 192 and K = 320: few tiles divide them
    chosen = transferred(odd, 1, SM90, H200, winners)
    fits = [s for s in winners if s.module.check(odd, s.knobs, SM90) is None]
    assert (chosen is None) == (not fits) and (chosen is None or chosen in fits)


def test_without_a_fitting_winner_the_whole_space_is_ranked(monkeypatch):
    import runtime.fallback as fallback

    monkeypatch.setattr(fallback, "best_schedule", lambda problem, m, arch, gpu: "ranked")
    assert fallback_schedule(UNTUNED[0], 1, SM90, H200, ()) == ("ranked", "the cost model's pick of the whole search space")
