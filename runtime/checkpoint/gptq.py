"""GPTQ checkpoints (AutoGPTQ, GPTQModel, Hugging Face): `quant_method: "gptq"`.

Per linear layer with K input and N output features, group size g (-1: one group spanning K):
- qweight int32 [K / 8, N], packed along K: row 8r + i of the codes is nibble i of word row r;
- qzeros int32 [K / g, N / 8], packed along N: column 8c + i is nibble i of word column c;
- scales [K / g, N]; g_idx int32 [K], the group of each input row (act-order when not k // g);
- w[k, n] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]).
`checkpoint_format` "gptq" (v1, the default) stores z - 1; GPTQModel's "gptq_v2" stores z. v1 has two
packings of z = 0, which a nibble of 15 marks:
- GPTQModel subtracts 0x11111111 from each whole word, so z = 0 borrows from the nibble above; adding
  the word back, as it does to read v1, recovers every z in 0..15 exactly;
- AutoGPTQ ORs each nibble's z - 1 into the word unmasked, so z = 0 (-1) sets every nibble from its
  own up to 15, and the zero points above it are lost.
A layer with a 15 below a nibble other than 15 can only be the first (a borrow), and so is a layer
whose 15s are each the word's top nibble alone (both packings read z = 0 there): those are read word
by word. A layer whose 15s all run to the word's top, some over two nibbles or more, is the second,
and is refused: no reading gives its zero points back.
Symmetric or not (`sym`) and act-order or not (`desc_act`) are read from the tensors themselves (zero
points all 8, g_idx the trivial map), so the flags need not be trusted.

`gptq_layer` unpacks one layer's tensors; `GptqFormat` reads them from a checkpoint folder for the
loader, and `QuantLinear.from_gptq` takes them as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from .files import LayerTensors, config_error
from .layer import BITS, NIBBLES, QuantizedLayer, build_layer, group_size_problem, unpack_columns, unpack_rows

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def gptq_layer(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               bits: int, group_size: int, checkpoint_format: str, bias: torch.Tensor | None,
               dtype: torch.dtype) -> QuantizedLayer:
    """One GPTQ layer's tensors, as written on disk, -> QuantizedLayer (scales and bias in `dtype`).

    K and N are read from qweight [K / 8, N]; g_idx None means the trivial map k // group. Raises
    ValueError, naming the field, for another bit width or checkpoint format, a group size no kernel
    runs, tensors whose dtypes or shapes do not fit together and an act-order map that does not give
    every group `group_size` rows.
    """
    if bits != BITS:
        raise ValueError(f"bits: tilemarlin runs 4-bit weights only; this GPTQ layer has bits={bits}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format: must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    for field, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise ValueError(f"{field}: expected 2-D torch.int32 words, found {tensor.dtype} {tuple(tensor.shape)}")
    k, n = qweight.shape[0] * NIBBLES, qweight.shape[1]
    problem = group_size_problem(group_size, k)
    if problem:
        raise ValueError(f"group_size: {problem}")
    groups = k // (k if group_size == -1 else group_size)
    shapes = f"for K={k}, N={n} (from qweight {tuple(qweight.shape)}) and group size {group_size}"
    for field, tensor, shape in (("scales", scales, (groups, n)), ("qzeros", qzeros, (groups, -(-n // NIBBLES)))):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{field}: expected shape {shape} {shapes}, found {tuple(tensor.shape)}")
    if checkpoint_format == "gptq":
        _refuse_lost_v1_zero_points(qzeros, n)
        qzeros = _v1_words_to_v2(qzeros)
    zeros = unpack_columns(qzeros)[:, :n]
    return build_layer(unpack_rows(qweight), scales, zeros, g_idx, group_size, bias, dtype)


V1_OFFSET = 0x11111111     # one in every nibble: what v1's writers take off each packed zero-point word


def _refuse_lost_v1_zero_points(qzeros: torch.Tensor, n: int) -> None:
    """A ValueError for v1 zero-point words that older AutoGPTQ's packing overwrote (module docstring);
    nothing for words that GPTQModel's whole-word packing wrote."""
    nibbles = unpack_columns(qzeros).view(qzeros.shape[0], qzeros.shape[1], NIBBLES)
    real = (torch.arange(qzeros.shape[1] * NIBBLES, device=qzeros.device) < n).view(1, -1, NIBBLES)
    fifteen = (nibbles == 15) & real
    if not bool(fifteen.any()):
        return
    # a 15 below a real nibble other than 15 in its word: a borrow, which only the whole-word packing makes
    above_fifteen = fifteen.int().cummax(dim=2).values.bool()
    if bool((above_fifteen & real & ~fifteen).any()):
        return
    runs = fifteen.sum(dim=2)            # each word's 15s run from the first to its top real nibble
    if bool((runs >= 2).any()):
        group, word = (runs >= 2).nonzero()[0].tolist()
        raise ValueError(f"qzeros: group {group}, columns {8 * word}..{min(8 * word + 7, n - 1)} read 15 from a zero "
                         "point up: an older AutoGPTQ's v1 packing, which overwrites the zero points above a zero "
                         "point of 0; quantize the model again, or save it as gptq_v2 with GPTQModel")


