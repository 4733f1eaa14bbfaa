"""The one way a block stores its fp32 result tile, shared by the mma.sync families.

Without split-K the tile is cast and written (rows past M skipped). With split-K every block adds its
fp32 partial into a zeroed global workspace with 16-byte vector atomics, then counts itself in on a
per-tile counter; the last block to arrive writes the output and zeroes the workspace tile and the
counter again, so the next call (or CUDA-graph replay) finds them ready. One launch, no host work.
On sm_90 the splits of a tile can instead form a thread-block cluster (`cluster=True`): after one
cluster barrier each block sums its share of the columns from every block's shared tile (distributed
shared memory) and writes them, and a second barrier keeps the tiles alive until all have read.
No workspace, no atomics, no global round trips.
Channelwise scales (one row, S[0, n]) are applied here, to the fp32 sums.
"""
# No `from __future__ import annotations`: TileLang macros evaluate their annotations.
import tilelang.language as T
from tilelang.cuda.language.pdl import pdl_sync

from .knob_space import split_v4_reason

# Split-K arrival: every thread fences its workspace atomics, then one thread counts the block in.
SPLIT_K_HELPERS = r"""
__device__ __forceinline__ int tm_split_k_arrive(int* counter, int parts) {
  __threadfence();
  int last = atomicAdd(counter, 1) == parts - 1;
  __threadfence();
  return last;
}
"""


# A float in another block's shared memory: map the local address into the cluster window of `rank`.
# And the wait for the previous kernel in the stream: TileLang 0.1.15's launcher (TVM's cuda_module.cc)
# launches every cluster kernel with programmatic stream serialization allowed, so such a kernel can
# start once the previous kernel's blocks have exited, before their writes are guaranteed visible;
# `griddepcontrol.wait` waits for that (a no-op when nothing is pending). Cluster kernels run it first.
CLUSTER_HELPERS = r"""
__device__ __forceinline__ void tm_wait_for_prior_grids() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ float tm_cluster_load_f32(const void* smem, int rank) {
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
"""


# split_v4: split-K's partial tiles summed with 16-byte accesses, each thread's loads all issued before
# the first is used. The scalar loops below wait for one round trip per element (a remote shared load
# in the cluster, an L2 load in the workspace: ~6-7 per thread at block 16 x 64, 57 at 128 x 128).
# Generated per kernel: the tile's shape, the threads and C's row length are constants, so the loops
# unroll into straight-line code.
# In a cluster, rank r takes the 4-column chunks q with q % ranks == r of every row, so that at small M
# (rows past m skipped) all blocks of the cluster still share the work.
CLUSTER_SUM_V4 = r"""
template <typename Out>    // (TileLang's half_t / bfloat16_t are declared after the prelude)
__device__ __forceinline__ void tm_cluster_sum_store(const float* tile, Out* out, int rows, {scale_arg}int rank,
                                                     int tid) {{
  constexpr int kChunksPerRow = {bn} / 4 / {ranks};     // this rank's 4-column chunks per row
  constexpr int kChunks = {bm} * kChunksPerRow;
  constexpr int kIters = (kChunks + {threads} - 1) / {threads};
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
      int c = it * {threads} + tid;
      int row = c / kChunksPerRow;
      if (c < kChunks && row < rows) {{
        int col = (c % kChunksPerRow * {ranks} + rank) * 4;
        float4 v;
        asm volatile("ld.shared::cluster.v4.f32 {{%0, %1, %2, %3}}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(base + (row * {bn} + col) * 4));
        sum[it].x += v.x; sum[it].y += v.y; sum[it].z += v.z; sum[it].w += v.w;
      }}
    }}
  }}
#pragma unroll
  for (int it = 0; it < kIters; ++it) {{
    int c = it * {threads} + tid;
    int row = c / kChunksPerRow;
    if (c < kChunks && row < rows) {{
      int col = (c % kChunksPerRow * {ranks} + rank) * 4;
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
WORKSPACE_SUM_V4 = r"""
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


def split_v4_helpers(block_m: int, block_n: int, split_k: int, threads: int, n: int, channelwise: bool,
                     cluster: bool) -> str:
    """CUDA source of split_v4's functions for one kernel: tm_cluster_sum_store (with `cluster`) or
    tm_workspace_add and tm_workspace_store."""
    reason = split_v4_reason(split_k, cluster, block_n)
    if reason:
        raise ValueError(reason)
    shape = dict(bm=block_m, bn=block_n, threads=threads, ldc=n)
    if not cluster:
        return STORE4 + WORKSPACE_SUM_V4.format(**shape)
    scale = ("\n      v.x *= static_cast<float>(scale[col]); v.y *= static_cast<float>(scale[col + 1]);"
             "\n      v.z *= static_cast<float>(scale[col + 2]); v.w *= static_cast<float>(scale[col + 3]);"
             ) if channelwise else ""
    return STORE4 + CLUSTER_SUM_V4.format(ranks=split_k, scale_arg="const Out* scale, " if channelwise else "",
                                          scale=scale, **shape)


