"""marlin_mma's cost-model traits (schedules/cost.py applies them)."""
from ..family import FamilyTraits

# lop3 + magic-number subtract: one instruction per weight (one of each per half2 pair); the group
# scale one hmul2 per pair. mma.sync needs warps on all four SM partitions, two deep.
TRAITS = FamilyTraits()

KNOB_FACTORS: dict = {}
FP8_KNOB_FACTORS: dict = {}     # its kernels take no FP8 activations
