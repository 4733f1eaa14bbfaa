"""compressed-tensors checkpoints (llm-compressor), INT4 weight-only `pack-quantized`.

`quant_method: "compressed-tensors"`; `config_groups` map schemes to the layers they target (module
class names such as "Linear", exact layer names, or "re:" regular expressions matched from the
name's start; a layer several groups target takes the scheme of its best match, an exact name before
a regular expression before a class name), `ignore` lists layers left dense. A `transform_config`
(QuIP or SpinQuant rotations, some applied to the activations at run time) is refused: the kernels
run plain products. Per layer, in nn.Linear's orientation [N, K]:
- weight_packed int32 [N, K / 8], packed along K: column 8c + i is nibble i of word column c;
- weight_shape [2] = (N, K); weight_scale [N, K / g] (strategy "group") or [N, 1] ("channel");
- weight_zero_point (asymmetric schemes only) int32 [N / 8, K / g or 1], packed along N the same
  way; checkpoints written before zero points were packed hold it as int8 [N, K / g or 1];
- weight_g_idx int32 [K] with `actorder: "group"`: the group of each input feature (-1: none set);
- nibbles are offset binary: the signed value q in -8..7 is stored as q + 8, zero points alike, so
  w = scale * (q - zp) = scale * (nibble - zero nibble), which is QuantizedLayer's form directly.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .files import LayerTensors, config_error
from .layer import BITS, NIBBLES, SYMMETRIC_ZERO, QuantizedLayer, build_layer, group_size_problem, unpack_columns, unpack_rows

PACK_QUANTIZED = "pack-quantized"
# Preset scheme names a config group may carry instead of a scheme: (symmetric, group size).
PRESETS = {"W4A16": (True, 128), "W4A16_ASYM": (False, 128)}


class Scheme:
    """One config group's weight quantization, as tilemarlin reads it."""

    def __init__(self, name: str, group: dict | list, global_format: str | None):
        where = f"config_groups.{name}"
        if isinstance(group, list):   # a preset: {"W4A16": ["Linear"]}
            if name not in PRESETS:
                raise config_error(where, f"preset scheme {name!r}: tilemarlin reads {sorted(PRESETS)}")
            self.targets = group
            self.symmetric, self.group_size = PRESETS[name]
            self.format = global_format
        else:
            self.targets = group.get("targets") or []
            self.format = group.get("format") or global_format
            weights = group.get("weights")
            if not isinstance(weights, dict):
                raise config_error(f"{where}.weights", "missing: tilemarlin runs weight-quantized layers")
            if group.get("input_activations") or group.get("output_activations"):
                raise config_error(f"{where}.input_activations",
                                   "quantized activations: tilemarlin runs weight-only (W4A16) schemes")
            self.symmetric, self.group_size = self._weights(weights, f"{where}.weights")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if self.format != PACK_QUANTIZED:
            raise config_error(f"{where}.format" if not isinstance(group, list) and group.get("format") else "format",
                               f"{self.format!r}: tilemarlin reads INT4 {PACK_QUANTIZED!r} checkpoints")

    @staticmethod
    def _weights(weights: dict, where: str) -> tuple[bool, int]:
        if weights.get("num_bits") != BITS:
            raise config_error(f"{where}.num_bits", f"{weights.get('num_bits')}-bit weights: tilemarlin runs 4-bit only")
        if weights.get("type", "int") != "int":
            raise config_error(f"{where}.type", f"{weights.get('type')!r}: tilemarlin runs integer weights")
        if weights.get("dynamic"):
            raise config_error(f"{where}.dynamic", "dynamic weight scales are not a stored checkpoint")
        strategy = weights.get("strategy") or _implied_strategy(weights.get("group_size"))
        if strategy == "channel":
            group_size = -1
        elif strategy == "group":
            group_size = weights.get("group_size")
            problem = group_size_problem(group_size)
            if problem:
                raise config_error(f"{where}.group_size", problem)
        else:
            raise config_error(f"{where}.strategy", f"{strategy!r}: tilemarlin reads 'group' and 'channel'")
        return bool(weights.get("symmetric", True)), group_size


def _implied_strategy(group_size) -> str:
    """The strategy compressed-tensors infers where a scheme names none: from its group size."""
    if group_size is None:
        return "tensor"
    return "channel" if group_size == -1 else "group"


