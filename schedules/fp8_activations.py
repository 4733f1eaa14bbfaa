"""W4A8's activation kernel: per-token dynamic FP8 e4m3, stored in the k order of the FP8 decode.

One block per row (token): its threads copy the row into shared memory (16-byte loads, the row's only
read of global memory) and reduce the largest magnitude across the block; then each thread takes 16
columns (or 8) of the shared copy, divides them by the row's scale (the smallest power of two s with
448 s >= amax: schedules.quant.fp8_token_scales), converts them to e4m3 (round to nearest, saturating
to the finite range) and stores the bytes at once in the order of marlin_mma.layout.fp8_k_order
(position p of every 16 columns holds column FP8_K_ORDER[p]), so that an 8-bit MMA fed with the
packed INT4 words sums matching k. The row's scale goes to S [M, 1] (1 for an all-zero row), the
per-token factor of the output; build_with_sums also writes the sum of each 128 columns' e4m3 values
to KS [M, K / 128], which GEMMs with offset_decode need (their weight decode is offset:
templates/dequant.cuh.j2). Each block first lets the next kernel launch
(griddepcontrol.launch_dependents): a GEMM built with the pdl knob then starts while this one runs,
asks L2 for its first weights (early_start) and waits for this kernel's writes before it reads them.
The row is read from global memory once: read a second time in the k order, under those early weight
reads, the calls measured slower (docs/performance.md). The math is
schedules.quant.quantize_fp8_per_token's; building imports TileLang.
"""
# (no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations, which name
# build()'s locals)
from .arch import Arch
from .epilogue import EARLY_START_HELPERS
from .marlin_mma.layout import FP8_K_ORDER, TILE_K
from .quant import FP8_K_TILE
from .row_kernels import threads_for


