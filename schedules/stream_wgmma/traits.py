"""stream_wgmma's cost-model traits and measured knob factors (schedules/cost.py applies them).

The factors are medians of same-run pairs (the kernel with and without the knob, other knobs equal)
over the measured time ratio divided by the model's ratio, on the H200 (2026-11-29 .. 2026-12-02);
docs/performance.md has each technique's measurements.
"""
from ..family import FamilyTraits

# TMA fills the stages (no warp waits for its own loads) and a stage is decoded under the previous
# stage's wgmmas. Fitted on 1831 H200 timings (52 layer-buckets, M = 1-4096, all searched families):
# its pull per SM is 3x marlin_mma's, its decode two ALU instructions per weight (under the wgmmas),
# its k-tiles cost nothing beyond their loads, decode and wgmmas (no block barrier waits for them),
# and its pipeline fill waits for two stages' loads, not all (the time over K of the M = 16 winners is
# F + k-tiles x t, F = 2.6-3.9 us): over the table's 1258 timings the model's first pick is 1.12x of
# the measured best.
TRAITS = FamilyTraits(wgmma=True, decode_ops=2.0, scale_ops=0.5, warps_to_fill_sm=8, mma_efficiency=1.0,
                      pull_scale=3.0, decode_under_mma=True, k_tile_scale=0.0, fill_stages=2)

KNOB_FACTORS = {
    # Release barriers alone: 1.15-1.45x slower below M = 256 (warp 0 waits for the release before it
    # refills). The producer warp, which needs them, takes that back and more: 0.93-0.98x of the plain
    # TMA pipeline from M = 64 on, a toss-up at M <= 16 (0.71-1.21x); the rows multiply to about that.
    "release_barriers": ((None, 1.25),),
    "producer_warp": ((16, 0.8), (None, 0.7)),
    # 128-deep k-tiles pay where one chain per SM is the limit (M = 32-256).
    ("block_k", 128): ((16, 0.86), (64, 0.88), (128, 0.78), (256, 0.89), (None, 0.9)),
    "setmaxnreg": ((64, 1.4), (None, 1.0)),    # the producer warpgroup's register hand-over
    "cluster_reduce": ((None, 0.96),),          # beats the workspace by more than its bytes say
    # Two warpgroups (or two 16-column groups per warp) side by side cost more than the terms say up
    # to M = 256 (medians 1.04-1.15x, 1.09-1.27x), where one short chain per block wins; above, where
    # the tensor pipe is the limit, the wider block is level or better. These and the rows below are
    # residual medians per M range (8-166 pairs each) of every pair differing in one knob.
    ("warpgroups", 2): ((16, 1.1), (64, 1.22), (256, 1.3), (None, 1.4)),
    ("groups", 2): ((8, 1.03), (16, 1.11), (64, 1.42), (256, 1.28), (None, 1.08)),
    # scale_on_acc over the same kernel without it: 8 pairs at M = 16-64, 0.82-1.31, median 1.05 (it
    # pays at 6-8 stages, loses at 4); its fold term already makes block_m 16 0.93x, 64 1.13x.
    "scale_on_acc": ((None, 1.05),),
    "fold_lag": ((None, 0.98),),                # over scale_on_acc alone: 25 pairs at M = 16
    ("stages", 6): ((None, 0.93),),
    ("stages", 8): ((None, 0.88),),
    # Where both stream families were measured at M = 4-8, stream_wgmma's best took 1.23-1.69x
    # stream_mma's; the fill of two stages alone would have ranked it first at qkv / gate_up 1.
    ("block_m", 8): ((8, 1.15), (None, 1.0)),
    ("block_m", 128): ((64, 1.0), (256, 0.91), (None, 0.85)),
    ("block_m", 256): ((64, 1.0), (256, 0.82), (None, 0.74)),
    # 176-row tiles (fewer waves where 22016 columns leave the last one short): 0.69-0.94x of the
    # estimate at M = 512-1024; unmeasured beyond.
    ("block_m", 176): ((256, 1.0), (1024, 0.77), (None, 1.0)),
    "staged_store": ((64, 0.985), (256, 0.965), (None, 0.975)),   # 23 pairs, every winner's variant
    "pdl": ((64, 0.99), (None, 0.996)),                          # 18 and 49 pairs
    "early_start": ((64, 0.976), (None, 0.99)),                  # 31 and 61 pairs
    # panel_m: 4 pairs per M; at M <= 1024 a block-256 grid has at most 4 M tiles, so panels only add
    # instructions.
    ("panel_m", 2): ((1024, 1.007), (2048, 1.0), (None, 0.95)),
    ("panel_m", 4): ((1024, 1.005), (2048, 1.0), (None, 0.952)),
    "stage_unroll": ((64, 0.95), (256, 0.985), (None, 1.0)),      # every winner with and without it
    ("ring", 8): ((32, 1.04), (64, 1.01), (256, 0.98), (None, 1.0)),
    # split_wait over the same kernels with the counter: 8 pairs at M = 16-64, 0.87-0.99, median 0.92.
    # Above M = 64 no winner splits through the workspace, so no pair: level.
    "split_wait": ((64, 0.92), (None, 1.0)),
}

# With FP8 activations (W4A8) two warpgroups cost about what the terms say above M = 256 and gain
# above M = 1024, where W4A16's medians above say they lose: 128 x 128 tiles against the 128 x 64
# winners of Llama-2-7B's four layers (H200, 2026-12-04) took 1.00-1.07x at M = 1024 and 0.87-1.00x
# at 4096, where the row above estimated 1.32-1.38x and 1.18-1.51x; at M = 128-256 it held
# (1.03-1.83x measured, 1.24-1.78x estimated), so those bounds keep W4A16's factors.
FP8_KNOB_FACTORS = {
    ("warpgroups", 2): ((16, 1.1), (64, 1.22), (256, 1.3), (1024, 1.08), (None, 0.93)),
    # offset_decode over the lookup decode, same kernels without the producer warp, Llama-2-7B's layers
    # (H100, 2026-12-06): 8 pairs per M of 128 x 64 and 128 x 128 tiles, then 24 / 32 / 32 pairs of
    # 128 x 128 tiles (block and release barriers, setmaxnreg; 4 and 6 stages) at M = 256 / 1024 / 4096,
    # medians 0.911 / 0.909 / 0.926 (0.85-1.05)
    "offset_decode": ((256, 0.9), (1024, 0.92), (None, 0.93)),
}
