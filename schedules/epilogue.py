"""The one way a block stores its fp32 result tile, shared by the mma.sync families.

Without split-K the tile is cast and written (rows past M skipped). With split-K every block adds its
fp32 partial into a zeroed global workspace with 16-byte vector atomics, then counts itself in on a
per-tile counter; the last block to arrive writes the output and zeroes the workspace tile and the
counter again, so the next call (or CUDA-graph replay) finds them ready. One launch, no host work.
Channelwise scales (one row, S[0, n]) are applied here, to the fp32 sums.
"""
# No `from __future__ import annotations`: TileLang macros evaluate their annotations.
import tilelang.language as T

# Split-K arrival: every thread fences its workspace atomics, then one thread counts the block in.
SPLIT_K_HELPERS = r"""
__device__ __forceinline__ int tm_split_k_arrive(int* counter, int parts) {
  __threadfence();
  int last = atomicAdd(counter, 1) == parts - 1;
  __threadfence();
  return last;
}
"""


def store_tile(block_m: int, block_n: int, grid_n: int, split_k: int, dtype: str, channelwise: bool):
    """A T.macro(C_s, C, S, ws, counters, m, by, bx, tx) that stores the block tile C_s [block_m,
    block_n] (fp32, complete for this block, threads synchronized) at rows by * block_m, columns
    bx * block_n of C [m, N]; ws and counters are used only when split_k > 1."""
    bm, bn = block_m, block_n

    def channel_scale(S, col):
        return T.cast(S[0, col], "float32") if channelwise else T.float32(1)

    @T.macro
    def store(C_s, C, S, ws, counters, m, by, bx, tx):
        if split_k == 1:
            for i, j in T.Parallel(bm, bn):
                if by * bm + i < m:
                    C[by * bm + i, bx * bn + j] = T.cast(C_s[i, j] * channel_scale(S, bx * bn + j), dtype)
        else:
            if channelwise:
                for i, j in T.Parallel(bm, bn):
                    C_s[i, j] = C_s[i, j] * channel_scale(S, bx * bn + j)
                T.sync_threads()
            # Tile-wide: 16-byte vector atomics (red.global.add.v4.f32) on sm_90, rows past m skipped.
            T.atomic_add(ws[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn], C_s)
            last = T.alloc_shared((1,), "int32")
            T.call_extern("handle", "__threadfence")
            T.sync_threads()
            if tx == 0:
                last[0] = T.call_extern("int32", "tm_split_k_arrive",
                                        T.access_ptr(counters[by * grid_n + bx], "rw"), split_k)
            T.sync_threads()
            if last[0] == 1:
                for i, j in T.Parallel(bm, bn):
                    if by * bm + i < m:
                        C[by * bm + i, bx * bn + j] = T.cast(
                            T.call_extern("float32", "__ldcg", T.access_ptr(ws[by * bm + i, bx * bn + j], "r")), dtype)
                        ws[by * bm + i, bx * bn + j] = T.float32(0)
                if tx == 0:
                    counters[by * grid_n + bx] = 0

    return store
