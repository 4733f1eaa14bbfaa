"""W4A8's offset correction (offset_decode): what the offset FP8 decode leaves out of the sums, added back
on the tensor cores.

Why it looks the way it does:
- offset_decode's decode (templates/dequant.cuh.j2, tm_decode_e4m3_offset_a_u4) turns each code c into
  the e4m3 byte c, whose value is c * 2^-9 exactly: two masks, a shift and two prmt per word where the
  table lookup of c - 8 takes 12 instructions, at the price of an offset. Per 128-deep k-tile j (one
  group, or part of one) the wgmmas sum P_j = sum_k c_k x_k / 512 instead of sum_k (c_k - 8) x_k =
  512 (P_j - X_j / 64), X_j being the k-tile's sum of the FP8 activations (the activation kernel's KS).
- The fold puts each k-tile's sums times its group scale s_j into the running sums, so after the
  k-loop they hold sum_j s_j P_j and lack sum_j s_j (-X_j / 64): a product over k-tiles, [rows x
  k-tiles] scales by [k-tiles x tokens] sums. It is where the running sums start (kernel.start_sums),
  before the k-loop, so that its loads and wgmmas run while the pipeline's first stages fill (after
  the k-loop its memory latency stood alone). It runs as 16-bit wgmmas with fp32 sums, one k16 step
  per 16 k-tiles: A from registers holds the lane's rows' scales (ones for channelwise scales, which
  multiply the output instead), B from shared memory -X / 64 in two parts of the scales' dtype (the
  second the first's rounding error), so that the correction keeps about 22 bits (fp16) or 16
  (bf16). The final sums are then times 512 (with the token scales, mainloop.scale_by_tokens).
- B's tile is written by the consumer threads in the canonical K-major layout without swizzle (8 x 8
  core matrices of 16-byte rows) and handed to the async proxy by a fence; k-tiles past the block's
  take zero scales.
"""
import tilelang.language as T

from templates import mma_operand_dtype

from ..quant import FP8_K_TILE

K_TILES_PER_STEP = 16       # one k16 step of the correction's wgmma: a k per k-tile
CORE = 8                    # a core matrix: 8 rows of 8 16-bit values (16 bytes)
CORE_UNITS = CORE * CORE * 2 // 16      # one core matrix, in the descriptor's 16-byte units
# The activations' sums enter B as -X / 64: the decode's 8 / 512, exact in any binary type.
SUM_FACTOR = -1.0 / 64
FENCE_ASYNC_SHARED = r"""
__device__ __forceinline__ void tm_fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
"""


