"""The one way a block stores its fp32 result tile, shared by the mma.sync families.

Without split-K the tile is cast and written (rows past M skipped). With split-K every block adds its
fp32 partial into a zeroed global workspace with 16-byte vector atomics, then counts itself in on a
per-tile counter; the last block to arrive reads the sums, writes the output and zeroes the workspace
tile and the counter again, so the next call (or CUDA-graph replay) finds them ready. One launch, no
host work. On sm_90 the splits of a tile can instead form a thread-block cluster (`cluster=True`):
after one cluster barrier each block sums its share of the tile from every block's shared tile
(distributed shared memory) and writes it, and a second barrier keeps the tiles alive until all have
read. No workspace, no atomics, no global round trips. Or (stream_wgmma's split_wait,
store_tile_split_wait) every split but the last stores its tile into a workspace slot of its own and
leaves, and the last split reads the slots after its own k-loop: no atomics, no counter.
Both sums move 16-byte vectors and issue all of a thread's loads before the first is used
(split_k_prelude): summed one element at a time, each element waited for a round trip of its own, which
made split-K 1.3-2x slower at M >= 64 (H200; docs/performance.md).
Channelwise scales (one row, S[0, n]) are applied here, to the fp32 sums.
"""
# No `from __future__ import annotations`: TileLang macros evaluate their annotations.
import tilelang.language as T
from tilelang.cuda.language.pdl import pdl_sync

from .quant import FP8_K_TILE

# Split-K arrival: every thread fences its workspace atomics, then one thread counts the block in.
SPLIT_K_HELPERS = r"""
__device__ __forceinline__ int tm_split_k_arrive(int* counter, int parts) {
  __threadfence();
  int last = atomicAdd(counter, 1) == parts - 1;
  __threadfence();
  return last;
}
"""


# The wait for the previous kernel in the stream, in every cluster kernel: TileLang 0.1.15's launcher
# (TVM's cuda_module.cc) launches every cluster kernel with programmatic stream serialization allowed,
# so such a kernel can start once the previous kernel's blocks have exited, before their writes are
# guaranteed visible; `griddepcontrol.wait` waits for that (a no-op when nothing is pending). Cluster
# kernels run it first.
CLUSTER_HELPERS = r"""
__device__ __forceinline__ void tm_wait_for_prior_grids() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// The cluster barrier after the split-K sum, before a block may exit: the other blocks only had to
// finish reading this block's tile, and they used every value they read before they arrive, so the
// arrive needs no release (TileLang's cluster_sync is arrive.release + wait.acquire, which ptxas
// turns into MEMBAR.ALL.GPU: every thread waits for its global stores of C to be acknowledged).
__device__ __forceinline__ void tm_cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
               "barrier.cluster.wait.aligned;\n" ::: "memory");
}
"""


