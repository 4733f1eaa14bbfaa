"""AWQ checkpoints, GEMM layout (AutoAWQ): `quant_method: "awq"`, `version: "gemm"`.

Per linear layer with K input and N output features, group size g:
- qweight int32 [K, N / 8] and qzeros int32 [K / g, N / 8], both packed along N: nibble i of word
  column c holds column 8c + AWQ_ORDER[i] (the order AutoAWQ's GEMM kernel dequantizes in);
- scales [K / g, N];
- w[k, n] = scales[k // g, n] * (q[k, n] - z[k // g, n]), zero points stored as they are.
AWQ's GEMM layers always carry zero points. "exllama" and "ipex" (`version`, or `format` in newer
transformers) are ways of running those same tensors and read as "gemm"; the "gemv" layouts and
llm-awq's own (`backend: "llm-awq"`: int16 words, scaled zeros) are other formats and are refused.
"""
from __future__ import annotations

import torch
from torch import nn

from .files import LayerTensors, config_error
from .layer import BITS, NIBBLES, QuantizedLayer, build_layer, group_size_problem, unpack_columns

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GEMM_TENSORS = ("gemm", "exllama", "ipex")   # versions whose files hold the GEMM layout


class AwqFormat:
    marker = "qweight"

    def __init__(self, qcfg: dict):
        bits = qcfg.get("bits", qcfg.get("w_bit"))
        if bits != BITS:
            raise config_error("bits", f"{bits}-bit weights: tilemarlin runs 4-bit weights only")
        self.group_size = qcfg.get("group_size", qcfg.get("q_group_size", 128))
        problem = group_size_problem(self.group_size)
        if problem:
            raise config_error("group_size", problem)
        if str(qcfg.get("backend", "auto")).lower() == "llm-awq":   # "auto" / "autoawq": AutoAWQ's tensors
            raise config_error("backend", "'llm-awq': its own layout (int16 words, scaled zeros); tilemarlin reads "
                                          "AutoAWQ's")
        key = "version" if "version" in qcfg else "format"
        version = str(qcfg.get(key, "gemm")).lower()
        if version not in GEMM_TENSORS:
            raise config_error(key, f"{version!r}: tilemarlin reads AWQ's 'gemm' layout only (also saved as "
                                    f"{GEMM_TENSORS[1:]})")

    def convert(self, t: LayerTensors, module: nn.Module, bias: torch.Tensor | None,
                dtype: torch.dtype) -> QuantizedLayer:
        k, n = module.in_features, module.out_features
        group = k if self.group_size == -1 else self.group_size
        problem = group_size_problem(self.group_size, k)
        if problem or n % NIBBLES:
            raise t.error("qweight", problem or f"out_features={n} is not a multiple of 8")
        shapes = f"for in_features={k}, out_features={n}, group_size={self.group_size}"
        qweight = t.require("qweight", torch.int32, (k, n // NIBBLES), shapes)
        qzeros = t.require("qzeros", torch.int32, (k // group, n // NIBBLES), shapes)
        scales = t.require("scales", shape=(k // group, n), why=shapes, floating=True)
        codes = unpack_columns(qweight, AWQ_ORDER)
        zeros = unpack_columns(qzeros, AWQ_ORDER)
        return build_layer(codes, scales, zeros, None, self.group_size, bias, dtype)
