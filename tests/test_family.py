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
    for key in fam.KNOB_FACTORS:            # every measured factor names a knob the family has
        assert (key[0] if isinstance(key, tuple) else key) in fields | set(fam.AXES), key
    knobs = fam.Knobs()
    for attr in ("name", "block_m", "block_n", "block_k", "num_stages", "threads", "split_k", "scale_on_acc",
                 "uses_workspace"):
        getattr(knobs, attr)
    assert knobs.shared_bytes(Problem(4096, 4096)) > 0


def test_the_searched_families_are_registered():
    assert set(SEARCHED) <= set(FAMILIES)