# Split-K's partial tiles summed with 16-byte accesses, each thread's loads all issued before the first
# is used. Generated per kernel: the tile's shape, the threads and C's row length are constants, so the
# loops unroll into straight-line code.
# In a cluster the tile's 4-column chunks, numbered row by row, are dealt out to the ranks in turn
# (rank r takes chunks r, r + ranks, ...), so that at small M (rows past m skipped) every block of the
# cluster still shares the work, whether or not a row's chunks divide by the ranks.
CLUSTER_SUM = r"""
template <typename Out>    // (TileLang's half_t / bfloat16_t are declared after the prelude)
__device__ __forceinline__ void tm_cluster_sum_store(const float* tile, Out* out, int rows, {scale_arg}int rank,
                                                     int tid) {{
  constexpr int kChunksPerRow = {bn} / 4;
  constexpr int kChunks = {bm} * kChunksPerRow;
  constexpr int kMine = (kChunks + {ranks} - 1) / {ranks};     // at most this rank's chunks
  constexpr int kIters = (kMine + {threads} - 1) / {threads};
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  float4 sum[kIters];
#pragma unroll
  for (int it = 0; it < kIters; ++it) sum[it] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 0; r < {ranks}; ++r) {{
    unsigned base;
    asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(base) : "r"(local), "r"(r));
#pragma unroll
    for (int it = 0; it < kIters; ++it) {{
      int c = (it * {threads} + tid) * {ranks} + rank;
      int row = c / kChunksPerRow;
      if (c < kChunks && row < rows) {{
        int col = c % kChunksPerRow * 4;
        float4 v;
        asm volatile("ld.shared::cluster.v4.f32 {{%0, %1, %2, %3}}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(base + (row * {bn} + col) * 4));
        sum[it].x += v.x; sum[it].y += v.y; sum[it].z += v.z; sum[it].w += v.w;
      }}
    }}
  }}
#pragma unroll
  for (int it = 0; it < kIters; ++it) {{
    int c = (it * {threads} + tid) * {ranks} + rank;
    int row = c / kChunksPerRow;
    if (c < kChunks && row < rows) {{
      int col = c % kChunksPerRow * 4;
      float4 v = sum[it];{scale}
      tm_store4(out + row * {ldc} + col, v);
    }}
  }}
}}
"""
# Through the workspace: the block adds its tile with 16-byte reductions (sm_90; four 4-byte ones
# before), and the last block of the tile reads all of its share of the sums at once, bypassing L1
# (other blocks' reductions went to L2), then stores the outputs and zeroes the workspace tile.
# Channelwise scales are in the tile already (the workspace holds scaled sums).
WORKSPACE_SUM = r"""
__device__ __forceinline__ void tm_workspace_add(const float* tile, float* ws, int rows, int tid) {{
  constexpr int kChunksPerRow = {bn} / 4;
  constexpr int kChunks = {bm} * kChunksPerRow;
  constexpr int kIters = (kChunks + {threads} - 1) / {threads};
#pragma unroll
  for (int it = 0; it < kIters; ++it) {{
    int c = it * {threads} + tid;
    int row = c / kChunksPerRow;
    if (c < kChunks && row < rows) {{
      int col = c % kChunksPerRow * 4;
      float4 v = *reinterpret_cast<const float4*>(tile + row * {bn} + col);
      float* dst = ws + row * {ldc} + col;
#if __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
      atomicAdd(dst, v.x); atomicAdd(dst + 1, v.y); atomicAdd(dst + 2, v.z); atomicAdd(dst + 3, v.w);
#endif
    }}
  }}
}}

template <typename Out>
__device__ __forceinline__ void tm_workspace_store(float* ws, Out* out, int rows, int tid) {{
  constexpr int kChunksPerRow = {bn} / 4;
  constexpr int kChunks = {bm} * kChunksPerRow;
  constexpr int kIters = (kChunks + {threads} - 1) / {threads};
  float4 sum[kIters];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {{
    int c = it * {threads} + tid;
    if (c < kChunks && c / kChunksPerRow < rows)
      sum[it] = __ldcg(reinterpret_cast<const float4*>(ws + c / kChunksPerRow * {ldc} + c % kChunksPerRow * 4));
  }}
#pragma unroll
  for (int it = 0; it < kIters; ++it) {{
    int c = it * {threads} + tid;
    if (c < kChunks && c / kChunksPerRow < rows) {{
      int at = c / kChunksPerRow * {ldc} + c % kChunksPerRow * 4;
      tm_store4(out + at, sum[it]);
      *reinterpret_cast<float4*>(ws + at) = make_float4(0.f, 0.f, 0.f, 0.f);
    }}
  }}
}}
"""
# split_wait: the tile's last split (the highest blockIdx.z, so launched after the others) waits for
# the others' partial tiles instead of the last to arrive summing them. Each other split stores its
# tile into a slot of its own in the workspace (slot z at rows z * M), every value's bits plus one:
# no fence, no counter, and the block leaves at once. A zero word is one not yet written (the
# workspace starts zeroed, and a stored word is never 0: fp32 bits 0xffffffff are a NaN no arithmetic
# produces). After its own k-loop, every thread of the last split loads its chunks of every slot at
# once, adds each 4-value chunk once all four of its words have landed (a 16-byte store need not land
# at once) and zeroes it, loads again what is still missing, and stores the sums. The last block to
# arrive at the tile's counter paid two L2 round trips (its reductions' fence, the counter; ~0.9 us
# each under the weights' stream at down_proj 16, docs/performance.md) before it could even read the sums;
# here the last split reads them at once. It waits only for blocks launched before it, so it cannot
# hold a slot that one of them needs. (A first form polled from the producer warp during the k-loop:
# its ~1200 instructions a round, issued beside 14 busy warps, took ~6 us, v56.)
SPLIT_WAIT_SUM = r"""
__device__ __forceinline__ void tm_split_k_put(const float* tile, float* slot, int rows, int tid) {{
  constexpr int kChunksPerRow = {bn} / 4;
  constexpr int kChunks = {bm} * kChunksPerRow;
#pragma unroll
  for (int c = tid; c < kChunks; c += {threads}) {{
    int row = c / kChunksPerRow;
    if (row < rows) {{
      int col = c % kChunksPerRow * 4;
      uint4 v = *reinterpret_cast<const uint4*>(tile + row * {bn} + col);
      v.x += 1u; v.y += 1u; v.z += 1u; v.w += 1u;
      *reinterpret_cast<uint4*>(slot + row * {ldc} + col) = v;
    }}
  }}
}}

// The block's own tile plus the other splits' slots, stored to `out`: a thread's chunks tid, tid +
// threads, ..., a bit per (slot, chunk) still to come.
template <typename Out>
__device__ __forceinline__ void tm_split_k_sum_slots(const float* tile, float* ws, long long slot_elems, Out* out,
                                                     int rows, int tid) {{
  constexpr int kChunksPerRow = {bn} / 4;
  constexpr int kChunks = {bm} * kChunksPerRow;
  constexpr int kMine = (kChunks + {threads} - 1) / {threads};
  static_assert({others} * kMine <= 64, "a bit per (slot, chunk) of a thread");
  float4 sum[kMine];
  unsigned long long mine = 0;
#pragma unroll
  for (int i = 0; i < kMine; ++i) {{
    int c = i * {threads} + tid;
    if (c < kChunks && c / kChunksPerRow < rows) {{
      mine |= 1ull << i;
      sum[i] = *reinterpret_cast<const float4*>(tile + c * 4);
    }}
  }}
  unsigned long long pending = 0;     // bit s * kMine + i: slot s's chunk i of this thread is still to come
#pragma unroll
  for (int s = 0; s < {others}; ++s) pending |= mine << (s * kMine);
  while (pending) {{
    uint4 v[{others}][kMine];
#pragma unroll
    for (int s = 0; s < {others}; ++s)
#pragma unroll
      for (int i = 0; i < kMine; ++i) {{
        int c = i * {threads} + tid;
        v[s][i] = make_uint4(0u, 0u, 0u, 0u);
        if (pending >> (s * kMine + i) & 1)
          asm volatile("ld.relaxed.gpu.global.v4.u32 {{%0, %1, %2, %3}}, [%4];\n"
                       : "=r"(v[s][i].x), "=r"(v[s][i].y), "=r"(v[s][i].z), "=r"(v[s][i].w)
                       : "l"(ws + s * slot_elems + c / kChunksPerRow * {ldc} + c % kChunksPerRow * 4));
      }}
#pragma unroll
    for (int s = 0; s < {others}; ++s)
#pragma unroll
      for (int i = 0; i < kMine; ++i) {{
        uint4 w = v[s][i];
        if ((pending >> (s * kMine + i) & 1) && w.x && w.y && w.z && w.w) {{
          int c = i * {threads} + tid;
          sum[i].x += __uint_as_float(w.x - 1u); sum[i].y += __uint_as_float(w.y - 1u);
          sum[i].z += __uint_as_float(w.z - 1u); sum[i].w += __uint_as_float(w.w - 1u);
          *reinterpret_cast<uint4*>(ws + s * slot_elems + c / kChunksPerRow * {ldc} + c % kChunksPerRow * 4) =
              make_uint4(0u, 0u, 0u, 0u);
          pending &= ~(1ull << (s * kMine + i));
        }}
      }}
  }}
#pragma unroll
  for (int i = 0; i < kMine; ++i) {{
    int c = i * {threads} + tid;
    if (mine >> i & 1) tm_store4(out + c / kChunksPerRow * {ldc} + c % kChunksPerRow * 4, sum[i]);
  }}
}}
"""
# Four outputs from four fp32 sums in one 8-byte store.
STORE4 = r"""
template <typename Out>
__device__ __forceinline__ void tm_store4(Out* dst, float4 v) {
  uint2 packed;
  Out* h = reinterpret_cast<Out*>(&packed);
  h[0] = Out(v.x); h[1] = Out(v.y); h[2] = Out(v.z); h[3] = Out(v.w);
  *reinterpret_cast<uint2*>(dst) = packed;
}
"""


