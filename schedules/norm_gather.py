"""An RMSNorm that writes its output in act-order's gathered column order:
Y[m, j] = W[j] * (X[m, P[j]] * rsqrt(mean(X[m, :]^2) + eps)), where W is the norm's weight already
in that order (W[j] = w[P[j]]).

Where a norm's output feeds only act-order layers that share one permutation (a Llama decoder layer's
input_layernorm before q/k/v, post_attention_layernorm before gate/up), the norm can emit the columns in
the layers' order itself, and no gather runs (runtime/checkpoint/norm_fold.py): the row is read once
either way, and the mean of its squares does not depend on the order of its columns.

The rounding follows transformers' RMSNorm: the row in fp32, its mean square, the normalized value
rounded to X's dtype, then multiplied by the weight in that dtype (the product of two 16-bit floats is
exact in fp32, so one rounding of it gives the 16-bit product). The mean is a block reduction, so its
last bits may differ from torch's order of summation.

The block's work is the gather kernel's (schedules/gather.py), one block per row, and a sum: indices
and weights first (no earlier kernel writes them), then the wait for the previous kernel, the row into
shared memory in 16-byte chunks, the block's sum of squares, and 8 outputs a thread per 16-byte store.
Each block first lets the next kernel launch (griddepcontrol.launch_dependents). Building imports
TileLang.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals)
from .arch import Arch
from .epilogue import EARLY_START_HELPERS
from .fp8_activations import row_into_shared
from .gather import own_chunk_steps, own_chunks_into_local
from .row_kernels import CHUNK, norm_gather_supports as supports, threads_for


def build(k: int, dtype: str, arch: Arch):
    """The TileLang prim_func rms_norm_gather(X [M, K] `dtype`, W [K] `dtype`, P [K] int32, E [1] float32,
    Y [M, K] `dtype`), M dynamic, for `arch`; E holds eps. P must be a permutation of range(K)."""
    import tilelang.language as T
    from tilelang.cuda.language.pdl import pdl_sync

    if not supports(k):
        raise ValueError(f"K={k} must be a multiple of {threads_for(k)}: each thread writes {CHUNK} columns a store, "
                         f"and the block's {threads_for(k)} threads split the row's squares evenly")
    m = T.dynamic("m")
    threads = threads_for(k)
    steps = own_chunk_steps(k)
    copy_row = row_into_shared(k)
    load_own = own_chunks_into_local(k)

    @T.prim_func
    def rms_norm_gather(X: T.Tensor((m, k), dtype), W: T.Tensor((k,), dtype), P: T.Tensor((k,), "int32"),
                        E: T.Tensor((1,), "float32"), Y: T.Tensor((m, k), dtype)):
        with T.Kernel(m, threads=threads, prelude=EARLY_START_HELPERS) as row:
            T.call_extern("handle", "tm_launch_dependents")
            x_s = T.alloc_shared((1, k), dtype)
            squares = T.alloc_fragment((1, k), "float32")
            total = T.alloc_fragment((1,), "float32")
            index = T.alloc_local((steps * CHUNK,), "int32")
            weight = T.alloc_local((steps * CHUNK,), dtype)
            value = T.alloc_local((CHUNK,), dtype)
            tx = T.get_thread_binding()
            load_own(P, index)
            load_own(W, weight)
            if arch.hopper:
                pdl_sync()       # X is the previous kernel's output; W, P and E are no kernel's
            copy_row(X, row, x_s)
            T.sync_threads()
            for i, j in T.Parallel(1, k):
                squares[i, j] = T.cast(x_s[i, j], "float32") * T.cast(x_s[i, j], "float32")
            T.reduce_sum(squares, total, dim=1)
            scale = T.rsqrt(total[0] / k + E[0])
            for step in T.unroll(steps):
                first = (step * threads + tx) * CHUNK
                if first < k:
                    for v in T.unroll(CHUNK):
                        normed = T.cast(T.cast(x_s[0, index[step * CHUNK + v]], "float32") * scale, dtype)
                        value[v] = T.cast(T.cast(weight[step * CHUNK + v], "float32") * T.cast(normed, "float32"),
                                          dtype)
                    for v in T.vectorized(CHUNK):
                        Y[row, first + v] = value[v]

    return rms_norm_gather