def _v1_words_to_v2(qzeros: torch.Tensor) -> torch.Tensor:
    """v1 zero-point words -> v2 (z itself in every nibble): V1_OFFSET added to each whole 32-bit word,
    carries included, modulo 2^32."""
    words = (qzeros.to(torch.int64) + V1_OFFSET) & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


class GptqFormat:
    marker = "qweight"   # the tensor whose presence makes a layer quantized

    def __init__(self, qcfg: dict):
        bits = qcfg.get("bits")
        if bits != BITS:
            raise config_error("bits", f"{bits}-bit weights: tilemarlin runs 4-bit weights only")
        self.group_size = qcfg.get("group_size", 128)
        problem = group_size_problem(self.group_size)
        if problem:
            raise config_error("group_size", problem)
        key = "checkpoint_format" if "checkpoint_format" in qcfg else "format"
        self.checkpoint_format = str(qcfg.get(key, "gptq")).lower()
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise config_error(key, f"{self.checkpoint_format!r} is not a layout tilemarlin reads; it reads "
                                    f"{CHECKPOINT_FORMATS}")
        if str(qcfg.get("pack_dtype", "int32")) != "int32":
            raise config_error("pack_dtype", f"{qcfg['pack_dtype']!r}: only int32 words are read")
        overrides = [rule for rule, settings in (qcfg.get("dynamic") or {}).items()
                     if not str(rule).startswith("-:") and self._overrides(settings)]
        if overrides:   # GPTQModel's "-:" rules only leave layers unquantized, which the files show
            raise config_error("dynamic", f"per-layer overrides of bits or group size ({overrides[0]!r}) are not "
                                          "supported; only '-:' rules, which skip layers, and rules that repeat "
                                          "the global bits and group size are")
        if qcfg.get("is_marlin_format"):
            raise config_error("is_marlin_format", "AutoGPTQ's Marlin repacking (tensors B and s) is not read; "
                                                   "save the model in the GPTQ layout (qweight, qzeros, scales)")
        if qcfg.get("rotation"):
            raise config_error("rotation", f"{qcfg['rotation']!r}: weights quantized after a rotation need "
                                           "the rotation applied to activations at run time, which tilemarlin "
                                           "does not do")

    def _overrides(self, settings) -> bool:
        """Whether a `dynamic` rule's settings change bits or group size (auto-round writes "+:lm_head"
        rules that repeat the global ones)."""
        if not isinstance(settings, dict):
            return True
        return (settings.get("bits", BITS) != BITS
                or settings.get("group_size", self.group_size) != self.group_size)

    def convert(self, t: LayerTensors, module: nn.Module, bias: torch.Tensor | None,
                dtype: torch.dtype) -> QuantizedLayer:
        """The layer's tensors, checked against the module built from config.json (errors name the
        file, the layer and the field), unpacked by gptq_layer."""
        k, n = module.in_features, module.out_features
        group = k if self.group_size == -1 else self.group_size
        problem = group_size_problem(self.group_size, k)
        if problem or k % NIBBLES:
            raise t.error("qweight", problem or f"in_features={k} is not a multiple of 8")
        shapes = f"for in_features={k}, out_features={n}, group_size={self.group_size}"
        qweight = t.require("qweight", torch.int32, (k // NIBBLES, n), shapes)
        qzeros = t.require("qzeros", torch.int32, (k // group, -(-n // NIBBLES)), shapes)
        scales = t.require("scales", shape=(k // group, n), why=shapes, floating=True)
        return gptq_layer(qweight, qzeros, scales, t.optional("g_idx"), BITS, self.group_size,
                          self.checkpoint_format, bias, dtype)
