"""GPTQ checkpoints (AutoGPTQ, GPTQModel, Hugging Face transformers/optimum) to and from codes/scales.

On disk, per linear layer with K input and N output features, 4 bits, group size g:
- qweight int32 [K / 8, N], packed along K: word row r holds input rows 8r..8r+7, row 8r+i in bits 4i..4i+3;
- qzeros int32 [K / g, N / 8], packed along N the same way (column 8c+i in bits 4i..4i+3);
- scales [K / g, N] (fp16); g_idx int32 [K], the group of each input row;
- w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
The classic format ("gptq", v1) stores z - 1, so a symmetric checkpoint stores 7 and means 8;
GPTQModel's "gptq_v2" stores z itself.

tilemarlin's kernels take symmetric weights (z = 8, as schedules.quant) in contiguous groups, so
importing checks both instead of silently computing something else.
"""
from __future__ import annotations

import torch

from schedules.quant import zero_point

BITS = 4
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_NIBBLES = 32 // BITS
_SHIFTS = tuple(range(0, 32, BITS))   # nibble i of a word sits at bits 4i..4i+3


def _unpack_along_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [8R, C]: row 8r+i is nibble i of word row r."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device).view(1, _NIBBLES, 1)
    nibbles = (words.unsqueeze(1) >> shifts) & 0xF   # arithmetic shift; the mask drops the sign
    return nibbles.reshape(-1, words.shape[1])


def _pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 [8R, C] -> int32 [R, C], the inverse of _unpack_along_rows."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device).view(1, _NIBBLES, 1)
    words = (values.to(torch.int64).reshape(-1, _NIBBLES, values.shape[1]) << shifts).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _check_format(bits: int, checkpoint_format: str) -> None:
    if bits != BITS:
        raise ValueError(f"tilemarlin runs 4-bit weights only; this GPTQ layer has bits={bits}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq"):
    """GPTQ tensors of one layer -> (codes uint8 [K, N], scales [K / group, N]) as schedules.quant uses.

    Raises ValueError for other bit widths, asymmetric zero points, act-order (desc_act) group maps
    and tensors whose shapes do not fit together.
    """
    _check_format(bits, checkpoint_format)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError(f"qweight and qzeros must be 2-D int32, got {qweight.dtype} {tuple(qweight.shape)} "
                         f"and {qzeros.dtype} {tuple(qzeros.shape)}")
    k, n = qweight.shape[0] * _NIBBLES, qweight.shape[1]
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"K={k} (from qweight {tuple(qweight.shape)}) is not a multiple of group_size={group_size}")
    groups = k // group
    if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, -(-n // _NIBBLES)):
        raise ValueError(f"for K={k}, N={n}, group_size={group_size} expected scales {(groups, n)} and qzeros "
                         f"{(groups, -(-n // _NIBBLES))}, got {tuple(scales.shape)} and {tuple(qzeros.shape)}")
    _check_group_map(g_idx, k, group)

    zeros = _unpack_along_rows(qzeros.t()).t()[:, :n]
    if checkpoint_format == "gptq":
        zeros = zeros + 1   # v1 stores z - 1
    _check_symmetric(zeros, checkpoint_format)
    codes = _unpack_along_rows(qweight).to(torch.uint8)
    return codes.contiguous(), scales.contiguous()


def _check_group_map(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if g_idx is None:
        return
    if tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx must have K={k} entries, got shape {tuple(g_idx.shape)}")
    expected = torch.arange(k, device=g_idx.device) // group
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError(
            "this GPTQ layer uses act-order (desc_act=True): g_idx is not k // group_size, so the rows of "
            "one group are scattered over K. tilemarlin's kernels need contiguous groups; quantize the "
            "model again with desc_act=False.")


def _check_symmetric(zeros: torch.Tensor, checkpoint_format: str) -> None:
    zero = zero_point(BITS)
    if bool((zeros != zero).any()):
        found = sorted(set(zeros.unique().tolist()))
        hint = ""
        if found == [zero + 1] and checkpoint_format == "gptq":
            hint = " (all zero points read 9: is this a gptq_v2 checkpoint? pass checkpoint_format='gptq_v2')"
        elif found == [zero - 1] and checkpoint_format == "gptq_v2":
            hint = " (all zero points read 7: is this a v1 checkpoint? pass checkpoint_format='gptq')"
        raise ValueError(f"asymmetric GPTQ weights are not supported: tilemarlin needs every zero point to be "
                         f"{zero} (sym=True), found {found[:8]}{hint}")


def to_gptq(codes: torch.Tensor, scales: torch.Tensor, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """(codes [K, N], scales [G, N]) -> GPTQ tensors {qweight, qzeros, scales, g_idx} as written on disk
    (symmetric, no act-order)."""
    _check_format(BITS, checkpoint_format)
    k, n = codes.shape
    groups = scales.shape[0]
    if k % _NIBBLES or n % _NIBBLES or k % groups or scales.shape[1] != n:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not make a GPTQ layer "
                         f"(K and N must be multiples of {_NIBBLES}, K of the number of groups)")
    stored_zero = zero_point(BITS) - (1 if checkpoint_format == "gptq" else 0)
    zeros = torch.full((groups, n), stored_zero, dtype=torch.int64, device=codes.device)
    return {
        "qweight": _pack_along_rows(codes),
        "qzeros": _pack_along_rows(zeros.t()).t().contiguous(),
        "scales": scales.contiguous(),
        "g_idx": (torch.arange(k, device=codes.device) // (k // groups)).to(torch.int32),
    }
