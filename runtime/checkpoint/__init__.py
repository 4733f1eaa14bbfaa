"""Quantized checkpoints on disk (GPTQ, AWQ, compressed-tensors) -> models served by the kernels.

`load_quantized(model_dir, dtype, device)` is the entry point (loader.py). Each format's reader
(gptq.py, awq.py, compressed_tensors.py) unpacks one layer into a QuantizedLayer (layer.py), the one
form every format meets in; QuantLinear.from_layer (runtime/linear.py) turns that into a QuantLinear.
"""
from .files import CheckpointError
from .layer import QuantizedLayer
from .loader import load_quantized

__all__ = ["CheckpointError", "QuantizedLayer", "load_quantized"]