def steps(plan) -> int:
    """The correction's k16 steps: the block's k-tiles (the longer splits' count) in sixteens."""
    return -(-(plan.trips + (1 if plan.extra else 0)) // K_TILES_PER_STEP)


def sums_per_thread(plan) -> int:
    """A consumer thread's share of a step's tile of sums."""
    return -(-plan.bm * K_TILES_PER_STEP // plan.consumers)


# The loads of a batch of steps go out together, so that the correction waits for memory once a batch
# rather than once a load: one rolled loop over the block's k-tiles left a thread's 16 sum loads one
# after the other, 2-4 us a step where one block per SM runs (down_proj with the producer warp). A step
# keeps its sums and 8 scales per group in registers, which the k-loop's k-tile sums and fragments no
# longer need; at most this many a batch:
BATCH_REGISTERS = 48


def batches(plan) -> tuple[int, int]:
    """(batches, steps per batch): the fewest batches within BATCH_REGISTERS, the steps spread evenly
    (a last step past the block's k-tiles adds zeros)."""
    per_step = sums_per_thread(plan) + 4 * plan.g
    count = -(-steps(plan) // max(1, BATCH_REGISTERS // per_step))
    return count, -(-steps(plan) // count)


@T.macro
def load_sums(plan, mem, by, tx, kv, c, first_tile, last_tile):
    """Step c's share of this thread: token r's k-tile sums first_tile + j into kv[c * per thread:],
    times -1/64. Rows past M and k-tiles past the block read a valid row and k-tile (their scales are
    zero, their sums never stored)."""
    per_part, per_thread = plan.bm * K_TILES_PER_STEP, sums_per_thread(plan)
    for s in T.unroll(per_thread):
        e = s * plan.consumers + tx
        row = T.min(by * plan.bm + e // K_TILES_PER_STEP, plan.m - 1)
        kv[c * per_thread + s] = T.if_then_else(
            e < per_part, mem.KS[row, T.min(first_tile + e % K_TILES_PER_STEP, last_tile)] * SUM_FACTOR, 0.0)


@T.macro
def load_scales(plan, mem, bx, wg, wq, lane, sv, c, first_tile, end_tile):
    """Step c's A fragments, group i's at sv[(c * groups + i) * 8:]: the lane's rows g and g + 8
    (weight columns) by k-tiles first_tile + 2t, + 1, + 8, + 9 (the 16-bit A layout), each its group's
    scale (1 for channelwise scales), 0 past end_tile."""
    t = lane % 4
    for i in T.unroll(plan.g):
        for half in T.unroll(2):           # k-tiles 2t, 2t + 1, then 2t + 8, 2t + 9
            for h in T.unroll(2):          # rows g, g + 8
                for e in T.unroll(2):
                    k_tile = first_tile + 2 * t + 8 * half + e
                    col = plan.weight_col(bx, wg, wq, lane, i, h)
                    group = T.min(k_tile, end_tile - 1) * FP8_K_TILE // plan.group
                    scale = mem.S[group, col] if plan.grouped else T.cast(1, plan.dtype)
                    sv[(c * plan.g + i) * 8 + half * 4 + h * 2 + e] = T.if_then_else(
                        k_tile < end_tile, scale, T.cast(0, plan.dtype))


@T.macro
def store_sums_tile(plan, mem, tx, kv, c):
    """B of step c from kv: token r's value of k-tile j at (part, r, j), part 0 its rounding to the
    dtype and part 1 the rest, in 8 x 8 core matrices (K-major, no swizzle)."""
    bm, dtype, tile = plan.bm, plan.dtype, mem.KS_s
    per_part, per_thread = bm * K_TILES_PER_STEP, sums_per_thread(plan)
    for s in T.unroll(per_thread):
        e = s * plan.consumers + tx
        if e < per_part:
            r = e // K_TILES_PER_STEP
            j = e % K_TILES_PER_STEP
            at = (j // CORE * (bm // CORE) + r // CORE) * CORE * CORE + r % CORE * CORE + j % CORE
            value = kv[c * per_thread + s]
            tile[at] = T.cast(value, dtype)
            tile[per_part + at] = T.cast(value - T.cast(T.cast(value, dtype), "float32"), dtype)


@T.macro
def add_offset_correction(plan, mem, by, bx, tx, wg, wq, lane, k0, count):
    """Before the k-loop, with no wgmma in flight: the running sums plus sum_j s_j (-X_j / 64) over the
    block's k-tiles k0 .. k0 + count, one 16-bit wgmma step per 16 k-tiles and part, the loads of a
    batch of steps first; every wgmma is done when it returns."""
    bm, g, acc = plan.bm, plan.g, mem.acc
    ab = mma_operand_dtype(plan.dtype)
    per_part_units = bm * K_TILES_PER_STEP * 2 // 16
    count_batches, batch = batches(plan)
    kv = T.alloc_local((batch * sums_per_thread(plan),), "float32")
    sv = T.alloc_local((batch * g * 8,), plan.dtype)
    # no swizzle (layout type 0); leading offset: the next 8 k (bm / 8 core matrices on); stride
    # offset: the next 8 tokens (one core matrix on)
    T.initialize_wgmma_descriptor(mem.ks_desc, mem.KS_s.access_ptr("r"), 0, bm // CORE * CORE_UNITS, CORE_UNITS)
    for b in T.serial(count_batches):
        for c in T.unroll(batch):
            first = k0 + (b * batch + c) * K_TILES_PER_STEP
            load_sums(plan, mem, by, tx, kv, c, first, k0 + count - 1)
            load_scales(plan, mem, bx, wg, wq, lane, sv, c, first, k0 + count)
        for c in T.unroll(batch):
            store_sums_tile(plan, mem, tx, kv, c)
            T.call_extern("handle", "tm_fence_async_shared")
            T.call_extern("handle", "tm_consumers_sync", plan.consumers)
            T.warpgroup_fence_operand(acc, num_regs=plan.acc_len)
            T.warpgroup_arrive()
            for part in T.unroll(2):
                for i in T.unroll(g):
                    T.ptx_wgmma_rs("float32", f"m64n{bm}k16", True, ab, ab, "fp32", sv.data, (c * g + i) * 8,
                                   mem.ks_desc.data, part * per_part_units, acc.data, i * (bm // 2), 1, 1, 1)
            T.warpgroup_commit_batch()
            T.warpgroup_wait(0)
            T.warpgroup_fence_operand(acc, num_regs=plan.acc_len)
            T.call_extern("handle", "tm_consumers_sync", plan.consumers)     # before the next step's tile