# early_start: let the next kernel of the stream launch once every block of this one runs (its blocks
# then fill the SM slots that this kernel's last blocks free; its own griddepcontrol.wait still waits
# for all of this kernel's writes), and ask L2 for bytes that no earlier kernel writes (weights,
# scales) before this kernel's own wait: one bulk prefetch moves up to a few KB without registers.
EARLY_START_HELPERS = r"""
__device__ __forceinline__ void tm_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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
               cluster: bool = False, split_v4: bool = False):
    """A T.macro(C_s, C, S, ws, counters, m, by, bx, tx) that stores the block tile C_s [block_m,
    block_n] (fp32, complete for this block, threads synchronized) at rows by * block_m, columns
    bx * block_n of C [m, N]; ws and counters are used only when split_k > 1 without `cluster`
    (then the kernel must launch the split_k blocks of a tile as one cluster, see CLUSTER_HELPERS;
    with `split_v4` the kernel's prelude has split_v4_helpers' functions too)."""
    bm, bn = block_m, block_n

    def channel_scale(S, col):
        return T.cast(S[0, col], "float32") if channelwise else T.float32(1)

    @T.macro
    def store(C_s, C, S, ws, counters, m, by, bx, tx):
        if split_k > 1 and cluster and split_v4:
            T.cluster_sync()                  # every split's tile is complete and visible
            if channelwise:
                T.call_extern("handle", "tm_cluster_sum_store", T.access_ptr(C_s[0, 0], "r"),
                              T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, T.access_ptr(S[0, bx * bn], "r"),
                              T.block_rank_in_cluster(), tx)
            else:
                T.call_extern("handle", "tm_cluster_sum_store", T.access_ptr(C_s[0, 0], "r"),
                              T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, T.block_rank_in_cluster(), tx)
            T.cluster_sync()                  # no block leaves while others still read its tile
        elif split_k > 1 and cluster:
            T.cluster_sync()                  # every split's tile is complete and visible
            rank = T.block_rank_in_cluster()
            for i, j in T.Parallel(bm, bn):
                if j % split_k == rank and by * bm + i < m:
                    total = sum(T.call_extern("float32", "tm_cluster_load_f32", T.access_ptr(C_s[i, j], "r"), r)
                                for r in range(split_k))
                    C[by * bm + i, bx * bn + j] = T.cast(total * channel_scale(S, bx * bn + j), dtype)
            T.cluster_sync()                  # no block leaves while others still read its tile
        elif split_k == 1:
            for i, j in T.Parallel(bm, bn):
                if by * bm + i < m:
                    C[by * bm + i, bx * bn + j] = T.cast(C_s[i, j] * channel_scale(S, bx * bn + j), dtype)
        else:
            if channelwise:
                for i, j in T.Parallel(bm, bn):
                    C_s[i, j] = C_s[i, j] * channel_scale(S, bx * bn + j)
                T.sync_threads()
            if split_v4:
                T.call_extern("handle", "tm_workspace_add", T.access_ptr(C_s[0, 0], "r"),
                              T.access_ptr(ws[by * bm, bx * bn], "rw"), m - by * bm, tx)
            else:
                # Tile-wide atomics (16-byte ones on sm_90 where the tile spreads evenly over the
                # threads, else 4-byte), rows past m skipped.
                T.atomic_add(ws[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn], C_s)
            last = T.alloc_shared((1,), "int32")
            T.call_extern("handle", "__threadfence")
            T.sync_threads()
            if tx == 0:
                last[0] = T.call_extern("int32", "tm_split_k_arrive",
                                        T.access_ptr(counters[by * grid_n + bx], "rw"), split_k)
            T.sync_threads()
            if last[0] == 1:
                if split_v4:
                    T.call_extern("handle", "tm_workspace_store", T.access_ptr(ws[by * bm, bx * bn], "rw"),
                                  T.access_ptr(C[by * bm, bx * bn], "w"), m - by * bm, tx)
                else:
                    for i, j in T.Parallel(bm, bn):
                        if by * bm + i < m:
                            C[by * bm + i, bx * bn + j] = T.cast(
                                T.call_extern("float32", "__ldcg", T.access_ptr(ws[by * bm + i, bx * bn + j], "r")),
                                dtype)
                            ws[by * bm + i, bx * bn + j] = T.float32(0)
                if tx == 0:
                    counters[by * grid_n + bx] = 0

    return store


def w4a16_prim_func(body, m, tiles, n: int, k: int, group: int, dtype: str, workspace: bool):
    """The kernel's signature, shared by the mma.sync families: A [m, K], packed B [K/16, 2N] int32,
    scales [K/group, N], C [m, N], and with `workspace` (split-K through global memory) the fp32
    workspace [m, N] and int32 tile counters [tiles]. `body` is a T.macro(A, B, S, C, ws, counters)
    and m, tiles the T.dynamic variables it was built with."""
    if workspace:
        @T.prim_func
        def w4a16_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k // 16, 2 * n), "int32"),
                       S: T.Tensor((k // group, n), dtype), C: T.Tensor((m, n), dtype),
                       ws: T.Tensor((m, n), "float32"), counters: T.Tensor((tiles,), "int32")):
            body(A, B, S, C, ws, counters)
    else:
        @T.prim_func
        def w4a16_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k // 16, 2 * n), "int32"),
                       S: T.Tensor((k // group, n), dtype), C: T.Tensor((m, n), dtype)):
            body(A, B, S, C, None, None)
    return w4a16_gemm
