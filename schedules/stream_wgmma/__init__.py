"""stream_wgmma: weights decoded from global memory into wgmma's register A operand, activations
from shared memory (sm_90a; see kernel.py for the why). Reads marlin_mma's packed layout."""
from __future__ import annotations

import dataclasses

from ..arch import Arch
from ..family import lazy_build
from ..knob_space import positional, valid_points
from ..problem import Problem
# marlin_mma's weight layout, and its kernel signature and split-K epilogue (schedules/epilogue.py):
# the same packed weights, arguments, checks and workspace.
from ..marlin_mma import LAYOUT, kernel_args, layout, pack, unpack, workspace_elems
from .knobs import RULES, Knobs, check
from .traits import FP8_KNOB_FACTORS, KNOB_FACTORS, TRAITS


# The TileLang pass configs the kernels compile with.
PASS_CONFIGS = {
    # Hand-written pipeline: no warp specialization, no TMA lowering, every barrier explicit.
    "tl.disable_warp_specialized": True,
    "tl.disable_tma_lower": True,
    "tl.disable_thread_storage_sync": True,
}


build = lazy_build(__name__)

NAME = "stream_wgmma"

AXES = {
    "block_m": (8, 16, 32, 64, 128, 176, 256),     # 8 and 16: small M, a TMA-fed weight stream
    "groups": (1, 2),
    "warpgroups": (1, 2),
    # 128: two 64-wide boxes (one 128-byte swizzle atom each) per stage, twice the work per barrier
    # wait: 0.83x at M=128, 0.96-0.98x at 64 and 256, level elsewhere (H200; docs/performance.md)
    "block_k": (64, 128),
    "stages": (4, 6, 8),
    # (uneven splits only through the workspace: see space())
    "split_k": (1, 2, 4, 6, 8),
    # Per-stage empty barriers: alone 15-45 % slower (H200; docs/performance.md), but the producer warp needs them.
    "release_barriers": (False, True),
    "producer_warp": (False, True),  # warp specialization: 2-7 % faster from M=64 on, a toss-up below (H200; docs/performance.md)
    # A producer warpgroup that hands its registers to the consumers (block_m 256 with a producer):
    # level on the median, 1-4 % faster at some M >= 256 buckets, which it won (H200; docs/performance.md).
    "setmaxnreg": (False, True),
    # Split-K through a thread-block cluster's shared memory instead of the fp32 workspace:
    # 0.95-0.97x at M = 16-64, up to 0.75x (H200; docs/performance.md).
    "cluster_reduce": (False, True),
    # Launched as the previous kernel drains (programmatic dependent launch): median 0.99x at
    # M = 16-64 (18 pairs), 0.996x above (49 pairs, 0.92-1.05) (H200; docs/performance.md).
    "pdl": (False, True),
    # The output tile through shared memory as 16-byte row chunks instead of 2-byte fragment stores
    # (split_k 1): 0.92-1.03x, median 0.976 over 23 pairs at M = 16-4096 (H200; docs/performance.md).
    "staged_store": (False, True),
    # Let the next kernel launch at the start and ask L2 for the first 2 k-tiles before the wait:
    # median 0.976x at M = 16-64 (31 pairs, 0.92-1.43), 0.989x above (61 pairs, 0.90-1.14) (H200; docs/performance.md).
    "early_start": (0, 2),
    # Tiles handed out in panels of P M tiles, so that a wave's activations and weights fit L2:
    # 0.93-0.99x at M = 4096 (8 pairs), 0.90-1.13x at 2048, 1.0-1.02x at 512-1024 (H200; docs/performance.md).
    # 8 is left out: never better than 2 or 4 where there are more than 8 M tiles.
    "panel_m": (0, 2, 4),
    # The consumers' k-loop unrolled by the stages, every stage index a constant: 18 % fewer
    # instructions per k-tile at block_m 16; 0.91-0.98x at M = 16-256 (median 0.96, 17 pairs), but
    # 1.4x where ptxas hoisted the constant descriptors into 148 registers (qkv 32, split 2 in a
    # cluster; H200). The producer warp's loop too: 0.95-1.007x against the
    # consumers' alone (13 pairs at M = 16-256, H200).
    "stage_unroll": (False, True),
    # The wgmmas committed a k-step at a time, D k-steps of fragments in flight: D = 8 0.95-0.985x at
    # M = 128-256 (qkv 128, o 128 / 256, down 128), 0.996-1.05x at M = 32-64, 1.02-1.22x at block_m 16
    # (qkv 16, gate_up 16); D = 2 won by 0.3-1.3 % at two M = 256 block_k 64 kernels and was never
    # better than 8 at block_k 128 (H200; docs/performance.md).
    "ring": (0, 8),
    # Group scales on each k-tile's fp32 sums instead of on the decoded weights: 0.92x at the M = 16
    # winners (qkv, gate_up), 0.93-0.96x at M = 32-64 where it won, but 1.06-1.23x at some stage
    # counts (H200; docs/performance.md).
    "scale_on_acc": (False, True),
    # scale_on_acc's fold under the next k-tile's wgmmas, a full wait once per unrolled trip: 0.84x
    # and 0.99x at the gate_up 16 / qkv 16 winners (6 and 8 stages), and it takes back 4 stages' loss
    # (0.74-0.88x); at down / o 16, 0.59-0.98x at split_k 4, 1.06-1.29x at split_k 2 and 8 (25
    # same-run pairs, median 0.98; H200).
    "fold_lag": (False, True),
    # The weight words read from shared memory without bank conflicts (each lane quarter of a warp
    # shifted to the next 16-column quarter of the slab): 0.92-0.99x at every M = 16-64 winner (12
    # same-run pairs, median 0.955; H200). Not measured from M = 128 on; the
    # table's older entries there keep it off (a knob missing from an entry is its default, False).
    "rotate": (True,),
    # The splits but the last leaving their tiles in workspace slots, the last reading them after its
    # k-loop: a same-run variant of the workspace winners at M = 16-64, 0.94x at down_proj 16, 0.95x at
    # o_proj 32, 0.99x at down_proj 32 (H200; docs/performance.md); qkv_proj 16's split pair through
    # the workspace level with the cluster pair (9.08 / 9.05 us); no M >= 128 winner took it
    # (docs/performance.md). A variant axis: the first round keeps one of each pair.
    "split_wait": (False, True),
    # W4A8: the codes decoded as e4m3 bytes (c * 2^-9) and the offset corrected on 16-bit wgmmas:
    # 0.86-0.99x of the table-lookup decode with two warpgroups at M = 256-4096, 0.90-1.06x with one
    # (H100, 2026-12-06; docs/performance.md, offset decode). Its activation kernel also writes the
    # k-tile sums, which the tune's GEMM-only times leave out: 0.2-1.2 us a layer more than the plain
    # kernel at M = 256-1024 (H100, 2026-12-06), against GEMMs 1-15 us faster.
    "offset_decode": (False, True),
}
# Knobs of the launch, the epilogue and the loop's unrolling: the first search round keeps one of
# each point's variants.
VARIANT_AXES = ("pdl", "staged_store", "early_start", "panel_m", "stage_unroll", "ring", "scale_on_acc",
                "fold_lag", "split_wait")


