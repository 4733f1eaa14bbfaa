"""stream_mma's cost-model traits and measured knob factors (schedules/cost.py applies them).

The factors are medians of same-run pairs (the kernel with and without the knob, other knobs equal)
over the measured time ratio divided by the model's ratio, on the H200 (2026-11-29 .. 2026-12-02);
docs/performance.md has each technique's measurements.
"""
from ..family import FamilyTraits

# Fitted on ~700 H200 sweep timings and 140 tune timings: with the per-SM pull and per-k-tile costs
# of marlin_mma and one ALU instruction per weight, estimates are within 17 % on average. Its pull
# per SM is 1.5x marlin_mma's, which takes the estimates' bias over 2904 timings from +0.22 (log) to 0.
TRAITS = FamilyTraits(decode_ops=1.0, pull_scale=1.5)

KNOB_FACTORS = {
    "fold_zero_point": ((16, 0.95), (None, 1.35)),
    "cluster_reduce": ((None, 0.97),),
    # Rows past M zero-filled and read through L1 (x_ldmatrix): the penalty once paid for repeated
    # rows fetched from L2 is gone.
    "x_ldmatrix": ((None, 0.93),),
    "async_weights": ((8, 0.95), (None, 0.92)),
    "sum_slices": ((None, 0.95),),           # medians of 16 pairs each at M = 1 and 8
    "pdl": ((None, 0.98),),
    # early_start: with late_trigger 0.943 (25 pairs) up to M = 8 and 0.99 (25) at M = 16-32, without
    # it 0.95 (3) and 0.973 (14); worst where one wave of blocks fills the GPU (the next kernel's
    # early blocks crowd the SMs that free first). Refitted below M = 32 with `gen modelcheck` on the
    # committed table: stream_mma's first pick 1.126 -> 1.087x of the measured best.
    "early_start": ((8, 0.95), (32, 0.975), (None, 1.06)),
    "late_trigger": ((8, 0.99), (32, 1.015), (None, 0.96)),   # 13 pairs at M = 1-8, with early_start
    # fold_lag against the fold without lag: 13 pairs at M = 1-16 (median 1.02, 0.99-1.09) and 2 at
    # M = 32 (o_proj: 0.94 at ahead 4, 0.90 at ahead 2).
    "fold_lag": ((16, 1.02), (None, 0.93)),
    # The shape knobs: a least-squares fit (one factor per value and M range, a free offset per layer
    # and M) on 1300 timings at M <= 32, relative to ahead 2, unroll 4, 4 warps, one m-tile, one
    # split. Deeper pipelines pay once the weights go through the warps' cp.async slots
    # (async_weights), which the model's terms do not see.
    ("ahead", 1): ((8, 1.2), (16, 1.23), (None, 1.27)),
    ("ahead", 3): ((8, 0.95), (16, 0.84), (None, 0.85)),
    ("ahead", 4): ((8, 0.91), (16, 0.71), (None, 0.82)),
    # One fold and one scale row per group instead of two: cheaper than the terms say up to M = 32.
    ("unroll", 8): ((8, 0.8), (16, 0.85), (32, 0.82), (None, 1.0)),
    ("warps", 8): ((8, 0.82), (None, 1.04)),
    ("m_tiles", 2): ((8, 1.0), (None, 0.93)),
    ("split_k", 2): ((8, 0.83), (None, 1.07)),
    ("split_k", 4): ((8, 0.82), (None, 1.0)),
    ("split_k", 6): ((8, 0.73), (None, 1.0)),
    ("split_k", 8): ((8, 0.65), (None, 0.8)),
}
FP8_KNOB_FACTORS: dict = {}     # its kernels take no FP8 activations
