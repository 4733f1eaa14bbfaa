"""The interface every schedule family implements, and the cost-model traits each one declares.

A family is a package under schedules/ (marlin_mma, stream_mma, stream_wgmma) whose module provides
the names below; `schedules.registry` holds the families by name and the tests check each against
`Family` (tests/test_family.py). Everything a caller needs from a family is here, so nothing reads
a family's module for names it may lack.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable, Protocol, runtime_checkable

from .arch import Arch
from .problem import Problem


@dataclass(frozen=True)
class FamilyTraits:
    """What the cost model (schedules/cost.py) needs to know about a family beyond its knobs."""

    wgmma: bool = False             # MMAs by wgmma (sm_90a) rather than mma.sync
    decode_ops: float = 1.0         # ALU instructions per decoded weight
    scale_ops: float = 0.5          # and per weight to apply its group scale
    warps_to_fill_sm: int = 8       # resident warps per SM that keep the tensor cores issuing
    mma_efficiency: float = 1.0     # the share of the arch's MMA rate the family's kernels reach
    pull_scale: float = 1.0         # per-SM pull rate relative to GpuSpec.sm_bytes_per_s (fitted on
                                    # warps that wait for their own loads; TMA's copies do not)
    decode_under_mma: bool = False  # the decode of one stage runs while the tensor cores work on
                                    # the previous one (asynchronous wgmma), rather than before it
    k_tile_scale: float = 1.0       # per-k-tile cost relative to GpuSpec.k_tile_us (barrier waits,
                                    # the chain from a landed stage to its issued MMAs)
    fill_stages: int = 0            # stages whose loads the pipeline fill waits for (0: all of them)


# Measured corrections to the cost model's terms, per family: a knob name (applies when the knob is
# on) or a (knob, value) pair -> rows of (M up to, factor); the first row whose bound holds applies.
KnobFactors = dict


class Knobs(Protocol):
    """What every family's frozen Knobs dataclass provides (the cost model and the runtime read it)."""

    name: str                # canonical, e.g. "stream_mma:mt1_w8_u4_a3_sk2_..."
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    threads: int
    split_k: int
    uses_workspace: bool

    def shared_bytes(self, problem: Problem) -> int: ...


@runtime_checkable
class Family(Protocol):
    """A schedule family: its knob space, its kernel builder, its weight layout and its arguments."""

    NAME: str                          # the name tables and the CLI use
    LAYOUT: str                        # the weight-layout contract its kernels read
    layout: ModuleType                 # that contract: pack/unpack, packed_shapes, check_packable
    AXES: dict[str, tuple]             # the searched knob values, by name
    VARIANT_AXES: tuple[str, ...]      # axes that only tweak a kernel (the search keeps one per point)
    Knobs: type                        # the frozen knob dataclass
    PASS_CONFIGS: dict                 # TileLang pass configs its kernels compile with
    TRAITS: FamilyTraits               # cost-model traits
    KNOB_FACTORS: KnobFactors          # measured cost corrections per knob
    FP8_KNOB_FACTORS: KnobFactors      # ... the rows that FP8-activation problems take instead

    check: Callable[[Problem, object, Arch], "str | None"]   # why knobs cannot run a problem, or None
    from_axes: Callable[[tuple], object]                       # the knobs at one point of AXES
    space: Callable[[Problem, Arch], Iterable]                 # every valid point for a problem
    build: Callable[[Problem, object], object]                 # the TileLang prim_func (imports TileLang)
    pack: Callable                                             # (codes, scales) -> packed tensors
    unpack: Callable                                           # the inverse
    workspace_elems: Callable[[Problem, object, int], tuple]   # split-K workspace for M rows
    kernel_args: Callable[..., tuple]                          # checked arguments, in build()'s order


def lazy_build(package: str) -> Callable[[Problem, object], object]:
    """A family's `build`: its package's kernel.build, imported at the first build. TileLang is
    imported then, when a kernel is built, and never when a stored kernel is loaded and served."""
    def build(problem: Problem, knobs):
        return importlib.import_module(".kernel", package).build(problem, knobs)

    return build
