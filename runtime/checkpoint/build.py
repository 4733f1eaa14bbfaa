"""QuantizedLayer -> QuantLinear: the kernels' packed weights, the act-order gather, zero points."""
from __future__ import annotations

from ..linear import QuantLinear
from ..op import DEFAULT_LAYOUT
from ..zero_points import zero_point_offsets
from .layer import QuantizedLayer


def quant_linear(layer: QuantizedLayer, layout: str = DEFAULT_LAYOUT) -> QuantLinear:
    """A QuantLinear on the layer's device computing x @ layer.dequantize() + bias.

    Symmetric weights in natural order run on the kernels unchanged. With act-order the module keeps
    `perm` and gathers x's columns by it first; with zero points it keeps
    C = scales * (8 - zeros) as `zero_offsets` and adds groupsum(x) @ C (runtime/zero_points.py).
    """
    module = QuantLinear.from_codes(layer.codes, layer.scales, layer.bias, layout=layout)
    if layer.perm is not None:
        module.perm = layer.perm.to(device=layer.codes.device)
    if layer.zeros is not None:
        module.zero_offsets = zero_point_offsets(layer.scales, layer.zeros)
    return module
