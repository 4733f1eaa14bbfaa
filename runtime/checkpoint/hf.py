"""`from_pretrained` through transformers' quantizer registry: quant_method "tilemarlin".

A checkpoint's config.json names its own method (gptq, awq, compressed-tensors), and transformers
refuses a `quantization_config=` argument of another kind for it, so the registry is reached by
handing `from_pretrained` a config whose quantization_config is tilemarlin's, wrapping the
checkpoint's own (`tilemarlin_config`). The quantizer then swaps each quantized layer for a
placeholder before transformers reads the dense weights, and afterwards fills the placeholders with
QuantLinear layers read by runtime/checkpoint (the same readers as load_quantized).
"""
from __future__ import annotations

import re
from pathlib import Path

from torch import nn
from transformers import AutoConfig
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..op import DEFAULT_LAYOUT
from .files import TensorFiles
from .loader import (arrange_for_serving, checkpoint_format, precompile_model, read_quantization_config,
                     refuse_unread_tensors, replace_quantized_linears)

METHOD = "tilemarlin"


@register_quantization_config(METHOD)
class TileMarlinConfig(QuantizationConfigMixin):
    """Serve a GPTQ / AWQ / compressed-tensors checkpoint on tilemarlin's kernels.

    source : the checkpoint's own quantization settings (config.json's quantization_config, or an
        older GPTQ folder's quantize_config.json), read by runtime/checkpoint.
    layout : the kernels' weight layout.
    fuse : the layers that read the same input as one QuantLinear (load_quantized's `fuse`).
    """

    def __init__(self, source: dict | None = None, layout: str = DEFAULT_LAYOUT, fuse: bool = True, **kwargs):
        self.quant_method = METHOD
        self.source = source
        self.layout = layout
        self.fuse = fuse


def tilemarlin_config(model_dir, fuse: bool = True):
    """The transformers config of `model_dir` with its quantization_config wrapped in TileMarlinConfig
    (`fuse` as load_quantized's): pass it as `from_pretrained(model_dir, config=...)`."""
    config = AutoConfig.from_pretrained(model_dir)
    source, place = read_quantization_config(Path(model_dir))
    checkpoint_format(source, place)     # refused here, naming the file it was read from
    config.quantization_config = TileMarlinConfig(source=source, fuse=fuse).to_dict()
    return config


class _Pending(nn.Module):
    """Where a quantized layer will go; holds nothing, so transformers reads no tensor for it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = linear.in_features, linear.out_features, linear.bias is not None


@register_quantizer(METHOD)
class TileMarlinHfQuantizer(HfQuantizer):
    requires_calibration = True   # it serves checkpoints; it does not quantize

    def _process_model_before_weight_loading(self, model, **kwargs):
        source = self.quantization_config.source
        if source is None:
            raise ValueError("TileMarlinConfig needs the checkpoint's quantization_config as `source` "
                             "(runtime.checkpoint.hf.tilemarlin_config builds it)")
        self.format = checkpoint_format(source)
        self.files = TensorFiles(Path(model.config._name_or_path))
        suffix = "." + self.format.marker
        quantized = {name[:-len(suffix)] for name in self.files.names() if name.endswith(suffix)}
        pending = []
        for name, module in list(model.named_modules()):
            if name in quantized and isinstance(module, nn.Linear):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, _Pending(module))
                pending.append(rf"^{re.escape(name)}\.")
        # The quantized layers' tensors are read afterwards, by runtime/checkpoint: not unexpected.
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | set(pending)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        device = next(model.parameters()).device
        for name, module in list(model.named_modules()):
            if isinstance(module, _Pending):
                linear = nn.Linear(module.in_features, module.out_features, bias=module.has_bias, device="meta")
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, linear)
        layout = self.quantization_config.layout
        replace_quantized_linears(model, self.format, self.files, model.dtype, device, layout)
        refuse_unread_tensors(model, self.files)
        arrange_for_serving(model, self.quantization_config.fuse)
        precompile_model(model, layout)
        return model

    def is_serializable(self):
        return False

    @property
    def is_trainable(self) -> bool:
        return False
