"""One quantized linear layer in the form every checkpoint format is converted to.

A checkpoint format packs the same few things in its own way: 4-bit codes, per-group scales, maybe
per-group zero points, maybe a map from input rows to groups (act-order). `QuantizedLayer` holds
them unpacked and in tilemarlin's orientation (W[K, N], input features x output features), so that
each format needs only an unpacker and the runtime has one place that turns a layer into kernels'
weights (`QuantLinear.from_layer`, runtime/linear.py).

Act-order. A GPTQ or compressed-tensors layer quantized in activation order assigns input row k to
group g_idx[k], so the rows of one group are scattered over K. Sorting the rows by g_idx (stably)
makes every group contiguous again: the codes are stored in that order, `perm[i]` being the input
feature of row i, and since x @ W = x[..., perm] @ W[perm], the layer gathers its input's columns
by `perm` before the GEMM. The trivial map g_idx[k] = k // group needs no permutation: perm is None.

Zero points. w = s * (q - z). None means symmetric, z = 8 everywhere; other zero points the kernels
take beside the scales (schedules/marlin_mma/layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from schedules.quant import zero_point
from schedules.registry import group_size_problem

BITS = 4
SYMMETRIC_ZERO = zero_point(BITS)   # 8: the code the kernels decode as zero
NIBBLES = 32 // BITS               # 4-bit values per int32 word


@dataclass(frozen=True)
class QuantizedLayer:
    """One linear layer's INT4 weights, unpacked: w[k, n] = scales[g, n] * (codes[k, n] - zeros[g, n]).

    codes : uint8 [K, N], values 0..15; with `perm`, row i holds input feature perm[i].
    scales : [K / group, N] in the model's dtype (float16 or bfloat16).
    zeros : uint8 [K / group, N], values 0..15, or None for symmetric weights (zero point 8).
    perm : int64 [K], the act-order permutation of the input features, or None.
    group_size : input rows per group, or -1 for one group spanning K (channelwise).
    bias : [N] in the model's dtype, or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    group_size: int
    bias: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.codes.shape[0]

    @property
    def n(self) -> int:
        return self.codes.shape[1]

    @property
    def group(self) -> int:
        """Rows per group, K when channelwise."""
        return self.k if self.group_size == -1 else self.group_size

    def dequantize(self) -> torch.Tensor:
        """fp32 W[K, N] in the input features' own order (perm undone)."""
        groups = self.scales.shape[0]
        zeros = SYMMETRIC_ZERO if self.zeros is None else self.zeros.float().unsqueeze(1)
        w = (self.codes.float().reshape(groups, self.group, self.n) - zeros) * self.scales.float().unsqueeze(1)
        w = w.reshape(self.k, self.n)
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(0, self.perm, w)


def build_layer(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                group_size: int, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantizedLayer:
    """A QuantizedLayer from unpacked tensors in the input features' order.

    codes [K, N] and zeros [G, N] are integers 0..15, scales [G, N]; g_idx [K] is the group of each
    input row or None (k // group). Rows are sorted by g_idx when it is not the trivial map, zero
    points that are all 8 are dropped (symmetric), scales and bias are cast to `dtype`.
    Raises ValueError naming the field that is wrong; the scales' values are checked where the layer
    becomes a QuantLinear (from_layer names the first one that is not finite and positive).
    """
    k, n = codes.shape
    group = k if group_size == -1 else group_size
    problem = group_size_problem(group_size, k)
    if problem:
        raise ValueError(f"group_size: {problem}")
    groups = k // group
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales: expected {(groups, n)} for K={k}, N={n}, group size {group_size}, "
                         f"got {tuple(scales.shape)}")
    if zeros is not None and tuple(zeros.shape) != (groups, n):
        raise ValueError(f"zero points: expected {(groups, n)} for K={k}, N={n}, group size {group_size}, "
                         f"got {tuple(zeros.shape)}")
    if zeros is not None and zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) > 15):
        raise ValueError(f"zero points: must lie in 0..15, found {int(zeros.min())}..{int(zeros.max())}")
    perm = None if g_idx is None else act_order_permutation(g_idx, k, group)
    if perm is not None:
        codes = codes.index_select(0, perm)
    if zeros is not None and bool((zeros == SYMMETRIC_ZERO).all()):
        zeros = None
    return QuantizedLayer(
        codes=codes.to(torch.uint8).contiguous(),
        scales=scales.to(dtype).contiguous(),
        zeros=None if zeros is None else zeros.to(torch.uint8).contiguous(),
        perm=perm,
        group_size=group_size,
        bias=None if bias is None else bias.to(dtype).contiguous(),
    )


def act_order_permutation(g_idx: torch.Tensor, k: int, group: int) -> torch.Tensor | None:
    """The stable sort of the input rows by group, or None when g_idx is already k // group.

    Raises ValueError when g_idx does not give every group exactly `group` rows (a layer the
    kernels' contiguous groups cannot express)."""
    if g_idx.dim() != 1 or g_idx.shape[0] != k:
        raise ValueError(f"g_idx: expected {k} entries (one per input feature), got shape {tuple(g_idx.shape)}")
    g_idx = g_idx.to(torch.int64)
    trivial = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx, trivial):
        return None
    groups = k // group
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"g_idx: groups must lie in [0, {groups}), found {int(g_idx.min())}..{int(g_idx.max())}")
    counts = torch.bincount(g_idx, minlength=groups)
    if bool((counts != group).any()):
        raise ValueError(f"g_idx: every group must hold {group} input rows, found group sizes "
                         f"{sorted(set(counts.tolist()))}")
    return torch.sort(g_idx, stable=True).indices


# --- 4-bit words -----------------------------------------------------------------------------------

def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [8R, C]: row 8r + i is nibble i (bits 4i..4i+3) of word row r."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=words.device).view(1, NIBBLES, 1)
    return ((words.unsqueeze(1) >> shifts) & 0xF).reshape(-1, words.shape[1])


def unpack_columns(words: torch.Tensor, order: tuple[int, ...] = tuple(range(NIBBLES))) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8C]: column 8c + order[i] is nibble i of word column c."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=words.device).view(1, 1, NIBBLES)
    nibbles = (words.unsqueeze(2) >> shifts) & 0xF                  # [R, C, slot]
    slot_of_column = torch.tensor(order, device=words.device).argsort()
    return nibbles[:, :, slot_of_column].reshape(words.shape[0], -1)
