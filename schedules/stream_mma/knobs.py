"""Knobs and validity check of the stream_mma family (small M, any arch >= sm_80)."""
from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch, padding_for_at_most
from ..marlin_mma.layout import SLAB_N, TILE_K
from ..problem import Problem

MMA_N = 8   # the swapped MMA's n: rows of M per m-tile


@dataclass(frozen=True)
class Knobs:
    """One point of the stream_mma schedule space.

    A block has `warps` warps that share one 64-column slab of the output and split the k-steps
    between them; each warp streams `unroll` k-steps of 16 rows per batch straight from global memory
    into registers (one 16-byte load per lane and k-step), with `ahead` batches in flight (register
    buffers: the next batches load while one is decoded). m_tiles MMA tiles of 8 rows cover
    block_m = 8 * m_tiles rows of M. split_k > 1 spreads the batches over that many blocks per
    output tile, whose fp32 partials meet in a global workspace (schedules/epilogue.py). Group
    scales multiply the decoded weights, unless fold_zero_point: the MMA multiplies the raw
    magic-number codes (4 lop3 and a shift per word, no subtraction, no scale) and one extra MMA per
    k-step computes the offsets that come off the fp32 sums, which then take the scale (per batch;
    channelwise scales once at the end). cluster_reduce (sm_90, split_k <= 8) launches a tile's splits
    as one thread-block cluster that adds its partial sums through distributed shared memory instead
    of a global workspace (schedules/epilogue.py).
    x_ldmatrix stages each batch's activations per warp in shared memory with coalesced 16-byte
    cp.async and reads the B fragments with ldmatrix.x4, instead of two 4-byte loads of 8 rows per
    k-step and m-tile (which flood the load pipe at M >= 16). async_weights (with x_ldmatrix) moves
    the weights and scales through the warp's shared slots too, so that the k-loop has no load into
    registers from global memory: ptxas tracks all of a loop's global loads on one scoreboard, so a
    register buffer `ahead` batches early is waited for together with the newest loads (H200; docs/performance.md); cp.async groups are counted in order and waited for one batch at a time. sum_slices: at
    the end every warp stores its sums into its own shared slice and each thread then adds one
    element's slices (two barriers), instead of the warps adding into one tile in turn (warps + 1).
    pdl (sm_90, not with cluster_reduce, whose launches already are) launches the kernel with
    programmatic stream serialization: it starts as the previous kernel drains and waits for its
    writes first (schedules/epilogue.py). early_start (n > 0, with pdl or cluster_reduce) overlaps
    the kernel boundary from both sides: the kernel lets the next one in the stream launch as soon
    as all of its own blocks run (griddepcontrol.launch_dependents; the next one's blocks then take
    the SM slots that this kernel's last blocks free), and before it waits for the previous kernel
    each warp asks L2 for the weights of its first n batches (weights never depend on an earlier
    kernel), so that the first DRAM round trip falls under the previous kernel's tail. late_trigger
    (with early_start) lets the next kernel launch only once this block's k-loop is done, so that its
    blocks overlap this kernel's end (the sums' reduction and stores) but not its weight stream.
    fold_lag (with fold_zero_point, even ahead) folds each batch's sums during the next batch, from a
    second set of sums, so that the fold does not wait for the MMAs it reads.
    max_blocks (B > 0, sm_90, x_ldmatrix) pads the activation slots' shared memory so that at most B
    blocks fit an SM: a split-K cluster grid under one wave then spreads over more SMs (stream_wgmma's
    clusters packed onto fewer SMs when more fit, docs/performance.md; on this family's M = 1-8 winners it
    moved nothing, v51); 0 leaves the count to registers and shared memory.
    """

    m_tiles: int = 1
    warps: int = 8
    unroll: int = 4
    split_k: int = 1
    ahead: int = 2
    fold_zero_point: bool = False
    cluster_reduce: bool = False
    x_ldmatrix: bool = False
    async_weights: bool = False
    sum_slices: bool = False
    pdl: bool = False
    early_start: int = 0
    late_trigger: bool = False
    fold_lag: bool = False
    max_blocks: int = 0

    @property
    def block_m(self) -> int:
        return MMA_N * self.m_tiles

    @property
    def block_n(self) -> int:
        return SLAB_N

    @property
    def block_k(self) -> int:
        """k rows one block's warps stream per batch, together."""
        return TILE_K * self.unroll * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def uses_workspace(self) -> bool:
        """Whether a call needs the split-K workspace and counters (schedules/epilogue.py)."""
        return self.split_k > 1 and not self.cluster_reduce

    @property
    def num_stages(self) -> int:
        """For the cost model: `ahead` batches in flight, like a pipeline of ahead + 1 stages."""
        return self.ahead + 1

    @property
    def name(self) -> str:
        return f"mt{self.m_tiles}_w{self.warps}_u{self.unroll}_a{self.ahead}_sk{self.split_k}" + (
            "_fz" if self.fold_zero_point else "") + ("_cl" if self.cluster_reduce else "") + (
            "_xl" if self.x_ldmatrix else "") + ("_aw" if self.async_weights else "") + (
            "_ss" if self.sum_slices else "") + ("_pdl" if self.pdl else "") + (
            f"_es{self.early_start}" if self.early_start else "") + ("_lt" if self.late_trigger else "") + (
            "_fl" if self.fold_lag else "") + (f"_mb{self.max_blocks}" if self.max_blocks else "")

    def batches(self, problem: Problem) -> int:
        return problem.k // (TILE_K * self.unroll)

    def shared_bytes(self, problem: Problem) -> int:
        """Dynamic shared memory as TileLang allocates it: with x_ldmatrix each warp's activation slots,
        with async_weights its weight and scale slots, all live during the k-loop; after it, the fp32
        tile in which the warps' sums meet and with sum_slices a slice of sums per warp, which TileLang
        lays over the slots (measured in its host launch code, docs/performance.md)."""
        slices = self.warps * self.block_m * self.block_n * 4 if self.sum_slices else 0
        return max(self._k_loop_bytes(problem) + self.pad_warps(problem) * self.x_slots_bytes,
                   self.block_m * self.block_n * 4 + slices)

    def _k_loop_bytes(self, problem: Problem) -> int:
        """The warps' slots, unpadded: activations with x_ldmatrix, weights and scales (and zero-point
        offsets) with async_weights."""
        x = self.warps * self.x_slots_bytes if self.x_ldmatrix else 0
        scale_rows = 2 if problem.zero_points else 1
        w = self.warps * self.ahead * (self.unroll * 512 + self.block_n * 2 * scale_rows) if self.async_weights else 0
        return x + w

    @property
    def x_slots_bytes(self) -> int:
        """One warp's activation slots (x_ldmatrix): `ahead` batches of block_m padded rows."""
        return self.ahead * self.block_m * (TILE_K * self.unroll + 8) * 2

    def pad_warps(self, problem: Problem) -> int:
        """Unused warps' worth of activation slots that max_blocks adds to the allocation: enough that
        B + 1 blocks overflow the SM, with 1 KB to spare."""
        if not self.max_blocks:
            return 0
        return padding_for_at_most(self.max_blocks, self._k_loop_bytes(problem), self.x_slots_bytes, spare=1024)

    def registers_estimate(self, problem: Problem | None = None) -> int:
        """32-bit registers per thread; a problem with zero points holds them beside the scales (and
        without fold_zero_point their offsets, 4 registers)."""
        zero_points = problem is not None and problem.zero_points
        scale_regs = 8 if zero_points else 4    # per batch: 8 or 16 halves
        sets = 2 if self.fold_lag else 1
        acc = 4 * self.m_tiles * 4 * (1 + sets if self.fold_zero_point else 1)
        acc += (self.m_tiles * 4 * sets + 4) if self.fold_zero_point else 0     # offsets' sums, constant A
        acc += 2 * scale_regs if self.fold_lag else 0      # the folded batch's scales (two sets)
        x_regs = self.m_tiles * 2 * self.unroll
        w_bufs = 1 if self.async_weights else self.ahead
        loads = w_bufs * (self.unroll * 4 + scale_regs) + self.ahead * (0 if self.x_ldmatrix else x_regs)
        loads += x_regs if self.x_ldmatrix else 0
        offsets = 4 if zero_points and not self.fold_zero_point else 0
        return acc + loads + offsets + 32   # + addresses and loop state (76 measured for mt1 u4 a1: est. 76)


