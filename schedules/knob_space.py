"""The one way a family turns its named knob axes into the valid points of its search space."""
from __future__ import annotations

import itertools
from typing import Callable


def valid_points(axes: dict[str, tuple], make: Callable[[tuple], object], check, problem, arch) -> list:
    """make(values) for every combination of the axes' values (in AXES order) that check() accepts."""
    points = (make(values) for values in itertools.product(*axes.values()))
    return [knobs for knobs in points if check(problem, knobs, arch) is None]
