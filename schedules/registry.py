"""The schedule families, and the (family, knobs) pair that names one kernel."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import marlin_mma, stream_mma, stream_wgmma
from .family import Family

FAMILIES: dict[str, Family] = {fam.NAME: fam for fam in (marlin_mma, stream_mma, stream_wgmma)}
# Each family's axes as defined, before a tune's `--axes` narrows or widens them for its run: a tuned
# table's entries are judged against these too, so that knob development on one shape leaves the
# other shapes' entries trusted.
DEFINED_AXES: dict[str, dict[str, tuple]] = {name: dict(fam.AXES) for name, fam in FAMILIES.items()}
# The families a search considers unless told otherwise (`--families`).
SEARCHED: tuple[str, ...] = ("marlin_mma", "stream_mma", "stream_wgmma")

# Every family reads a k-tile within one scale row: marlin_mma and stream_wgmma tile K by block_k
# (64 or 128), stream_mma by batches of unroll * 16 rows (unroll 4 or 8). So a group size is a
# multiple of the smallest, 64, and so is K, whatever the grouping.
GROUP_MULTIPLE = 64


def group_size_problem(group_size, k: int | None = None) -> str | None:
    """Why no family can run weights in groups of `group_size` input rows (-1 or K: one group spanning
    K) over K input features (when given), or None."""
    if group_size == -1 or (k and group_size == k):
        if k and k % GROUP_MULTIPLE:
            return (f"group size -1 (channelwise) with K={k} cannot run on tilemarlin's kernels: their k-tiles "
                    f"need K to be a multiple of {GROUP_MULTIPLE}")
        return None
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
            or group_size % GROUP_MULTIPLE or (k and k % group_size)):
        on_k = f" with K={k}" if k else ""
        return (f"group size {group_size}{on_k} cannot run on tilemarlin's kernels: they take a multiple of "
                f"{GROUP_MULTIPLE} that divides K (64, 128, 256, ...) or -1 (channelwise)")
    return None


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown schedule family {name!r}; known: {sorted(FAMILIES)}") from None


@dataclass(frozen=True)
class Schedule:
    family: str
    knobs: object   # the family's frozen Knobs dataclass

    @property
    def name(self) -> str:
        return f"{self.family}:{self.knobs.name}"

    @property
    def module(self) -> Family:
        return family(self.family)

    def to_dict(self) -> dict:
        return {"family": self.family, "knobs": asdict(self.knobs)}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        fam = family(d["family"])
        return cls(d["family"], fam.Knobs(**d["knobs"]))
