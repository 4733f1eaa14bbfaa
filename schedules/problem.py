"""The problem a kernel solves: C[M, N] = A[M, K] @ dequant(W)[K, N], M dynamic."""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_BITS = (4,)


@dataclass(frozen=True)
class Problem:
    """One weight matrix: K input features, N output features, `group` rows per scale.

    ``group == K`` is channelwise quantization (one scale per output column). M is not part
    of the problem: every compiled kernel serves any M.
    """

    n: int
    k: int
    group: int = 128
    dtype: str = "float16"
    bits: int = 4

    def __post_init__(self):
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{self.bits}-bit weights are not supported; supported: {SUPPORTED_BITS}")
        if self.n <= 0 or self.k <= 0:
            raise ValueError(f"N and K must be positive, got N={self.n}, K={self.k}")
        if self.group <= 0 or self.k % self.group:
            raise ValueError(f"K={self.k} is not a multiple of the group size {self.group}")

    @classmethod
    def make(cls, n: int, k: int, group: int = 128, dtype: str = "float16", bits: int = 4) -> "Problem":
        """Build a problem; ``group=-1`` means channelwise (one group spanning K)."""
        return cls(n=n, k=k, group=k if group == -1 else group, dtype=dtype, bits=bits)

    @property
    def channelwise(self) -> bool:
        return self.group == self.k

    @property
    def num_groups(self) -> int:
        return self.k // self.group

    @property
    def name(self) -> str:
        g = "cw" if self.channelwise else f"g{self.group}"
        return f"n{self.n}_k{self.k}_{g}_{self.dtype}_w{self.bits}"

    def weight_bytes(self) -> int:
        """Bytes of packed weights plus scales that one call must read."""
        return self.k * self.n * self.bits // 8 + self.num_groups * self.n * 2
