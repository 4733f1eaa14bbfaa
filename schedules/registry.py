"""The schedule families, and the (family, knobs) pair that names one kernel."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from types import ModuleType

from . import hopper_wgmma, marlin_mma, stream_mma, stream_wgmma

FAMILIES: dict[str, ModuleType] = {fam.NAME: fam for fam in (marlin_mma, stream_mma, hopper_wgmma, stream_wgmma)}
# The families a search considers unless told otherwise. hopper_wgmma (decode into a shared fp16 tile,
# then wgmma) never won a measurement on the H200 and stream_wgmma's TMA pipeline now beats it by
# 2.5-3x everywhere (perf-notes v5, v13): it stays available by name (`--families hopper_wgmma`).
SEARCHED: tuple[str, ...] = ("marlin_mma", "stream_mma", "stream_wgmma")


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
