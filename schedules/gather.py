"""Act-order's column gather: Y[m, j] = X[m, P[j]], the activations in the order of the weight rows,
which act-order checkpoints store sorted by group (runtime/checkpoint).

One block per row (token), as W4A8's activation kernel (schedules/fp8_activations.py). Each thread
first loads the indices of all its outputs (8 int32 per 16-byte load), which no earlier kernel writes;
then the block copies the row into shared memory in 16-byte chunks (the row's only read of global
memory), so that the indices' and the row's round trips to memory overlap instead of following each
other; then each thread takes 8 consecutive outputs at a time from the shared row, one 16-byte store
each. Each block first lets the next kernel launch (griddepcontrol.launch_dependents): a GEMM built with
the pdl knob then starts while this one runs and waits for its writes. On Hopper the kernel is itself
launched as the previous kernel drains (TileLang's pdl_sync: programmatic stream serialization) and
waits for that kernel's writes only after its index loads.

At small M (up to SPLIT_ROWS rows) one block per row leaves the whole gather to a few SMs, each
fetching a row and all of its indices; the split kernel (build_split) gives each row splits_for(K)
blocks, each loading the whole row but the indices of its own part only. Building imports TileLang.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals.) TileLang is imported by the builds only: the runtime reads splits_for and
# SPLIT_ROWS to choose between the two kernels.
from .arch import Arch

CHUNK = 8      # outputs per thread and step: one 16-byte store of 2-byte values
# The split kernel's blocks take about SPLIT_OUTPUTS columns of a row each. The op runs it up to
# SPLIT_ROWS rows; above that the row blocks fill more SMs and the split's repeated reads of each row
# (once per block) would cost more than they save.
SPLIT_OUTPUTS = 2048
SPLIT_ROWS = 16


def splits_for(k: int) -> int:
    """Blocks per row of the split kernel: the largest power of two at most K / SPLIT_OUTPUTS that
    splits the row into whole 8-column chunks (1: no split)."""
    splits = 1
    while 2 * splits <= k // SPLIT_OUTPUTS and (k // CHUNK) % (2 * splits) == 0:
        splits *= 2
    return splits


def build(k: int, dtype: str, arch: Arch):
    """The TileLang prim_func gather_columns(X [M, K] `dtype`, P [K] int32, Y [M, K] `dtype`), M dynamic,
    for `arch`, one block per row. P must be a permutation of range(K); an index outside the row reads
    shared memory out of bounds."""
    return _build(k, dtype, arch, 1)


def build_split(k: int, dtype: str, arch: Arch):
    """build's kernel with splits_for(K) blocks per row, each writing its part of the row (small M)."""
    return _build(k, dtype, arch, splits_for(k))


def _build(k: int, dtype: str, arch: Arch, splits: int):
    import tilelang.language as T
    from tilelang.cuda.language.pdl import pdl_sync

    from .epilogue import EARLY_START_HELPERS
    from .fp8_activations import row_into_shared, threads_for

    if k % CHUNK:
        raise ValueError(f"K={k} must be a multiple of {CHUNK} (each thread writes {CHUNK} columns a store)")
    m = T.dynamic("m")
    threads = threads_for(k)
    part_k = k // splits         # the columns a block writes
    steps = -(-part_k // (CHUNK * threads))
    copy_row = row_into_shared(k)

    @T.prim_func
    def gather_columns(X: T.Tensor((m, k), dtype), P: T.Tensor((k,), "int32"), Y: T.Tensor((m, k), dtype)):
        with T.Kernel(m, splits, threads=threads, prelude=EARLY_START_HELPERS) as (row, part):
            T.call_extern("handle", "tm_launch_dependents")
            x_s = T.alloc_shared((1, k), dtype)
            index = T.alloc_local((steps * CHUNK,), "int32")
            value = T.alloc_local((CHUNK,), dtype)
            tx = T.get_thread_binding()
            for step in T.unroll(steps):
                first = (step * threads + tx) * CHUNK
                if first < part_k:
                    for v in T.vectorized(CHUNK):
                        index[step * CHUNK + v] = P[part * part_k + first + v]
            if arch.hopper:
                pdl_sync()       # X is the previous kernel's output; P is not written by any kernel
            copy_row(X, row, x_s)
            T.sync_threads()
            for step in T.unroll(steps):
                first = (step * threads + tx) * CHUNK
                if first < part_k:
                    for v in T.unroll(CHUNK):
                        value[v] = x_s[0, index[step * CHUNK + v]]
                    for v in T.vectorized(CHUNK):
                        Y[row, part * part_k + first + v] = value[v]

    return gather_columns
