"""The schedule families, and the (family, knobs) pair that names one kernel."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from types import ModuleType

from . import hopper_wgmma, marlin_mma, stream_mma, stream_wgmma

FAMILIES: dict[str, ModuleType] = {fam.NAME: fam for fam in (marlin_mma, stream_mma, hopper_wgmma, stream_wgmma)}


def family(name: str) -> ModuleType:
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
    def module(self) -> ModuleType:
        return family(self.family)

    def to_dict(self) -> dict:
        return {"family": self.family, "knobs": asdict(self.knobs)}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        fam = family(d["family"])
        return cls(d["family"], fam.Knobs(**d["knobs"]))
