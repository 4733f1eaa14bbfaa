"""W4A8 on the W4A16 kernels (Problem.rounds_fp8): the activations, in the problem's dtype, rounded to
their FP8 values inside the kernel, so that no activation kernel runs before it.

Each 16-bit activation is rounded to e4m3's 3 mantissa bits, to nearest with ties to even, on its bits:
add half the last kept bit's weight less one, and that bit itself (a tie goes to the even side), then
clear the dropped bits (7 of float16's mantissa, 4 of bfloat16's). A carry out of the mantissa moves
the exponent up, as rounding should; none crosses into the other half of a 32-bit word for finite
values. With W4A8's power-of-two token scales this is e4m3's rounding of x / s, times s, wherever x / s
is a normal e4m3 number (schedules.quant.fp8_token_scales) and x a normal float16 / bfloat16: the kernel
needs no scale, so it needs no pass over the row first. Below 2^-6 s, where e4m3 has subnormals, values
keep 3 bits instead, and float16's subnormals (under 2^-14) round to multiples of 2^-17: within 2^-9 s
or 2^-17 of W4A8's value (tests/test_fp8_decode.py). float16 values from 63488 up round to infinity, as
the rounded product with the scale does.

stream_mma rounds its activation registers before their MMAs (ROUND_PAIR); stream_wgmma, whose wgmmas
read the activations from shared memory, rounds each landed stage in place and hands it to the async
proxy (ROUND_CHUNKS).
"""

# Bits of each dtype's mantissa that e4m3 drops.
DROPPED_BITS = {"float16": 7, "bfloat16": 4}

ROUND_PAIR = r"""
template <int kDropped>
__device__ __forceinline__ unsigned tm_round_e4m3_word(unsigned w) {
  constexpr unsigned kBias = ((1u << (kDropped - 1)) - 1) * 0x00010001u;
  constexpr unsigned kKept = ((0xFFFFu << kDropped) & 0xFFFFu) * 0x00010001u;
  return (w + kBias + ((w >> kDropped) & 0x00010001u)) & kKept;
}
template <int kDropped>
__device__ __forceinline__ void tm_round_e4m3_pair(void* pair) {
  unsigned& w = *static_cast<unsigned*>(pair);
  w = tm_round_e4m3_word<kDropped>(w);
}
"""

# A shared stage of kChunks 16-byte chunks rounded in place by kThreads threads (the element order does
# not matter: every element is rounded alike, so the swizzle is ignored), then fenced for the async
# proxy that the wgmmas read through; the caller makes the threads meet before any wgmma reads it.
ROUND_CHUNKS = ROUND_PAIR + r"""
template <int kDropped, int kChunks, int kThreads>
__device__ __forceinline__ void tm_round_e4m3_chunks(void* stage) {
  uint4* chunks = static_cast<uint4*>(stage);
  #pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int c = i * kThreads + static_cast<int>(threadIdx.x);
    if (kChunks % kThreads == 0 || c < kChunks) {
      uint4 v = chunks[c];
      v.x = tm_round_e4m3_word<kDropped>(v.x);
      v.y = tm_round_e4m3_word<kDropped>(v.y);
      v.z = tm_round_e4m3_word<kDropped>(v.z);
      v.w = tm_round_e4m3_word<kDropped>(v.w);
      chunks[c] = v;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
"""


def round_pair_call(dtype: str) -> str:
    """The device function that rounds one 32-bit register of two `dtype` activations in place."""
    return f"tm_round_e4m3_pair<{DROPPED_BITS[dtype]}>"


def round_chunks_call(dtype: str, chunks: int, threads: int) -> str:
    """The device function that rounds a shared stage of `chunks` 16-byte chunks with `threads` threads."""
    return f"tm_round_e4m3_chunks<{DROPPED_BITS[dtype]}, {chunks}, {threads}>"
