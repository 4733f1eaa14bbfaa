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
waits for that kernel's writes only after its index loads. Building imports TileLang.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals)
from .arch import Arch
from .epilogue import EARLY_START_HELPERS
from .fp8_activations import row_into_shared
from .row_kernels import CHUNK, threads_for


def own_chunks_into_local(k: int):
    """A T.macro(V, local) that loads this thread's chunks of the vector V [K] into `local`
    [steps * CHUNK] (steps = own_chunk_steps(k)): at step s the CHUNK elements from
    (s * threads + thread) * CHUNK, one 16-byte load of int32 indices or two of 2-byte weights: the
    columns of the output chunks the thread later writes."""
    import tilelang.language as T

    threads = threads_for(k)

    @T.macro
    def load(V, local):
        tx = T.get_thread_binding()
        for step in T.unroll(own_chunk_steps(k)):
            first = (step * threads + tx) * CHUNK
            if first < k:
                for v in T.vectorized(CHUNK):
                    local[step * CHUNK + v] = V[first + v]

    return load


def own_chunk_steps(k: int) -> int:
    """How many chunks of CHUNK columns each thread of a row's block takes (the last may be short of threads)."""
    return -(-k // (CHUNK * threads_for(k)))


def build(k: int, dtype: str, arch: Arch):
    """The TileLang prim_func gather_columns(X [M, K] `dtype`, P [K] int32, Y [M, K] `dtype`), M dynamic,
    for `arch`. P must be a permutation of range(K); an index outside the row reads shared memory out
    of bounds."""
    import tilelang.language as T
    from tilelang.cuda.language.pdl import pdl_sync

    if k % CHUNK:
        raise ValueError(f"K={k} must be a multiple of {CHUNK} (each thread writes {CHUNK} columns a store)")
    m = T.dynamic("m")
    threads = threads_for(k)
    steps = own_chunk_steps(k)
    copy_row = row_into_shared(k)
    load_indices = own_chunks_into_local(k)

    @T.prim_func
    def gather_columns(X: T.Tensor((m, k), dtype), P: T.Tensor((k,), "int32"), Y: T.Tensor((m, k), dtype)):
        with T.Kernel(m, threads=threads, prelude=EARLY_START_HELPERS) as row:
            T.call_extern("handle", "tm_launch_dependents")
            x_s = T.alloc_shared((1, k), dtype)
            index = T.alloc_local((steps * CHUNK,), "int32")
            value = T.alloc_local((CHUNK,), dtype)
            tx = T.get_thread_binding()
            load_indices(P, index)
            if arch.hopper:
                pdl_sync()       # X is the previous kernel's output; P is not written by any kernel
            copy_row(X, row, x_s)
            T.sync_threads()
            for step in T.unroll(steps):
                first = (step * threads + tx) * CHUNK
                if first < k:
                    for v in T.unroll(CHUNK):
                        value[v] = x_s[0, index[step * CHUNK + v]]
                    for v in T.vectorized(CHUNK):
                        Y[row, first + v] = value[v]

    return gather_columns