def split_k_prelude(block_m: int, block_n: int, split_k: int, threads: int, n: int, channelwise: bool,
                    cluster: bool, split_wait: bool = False) -> str:
    """CUDA source of the functions that store_tile's split-K sums call, for one kernel ("" without
    split-K): tm_cluster_sum_store (with `cluster`), or tm_workspace_add, tm_split_k_arrive and
    tm_workspace_store, or with `split_wait` tm_split_k_put and tm_split_k_sum_slots."""
    if split_k == 1:
        return ""
    if block_n % 4:
        raise ValueError(f"split-K sums move 4 columns at a time: block_n={block_n} is not a multiple of 4")
    shape = dict(bm=block_m, bn=block_n, threads=threads, ldc=n)
    if not cluster:
        if split_wait:
            return STORE4 + SPLIT_WAIT_SUM.format(others=split_k - 1, **shape)
        return SPLIT_K_HELPERS + STORE4 + WORKSPACE_SUM.format(**shape)
    scale = ("\n      v.x *= static_cast<float>(scale[col]); v.y *= static_cast<float>(scale[col + 1]);"
             "\n      v.z *= static_cast<float>(scale[col + 2]); v.w *= static_cast<float>(scale[col + 3]);"
             ) if channelwise else ""
    return STORE4 + CLUSTER_SUM.format(ranks=split_k, scale_arg="const Out* scale, " if channelwise else "",
                                       scale=scale, **shape)


