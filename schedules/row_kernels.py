"""The shape of the kernels that take one block per row of activations (W4A8's two activation kernels,
act-order's gather and its gathering RMSNorm), importable without TileLang: the runtime asks it which
rows a kernel takes before anything is built.
"""
from __future__ import annotations

# One block per row: at M = 1 a single SM reads the whole row twice, so the block is as wide as the
# row's layout over the threads allows (TileLang spreads the row evenly: the count must divide K).
# 128 threads took ~5 us of an 18 us down_proj call at M = 1 on the H200 (2026-12-03).
THREAD_CHOICES = (512, 256, 128)
CHUNK = 8      # outputs per thread and step in the gathers: one 16-byte store of 2-byte values


def threads_for(k: int) -> int:
    """The widest block whose threads split a row of K evenly (128 where none does)."""
    return next((t for t in THREAD_CHOICES if k % t == 0), THREAD_CHOICES[-1])


def norm_gather_supports(k: int) -> bool:
    """Whether the gathering RMSNorm (schedules/norm_gather.py) builds for rows of K: whole 16-byte
    stores, and a row that the block's threads split evenly (its squares are laid over all of them)."""
    return k % CHUNK == 0 and k % threads_for(k) == 0
