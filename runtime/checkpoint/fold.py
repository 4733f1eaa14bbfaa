"""Act-order without a gather where the layer before can take it: a gated MLP's down_proj.

An act-order layer reads x[..., perm] (runtime/checkpoint/layer.py), which costs a gather kernel
before its GEMM. A gated MLP (Llama, Mistral, Qwen2, Gemma) computes
down_proj(act_fn(gate_proj(x)) * up_proj(x)), column by column: column j of down_proj's input
depends on column j of gate_proj's and up_proj's outputs alone. Storing gate_proj's and up_proj's
output columns in down_proj's `perm` order (their codes, scales, zero points and bias permuted
along N, which costs their GEMMs nothing) hands down_proj its input already gathered, so down_proj
runs without its permutation. Of a Llama block's act-order gathers this removes the one on the
longest rows (K = intermediate size).

Which modules are gated MLPs is not taken from their class names: `feeds_columnwise` runs the
module's own forward with stand-ins for its three layers and checks that permuting the columns
that gate_proj and up_proj return permutes the columns that down_proj receives, and nothing else.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .layer import QuantizedLayer
from ..probe import Fixed, Returns, copied, equal, random_like, single_owner, swapped

GATED_MLP = ("gate_proj", "up_proj", "down_proj")
_PROBE_ROWS = 3


class GatherFolding:
    """The folds of one model: down_proj's permutation moved into its gate_proj and up_proj.

    `order(names)` lists the quantized layers so that each folded down_proj comes before its
    gate_proj and up_proj; `apply(name, layer)` must then see the converted layers in that order, and
    returns each as it is to be served."""

    def __init__(self, model: nn.Module, quantized: set[str]):
        self.gates_of = gated_mlps(model, quantized)
        self._output_order: dict[str, torch.Tensor] = {}

    def order(self, names: list[str]) -> list[str]:
        down_of = {gate: down for down, gates in self.gates_of.items() for gate in gates}
        ordered: list[str] = []
        for name in names:
            down = down_of.get(name)
            if down in names and down not in ordered:
                ordered.append(down)
            if name not in ordered:
                ordered.append(name)
        return ordered

    def apply(self, name: str, layer: QuantizedLayer) -> QuantizedLayer:
        if name in self.gates_of and layer.perm is not None:
            self._output_order.update(dict.fromkeys(self.gates_of[name], layer.perm))
            layer = dataclasses.replace(layer, perm=None)
        if name in self._output_order:
            layer = outputs_permuted(layer, self._output_order.pop(name))
        return layer


def outputs_permuted(layer: QuantizedLayer, order: torch.Tensor) -> QuantizedLayer:
    """The layer whose output column i is `layer`'s output column order[i]."""
    order = order.to(layer.codes.device)

    def columns(t):
        return None if t is None else t.index_select(-1, order).contiguous()

    return dataclasses.replace(layer, codes=columns(layer.codes), scales=columns(layer.scales),
                               zeros=columns(layer.zeros), bias=columns(layer.bias))


def gated_mlps(model: nn.Module, quantized: set[str]) -> dict[str, tuple[str, str]]:
    """down_proj's name -> (gate_proj's, up_proj's) for every module of `model` with those three
    nn.Linear children, all three in `quantized`, of matching widths, used nowhere else in the model,
    that feeds_columnwise."""
    owned = single_owner(model)
    found = {}
    for name, module in model.named_modules():
        layers = [getattr(module, child, None) for child in GATED_MLP]
        if not all(isinstance(layer, nn.Linear) and id(layer) in owned for layer in layers):
            continue
        names = [f"{name}.{child}" if name else child for child in GATED_MLP]
        gate, up, down = layers
        widths_match = gate.out_features == up.out_features == down.in_features and gate.in_features == up.in_features
        if all(n in quantized for n in names) and widths_match and feeds_columnwise(module):
            found[names[2]] = (names[0], names[1])
    return found


def feeds_columnwise(mlp: nn.Module) -> bool:
    """Whether `mlp`'s forward gives down_proj a columnwise function of gate_proj's and up_proj's
    outputs and uses them nowhere else: run on the CPU in float32 with stand-ins for the three layers
    (probe.py), permuting the columns that gate_proj and up_proj return must permute down_proj's input
    the same way and leave the module's output (down_proj's stand-in returns a fixed tensor) as it
    was. Any error of the probe (parameters on the meta device, another call pattern) answers False."""
    gate, down = mlp.gate_proj, mlp.down_proj
    cpu = torch.empty(0)
    x = random_like((1, _PROBE_ROWS, gate.in_features), cpu, seed=0)
    g, u = (random_like((1, _PROBE_ROWS, gate.out_features), cpu, seed) for seed in (1, 2))
    order = torch.randperm(gate.out_features, generator=torch.Generator().manual_seed(3))
    seen, outputs = [], []
    try:
        for g_out, u_out in ((g, u), (g[..., order], u[..., order])):
            recorder = Fixed(down.out_features)
            with swapped(mlp, {"gate_proj": Returns(g_out), "up_proj": Returns(u_out), "down_proj": recorder}):
                outputs.append(copied(mlp(x)))
            seen.append(recorder.seen)
        first, permuted = seen
        return (first.shape == g.shape and torch.allclose(permuted, first[..., order], rtol=1e-6, atol=0)
                and equal(*outputs))
    except Exception:   # noqa: BLE001 - a forward the probe cannot run (or that skips a layer) is not folded
        return False
