"""Act-order's column gather: Y[m, j] = X[m, perm[j]], the activations in the order of the weight rows
that act-order checkpoints store sorted by group (runtime/checkpoint).

torch's index_select along the last dimension took about 5x the time its bytes need at large M on the
H200 (+425 us at M = 4096 over four Llama-2-7B layers, where moving them takes ~87 us), and at small
M it broke the GEMMs' programmatic launch overlap. This kernel reads the permutation and writes Y
coalesced (the gathered reads of X hit L1 / L2 within a row), and lets the next kernel launch at once
(griddepcontrol.launch_dependents): the GEMMs built with the pdl knob then launch while it runs and
wait for its writes. It is itself launched programmatically (pdl_sync), waiting for the previous
kernel's writes before it reads X. Building imports TileLang.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals)
from .epilogue import EARLY_START_HELPERS

THREADS = 256
COLUMNS = 2048     # columns per block: eight per thread, so that M = 1 still spreads over K / 2048 SMs


def build(k: int, dtype: str = "float16"):
    """The TileLang prim_func gather(X [M, K] `dtype`, P [K] int64, Y [M, K] `dtype`), M dynamic."""
    import tilelang.language as T
    from tilelang.cuda.language.pdl import pdl_sync

    m = T.dynamic("m")
    per_thread = COLUMNS // THREADS

    @T.prim_func
    def gather_columns(X: T.Tensor((m, k), dtype), P: T.Tensor((k,), "int64"), Y: T.Tensor((m, k), dtype)):
        # (rows along the grid's x, which allows 2^31 - 1 blocks; y allows 65535)
        with T.Kernel(m, T.ceildiv(k, COLUMNS), threads=THREADS, prelude=EARLY_START_HELPERS) as (row, bx):
            T.call_extern("handle", "tm_launch_dependents")
            pdl_sync()
            tx = T.get_thread_binding()
            for i in T.unroll(per_thread):
                j = bx * COLUMNS + i * THREADS + tx
                if j < k:
                    Y[row, j] = X[row, P[j]]

    return gather_columns