from_axes = positional(Knobs)    # AXES name the Knobs fields in order


def space(problem: Problem, arch: Arch) -> list[Knobs]:
    """Every valid point of the named axes for `problem` on `arch` whose splits are even or meet
    through the workspace. Uneven splits in a cluster measured slower wherever tried (down_proj 16,
    docs/performance.md): a grid of clusters of 3 or more blocks runs on 124 of the H200's 132 SMs and
    holds fewer clusters at once than its blocks per SM suggest (64 clusters of 6 at 3 blocks per SM
    take two waves, v52); through the workspace down_proj 16's 86 k-tiles in 6 splits of 15 and 14
    won (H200; docs/performance.md). `gen sweep` and `--variants` still reach every valid point.
    split_wait applies only to splits through the workspace, so its True values are those points'
    twins, not a product over the axis (which would double the enumeration for points check() refuses:
    ~20 s a shape on one core)."""
    waits = AXES["split_wait"]
    points = valid_points({**AXES, "split_wait": (False,)}, from_axes, check, problem, arch, RULES)
    twins = [dataclasses.replace(kb, split_wait=True) for kb in points if kb.split_k > 1 and kb.uses_workspace] \
        if True in waits else []
    points = (points if False in waits else []) + [kb for kb in twins if check(problem, kb, arch) is None]
    # offset_decode's correction with the producer warp: 1.06-1.87x slower than the lookup decode at
    # M = 256-1024 (H100, 2026-12-06; docs/performance.md, offset decode)
    return [kb for kb in points if not (kb.longer_splits(problem) and kb.cluster_reduce)
            and not (kb.offset_decode and kb.producer_warp)]


__all__ = ["NAME", "LAYOUT", "AXES", "Knobs", "check", "from_axes", "space", "build", "PASS_CONFIGS", "pack", "unpack",
           "workspace_elems", "kernel_args", "layout", "VARIANT_AXES", "TRAITS", "KNOB_FACTORS",
           "FP8_KNOB_FACTORS"]
