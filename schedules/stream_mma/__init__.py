"""stream_mma: small-M kernels that stream weights into registers and swap the MMA operands
(see kernel.py for the why). Reads marlin_mma's packed layout: no repacking."""
from __future__ import annotations

from ..arch import Arch
from ..family import lazy_build
from ..knob_space import positional, valid_points
from ..problem import Problem
# marlin_mma's weight layout, and its kernel signature and split-K epilogue (schedules/epilogue.py):
# the same packed weights, arguments, checks and workspace.
from ..marlin_mma import LAYOUT, kernel_args, layout, pack, unpack, workspace_elems
from .knobs import Knobs, check
from .traits import FP8_KNOB_FACTORS, KNOB_FACTORS, TRAITS


# The TileLang pass configs the kernels compile with.
PASS_CONFIGS = {
    # Hand-written register code throughout: no warp specialization, no TMA.
    "tl.disable_warp_specialized": True,
    "tl.disable_tma_lower": True,
    # Every barrier is written out: TileLang cannot see that x_ldmatrix's shared slots are private
    # to a warp and would put two block-wide barriers into every batch (the __syncwarp suffices).
    "tl.disable_thread_storage_sync": True,
}


build = lazy_build(__name__)

NAME = "stream_mma"

AXES = {
    "m_tiles": (1, 2, 4),
    "warps": (4, 8),        # 2 warps never won a sweep or a tune
    "unroll": (4, 8),       # nor did unroll 2
    "split_k": (1, 2, 3, 4, 6, 8, 16),
    # Batches in flight per warp. 3 and 4 lost while the loads went into registers (H200; docs/performance.md); through
    # async_weights' shared slots they win 18 of the 24 buckets up to M = 32 (H200; docs/performance.md).
    "ahead": (1, 2, 3, 4),
    # Measured correct and each faster somewhere (H200; docs/performance.md): raw codes into the MMA at
    # M <= 16, the cluster's split-K reduction on the small layers, ldmatrix activations at M >= 32.
    "fold_zero_point": (False, True),
    "cluster_reduce": (False, True),
    "x_ldmatrix": (False, True),
    # Weights through the warp's cp.async slots (with x_ldmatrix): measured correct and a median 5 %
    # (M = 1) to 8 % (M = 16) faster than the same knobs without (H200; docs/performance.md).
    "async_weights": (False, True),
    # The warps' sums meet through a slice each (two barriers, not warps + 1): the end of a ~5 us
    # kernel. Faster in all 16 measured pairs at M = 1 and 8, by 2.5-8 % (H200; docs/performance.md).
    "sum_slices": (False, True),
    # Launched as the previous kernel drains (programmatic dependent launch): 0-2.5 % faster in all
    # 16 measured pairs at M = 1 and 8 (H200; docs/performance.md).
    "pdl": (False, True),
    # Let the next kernel launch at the start and ask L2 for the first 2 batches before the wait:
    # 0.94-1.46x, median 1.06 over 60 pairs at M = 1-32; it won 4 buckets by 1-4 % (H200; docs/performance.md).
    "early_start": (0, 2),
    # early_start's launch of the next kernel after the k-loop instead of first: median 0.96x of
    # early_start alone (13 pairs at M = 1-8, 0.83-1.03), 1.02x of neither (H200; docs/performance.md).
    "late_trigger": (False, True),
    # fold_zero_point's fold of a batch's sums one batch late, from a second set (H200).
    "fold_lag": (False, True),
}
# Axes that the first search round does not spread over (gen/search.py one_per_variant): the model
# ranks their better value first and the second round's neighbours try the other.
VARIANT_AXES = ("sum_slices", "pdl", "early_start", "late_trigger", "fold_lag")


from_axes = positional(Knobs)    # AXES name the Knobs fields in order


def space(problem: Problem, arch: Arch) -> list[Knobs]:
    """Every valid point of the named axes for `problem` on `arch`."""
    return valid_points(AXES, from_axes, check, problem, arch)


__all__ = ["NAME", "LAYOUT", "AXES", "Knobs", "check", "from_axes", "space", "build", "PASS_CONFIGS", "pack", "unpack",
           "workspace_elems", "kernel_args", "layout", "VARIANT_AXES", "TRAITS", "KNOB_FACTORS",
           "FP8_KNOB_FACTORS"]
