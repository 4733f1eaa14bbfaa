"""Knobs and validity check of the hopper_wgmma family (sm_90a only)."""
from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch
from ..marlin_mma.layout import SLAB_N, TILE_K
from ..knob_space import tiling_reason
from ..problem import Problem


@dataclass(frozen=True)
class Knobs:
    """block_m x block_n x block_k tile per consumer warpgroup set; `threads` consumer threads (128
    per warpgroup; TileLang adds a 128-thread producer warpgroup for the TMA loads); num_stages deep
    TMA pipeline of activation and packed-weight tiles."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    threads: int = 256
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}k{self.block_k}_t{self.threads}_s{self.num_stages}"

    def shared_bytes(self, problem: Problem) -> int:
        elem = 2
        stage = self.block_m * self.block_k * elem + self.block_k * self.block_n * problem.bits // 8 + self.block_n * elem
        dequantized = self.block_n * self.block_k * elem
        return self.num_stages * stage + dequantized + 1024


def check(problem: Problem, knobs: Knobs, arch: Arch) -> str | None:
    kb = knobs
    if not arch.hopper:
        return f"wgmma and TMA need sm_90a; {arch.name} has neither"
    if kb.threads not in (128, 256):
        return f"threads={kb.threads}: one or two consumer warpgroups (128 or 256)"
    if kb.block_m % (64 * (kb.threads // 128)):
        return f"block_m={kb.block_m} must give each of the {kb.threads // 128} warpgroups a multiple of 64 rows"
    if kb.block_n % SLAB_N or kb.block_n > 256:
        return f"block_n={kb.block_n} must be a multiple of {SLAB_N} and at most 256 (one wgmma N)"
    if kb.block_k % TILE_K or kb.block_k < 32:
        return f"block_k={kb.block_k} must be a multiple of 16, at least 32"
    reason = tiling_reason(problem, kb.block_n, kb.block_k)
    if reason:
        return reason
    if kb.num_stages < 2:
        return "num_stages must be at least 2"
    if problem.k // kb.block_k < kb.num_stages:
        return f"K={problem.k} has fewer k-tiles than num_stages={kb.num_stages}"
    smem = kb.shared_bytes(problem)
    if smem > arch.max_shared_bytes:
        return f"needs {smem} B of shared memory, {arch.name} allows {arch.max_shared_bytes} B per block"
    acc_regs = kb.block_m * kb.block_n // kb.threads
    if acc_regs > 128:
        return f"{acc_regs} fp32 accumulators per thread would spill"
    return None