def _match_rank(target: str, name: str, module: nn.Module) -> int | None:
    """How `target` matches the layer by compressed-tensors' rule, best first: 0 the exact name, 1 "re:"
    + a pattern matched at the name's start, 2 the name of a class in the module's MRO; None if not."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) is not None else None
    if target == name:
        return 0
    return 2 if any(cls.__name__ == target for cls in type(module).__mro__) else None


class CompressedTensorsFormat:
    marker = "weight_packed"

    def __init__(self, qcfg: dict):
        groups = qcfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise config_error("config_groups", "missing or empty: no scheme says how the layers are quantized")
        if qcfg.get("transform_config"):
            raise config_error("transform_config", "transformed weights (rotations applied at run time) are "
                                                   "not served: tilemarlin runs plain INT4 products")
        global_format = qcfg.get("format")
        # target -> scheme; a target named by two groups is the later group's, as compressed-tensors
        # applies them
        self.scheme_of_target: dict[str, Scheme] = {}
        for name, group in groups.items():
            scheme = Scheme(name, group, global_format)
            self.scheme_of_target.update(dict.fromkeys(scheme.targets, scheme))
        self.ignore = qcfg.get("ignore") or []

    def scheme_of(self, name: str, module: nn.Module) -> Scheme | None:
        """The scheme of the layer's best-matching target (an exact name before a regular expression
        before a class name, as compressed-tensors chooses), None for an ignored or untargeted layer."""
        if any(_match_rank(target, name, module) is not None for target in self.ignore):
            return None
        ranked = [(rank, i) for i, target in enumerate(self.scheme_of_target)
                  if (rank := _match_rank(target, name, module)) is not None]
        if not ranked:
            return None
        return list(self.scheme_of_target.values())[min(ranked)[1]]

    def convert(self, t: LayerTensors, module: nn.Module, bias: torch.Tensor | None,
                dtype: torch.dtype) -> QuantizedLayer:
        n, k = module.out_features, module.in_features
        scheme = self.scheme_of(t.prefix, module)
        if scheme is None:
            raise t.error("weight_packed", "packed weights, but no config_groups scheme targets this layer "
                                           "(or it is in ignore)")
        groups = 1 if scheme.group_size == -1 else k // scheme.group_size
        problem = group_size_problem(scheme.group_size, k)
        if problem or k % NIBBLES:
            raise t.error("weight_packed", problem or f"in_features={k} is not a multiple of 8")
        shapes = f"for in_features={k}, out_features={n}, group size {scheme.group_size}"
        stored_shape = t.require("weight_shape")
        if stored_shape.tolist() != [n, k]:
            raise t.error("weight_shape", f"{stored_shape.tolist()}, but the model's layer is [{n}, {k}] "
                                          f"(out_features, in_features from config.json)")
        packed = t.require("weight_packed", torch.int32, (n, k // NIBBLES), shapes)
        scales = t.require("weight_scale", shape=(n, groups), why=shapes, floating=True)
        zeros = None if scheme.symmetric else self._zero_points(t, n, groups, shapes)
        g_idx = t.optional("weight_g_idx")
        if g_idx is not None and bool((g_idx < 0).any()):   # "-1" marks a g_idx never filled in
            g_idx = None
        codes = unpack_columns(packed).t()
        return build_layer(codes, scales.t(), zeros, g_idx, scheme.group_size, bias, dtype)

    @staticmethod
    def _zero_points(t: LayerTensors, n: int, groups: int, shapes: str) -> torch.Tensor:
        """Zero nibbles [K / g, N] from the packed int32 form, or from the older unpacked int8 one."""
        stored = t.require("weight_zero_point")
        if stored.dtype == torch.int8:
            if tuple(stored.shape) != (n, groups):
                raise t.error("weight_zero_point", f"expected int8 shape {(n, groups)} {shapes}, "
                                                   f"found {tuple(stored.shape)}")
            return (stored.to(torch.int32) + SYMMETRIC_ZERO).t()
        expected = (-(-n // NIBBLES), groups)
        if stored.dtype != torch.int32 or tuple(stored.shape) != expected:
            raise t.error("weight_zero_point", f"expected int32 {expected} (packed along N) {shapes}, "
                                               f"found {stored.dtype} {tuple(stored.shape)}")
        return unpack_rows(stored)[:n].t()
