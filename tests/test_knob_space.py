"""The enumeration of a family's space: rules prune prefixes, and never a point check() accepts."""
import pytest

from schedules import stream_wgmma
from schedules.arch import get_arch
from schedules.knob_space import Rule, valid_points
from schedules.problem import Problem

SM90 = get_arch("sm_90a")


def test_rules_prune_prefixes_and_keep_what_check_keeps():
    axes = {"a": (0, 1, 2), "b": (0, 1), "c": (0, 1)}
    seen = []

    def check(problem, point, arch):
        seen.append(point)
        return None if point[1] <= point[2] else "b after c"

    rules = (Rule(("b", "c"), lambda p, b, c: b <= c),)
    pruned = valid_points(axes, tuple, check, None, SM90, rules)
    assert len(seen) == len(pruned) == 9            # the 3 refused points were never built
    assert pruned == valid_points(axes, tuple, check, None, SM90)   # same points, same order


@pytest.mark.parametrize("problem", [Problem.make(n=12288, k=4096), Problem.make(n=4096, k=11008, group=-1),
                                     Problem.make(n=4096, k=11008, group=-1, zero_points=True),
                                     Problem.make(n=4096, k=11008, zero_points=True)],
                         ids=lambda p: p.name)
def test_stream_wgmma_rules_refuse_nothing_that_check_accepts(problem):
    """Every rule's axis at more than one value, the rest narrowed so the exhaustive product stays
    small: both enumerations give the same points."""
    axes = {**stream_wgmma.AXES, "block_m": (16, 64), "stages": (4, 8), "split_k": (1, 3, 4), "split_wait": (False,),
            "panel_m": (0, 2), "groups": (1, 2)}
    args = (axes, stream_wgmma.from_axes, stream_wgmma.check, problem, SM90)
    with_rules = valid_points(*args, stream_wgmma.RULES)
    assert with_rules and with_rules == valid_points(*args)