# early_start: let the next kernel of the stream launch once every block of this one runs (its blocks
# then fill the SM slots that this kernel's last blocks free; its own griddepcontrol.wait still waits
# for all of this kernel's writes), and ask L2 for bytes that no earlier kernel writes (weights,
# scales) before this kernel's own wait: one bulk prefetch moves up to a few KB without registers.
EARLY_START_HELPERS = r"""
__device__ __forceinline__ void tm_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900   // (act-order's gather also runs before Hopper)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void tm_prefetch_l2(const void* src, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(src), "r"(bytes) : "memory");
}
"""


def wait_for_prior_grids(cluster: bool, pdl: bool):
    """A T.macro() for a kernel's first statement: no read of the activations, and no write of C,
    before the previous kernel's writes are visible. A cluster kernel (launched with programmatic
    stream serialization by TileLang's launcher, see CLUSTER_HELPERS) waits with griddepcontrol; with
    the pdl knob, TileLang's pdl_sync (cudaGridDependencySynchronize) also marks the kernel, so that
    its launcher allows that launch for it too: launched as the previous kernel drains, it waits here
    (the kernel boundary's latency overlapped; nothing of the previous kernel's work). Otherwise
    nothing: stream order already serializes the kernels."""

    @T.macro
    def wait():
        if cluster:
            T.call_extern("handle", "tm_wait_for_prior_grids")
        elif pdl:
            pdl_sync()

    return wait


