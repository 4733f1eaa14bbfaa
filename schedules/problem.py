"""The problem a kernel solves: C[M, N] = A[M, K] @ dequant(W)[K, N], M dynamic."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_BITS = (4,)
# What the GEMM's activation operand is: the problem's dtype itself (W4A16), FP8 e4m3 with a scale per
# token (W4A8: schedules/fp8_activations.py quantizes them first), or the problem's dtype rounded to
# those FP8 values by a W4A16 kernel itself (fp8_rounded: W4A8 at small M, schedules/fp8_rounding.py).
SUPPORTED_ACTS = ("dtype", "fp8", "fp8_rounded")
# What a layer asks for: fp8_rounded is what the op runs a W4A8 layer as at some buckets, not a choice.
LAYER_ACTS = ("dtype", "fp8")


@dataclass(frozen=True)
class Problem:
    """One weight matrix: K input features, N output features, `group` rows per scale.

    ``group == K`` is channelwise quantization (one scale per output column). With `zero_points`
    each group and column has its own zero point z, w = s * (q - z), instead of 8; the kernels take
    it beside the scale (schedules/marlin_mma/layout.py). With ``act="fp8"``
    the kernel multiplies FP8 e4m3 activations (a scale per token, in layout.fp8_k_order) by the
    same packed weights on FP8 tensor cores, and `dtype` is the type of the layer's input, scales and
    output. M is not part of the problem: every compiled kernel serves any M.
    """

    n: int
    k: int
    group: int = 128
    dtype: str = "float16"
    bits: int = 4
    zero_points: bool = False
    act: str = "dtype"

    def __post_init__(self):
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{self.bits}-bit weights are not supported; supported: {SUPPORTED_BITS}")
        if self.n <= 0 or self.k <= 0:
            raise ValueError(f"N and K must be positive, got N={self.n}, K={self.k}")
        if not isinstance(self.zero_points, bool):
            raise ValueError(f"zero_points must be True or False, got {self.zero_points!r}")
        if self.group <= 0:
            raise ValueError(f"group size {self.group}: a group holds a positive number of input rows (-1: "
                             "channelwise)")
        if self.k % self.group:
            raise ValueError(f"K={self.k} is not a multiple of the group size {self.group}")
        if self.act not in SUPPORTED_ACTS:
            raise ValueError(f"activations {self.act!r} are not supported; use one of {SUPPORTED_ACTS}")
        if self.act != "dtype" and self.zero_points:
            raise ValueError("FP8 activations with zero points are not supported: W4A8 takes symmetric weights")

    @classmethod
    def make(cls, n: int, k: int, group: int = 128, dtype: str = "float16", bits: int = 4,
             zero_points: bool = False, act: str = "dtype") -> "Problem":
        """Build a problem; ``group=-1`` means channelwise (one group spanning K)."""
        return cls(n=n, k=k, group=k if group == -1 else group, dtype=dtype, bits=bits, zero_points=zero_points,
                   act=act)

    @property
    def channelwise(self) -> bool:
        return self.group == self.k

    @property
    def fp8(self) -> bool:
        """W4A8: FP8 e4m3 activations."""
        return self.act == "fp8"

    @property
    def rounds_fp8(self) -> bool:
        """W4A8 on a W4A16 kernel that rounds the activations (in the problem's dtype) to their FP8
        values itself: e4m3's 3 mantissa bits, which with W4A8's power-of-two token scales are its
        values wherever they are normal e4m3 numbers (schedules/fp8_rounding.py)."""
        return self.act == "fp8_rounded"

    @property
    def rounded_twin(self) -> "Problem":
        """The same weights as fp8_rounded: what a W4A8 problem runs as on its W4A16 twin's schedules
        (runtime.dispatch.Dispatch.serving_problem)."""
        return dataclasses.replace(self, act="fp8_rounded")

    @property
    def w4a16_twin(self) -> "Problem":
        """The same weights with activations in the problem's dtype: the W4A16 problem whose tuned
        schedules serve a W4A8 one, as fp8_rounded, at the buckets where they are faster
        (runtime.dispatch.Dispatch.serving_problem)."""
        return dataclasses.replace(self, act="dtype")

    @property
    def num_groups(self) -> int:
        return self.k // self.group

    @property
    def name(self) -> str:
        g = "cw" if self.channelwise else f"g{self.group}"
        return f"n{self.n}_k{self.k}_{g}_{self.dtype}_w{self.bits}" + ("_zp" if self.zero_points else "") + \
            ("_a8" if self.fp8 else "") + ("_r8" if self.rounds_fp8 else "")

    @property
    def scale_rows(self) -> int:
        """Rows of the kernels' scales tensor: a scale row per group, and with zero points a zero-point
        row after each."""
        return self.num_groups * (2 if self.zero_points else 1)

    def weight_bytes(self) -> int:
        """Bytes of packed weights plus scales (and zero points) that one call must read."""
        return self.k * self.n * self.bits // 8 + self.scale_rows * self.n * 2
