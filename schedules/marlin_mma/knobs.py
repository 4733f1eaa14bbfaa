"""The knobs of the marlin_mma family and the validity check that runs before any compiler does."""
from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch
from ..knob_space import tiling_reason
from ..problem import Problem
from .layout import SLAB_N, TILE_K


@dataclass(frozen=True)
class Knobs:
    """One point of the marlin_mma schedule space.

    block_m x block_n x block_k is the thread-block tile; the block's warps form a
    warps_m x warps_n x warps_k grid (warps_k > 1 splits a block's k-steps between warps and adds
    their sums in shared memory at the end, Marlin's answer to too few MMAs per warp at small M);
    num_stages is the depth of the cp.async pipeline; split_k > 1 splits K between thread blocks
    (in whole quantization groups, as evenly as they go), whose fp32 partial sums are reduced in a
    global workspace. scale_on_acc applies group scales to each group's fp32 partial sums instead of
    to every decoded weight: at small M a thread holds far fewer sums than it decodes weights.
    """

    block_m: int = 16
    block_n: int = 256
    block_k: int = 128
    warps_m: int = 1
    warps_n: int = 4
    warps_k: int = 1
    num_stages: int = 4
    split_k: int = 1
    scale_on_acc: bool = False

    @property
    def warps(self) -> tuple[int, int, int]:
        """The warp grid (warps_m, warps_n, warps_k): one axis of the search (AXES["warps"])."""
        return self.warps_m, self.warps_n, self.warps_k

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n * self.warps_k

    @property
    def uses_workspace(self) -> bool:
        """Whether a call needs the split-K workspace and counters (schedules/epilogue.py)."""
        return self.split_k > 1

    @property
    def warp_m(self) -> int:
        return self.block_m // self.warps_m

    @property
    def warp_n(self) -> int:
        return self.block_n // self.warps_n

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}_w{self.warps_m}x{self.warps_n}x{self.warps_k}"
                f"_s{self.num_stages}_sk{self.split_k}" + ("_sacc" if self.scale_on_acc else ""))

    def split_unit_tiles(self, problem: Problem) -> int:
        """k-tiles per unit of split-K work: a whole group, so no split ends inside one."""
        return 1 if problem.channelwise else problem.group // self.block_k

    def min_iters(self, problem: Problem) -> int:
        """k-tiles of the smallest split."""
        units = problem.k // (self.block_k * self.split_unit_tiles(problem))
        return (units // self.split_k) * self.split_unit_tiles(problem)

    def shared_bytes(self, problem: Problem) -> int:
        """Dynamic shared memory: the pipeline stages, or the fp32 epilogue tile if larger."""
        elem = 2  # fp16 / bf16
        stage = (self.block_m * self.block_k * elem
                 + self.block_k * self.block_n * problem.bits // 8
                 + (0 if problem.channelwise else self.block_n * elem))
        epilogue = self.block_m * self.block_n * 4
        return max(self.num_stages * stage, epilogue) + 64

    def registers_estimate(self) -> int:
        """32-bit registers per thread for accumulators and fragments (the rest is addressing)."""
        acc = (self.warp_m // 16) * (self.warp_n // 8) * 4 * (2 if self.scale_on_acc else 1)
        frags = (self.warp_m // 16) * 4 + 4 + 4 + (self.warp_n // SLAB_N) * 4
        return acc + frags


def check(problem: Problem, knobs: Knobs, arch: Arch) -> str | None:
    """Why (problem, knobs) cannot compile or run on `arch`, or None when it can."""
    kb = knobs
    for field in ("block_m", "block_n", "block_k", "warps_m", "warps_n", "warps_k", "num_stages", "split_k"):
        if getattr(kb, field) < 1:
            return f"{field}={getattr(kb, field)} must be positive"
    if kb.block_m % (16 * kb.warps_m):
        return f"block_m={kb.block_m} must split into warps_m={kb.warps_m} warp tiles of a multiple of 16 rows"
    if kb.block_n % (SLAB_N * kb.warps_n):
        return f"block_n={kb.block_n} must split into warps_n={kb.warps_n} warp tiles of a multiple of {SLAB_N}"
    if kb.block_k % TILE_K or (kb.block_k // TILE_K) % kb.warps_k:
        return f"block_k={kb.block_k} must be a multiple of 16 * warps_k={16 * kb.warps_k}"
    if kb.threads > 1024:
        return f"{kb.threads} threads exceed the 1024 a block may have"
    if problem.zero_points:
        return "marlin_mma decodes the zero point 8 only; stream_mma and stream_wgmma decode others"
    if problem.fp8:
        return "FP8 activations run on stream_wgmma only (FP8 wgmma, sm_90a)"
    if problem.rounds_fp8:
        return ("activations rounded to FP8 in the kernel are stream_mma's and stream_wgmma's: marlin_mma's pass "
                "from shared memory to the MMAs by ldmatrix without a rounding step")
    reason = tiling_reason(problem, kb.block_n, kb.block_k, "one scale row per tile")
    if reason:
        return reason
    if problem.channelwise and kb.scale_on_acc:
        return "channelwise scales are always applied to the sums; scale_on_acc adds nothing"
    if kb.num_stages < 2:
        return "num_stages must be at least 2 for the loads to overlap the math"
    if kb.min_iters(problem) < kb.num_stages:
        return (f"split_k={kb.split_k} leaves a split with {kb.min_iters(problem)} k-tiles, fewer than "
                f"num_stages={kb.num_stages}")
    smem = kb.shared_bytes(problem)
    if smem > arch.max_shared_bytes:
        return f"needs {smem} B of shared memory, {arch.name} allows {arch.max_shared_bytes} B per block"
    regs = kb.registers_estimate()
    if regs > 200:
        return f"about {regs} registers per thread for fragments alone would spill (limit 255)"
    if kb.threads * 64 > arch.registers_per_sm:
        return f"{kb.threads} threads cannot each get 64 registers on {arch.name}"
    if problem.dtype == "bfloat16" and arch.sm < 80:
        return "bf16 MMA needs sm_80 or newer"
    return None
