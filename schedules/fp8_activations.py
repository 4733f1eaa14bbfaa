"""W4A8's activation kernel: per-token dynamic FP8 e4m3, stored in the k order of the FP8 decode.

One block per row (token): its threads copy the row into shared memory (16-byte loads, the row's only
read of global memory) and reduce the largest magnitude across the block, then write each element,
taken from the shared copy in the FP8 k order, divided by amax / 448 as e4m3 (round to nearest,
saturating), clamped to the finite range, at its position in marlin_mma.layout.fp8_k_order (position p
of every 16 columns holds column FP8_K_ORDER[p]), so that an 8-bit MMA fed with the packed INT4 words
sums matching k. The row's scale goes to S [M, 1] (1 for an all-zero row), the per-token factor of the
output, and the sum of each 128 columns' e4m3 values to KS [M, K / 128], which the GEMM needs because
its weight decode is offset (templates/dequant.cuh.j2). Each block first lets the next kernel launch (griddepcontrol.launch_dependents): a GEMM built
with the pdl knob then starts while this one runs, asks L2 for its first weights (early_start) and
waits for this kernel's writes before it reads them. The row is read from global memory once: read a
second time in the k order, under those early weight reads, the calls measured slower
(docs/performance.md). The math is schedules.quant.quantize_fp8_per_token's; building imports TileLang.

build_rounded is the same row kernel for the buckets where W4A8 runs on the W4A16 kernels: it writes
each element's e4m3 value times the row's scale, in the input's dtype and order.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals)
from .arch import Arch
from .epilogue import EARLY_START_HELPERS
from .marlin_mma.layout import FP8_K_ORDER, TILE_K
from .quant import FP8_E4M3_MAX, FP8_K_TILE
from .row_kernels import threads_for


def _source_column(j):
    """The column stored at position j: j's 16-column block, then FP8_K_ORDER within it, written as
    arithmetic on j (2 (p // 4) + 8 (p % 2) + (p % 4) // 2 for p = j % 16) so that it stays an index
    expression; checked against FP8_K_ORDER at import."""
    p = j % TILE_K
    return j - p + 2 * (p // 4) + 8 * (p % 2) + p % 4 // 2


assert tuple(_source_column(p) for p in range(TILE_K)) == FP8_K_ORDER


def row_into_shared(k: int):
    """A T.macro(X, row, x_s) that copies row `row` of X [M, K] into the shared x_s [1, K] in 16-byte
    chunks, chunk c by thread c % threads (T.copy moves K / threads elements a thread, with 2-byte
    loads where that is not a multiple of 8: 43 a thread at K = 11008). The caller synchronizes."""
    import tilelang.language as T

    threads = threads_for(k)
    chunks = k // 8
    steps = -(-chunks // threads)

    @T.macro
    def copy_row(X, row, x_s):
        tx = T.get_thread_binding()
        for step in T.unroll(steps):
            chunk = step * threads + tx
            if chunk < chunks:
                for v in T.vectorized(8):
                    x_s[0, chunk * 8 + v] = X[row, chunk * 8 + v]

    return copy_row


def _staged_row_scale(k: int):
    """A T.macro(X, row, x_s, scale): lets the next kernel launch, waits for the previous one's writes
    (the kernel itself launches as that one drains: TileLang's pdl_sync), copies row `row` of X into
    the shared x_s (its only global read) and sets scale[0] to its largest magnitude / 448 (1 for a zero
    row)."""
    import tilelang.language as T
    from tilelang.cuda.language.pdl import pdl_sync

    copy_row = row_into_shared(k)

    @T.macro
    def staged_row_scale(X, row, x_s, scale):
        T.call_extern("handle", "tm_launch_dependents")
        pdl_sync()        # launched as the previous kernel drains; X is its output
        x = T.alloc_fragment((1, k), "float32")
        amax = T.alloc_fragment((1,), "float32")
        copy_row(X, row, x_s)
        T.sync_threads()
        T.copy(x_s, x)
        T.reduce_absmax(x, amax, dim=1)
        scale[0] = T.if_then_else(amax[0] > 0, amax[0] / FP8_E4M3_MAX, 1.0)

    return staged_row_scale


def _check_hopper(arch: Arch) -> None:
    if not arch.hopper:
        raise ValueError(f"W4A8's activation kernels serve FP8 wgmma (Hopper, sm_90a); {arch.name} has none")


def _e4m3(value):
    """value (float32, already divided by the row's scale) as e4m3: clamped to the finite range, then
    rounded to nearest (saturating)."""
    import tilelang.language as T

    return T.cast(T.clamp(value, -FP8_E4M3_MAX, FP8_E4M3_MAX), "float8_e4m3fn")


def build(k: int, dtype: str, arch: Arch):
    """The TileLang prim_func quantize(X [M, K] `dtype`, Q [M, K] float8_e4m3fn, S [M, 1] float32,
    KS [M, K / 128] float32), M dynamic, for `arch` (Hopper: W4A8 runs on FP8 wgmma). KS holds the
    sum of each 128 columns' e4m3 values (before the token scale): the W4A8 GEMM's decode leaves its
    sums short by 8 times it per k-tile (templates/dequant.cuh.j2, tm_decode_e4m3_a_u4)."""
    import tilelang.language as T

    _check_hopper(arch)

    if k % FP8_K_TILE:
        raise ValueError(f"K={k} must be a multiple of {FP8_K_TILE} (the W4A8 GEMM's k-tile, one sum each)")
    m = T.dynamic("m")
    tiles = k // FP8_K_TILE
    staged_row_scale = _staged_row_scale(k)

    @T.prim_func
    def quantize_fp8(X: T.Tensor((m, k), dtype), Q: T.Tensor((m, k), "float8_e4m3fn"),
                     S: T.Tensor((m, 1), "float32"), KS: T.Tensor((m, tiles), "float32")):
        with T.Kernel(m, threads=threads_for(k), prelude=EARLY_START_HELPERS) as row:
            x_s = T.alloc_shared((1, k), dtype)
            scale = T.alloc_local((1,), "float32")
            q = T.alloc_fragment((tiles, FP8_K_TILE), "float32")
            sums = T.alloc_fragment((tiles,), "float32")
            staged_row_scale(X, row, x_s, scale)
            for i, j in T.Parallel(1, k):
                Q[row, j] = _e4m3(T.cast(x_s[i, _source_column(j)], "float32") / scale[0])
            # (the FP8 k order permutes within 16 columns: a k-tile's sum is the same in either order)
            for t, c in T.Parallel(tiles, FP8_K_TILE):
                q[t, c] = T.cast(_e4m3(T.cast(x_s[0, t * FP8_K_TILE + c], "float32") / scale[0]), "float32")
            T.reduce_sum(q, sums, dim=1)
            for t in T.Parallel(tiles):
                KS[row, t] = sums[t]
            S[row, 0] = scale[0]

    return quantize_fp8


def build_rounded(k: int, dtype: str, arch: Arch):
    """The TileLang prim_func round_fp8(X [M, K] `dtype`, Y [M, K] `dtype`), M dynamic, for `arch`
    (Hopper): Y = the FP8 e4m3 value of each element times its row's scale, in X's order and dtype, for
    W4A8 calls that run on the W4A16 kernels (runtime.dispatch.Dispatch.serving_problem). e4m3
    values are exact in float16 and bfloat16; the product with the scale is rounded once, to `dtype`."""
    import tilelang.language as T

    _check_hopper(arch)

    m = T.dynamic("m")
    staged_row_scale = _staged_row_scale(k)

    @T.prim_func
    def round_fp8(X: T.Tensor((m, k), dtype), Y: T.Tensor((m, k), dtype)):
        with T.Kernel(m, threads=threads_for(k), prelude=EARLY_START_HELPERS) as row:
            x_s = T.alloc_shared((1, k), dtype)
            scale = T.alloc_local((1,), "float32")
            staged_row_scale(X, row, x_s, scale)
            for i, j in T.Parallel(1, k):
                q = _e4m3(T.cast(x_s[i, j], "float32") / scale[0])
                Y[row, j] = T.cast(T.cast(q, "float32") * scale[0], dtype)

    return round_fp8
