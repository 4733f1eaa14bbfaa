"""The one way a family turns its named knob axes into the valid points of its search space, and
the one way command-line text becomes a knob value."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable


def valid_points(axes: dict[str, tuple], make: Callable[[tuple], object], check, problem, arch) -> list:
    """make(values) for every combination of the axes' values (in AXES order) that check() accepts."""
    points = (make(values) for values in itertools.product(*axes.values()))
    return [knobs for knobs in points if check(problem, knobs, arch) is None]


def positional(knobs_cls) -> Callable[[tuple], object]:
    """A family's from_axes when its AXES name its Knobs fields in order: values -> Knobs(*values)."""
    return lambda values: knobs_cls(*values)


def axis_values(axes: dict[str, tuple], knobs) -> tuple:
    """The point of `axes` that `knobs` is (the inverse of a family's from_axes): each axis is a knob
    or a property of the Knobs named like it."""
    return tuple(getattr(knobs, name) for name in axes)


def tiling_reason(problem, block_n: int, block_k: int, scale_rows: str = "") -> str | None:
    """Why block_n x block_k tiles do not fit `problem` (N, K, and with group scales the group size,
    so that a k-tile never straddles two scale rows), or None; `scale_rows` adds the family's words
    for that last rule."""
    if problem.n % block_n:
        return f"N={problem.n} is not a multiple of block_n={block_n}"
    if problem.k % block_k:
        return f"K={problem.k} is not a multiple of block_k={block_k}"
    if not problem.channelwise and problem.group % block_k:
        return f"group={problem.group} must be a multiple of block_k={block_k}" + (f" ({scale_rows})" if scale_rows else "")
    return None


def knob_value(knobs_cls, name: str, text: str):
    """A knob's value from command-line text: 0/1/true/false/yes/no for flags, integers otherwise.
    An unknown knob or a value of the wrong type is a ValueError that names it."""
    fields = {f.name: f for f in dataclasses.fields(knobs_cls)}
    if name not in fields:
        raise ValueError(f"no knob {name!r}; the knobs are {', '.join(fields)}")
    kind = fields[name].type
    if kind in (bool, "bool"):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"knob {name!r} is a flag: use 0/1 or true/false, not {text!r}")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"knob {name!r} takes integers, not {text!r}") from None