def check(problem: Problem, knobs: Knobs, arch: Arch) -> str | None:
    """Why (problem, knobs) cannot compile or run on `arch`, or None when it can."""
    kb = knobs
    for field in ("m_tiles", "warps", "unroll", "split_k", "ahead"):
        if getattr(kb, field) < 1:
            return f"{field}={getattr(kb, field)} must be positive"
    if kb.threads > 1024:
        return f"{kb.threads} threads exceed the 1024 a block may have"
    if problem.fp8:
        return "FP8 activations run on stream_wgmma only (FP8 wgmma, sm_90a)"
    if problem.n % kb.block_n:
        return f"N={problem.n} is not a multiple of block_n={kb.block_n} (one slab)"
    batch_rows = TILE_K * kb.unroll
    if problem.k % batch_rows:
        return f"K={problem.k} is not a multiple of unroll * 16 = {batch_rows}"
    if not problem.channelwise and problem.group % batch_rows:
        return f"group={problem.group} must be a multiple of unroll * 16 = {batch_rows} (one scale row per batch)"
    if kb.cluster_reduce:
        if not arch.hopper:
            return f"cluster_reduce needs thread-block clusters (sm_90); {arch.name} has none"
        if not 2 <= kb.split_k <= 8:
            return f"cluster_reduce needs 2 <= split_k <= 8 (a portable cluster), got split_k={kb.split_k}"
    if kb.pdl and not arch.hopper:
        return f"pdl needs griddepcontrol (sm_90); {arch.name} has none"
    if kb.pdl and kb.cluster_reduce:
        return "cluster_reduce kernels are already launched with programmatic stream serialization; drop pdl"
    if kb.early_start < 0:
        return f"early_start={kb.early_start} must be 0 (off) or a number of batches"
    if kb.early_start and not (kb.pdl or kb.cluster_reduce):
        return "early_start overlaps a programmatic launch: it needs pdl or cluster_reduce"
    if kb.late_trigger and not kb.early_start:
        return "late_trigger moves early_start's launch of the next kernel: it needs early_start"
    if kb.x_ldmatrix and kb.unroll % 2:
        return f"x_ldmatrix reads two k-steps per ldmatrix.x4: unroll={kb.unroll} must be even"
    if kb.async_weights and not kb.x_ldmatrix:
        return "async_weights needs x_ldmatrix (the activations' cp.async slots and waits)"
    if kb.fold_lag and not kb.fold_zero_point:
        return "fold_lag delays fold_zero_point's per-batch fold: it needs fold_zero_point"
    if kb.fold_lag and kb.ahead % 2:
        return f"fold_lag takes a batch's set of sums from its parity, constant only for even ahead (got {kb.ahead})"
    if kb.max_blocks < 0 or kb.max_blocks and not (arch.hopper and kb.x_ldmatrix):
        return (f"max_blocks={kb.max_blocks}: 0 (no cap) or the blocks per sm_90 SM, padding the activation "
                "slots (x_ldmatrix)")
    workers = kb.split_k * kb.warps
    if kb.batches(problem) < workers:
        return (f"{kb.batches(problem)} batches of {batch_rows} rows leave some of the "
                f"split_k * warps = {workers} warps without work")
    regs = kb.registers_estimate(problem)
    if regs > 200:
        return f"about {regs} registers per thread for sums and loads would spill"
    if kb.shared_bytes(problem) > arch.max_shared_bytes:
        return f"needs {kb.shared_bytes(problem)} B of shared memory, {arch.name} allows {arch.max_shared_bytes} B"
    if problem.dtype == "bfloat16" and arch.sm < 80:
        return "bf16 MMA needs sm_80 or newer"
    return None
