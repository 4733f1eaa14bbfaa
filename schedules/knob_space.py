"""The one way a family turns its named knob axes into the valid points of its search space, and
the one way command-line text becomes a knob value."""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Rule:
    """A condition on a few axes that every point check() accepts meets. The enumeration drops a
    partial point that breaks a rule before spanning the axes after it, so a family whose flags
    depend on each other need not build and check millions of points it would refuse. check()
    still decides every full point: a rule only saves work, and must never refuse what check()
    accepts (tests compare both ways)."""
    axes: tuple[str, ...]
    holds: Callable[..., bool]      # holds(problem, **{axis: value})


def valid_points(axes: dict[str, tuple], make: Callable[[tuple], object], check, problem, arch,
                 rules: tuple[Rule, ...] = ()) -> list:
    """make(values) for every combination of the axes' values (in AXES order) that check() accepts,
    enumerated depth-first: `rules` prune a prefix as soon as its last axis has a value."""
    names = list(axes)
    position = {name: i for i, name in enumerate(names)}
    rules_at = [[] for _ in names]       # each rule is tested once its last axis is set
    for rule in rules:
        rules_at[max(position[a] for a in rule.axes)].append(rule)
    points, values = [], []

    def extend(depth: int) -> None:
        if depth == len(names):
            knobs = make(tuple(values))
            if check(problem, knobs, arch) is None:
                points.append(knobs)
            return
        for value in axes[names[depth]]:
            values.append(value)
            if all(rule.holds(problem, **{a: values[position[a]] for a in rule.axes}) for rule in rules_at[depth]):
                extend(depth + 1)
            values.pop()

    extend(0)
    return points


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
