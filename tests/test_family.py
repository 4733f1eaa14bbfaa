"""Every schedule family implements the Family interface, and its cost traits sit beside it."""
import dataclasses

import pytest

from schedules.family import Family, FamilyTraits
from schedules.problem import Problem
from schedules.registry import FAMILIES, SEARCHED


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_implements_the_interface(name):
    fam = FAMILIES[name]
    assert isinstance(fam, Family), [a for a in Family.__protocol_attrs__ if not hasattr(fam, a)]
    assert fam.NAME == name and isinstance(fam.TRAITS, FamilyTraits)
    assert set(fam.VARIANT_AXES) <= set(fam.AXES)
    fields = {f.name for f in dataclasses.fields(fam.Knobs)}
    for key in {**fam.KNOB_FACTORS, **fam.FP8_KNOB_FACTORS}:     # every measured factor names a knob the family has
        assert (key[0] if isinstance(key, tuple) else key) in fields | set(fam.AXES), key
    knobs = fam.Knobs()
    for attr in ("name", "block_m", "block_n", "block_k", "num_stages", "threads", "split_k", "uses_workspace"):
        getattr(knobs, attr)
    assert knobs.shared_bytes(Problem(4096, 4096)) > 0


def test_the_searched_families_are_registered():
    assert set(SEARCHED) <= set(FAMILIES)


def test_the_group_size_rule_is_the_families_smallest_k_tile():
    """A k-tile lies within one scale row: marlin_mma's and stream_wgmma's block_k, stream_mma's
    unroll * 16 rows. The rule's multiple is the smallest of them, and each family's check refuses a
    group below it for that reason."""
    from schedules import marlin_mma, stream_mma, stream_wgmma
    from schedules.arch import get_arch
    from schedules.registry import GROUP_MULTIPLE, group_size_problem

    smallest = {"marlin_mma": min(marlin_mma.AXES["block_k"]), "stream_wgmma": min(stream_wgmma.AXES["block_k"]),
                "stream_mma": 16 * min(stream_mma.AXES["unroll"])}
    assert set(smallest) == set(FAMILIES) and min(smallest.values()) == GROUP_MULTIPLE
    tiles = {"marlin_mma": marlin_mma.Knobs(block_k=64), "stream_wgmma": stream_wgmma.Knobs(block_k=64),
             "stream_mma": stream_mma.Knobs(unroll=4)}
    for name, knobs in tiles.items():
        check = FAMILIES[name].check
        assert "group=32" in check(Problem(4096, 4096, group=32), knobs, get_arch("sm_90a"))
        assert "group" not in (check(Problem(4096, 4096, group=64), knobs, get_arch("sm_90a")) or "")
    assert group_size_problem(64, 4096) is None and group_size_problem(192, 3072) is None
    assert group_size_problem(-1, 4096) is None and group_size_problem(4096, 4096) is None
    for group, k in ((32, 4096), (96, 3072), (128, 4160), (0, 4096), (True, 4096), (-1, 4112), ("128", 4096)):
        assert group_size_problem(group, k), (group, k)