def store_tile(block_m: int, block_n: int, grid_n: int, split_k: int, dtype: str, channelwise: bool,
               cluster: bool = False):
    """A T.macro(C_s, C, S, ws, counters, m, by, bx, tx) that stores the block tile C_s [block_m,
    block_n] (fp32, complete for this block, threads synchronized) at rows by * block_m, columns
    bx * block_n of C [m, N]. With split_k > 1 the kernel's prelude must hold split_k_prelude's
    functions; ws and counters are used only without `cluster` (with it, the kernel must launch the
    split_k blocks of a tile as one cluster, see CLUSTER_HELPERS). For split_wait, see
    store_tile_split_wait."""
    bm, bn = block_m, block_n

    @T.macro
    def store(C_s, C, S, ws, counters, m, by, bx, tx):
        if split_k > 1 and cluster:
            T.cluster_sync()                  # every split's tile is complete and visible
            if channelwise:
                T.call_extern("handle", "tm_cluster_sum_store", T.access_ptr(C_s[0, 0], "r"),
                              T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, T.access_ptr(S[0, bx * bn], "r"),
                              T.block_rank_in_cluster(), tx)
            else:
                T.call_extern("handle", "tm_cluster_sum_store", T.access_ptr(C_s[0, 0], "r"),
                              T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, T.block_rank_in_cluster(), tx)
            T.call_extern("handle", "tm_cluster_sync_relaxed")    # no block leaves while others read its tile
        elif split_k == 1:
            for i, j in T.Parallel(bm, bn):
                if by * bm + i < m:
                    scale = T.cast(S[0, bx * bn + j], "float32") if channelwise else T.float32(1)
                    C[by * bm + i, bx * bn + j] = T.cast(C_s[i, j] * scale, dtype)
        else:
            if channelwise:
                for i, j in T.Parallel(bm, bn):
                    C_s[i, j] = C_s[i, j] * T.cast(S[0, bx * bn + j], "float32")
                T.sync_threads()
            T.call_extern("handle", "tm_workspace_add", T.access_ptr(C_s[0, 0], "r"),
                          T.access_ptr(ws[by * bm, bx * bn], "rw"), m - by * bm, tx)
            last = T.alloc_shared((1,), "int32")
            T.call_extern("handle", "__threadfence")
            T.sync_threads()
            if tx == 0:
                last[0] = T.call_extern("int32", "tm_split_k_arrive",
                                        T.access_ptr(counters[by * grid_n + bx], "rw"), split_k)
            T.sync_threads()
            if last[0] == 1:
                T.call_extern("handle", "tm_workspace_store", T.access_ptr(ws[by * bm, bx * bn], "rw"),
                              T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, tx)
                if tx == 0:
                    counters[by * grid_n + bx] = 0

    return store


def store_tile_split_wait(block_m: int, block_n: int, split_k: int, n: int, channelwise: bool):
    """split_wait's store (SPLIT_WAIT_SUM; split_k_prelude with split_wait): a T.macro(C_s, C, S, ws, m,
    by, bx, bz, tx). The splits bz < split_k - 1 put C_s into their slot of the workspace, rows bz * m
    of ws's [(split_k - 1) * m, N]; the last one adds the slots to C_s and stores the tile."""
    bm, bn = block_m, block_n

    @T.macro
    def store(C_s, C, S, ws, m, by, bx, bz, tx):
        if channelwise:
            for i, j in T.Parallel(bm, bn):
                C_s[i, j] = C_s[i, j] * T.cast(S[0, bx * bn + j], "float32")
            T.sync_threads()
        if bz < split_k - 1:
            T.call_extern("handle", "tm_split_k_put", T.access_ptr(C_s[0, 0], "r"),
                          T.access_ptr(ws[bz * m + by * bm, bx * bn], "w"), m - by * bm, tx)
        else:
            T.call_extern("handle", "tm_split_k_sum_slots", T.access_ptr(C_s[0, 0], "r"),
                          T.access_ptr(ws[by * bm, bx * bn], "rw"), T.cast(m, "int64") * n,
                          T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, tx)

    return store


