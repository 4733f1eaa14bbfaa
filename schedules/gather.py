"""Act-order's column gather: Y[m, j] = X[m, perm[j]], the activations in the order of the weight rows
that act-order checkpoints store sorted by group (runtime/checkpoint).

torch's index_select along the last dimension took about 5x the time its bytes need at large M on the
H200 (+425 us at M = 4096 over four Llama-2-7B layers, where moving them takes ~87 us), and at small
M it broke the GEMMs' programmatic launch overlap. This kernel reads the permutation and writes Y
coalesced (each row read once, into shared memory, where the gathered reads happen), and lets the next kernel launch at once
(griddepcontrol.launch_dependents): the GEMMs built with the pdl knob then launch while it runs and
wait for its writes. It is itself launched programmatically (pdl_sync), waiting for the previous
kernel's writes before it reads X. Building imports TileLang.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals)
from .epilogue import EARLY_START_HELPERS

THREADS = 256
STAGED_BYTES = 96 * 1024     # shared memory for a block's rows: up to 4 rows, as many as fit


def rows_per_block(k: int, dtype: str) -> int:
    """Rows a block gathers (each thread's permutation entries are then reused from L1 by the others)."""
    row_bytes = k * (4 if dtype == "float32" else 2)
    return next((r for r in (4, 2) if r * row_bytes <= STAGED_BYTES), 1)


def build(k: int, dtype: str = "float16"):
    """The TileLang prim_func gather(X [M, K] `dtype`, P [K] int64, Y [M, K] `dtype`), M dynamic: a
    block copies rows_per_block rows into shared memory, then writes Y[row, j] = row[P[j]] in order."""
    import tilelang.language as T
    from tilelang.cuda.language.pdl import pdl_sync

    m = T.dynamic("m")
    rows = rows_per_block(k, dtype)

    @T.prim_func
    def gather_columns(X: T.Tensor((m, k), dtype), P: T.Tensor((k,), "int64"), Y: T.Tensor((m, k), dtype)):
        with T.Kernel(T.ceildiv(m, rows), threads=THREADS, prelude=EARLY_START_HELPERS) as block:
            x = T.alloc_shared((rows, k), dtype)
            T.call_extern("handle", "tm_launch_dependents")
            pdl_sync()
            for r, j in T.Parallel(rows, k):
                if block * rows + r < m:
                    x[r, j] = X[block * rows + r, j]
            for r, j in T.Parallel(rows, k):
                if block * rows + r < m:
                    Y[block * rows + r, j] = x[r, P[j]]

    return gather_columns
