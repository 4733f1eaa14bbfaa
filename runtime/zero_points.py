"""Zero points other than 8, served beside the kernels until the kernels decode them themselves.

The kernels decode w = s * (q - 8). A layer with zero points z has w = s * (q - z)
= s * (q - 8) + s * (8 - z), so

    x @ W = op(x, q, s) + groupsum(x) @ C,    C[g, n] = s[g, n] * (8 - z[g, n]),

where groupsum(x)[..., g] is the sum of x over the K columns of group g. C is [K / group, N]: the
correction is one GEMM of M x (K / group) x N beside the kernel's M x K x N, plus the sums over x.
C is computed in fp32 and stored in the model's dtype; the sums and the small GEMM run in fp32, and
one rounding to the model's dtype follows the addition. Everything is plain torch: no host
synchronization, CUDA-graph and torch.compile safe, and it runs on CPU tensors as well.
"""
from __future__ import annotations

import torch

from schedules.quant import zero_point_offsets

__all__ = ["zero_point_offsets", "group_sums", "add_zero_point_correction"]


def group_sums(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 [..., K / group]: x [..., K] summed over each group's contiguous K columns."""
    return x.float().unflatten(-1, (x.shape[-1] // group, group)).sum(dim=-1)


def add_zero_point_correction(y: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor:
    """y + groupsum(x) @ offsets, in fp32, returned in y's dtype.

    y : [..., N], the kernel's x @ (s * (q - 8)); x : [..., K] in the codes' row order (after any
    act-order gather); offsets : [K / group, N] from zero_point_offsets; group : rows per group (K
    when channelwise)."""
    correction = group_sums(x, group) @ offsets.float()
    return (y.float() + correction).to(y.dtype)