def w4a16_prim_func(body, m, tiles, n: int, k: int, scale_rows: int, dtype: str, workspace: bool, slots: int = 1):
    """The kernel's signature, shared by the mma.sync families: A [m, K], packed B [K/16, 2N] int32,
    scales [scale_rows, N] (Problem.scale_rows: K/group, with zero points a zero-point row after each),
    C [m, N], and with `workspace` (split-K through global memory) the fp32 workspace [slots * m, N]
    (split_wait: a slot of m rows per split but the last) and int32 tile counters [tiles]. `body` is a
    T.macro(A, B, S, C, ws, counters) and m, tiles the T.dynamic variables it was built with. (TileLang
    reads a prim_func's parameters from its Python signature, so each set of tensors is a def of its own.)"""
    if workspace:
        @T.prim_func
        def w4a16_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k // 16, 2 * n), "int32"),
                       S: T.Tensor((scale_rows, n), dtype), C: T.Tensor((m, n), dtype),
                       ws: T.Tensor((slots * m, n), "float32"), counters: T.Tensor((tiles,), "int32")):
            body(A, B, S, C, ws, counters)
    else:
        @T.prim_func
        def w4a16_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k // 16, 2 * n), "int32"),
                       S: T.Tensor((scale_rows, n), dtype), C: T.Tensor((m, n), dtype)):
            body(A, B, S, C, None, None)
    return w4a16_gemm


def w4a8_prim_func(body, m, tiles, n: int, k: int, scale_rows: int, dtype: str, workspace: bool, slots: int = 1,
                   sums: bool = False):
    """w4a16_prim_func's signature with FP8 activations: A [m, K] float8_e4m3fn (in the FP8 k order of
    schedules/marlin_mma/layout.fp8_k_order), their token scales TS [m, 1] fp32 and with `sums` their
    k-tile sums KS [m, K / 128] fp32 first, then as there; `dtype` is the scales' and the output's.
    `body` also takes TS and KS (None without `sums`), as its last arguments."""
    fp8 = "float8_e4m3fn"
    if not sums:
        return _w4a8_prim_func(body, m, tiles, n, k, scale_rows, dtype, workspace, slots)
    k_tiles = k // FP8_K_TILE
    if workspace:
        @T.prim_func
        def w4a8_gemm(A: T.Tensor((m, k), fp8), TS: T.Tensor((m, 1), "float32"),
                      KS: T.Tensor((m, k_tiles), "float32"),
                      B: T.Tensor((k // 16, 2 * n), "int32"), S: T.Tensor((scale_rows, n), dtype),
                      C: T.Tensor((m, n), dtype), ws: T.Tensor((slots * m, n), "float32"),
                      counters: T.Tensor((tiles,), "int32")):
            body(A, B, S, C, ws, counters, TS, KS)
    else:
        @T.prim_func
        def w4a8_gemm(A: T.Tensor((m, k), fp8), TS: T.Tensor((m, 1), "float32"),
                      KS: T.Tensor((m, k_tiles), "float32"),
                      B: T.Tensor((k // 16, 2 * n), "int32"), S: T.Tensor((scale_rows, n), dtype),
                      C: T.Tensor((m, n), dtype)):
            body(A, B, S, C, None, None, TS, KS)
    return w4a8_gemm


def _w4a8_prim_func(body, m, tiles, n: int, k: int, scale_rows: int, dtype: str, workspace: bool, slots: int):
    """w4a8_prim_func without the k-tile sums."""
    fp8 = "float8_e4m3fn"
    if workspace:
        @T.prim_func
        def w4a8_gemm(A: T.Tensor((m, k), fp8), TS: T.Tensor((m, 1), "float32"),
                      B: T.Tensor((k // 16, 2 * n), "int32"), S: T.Tensor((scale_rows, n), dtype),
                      C: T.Tensor((m, n), dtype), ws: T.Tensor((slots * m, n), "float32"),
                      counters: T.Tensor((tiles,), "int32")):
            body(A, B, S, C, ws, counters, TS, None)
    else:
        @T.prim_func
        def w4a8_gemm(A: T.Tensor((m, k), fp8), TS: T.Tensor((m, 1), "float32"),
                      B: T.Tensor((k // 16, 2 * n), "int32"), S: T.Tensor((scale_rows, n), dtype),
                      C: T.Tensor((m, n), dtype)):
            body(A, B, S, C, None, None, TS, None)
    return w4a8_gemm