# E4M3_COLUMNS stores byte p of every 16 columns from column 2 (p // 4) + 8 (p % 2) + (p % 4) // 2
assert tuple(2 * (p // 4) + 8 * (p % 2) + p % 4 // 2 for p in range(TILE_K)) == FP8_K_ORDER


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
    the shared x_s (its only global read) and sets scale[0] to its token scale (TOKEN_SCALE; 1 for a
    zero row)."""
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
        scale[0] = T.if_then_else(amax[0] > 0, T.call_extern("float32", "tm_token_scale", amax[0]), 1.0)

    return staged_row_scale


# The token scale of a row whose largest magnitude is amax > 0, as schedules.quant.fp8_token_scales:
# amax = f 2^e with f in [0.5, 1) takes 2^(e - 9) while f <= 0.875, else 2^(e - 8).
TOKEN_SCALE = r"""
__device__ __forceinline__ float tm_token_scale(float amax) {
  int e;
  const float f = frexpf(amax, &e);
  return ldexpf(1.0f, f <= 0.875f ? e - 9 : e - 8);
}
"""

# A thread's columns of the staged row at once: each divided by the row's scale (IEEE division, exact
# by a power of two, also where the scale is subnormal), converted to e4m3 two at a time (round to
# nearest, saturating to +-448) and stored
# in the FP8 k order, in which byte 4w + j of every 16 columns holds column 2w + 8 (j % 2) + j / 2
# (FP8_K_ORDER): words w of a 16-column group read columns 2w, 2w + 1, 2w + 8 and 2w + 9. A thread
# takes a whole group (kWords 4: columns 0-7 and 8-15, one 16-byte store) or half of one (kWords 2,
# `cols` 4h columns in: columns 0-3 and 8-11 from there, one 8-byte store at byte 8h). It returns the
# sum of its e4m3 values, exact in fp32 (multiples of 2^-9 below 2^13), which the plain kernel leaves
# unused; the lanes of a k-tile then add theirs (tm_sum_lanes). The 16-bit values are converted from
# their bits: the prelude precedes every header.
E4M3_COLUMNS = r"""
__device__ __forceinline__ unsigned tm_e4m3x2(float low, float high) {
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(high), "f"(low));
  return pair;
}

__device__ __forceinline__ float tm_e4m3x2_sum(unsigned pair) {
  float low, high;
  asm("{\n .reg .b32 halves;\n .reg .b16 l, h;\n cvt.rn.f16x2.e4m3x2 halves, %2;\n mov.b32 {l, h}, halves;\n"
      " cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
      : "=f"(low), "=f"(high) : "h"(static_cast<unsigned short>(pair)));
  return low + high;
}

template <bool kBfloat16>
__device__ __forceinline__ float tm_16bit_to_float(unsigned short bits) {
  if (kBfloat16) return __uint_as_float(static_cast<unsigned>(bits) << 16);
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
  return value;
}

template <int kWords> struct tm_words { using type = uint4; };    // a thread's e4m3 bytes, one store
template <> struct tm_words<2> { using type = uint2; };

template <bool kBfloat16, int kWords>
__device__ __forceinline__ float tm_e4m3_words(const void* cols, void* out, float scale) {
  using Vec = typename tm_words<kWords>::type;
  const Vec raw[2] = {static_cast<const Vec*>(cols)[0], static_cast<const Vec*>(cols)[8 / (2 * kWords)]};
  const unsigned short* x = reinterpret_cast<const unsigned short*>(raw);   // columns 0 .. 2kWords - 1, 8 ..
  float v[4 * kWords];
  #pragma unroll
  for (int c = 0; c < 4 * kWords; ++c) v[c] = __fdiv_rn(tm_16bit_to_float<kBfloat16>(x[c]), scale);
  unsigned word[kWords];
  float sum = 0.0f;
  #pragma unroll
  for (int w = 0; w < kWords; ++w) {
    const unsigned low = tm_e4m3x2(v[2 * w], v[2 * kWords + 2 * w]);
    const unsigned high = tm_e4m3x2(v[2 * w + 1], v[2 * kWords + 2 * w + 1]);
    word[w] = low | high << 16;
    sum += tm_e4m3x2_sum(low) + tm_e4m3x2_sum(high);
  }
  *static_cast<Vec*>(out) = *reinterpret_cast<const Vec*>(word);
  return sum;
}

__device__ __forceinline__ float tm_sum_lanes(float v, int lanes) {     // all 32 lanes call it
  for (lanes >>= 1; lanes > 0; lanes >>= 1) v += __shfl_xor_sync(0xffffffffu, v, lanes);
  return v;
}
"""


def quantize_unit(k: int) -> int:
    """Columns a thread quantizes at a time: a whole 16-column group of the FP8 k order, or half of one
    where the groups are fewer than the block's threads (K = 4096: 256 groups, 512 threads)."""
    return TILE_K if k // TILE_K >= threads_for(k) else TILE_K // 2


def _quantize_columns(k: int, dtype: str, sums: bool):
    """A T.macro(x_s, scale, Q, KS, row) that writes row `row` of Q: the staged row x_s divided by
    scale[0], as e4m3 in the FP8 k order, quantize_unit(k) columns a thread and store (E4M3_COLUMNS), unit
    u by thread u % threads; with `sums` also KS[row, t], the sum of k-tile t's e4m3 values: its units
    are neighbouring lanes, which add theirs by shuffles (lanes past the row add zeros), and the first
    writes. (Column by column, with byte stores and the sums in a second pass, the kernel with sums
    took 1.4-2.2x the plain one's time: H100, 2026-12-06, docs/performance.md.)"""
    import tilelang.language as T

    threads = threads_for(k)
    unit = quantize_unit(k)
    units = k // unit
    steps = -(-units // threads)
    per_tile = FP8_K_TILE // unit
    convert = f"tm_e4m3_words<{str(dtype == 'bfloat16').lower()}, {unit // 4}>"

    def source(u):      # the unit's first column: a group's, or 4 columns in for its second half
        return u // 2 * TILE_K + u % 2 * 4 if unit < TILE_K else u * TILE_K

    @T.macro
    def quantize_columns(x_s, scale, Q, KS, row):
        tx = T.get_thread_binding()
        part = T.alloc_local((1,), "float32")
        for step in T.unroll(steps):
            u = step * threads + tx
            if sums:
                part[0] = T.float32(0)
                if u < units:
                    part[0] = T.call_extern("float32", convert, T.address_of(x_s[0, source(u)]),
                                            T.address_of(Q[row, u * unit]), scale[0])
                part[0] = T.call_extern("float32", "tm_sum_lanes", part[0], per_tile)
                if u < units:
                    if tx % per_tile == 0:
                        KS[row, u // per_tile] = part[0]
            elif u < units:
                T.call_extern("handle", convert, T.address_of(x_s[0, source(u)]), T.address_of(Q[row, u * unit]),
                              scale[0])

    return quantize_columns


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

    if not arch.hopper:
        raise ValueError(f"W4A8's activation kernels serve FP8 wgmma (Hopper, sm_90a); {arch.name} has none")
    if k % TILE_K:
        raise ValueError(f"K={k} must be a multiple of {TILE_K} (the FP8 k order permutes within 16 columns)")
    m = T.dynamic("m")
    staged_row_scale = _staged_row_scale(k)
    quantize_columns = _quantize_columns(k, dtype, sums)

    @T.macro
    def quantize_row(X, Q, S, KS, row):
        x_s = T.alloc_shared((1, k), dtype)
        scale = T.alloc_local((1,), "float32")
        staged_row_scale(X, row, x_s, scale)
        quantize_columns(x_s, scale, Q, KS, row)
        S[row, 0] = scale[0]

    prelude = EARLY_START_HELPERS + TOKEN_SCALE + E4M3_COLUMNS
    if sums:
        @T.prim_func
        def quantize_fp8(X: T.Tensor((m, k), dtype), Q: T.Tensor((m, k), "float8_e4m3fn"),
                         S: T.Tensor((m, 1), "float32"), KS: T.Tensor((m, k // FP8_K_TILE), "float32")):
            with T.Kernel(m, threads=threads_for(k), prelude=prelude) as row:
                quantize_row(X, Q, S, KS, row)
    else:
        @T.prim_func
        def quantize_fp8(X: T.Tensor((m, k), dtype), Q: T.Tensor((m, k), "float8_e4m3fn"),
                         S: T.Tensor((m, 1), "float32")):
            with T.Kernel(m, threads=threads_for(k), prelude=prelude) as row:
                quantize_row(X, Q, S, None, row)

    return quantize_fp8

