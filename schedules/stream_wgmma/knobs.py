"""Knobs and validity check of the stream_wgmma family (sm_90a only)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..arch import Arch
from ..marlin_mma.layout import SLAB_N, TILE_K
from ..knob_space import Rule, tiling_reason
from ..problem import Problem

WARPGROUP = 128
PRODUCER_REGISTERS = 40   # setmaxnreg: what the producer warpgroup keeps (TMA issue and barrier waits)


@dataclass(frozen=True)
class Knobs:
    """One point of the stream_wgmma schedule space (kernel.py says why the kernel looks as it does;
    docs/performance.md has each technique's measurements, under its knob's name).

    A block is `warpgroups` consumer warpgroups side by side along N. Per k-step of 16 every warp of a
    warpgroup decodes `groups` packed words (16 weight columns each) straight into wgmma A fragments,
    so one warpgroup covers 64 * groups weight columns with `groups` wgmma m64n{block_m}k16 per
    k-step; block_m rows of M are the wgmma's N and come from shared memory. block_k (64 or 128) rows
    of K per stage: TMA fills each of the `stages` stages with the k-tile's activations (the 128-byte
    swizzle, one 64-wide box per swizzle width), packed words and scale row against the stage's
    mbarrier, and a warpgroup decodes k-tile t + 1 into a second fragment buffer while k-tile t's
    wgmmas run. split_k > 1 spreads the k-tiles over that many blocks per output tile (fp32
    workspace, schedules/epilogue.py); with the producer warp they need not divide evenly (the first
    k_tiles % split_k splits take one more).
    Without release_barriers every k-tile ends in a block barrier, after which one elected thread
    refills the freed stage. release_barriers frees each stage through an mbarrier that every
    consumer thread arrives on once done with it instead: warp 0 waits on it before refilling the
    stage, and the warpgroups no longer meet. producer_warp (with release_barriers) adds a 9th (or
    5th) warp that only refills stages, warp specialization: no consumer warp ever waits for a
    release or issues a copy, and all `stages` stages fill at once.
    setmaxnreg (with producer_warp, two warpgroups, split_k 1) makes the producer a whole warpgroup
    that drops to PRODUCER_REGISTERS with setmaxnreg.dec and hands the rest to the two consumer
    warpgroups (setmaxnreg.inc): 232 registers each instead of the 224 that 288 threads leave them,
    with ptxas's headroom for wgmmas in flight, so block_m 256 can have a producer.
    cluster_reduce (split_k 2-8) launches a tile's splits as one thread-block cluster that adds the
    partial tiles through distributed shared memory (schedules/epilogue.py, as stream_mma does)
    instead of the fp32 workspace in global memory. pdl (not with cluster_reduce, whose launches
    already are) launches the kernel with programmatic stream serialization: it starts as the
    previous kernel drains and waits for its writes first.
    staged_store (split_k 1) stores the output tile through a shared tile of its own: the sums go into
    it in C's row-major order and leave as 16-byte chunks of whole rows, instead of each thread
    storing its fragment's 2-byte elements (4 rows x 16 bytes per warp store, half of each 32-byte
    sector). early_start (n > 0, with pdl or cluster_reduce) lets the next kernel launch once all of
    this kernel's blocks run and asks L2 for the block's first n k-tiles of weights and scales before
    the wait for the previous kernel (as in stream_mma).
    panel_m (P >= 2) hands out the output tiles in panels of P M tiles: the blocks launched one after
    another walk the P M tiles of a panel, then the next N tile, so that a wave of blocks reads P
    M tiles' activations and 132 / P N tiles' weights (about 16 MB at P = 4, block 256 x 128, K =
    4096), which L2 holds, instead of every M tile's activations (32 MB at M = 4096, 90 MB for
    down_proj) once per wave; 0 keeps the grid's order (M tiles fastest).
    stage_unroll unrolls the consumers' k-loop by a multiple of `stages`, so that every stage index,
    barrier phase and descriptor offset in it is a constant instead of a division per k-tile; with
    producer_warp (not setmaxnreg's producer warpgroup, whose 40 registers were not checked for the
    unrolled copies) the producer warp's loop is unrolled by the stages too. ring = D > 0 (D divides
    the k-steps of a stage) commits each k-step's wgmmas as a group of their own and decodes k-step u
    into fragment slot u % D once the wgmmas that read the slot last, D groups back, are done: D
    k-steps of wgmmas in flight with D k-steps of A fragments instead of two whole stages' (ptxas at
    block_m 16, block_k 128: ~67 registers with D = 8 or 4, ~54 with D = 2, against ~104), so that
    more blocks fit per SM; 0 keeps the two whole buffers.
    scale_on_acc (group scales, and every W4A8 kernel, whose channelwise scales fold as ones; no
    ring) decodes the words unscaled (code - 8, with zero points code - z, with FP8 as e4m3,
    all exact) and gives each k-tile's wgmmas sums of their own (the first k-step overwrites them):
    once k-tile t + 1 is decoded under k-tile t's wgmmas, the warpgroup waits for all of them, adds k-tile t's
    sums times its group's scales to the running fp32 sums and issues k-tile t + 1. Four HMUL2 per
    word become one FFMA per sum and k-tile. fold_lag (with scale_on_acc) keeps two sets of k-tile
    sums by parity and folds k-tile t's after the wait that completes it, while k-tile t + 1's
    wgmmas run; ptxas allows that only within the unrolled trip of the k-loop, so the warpgroup
    waits for all its wgmmas once per trip (lcm(2, stages) k-tiles with stage_unroll) instead of
    once per k-tile.
    rotate (groups 1 or 2) has each 8-lane quarter of a warp read the next 16-column quarter of the
    slab (plan.slab_quarter), so that a warp's loads of its packed words from shared memory touch
    every bank once instead of 8 banks four times; the sums and scales follow.
    offset_decode (W4A8) decodes each code c to the e4m3 byte c, worth c * 2^-9 (two masks, a shift and
    two prmt per word against the table lookup's 12 instructions) and starts the running sums at the
    correction for the offset, -8 times each k-tile's sum of activations times its scales, on 16-bit
    wgmmas (correction.py); the final sums are times 512.
    split_wait (split-K through the workspace, with the producer warp): every split but the last
    stores its tile into a workspace slot of its own and leaves, without fence or counter; after
    its k-loop the last split reads the slots (again where a value has not landed yet), adds them to
    its own tile, zeroes them and stores (epilogue.SPLIT_WAIT_SUM); uneven splits give the extra
    k-tiles to the last splits, so that the waiting one, launched last, also has the most to do.
    """

    block_m: int = 128
    groups: int = 2
    warpgroups: int = 1
    block_k: int = 64
    stages: int = 3
    split_k: int = 1
    release_barriers: bool = False
    producer_warp: bool = False
    setmaxnreg: bool = False
    cluster_reduce: bool = False
    pdl: bool = False
    staged_store: bool = False
    early_start: int = 0
    panel_m: int = 0
    stage_unroll: bool = False
    ring: int = 0
    scale_on_acc: bool = False
    fold_lag: bool = False
    rotate: bool = False
    split_wait: bool = False
    offset_decode: bool = False

    @property
    def block_n(self) -> int:
        return SLAB_N * self.groups * self.warpgroups

    @property
    def consumer_threads(self) -> int:
        """The warpgroups that decode and issue wgmmas."""
        return WARPGROUP * self.warpgroups

    @property
    def producer_threads(self) -> int:
        """The producer warp, or with setmaxnreg its whole warpgroup (setmaxnreg works per warpgroup)."""
        return WARPGROUP if self.setmaxnreg else 32 if self.producer_warp else 0

    @property
    def threads(self) -> int:
        return self.consumer_threads + self.producer_threads

    @property
    def max_registers(self) -> int:
        """Registers per consumer thread with one block of `threads` per SM (at most 255): the block's
        share, or with setmaxnreg what the producer warpgroup leaves, in setmaxnreg's steps of 8."""
        if self.setmaxnreg:
            return min(248, (65536 - WARPGROUP * PRODUCER_REGISTERS) // self.consumer_threads // 8 * 8)
        return min(255, 65536 // self.threads // 8 * 8)

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def k_steps(self) -> int:
        """k-steps of 16 per stage."""
        return self.block_k // TILE_K

    @property
    def uses_workspace(self) -> bool:
        return self.split_k > 1 and not self.cluster_reduce

    @property
    def workspace_slots(self) -> int:
        """[m, N] slots of the fp32 workspace: split_wait gives each split but the last its own."""
        return self.split_k - 1 if self.split_wait else 1

    @property
    def name(self) -> str:
        flags = (("_rb", self.release_barriers), ("_pw", self.producer_warp), ("_nreg", self.setmaxnreg),
                 ("_cl", self.cluster_reduce), ("_pdl", self.pdl), ("_st", self.staged_store),
                 (f"_es{self.early_start}", self.early_start), (f"_pm{self.panel_m}", self.panel_m),
                 ("_su", self.stage_unroll), (f"_ring{self.ring}", self.ring), ("_sacc", self.scale_on_acc),
                 ("_fl", self.fold_lag), ("_rot", self.rotate), ("_wait", self.split_wait),
                 ("_od", self.offset_decode))
        return (f"m{self.block_m}_g{self.groups}_wg{self.warpgroups}_k{self.block_k}_s{self.stages}"
                f"_sk{self.split_k}" + "".join(tag for tag, on in flags if on))

    def k_tiles(self, problem: Problem) -> int:
        return problem.k // self.block_k

    def longer_splits(self, problem: Problem) -> int:
        """How many splits take one k-tile more than the others (uneven split_k: the first ones, with
        split_wait the last ones)."""
        return self.k_tiles(problem) % self.split_k

    def mma_steps(self, problem: Problem) -> int:
        """wgmma k-steps per stage: 16 deep, or 32 with FP8 activations (whose words then pair up)."""
        return self.block_k // (2 * TILE_K if problem.fp8 else TILE_K)

    def shared_bytes(self, problem: Problem) -> int:
        x = self.stages * self.block_m * self.block_k * (1 if problem.fp8 else 2)
        # a stage's packed words and its scale row (with zero points, the zero-point row too)
        w = self.stages * (self.block_k * self.block_n // 2 + self.block_n * 2 * (2 if problem.zero_points else 1))
        c = self.block_m * self.block_n * 4 if self.split_k > 1 else 0
        # staged_store's tile (TileLang's merge may place it over the dead activation stages, or not)
        y = self.block_m * (self.block_n + 8) * 2 if self.staged_store else 0
        # offset_decode's correction: two 16-bit parts of 16 k-tile sums per row (correction.py)
        ks = self.block_m * 16 * 2 * 2 if self.offset_decode else 0
        return x + w + c + y + ks + 64

    def registers_estimate(self, problem: Problem | None = None) -> int:
        # the total and one (scale_on_acc) or two (fold_lag) sets of k-tile sums
        acc = self.groups * self.block_m // 2 * (3 if self.fold_lag else 2 if self.scale_on_acc else 1)
        # two fragment buffers (decode under the wgmmas) of 4 registers per wgmma k-step and group
        steps = self.k_steps if problem is None else self.mma_steps(problem)
        a = steps * self.groups * 4 * 2
        raw = self.k_steps * self.groups + self.groups
        # zero points: z and the decode's subtrahends (scale_on_acc: 4 registers per group in fp16, 2 in
        # bf16) or offsets (1)
        zero = (5 if self.scale_on_acc else 2) * self.groups if problem is not None and problem.zero_points else 0
        return acc + a + raw + zero + self._other_registers(problem)

    def _other_registers(self, problem: Problem | None) -> int:
        """Addresses, barrier phases, the decode's constants. W4A8 without the producer warp needs almost
        none beyond the terms (ptxas for sm_90a: block_m 128 170 registers, 192 230-232, against terms of
        169 and 233: its decode is two masks, a shift and two prmt, and its scales go on the sums); with the
        producer warp the same kernels had ptxas serialize the wgmmas at 158-160, so they keep W4A16's 40."""
        return 4 if problem is not None and problem.fp8 and self.offset_decode and not self.producer_warp else 40


def check(problem: Problem, knobs: Knobs, arch: Arch) -> str | None:
    """Why (problem, knobs) cannot compile or run on `arch`, or None when it can."""
    kb = knobs
    if not arch.hopper:
        return f"wgmma needs sm_90a; {arch.name} has none"
    for field in ("block_m", "groups", "warpgroups", "block_k", "stages", "split_k"):
        if getattr(kb, field) < 1:
            return f"{field}={getattr(kb, field)} must be positive"
    if kb.block_m % 8 or kb.block_m > 256:
        return f"block_m={kb.block_m} is the wgmma's N: a multiple of 8, at most 256"
    if kb.groups not in (1, 2, 4):
        return f"groups={kb.groups}: a packed word vector holds 4 groups, so 1, 2 or 4"
    if kb.warpgroups not in (1, 2):
        return f"warpgroups={kb.warpgroups}: 1 or 2"
    if kb.block_k % (2 * TILE_K):
        return f"block_k={kb.block_k} must be a multiple of 32"
    reason = tiling_reason(problem, kb.block_n, kb.block_k, "one scale row per stage")
    if reason:
        return reason
    if kb.block_k not in (64, 128):
        return (f"block_k={kb.block_k}: TMA fills the stages in 64-wide swizzled tiles (block_k=64, or 128 as two "
                "of them)")
    if problem.rounds_fp8 and kb.block_m > 16:
        # The consumers round every landed stage on their own path: 4-12 % of the kernel at block_m 16,
        # 30-60 % at 32 and 64 (H100, 2026-12-06; docs/performance.md, W4A8 on the W4A16 kernels).
        return (f"fp8_rounded rounds each stage's {kb.block_m} x {kb.block_k} activations on the consumers' path: "
                "measured worth it up to block_m=16 only")
    reason = fp8_reason(problem, kb) or offset_decode_reason(problem, kb)
    if reason:
        return reason
    if kb.producer_warp and not kb.release_barriers:
        return "producer_warp refills the stages that the consumers release: it needs release_barriers"
    if kb.setmaxnreg and not (kb.producer_warp and kb.warpgroups == 2 and kb.split_k == 1):
        return ("setmaxnreg moves the producer's registers to two consumer warpgroups: it needs producer_warp, "
                "warpgroups=2 and split_k=1 (the producer keeps too few for the epilogue)")
    if kb.pdl and kb.cluster_reduce:
        return "cluster_reduce kernels are already launched with programmatic stream serialization; drop pdl"
    if kb.early_start < 0:
        return f"early_start={kb.early_start} must be 0 (off) or a number of k-tiles"
    if kb.early_start and not (kb.pdl or kb.cluster_reduce):
        return "early_start overlaps a programmatic launch of the tiled kernel: it needs pdl or cluster_reduce"
    if kb.early_start * kb.k_steps + kb.early_start > 32:
        return f"early_start={kb.early_start} asks for more rows than the 32 lanes of one warp prefetch"
    if kb.early_start > kb.k_tiles(problem) // kb.split_k:
        return f"early_start={kb.early_start} exceeds the block's {kb.k_tiles(problem) // kb.split_k} k-tiles"
    if kb.rotate and kb.groups >= 4:
        return "rotate shifts each lane quarter's 16-column quarter of the slab: at groups 4 a warp reads all four already"
    if kb.ring < 0 or kb.ring and (kb.ring < 2 or kb.k_steps % kb.ring):
        return (f"ring={kb.ring}: 0 (two whole fragment buffers) or k-steps in flight, at least 2 and dividing "
                f"the stage's {kb.k_steps} k-steps")
    if kb.scale_on_acc and problem.channelwise and not problem.fp8:
        return "scale_on_acc scales each k-tile's sums by its group's scales: channelwise scales have no groups"
    if kb.scale_on_acc and kb.ring:
        return ("scale_on_acc folds k-tile t - 1's sums after the wait for all wgmmas: it takes no ring (a wait "
                "a k-step)")
    if kb.fold_lag and not kb.scale_on_acc:
        return "fold_lag delays scale_on_acc's fold of each k-tile's sums: it needs scale_on_acc"
    if kb.panel_m < 0 or kb.panel_m == 1:
        return f"panel_m={kb.panel_m}: 0 (the grid's order) or at least 2 M tiles per panel"
    if kb.cluster_reduce and not 2 <= kb.split_k <= 8:
        return f"cluster_reduce needs 2 <= split_k <= 8 (a portable cluster), got split_k={kb.split_k}"
    if kb.split_wait and not (kb.split_k > 1 and kb.producer_warp) or kb.split_wait and (
            kb.cluster_reduce or kb.setmaxnreg):
        return ("split_wait has the last split of a tile read the others' workspace slots: it is wired into "
                "split_k > 1 through the workspace (no cluster_reduce) with the producer warp, and no setmaxnreg")
    mine = -(-kb.block_m * kb.block_n // 4 // kb.threads)
    if kb.split_wait and (kb.split_k - 1) * mine > 64:
        return (f"split_wait's last split keeps a bit per slot and 4-column chunk of a thread, at most 64: "
                f"{kb.split_k - 1} slots of {mine} chunks (block_m={kb.block_m}, block_n={kb.block_n}, "
                f"{kb.threads} threads)")
    if kb.staged_store and kb.split_k > 1:
        return "staged_store is wired into split_k=1 only (split-K tiles meet in the common epilogue)"
    if kb.stages < 2:
        # A stage is released once the wgmmas of the k-tile after it are issued (decode under the wgmmas).
        return f"stages={kb.stages} leaves no stage in flight: a stage is refilled a k-tile after its use"
    if kb.longer_splits(problem) and not kb.producer_warp:
        return (f"{kb.k_tiles(problem)} k-tiles do not split evenly into split_k={kb.split_k}; uneven splits "
                "(the first ones a k-tile longer) need the producer warp")
    if kb.k_tiles(problem) // kb.split_k < kb.stages:
        return f"each split has fewer k-tiles than stages={kb.stages}"
    regs = kb.registers_estimate(problem)
    if regs > kb.max_registers + 1:     # ptxas fitted estimates up to 255 without spilling
        return f"about {regs} registers per thread would spill ({kb.max_registers} for {kb.threads} threads)"
    if kb.producer_warp and regs > kb.max_registers - 20:
        # At block_m 256 (estimate 205 of 224) ptxas kept its registers but waited for every wgmma
        # before the next (its warning C7512): the producer warp costs the consumers 32 registers each.
        return (f"about {regs} registers per thread leave ptxas too few of {kb.max_registers} to keep the wgmmas "
                "in flight")
    if kb.shared_bytes(problem) > arch.max_shared_bytes:
        return f"needs {kb.shared_bytes(problem)} B of shared memory, {arch.name} allows {arch.max_shared_bytes} B"
    return None


def fp8_reason(problem: Problem, kb: Knobs) -> str | None:
    """Why the knobs cannot take FP8 activations (W4A8), or None: an FP8 k-tile of 128 is one 128-byte
    swizzle atom, and e4m3 weights hold the codes - 8 (offset_decode: c * 2^-9) but no scale, and their
    sums must not run through the FP8 accumulator across K, whose adds keep ~14 bits (offset_decode's
    codes, of mean 7.5: 2.2e-3 relative error at K = 11008 with channelwise scales, 0.1-0.17 with
    activations of mean 1-4; H100, 2026-12-06): every k-tile's sums are promoted (scale_on_acc),
    channelwise ones times 1."""
    if not problem.fp8:
        return None
    if kb.block_k != 128:
        return f"block_k={kb.block_k}: with FP8 activations a k-tile is one 128-byte swizzle atom, block_k=128"
    if not kb.scale_on_acc:
        return ("FP8 weights are the codes as e4m3, unscaled: each k-tile's sums go into the running fp32 sums "
                "times its group scale (1 for channelwise scales), so FP8 needs scale_on_acc")
    if kb.ring:
        return "ring decodes one 16-deep k-step per slot; FP8 wgmmas are 32 deep: ring=0"
    return None


def offset_decode_reason(problem: Problem, kb: Knobs) -> str | None:
    """Why the knobs cannot take offset_decode, or None."""
    if kb.offset_decode and not problem.fp8:
        return "offset_decode decodes the codes to FP8 e4m3: it is W4A8's (FP8 activations)"
    return None


def form_for(problem: Problem, kb: Knobs) -> Knobs:
    """Another problem's winner in the form `problem` takes, so that it transfers with its tiles, splits
    and pipeline: FP8 activations need 128-deep k-tiles, no ring and scale_on_acc (fp8_reason); W4A16's
    channelwise scales take no scale_on_acc (nor its fold_lag)."""
    if problem.fp8:
        return dataclasses.replace(kb, block_k=128, ring=0, scale_on_acc=True)
    kb = dataclasses.replace(kb, offset_decode=False)
    if kb.scale_on_acc and problem.channelwise:
        return dataclasses.replace(kb, scale_on_acc=False, fold_lag=False)
    return kb


# check()'s conditions on a few axes each, for the enumeration to prune with (knob_space.Rule): the
# flags that depend on each other cut the product of AXES (about 5 million points) to a few percent
# before check() sees a point.
RULES = (
    Rule(("offset_decode",), lambda p, offset_decode: p.fp8 or not offset_decode),
    Rule(("groups", "warpgroups", "block_k"),
         lambda p, groups, warpgroups, block_k: tiling_reason(p, SLAB_N * groups * warpgroups, block_k) is None),
    Rule(("block_k", "stages", "split_k"), lambda p, block_k, stages, split_k: p.k // block_k // split_k >= stages),
    Rule(("release_barriers", "producer_warp"), lambda p, release_barriers, producer_warp:
         release_barriers or not producer_warp),
    Rule(("block_k", "split_k", "producer_warp"), lambda p, block_k, split_k, producer_warp:
         producer_warp or p.k // block_k % split_k == 0),
    Rule(("warpgroups", "split_k", "producer_warp", "setmaxnreg"), lambda p, warpgroups, split_k, producer_warp,
         setmaxnreg: not setmaxnreg or (producer_warp and warpgroups == 2 and split_k == 1)),
    Rule(("split_k", "cluster_reduce"), lambda p, split_k, cluster_reduce: not cluster_reduce or 2 <= split_k <= 8),
    Rule(("cluster_reduce", "pdl"), lambda p, cluster_reduce, pdl: not (cluster_reduce and pdl)),
    Rule(("split_k", "staged_store"), lambda p, split_k, staged_store: not staged_store or split_k == 1),
    Rule(("cluster_reduce", "pdl", "early_start"), lambda p, cluster_reduce, pdl, early_start:
         not early_start or pdl or cluster_reduce),
    Rule(("block_k", "ring"), lambda p, block_k, ring: ring == 0 or ring >= 2 and block_k // TILE_K % ring == 0),
    Rule(("ring", "scale_on_acc"), lambda p, ring, scale_on_acc:
         not scale_on_acc or not (p.channelwise and not p.fp8 or ring)),
    Rule(("block_k", "ring", "scale_on_acc"), lambda p, block_k, ring, scale_on_acc:
         not p.fp8 or block_k == 128 and ring == 0 and scale_on_acc),
    Rule(("scale_on_acc", "fold_lag"), lambda p, scale_on_acc, fold_lag: scale_on_acc or not fold_lag),
    Rule(("groups", "rotate"), lambda p, groups, rotate: not rotate or groups < 4),
)
