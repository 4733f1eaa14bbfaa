"""The schedule families, and the (family, knobs) pair that names one kernel."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import marlin_mma, stream_mma, stream_wgmma
from .family import Family

FAMILIES: dict[str, Family] = {fam.NAME: fam for fam in (marlin_mma, stream_mma, stream_wgmma)}
# The families a search considers unless told otherwise (`--families`).
SEARCHED: tuple[str, ...] = ("marlin_mma", "stream_mma", "stream_wgmma")


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
