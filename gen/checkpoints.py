"""The layers a quantized checkpoint's model runs, as runtime.load_quantized serves it: what `gen tune`,
`gen precompile` and `gen export` act on with --checkpoint DIR.

The checkpoint is loaded (on the GPU where its files take at most half of the free memory, else on
the CPU, where repacking takes longer; no kernel is built) and its
QuantLinear layers are read off the model: each one's problem (shape, group size, zero points where
its zero points are not all 8, the dtype asked for), and the act-order gathers the model runs (the
layers that gather their own input, and the modules that gather for the layers they call; a gated
MLP's down_proj gathers nothing: runtime/checkpoint/fold.py). Reading it from the loaded model rather
than from config.json's fields keeps the plan to what serving will load, per-layer schemes and
folds included. load_quantized fuses the layers that read one input (q, k and v; gate and up:
runtime/fuse.py), so these are the fused shapes the tuned tables hold.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from schedules.problem import SUPPORTED_DTYPES, Problem


@dataclass
class CheckpointLayers:
    """The problems of a checkpoint's INT4 layers, each with the (index-free) names of its layers, the
    problems whose input the model gathers first, and those whose input an RMSNorm writes in their
    order (runtime/checkpoint/norm_fold.py)."""

    layers: dict[Problem, list[str]] = field(default_factory=dict)
    gathered: list[Problem] = field(default_factory=list)
    normed: list[Problem] = field(default_factory=list)


def config_dtype(folder: str) -> str | None:
    """config.json's torch_dtype (or dtype) where it is float16 or bfloat16, else None."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None      # load_quantized names the problem
    value = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    return value if value in SUPPORTED_DTYPES else None


def checkpoint_layers(folder: str, dtype: str) -> CheckpointLayers:
    """The checkpoint's INT4 layers in `dtype` ("float16" or "bfloat16"). Raises runtime's
    CheckpointError (a ValueError naming file, layer and field) for a checkpoint load_quantized refuses."""
    import torch

    from runtime import load_quantized

    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"--dtype {dtype}: a checkpoint's model runs in one of {', '.join(SUPPORTED_DTYPES)}")
    device = loading_device(folder)
    model = load_quantized(folder, getattr(torch, dtype), device, precompile=False)
    found = layers_of(model)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()    # a tune's measuring processes come next
    return found


def loading_device(folder: str) -> str:
    """"cuda" where a GPU is visible and the checkpoint's safetensors take at most half of its free
    memory (the repacked layers and the dense parameters fit beside what is read), else "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    size = sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))
    return "cuda" if size <= torch.cuda.mem_get_info()[0] / 2 else "cpu"


def layers_of(model) -> CheckpointLayers:
    """The INT4 layers of a loaded model (see CheckpointLayers)."""
    from runtime import QuantLinear
    from runtime.checkpoint.loader import act_order_layers

    found = CheckpointLayers()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            names = found.layers.setdefault(module.problem, [])
            if short_name(name) not in names:
                names.append(short_name(name))
    _, gathered, normed = act_order_layers(model)
    found.gathered = list(dict.fromkeys(m.problem for m in gathered))
    found.normed = list(dict.fromkeys(m.problem for m in normed))
    return found


def short_name(module_name: str) -> str:
    """A layer's name without its decoder layer's index: model.layers.3.self_attn.q_proj -> self_attn.q_proj."""
    return re.sub(r"^.*\.\d+\.", "", module_name)
