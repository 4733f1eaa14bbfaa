"""W4A8's activation kernel: per-token dynamic FP8 e4m3, stored in the k order of the FP8 decode.

One block per row (token): its threads copy the row into shared memory (16-byte loads, the row's only
read of global memory) and reduce the largest magnitude across the block, then write each element,
taken from the shared copy in the FP8 k order, divided by amax / 448 as e4m3 (round to nearest,
saturating), clamped to the finite range, at its position in marlin_mma.layout.fp8_k_order (position p
of every 16 columns holds column FP8_K_ORDER[p]), so that an 8-bit MMA fed with the packed INT4 words
sums matching k. The row's scale goes to S [M, 1] (1 for an all-zero row), the per-token factor of the
output; build_with_sums also writes the sum of each 128 columns' e4m3 values to KS [M, K / 128], which
GEMMs with offset_decode need (their weight decode is offset: templates/dequant.cuh.j2). Each block
first lets the next kernel launch (griddepcontrol.launch_dependents): a GEMM built with the pdl knob
then starts while this one runs, asks L2 for its first weights (early_start) and waits for this
kernel's writes before it reads them. The row is read from global memory once: read a
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


# The 16 lanes of a half-warp add their values (all 32 lanes call it).
SUM16 = r"""
__device__ __forceinline__ float tm_sum16(float v) {
  for (int lanes = 8; lanes > 0; lanes >>= 1) v += __shfl_xor_sync(0xffffffffu, v, lanes);
  return v;
}
"""


def _k_tile_sums(k: int):
    """A T.macro(x_s, scale, KS, row): KS[row, t] = the sum of k-tile t's e4m3 values (x_s / scale, in
    any order: the FP8 k order permutes within 16 columns). Each thread sums the 8 values of a 16-byte
    chunk, chunk c by thread c % threads as row_into_shared reads them, so that a k-tile's 16 chunks
    are 16 neighbouring lanes, which add theirs by shuffles; the first writes. (TileLang's reduce over
    a [k-tiles, 128] fragment left whole k-tiles to single threads: 26-44 us a call more at K = 11008,
    M = 256-4096, H100.)"""
    import tilelang.language as T

    threads = threads_for(k)
    chunks = k // 8
    steps = -(-chunks // threads)
    per_tile = FP8_K_TILE // 8

    @T.macro
    def k_tile_sums(x_s, scale, KS, row):
        tx = T.get_thread_binding()
        part = T.alloc_local((1,), "float32")
        for step in T.unroll(steps):
            chunk = step * threads + tx
            part[0] = T.float32(0)
            for v in T.unroll(8):
                # (lanes past the row add zeros: every lane takes part in the shuffles)
                part[0] += T.if_then_else(chunk < chunks, T.cast(_e4m3(
                    T.cast(x_s[0, T.min(chunk, chunks - 1) * 8 + v], "float32") / scale[0]), "float32"), 0.0)
            part[0] = T.call_extern("float32", "tm_sum16", part[0])
            if chunk < chunks:
                if tx % per_tile == 0:
                    KS[row, chunk // per_tile] = part[0]

    return k_tile_sums


def _check_hopper(arch: Arch) -> None:
    if not arch.hopper:
        raise ValueError(f"W4A8's activation kernels serve FP8 wgmma (Hopper, sm_90a); {arch.name} has none")


def _e4m3(value):
    """value (float32, already divided by the row's scale) as e4m3: clamped to the finite range, then
    rounded to nearest (saturating)."""
    import tilelang.language as T

    return T.cast(T.clamp(value, -FP8_E4M3_MAX, FP8_E4M3_MAX), "float8_e4m3fn")


def build(k: int, dtype: str, arch: Arch):
    """The TileLang prim_func quantize(X [M, K] `dtype`, Q [M, K] float8_e4m3fn, S [M, 1] float32), M dynamic,
    for `arch` (Hopper: W4A8 runs on FP8 wgmma)."""
    return _build(k, dtype, arch, sums=False)


def build_with_sums(k: int, dtype: str, arch: Arch):
    """build's prim_func with a fourth tensor, KS [M, K / 128] float32: the sum of each 128 columns'
    e4m3 values (before the token scale), which GEMMs with offset_decode add back
    (templates/dequant.cuh.j2, tm_decode_e4m3_offset_a_u4)."""
    if k % FP8_K_TILE:
        raise ValueError(f"K={k} must be a multiple of {FP8_K_TILE} (the W4A8 GEMM's k-tile, one sum each)")
    return _build(k, dtype, arch, sums=True)


def _build(k: int, dtype: str, arch: Arch, sums: bool):
    import tilelang.language as T

    _check_hopper(arch)

    if k % TILE_K:
        raise ValueError(f"K={k} must be a multiple of {TILE_K} (the FP8 k order permutes within 16 columns)")
    m = T.dynamic("m")
    staged_row_scale = _staged_row_scale(k)
    k_tile_sums = _k_tile_sums(k) if sums else None

    @T.macro
    def quantize_row(X, Q, S, KS, row):
        x_s = T.alloc_shared((1, k), dtype)
        scale = T.alloc_local((1,), "float32")
        staged_row_scale(X, row, x_s, scale)
        for i, j in T.Parallel(1, k):
            Q[row, j] = _e4m3(T.cast(x_s[i, _source_column(j)], "float32") / scale[0])
        if sums:
            k_tile_sums(x_s, scale, KS, row)
        S[row, 0] = scale[0]

    if sums:
        @T.prim_func
        def quantize_fp8(X: T.Tensor((m, k), dtype), Q: T.Tensor((m, k), "float8_e4m3fn"),
                         S: T.Tensor((m, 1), "float32"), KS: T.Tensor((m, k // FP8_K_TILE), "float32")):
            with T.Kernel(m, threads=threads_for(k), prelude=EARLY_START_HELPERS + SUM16) as row:
                quantize_row(X, Q, S, KS, row)
    else:
        @T.prim_func
        def quantize_fp8(X: T.Tensor((m, k), dtype), Q: T.Tensor((m, k), "float8_e4m3fn"),
                         S: T.Tensor((m, 1), "float32")):
            with T.Kernel(m, threads=threads_for(k), prelude=EARLY_START_HELPERS) as row:
                quantize_row(X, Q, S, None, row)

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
