"""QuantLinear, the drop-in nn.Linear with INT4 weights, and replace_linear, which swaps them in.

Conventions: nn.Linear.weight is [N, K] (out x in); tilemarlin's weight is W[K, N], so converting a
layer quantizes weight.T. A QuantLinear holds its weights already packed for the kernel (buffers
`qweight` and `scales`, saved in the state dict; with zero points `scales` holds each group's zero
points z after its scale row, as whole numbers), so loading one costs no repacking.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from schedules.marlin_mma.layout import check_zero_points, split_zero_points
from schedules.problem import Problem
from schedules.quant import quantize_rtn, quantize_rtn_asymmetric

from .op import (DEFAULT_LAYOUT, dtype_name, gather_columns, layout_family, packed_shapes, problem_of, w4a8_gemm,
                 w4a16_gemm)
from .precompile import precompile_layers, start_precompile

if TYPE_CHECKING:
    from .checkpoint.layer import QuantizedLayer


class QuantLinear(nn.Module):
    """y = x @ dequant(W) + bias with INT4 weights, run by tilemarlin's tuned kernels.

    Build one with :meth:`from_linear` (round-to-nearest), :meth:`from_gptq` (a GPTQ checkpoint's
    tensors), :meth:`from_layer` (a checkpoint layer of any format) or :meth:`from_codes`; or
    construct an empty one of the right shape and load a state dict.
    act="fp8" runs it as W4A8 (runtime.op.w4a8_gemm: activations quantized per token to FP8 e4m3,
    FP8 tensor cores, Hopper only; at small M those FP8 values on the W4A16 kernels where the tuned
    table times them faster) on the same packed weights; symmetric weights only.
    On a CUDA device each of them builds, before it returns, every kernel the layer will run for M up
    to `max_m` (all M buckets by default; runtime/precompile.py); `precompile=False` or
    TILEMARLIN_PRECOMPILE=0 leaves that to the first calls.
    """

    bits = 4

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128,
                 dtype: torch.dtype = torch.float16, device=None, layout: str = DEFAULT_LAYOUT,
                 act_order: bool = False, zero_points: bool = False,
                 precompile: bool = True, max_m: int | None = None, act: str = "dtype"):
        super().__init__()
        problem = problem_of(out_features, in_features, group_size, dtype_name(dtype), layout, zero_points, act)
        self.in_features, self.out_features = in_features, out_features
        self.group_size = problem.group   # group_size=-1 (one group over K) is stored as K
        self.layout, self.zero_points, self.act = layout, zero_points, act
        weight_shape, scales_shape = packed_shapes(problem, layout)
        self.register_buffer("qweight", torch.zeros(weight_shape, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(scales_shape, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        # Checkpoint layers (runtime/checkpoint): the act-order gather of x's columns (int32, as the gather
        # kernel reads it); None in natural order.
        perm = torch.arange(in_features, dtype=torch.int32, device=device) if act_order else None
        self.register_buffer("perm", perm)
        if precompile:
            layer = [(problem, self.qweight.device)]
            precompile_layers(layer, max_m, layout, gathered=layer if act_order else ())

    @property
    def problem(self) -> Problem:
        return problem_of(self.out_features, self.in_features, self.group_size, dtype_name(self.scales.dtype),
                          self.layout, self.zero_points, self.act)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   layout: str = DEFAULT_LAYOUT, precompile: bool = True, max_m: int | None = None,
                   zeros: torch.Tensor | None = None, act: str = "dtype") -> "QuantLinear":
        """From INT4 codes [K, N], scales [K / group, N] and zero points (the scales' shape; None for 8),
        on their device.

        Raises ValueError, before any kernel is built, for shapes or a group size the kernels cannot
        run, for a code outside 0..15, a scale that is not finite and positive and a zero point that is
        not a whole number in 0..15 (naming the first one).
        """
        if codes.dim() != 2:
            raise ValueError(f"codes must be [K, N], got shape {tuple(codes.shape)}")
        k, n = codes.shape
        if scales.dim() != 2 or scales.shape[1] != n or not scales.shape[0] or k % scales.shape[0]:
            raise ValueError(f"scales {tuple(scales.shape)} do not fit codes {tuple(codes.shape)}: expected "
                             f"[K / group, N] with N={n} and a whole number of groups in K={k}")
        problem_of(n, k, k // scales.shape[0], dtype_name(scales.dtype), layout, zeros is not None, act)
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit N={n}: expected [N]")
        _check_codes(codes)
        _check_scales(scales)
        if zeros is not None:
            check_zero_points(zeros, scales)
        return cls._packed(codes, scales, bias, layout, precompile, max_m, zeros, act)

    @classmethod
    def _packed(cls, codes, scales, bias, layout, precompile, max_m, zeros=None, act="dtype") -> "QuantLinear":
        """from_codes after its checks."""
        k, n = codes.shape
        layer = cls(k, n, bias=bias is not None, group_size=k // scales.shape[0], dtype=scales.dtype,
                    device=codes.device, layout=layout, zero_points=zeros is not None, precompile=precompile,
                    max_m=max_m, act=act)
        qweight, packed_scales = layout_family(layout).pack(codes, scales, zeros)
        layer.qweight.copy_(qweight)
        layer.scales.copy_(packed_scales)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, precompile: bool = True,
                    max_m: int | None = None, zero_points: bool = False, act: str = "dtype") -> "QuantLinear":
        """Round-to-nearest INT4 quantization of an fp16/bf16 nn.Linear, on its device: symmetric
        (zero point 8), or with zero_points a zero point per group and column (each group's own range,
        widened to hold 0; closer to the weights, 3 % more bytes).

        Raises ValueError, before quantizing, for shapes or a group size the kernels cannot run and
        for a weight that is not finite (naming the first one: it would make its group's scale NaN
        or infinite).
        """
        weight = linear.weight.detach()
        cls.problem_of_linear(linear, group_size, zero_points, act)
        bad = _first_false(torch.isfinite(weight))
        if bad is not None:
            row, column = bad
            raise ValueError(f"weight {weight[row, column].item()} at row {row}, column {column} (output feature "
                             f"{row}, input feature {column}): weights must be finite")
        # The scales of finite weights are finite and positive (the quantizers' smallest is above 0).
        if zero_points:
            codes, scales, zeros = quantize_rtn_asymmetric(weight.t(), group_size, cls.bits, dtype_name(weight.dtype))
        else:
            (codes, scales), zeros = quantize_rtn(weight.t(), group_size, cls.bits, dtype_name(weight.dtype)), None
        bias = None if linear.bias is None else linear.bias.detach()
        return cls._packed(codes, scales, bias, DEFAULT_LAYOUT, precompile, max_m, zeros, act)

    @staticmethod
    def problem_of_linear(linear: nn.Linear, group_size: int = 128, zero_points: bool = False,
                          act: str = "dtype") -> Problem:
        """The Problem that from_linear(linear, ...) will run, before quantizing anything; ValueError for
        shapes or a group size the kernels cannot run."""
        return problem_of(linear.out_features, linear.in_features, group_size, dtype_name(linear.weight.dtype),
                          DEFAULT_LAYOUT, zero_points, act)

    @classmethod
    def from_layer(cls, layer: QuantizedLayer, layout: str = DEFAULT_LAYOUT, precompile: bool = True,
                   max_m: int | None = None) -> "QuantLinear":
        """From a checkpoint layer (runtime/checkpoint/layer.py), on its device: x @ layer.dequantize() + bias.

        The codes, scales and zero points are packed as from_codes packs them (the kernels decode the
        zero points). With act-order the module keeps the layer's `perm` and gathers x's columns by it
        first. Raises ValueError as from_codes does, before any kernel is built.
        """
        module = cls.from_codes(layer.codes, layer.scales, layer.bias, layout, False, max_m, layer.zeros)
        if layer.perm is not None:
            module.perm = layer.perm.to(device=layer.codes.device, dtype=torch.int32)
        if precompile:    # the GEMMs and the gather in one parallel build
            pair = [(module.problem, module.qweight.device)]
            precompile_layers(pair, max_m, layout, gathered=pair if layer.perm is not None else ())
        return module

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None, bias: torch.Tensor | None = None, bits: int = 4,
                  group_size: int = 128, checkpoint_format: str = "gptq", precompile: bool = True,
                  max_m: int | None = None) -> "QuantLinear":
        """From one layer's tensors of a GPTQ checkpoint, as written on disk (runtime/checkpoint/gptq.py
        has the layout), in the scales' dtype and on their device.

        Symmetric or asymmetric, with or without act-order (desc_act), in either checkpoint format
        ("gptq" stores zero points minus one, "gptq_v2" as they are): from_layer serves them all.
        Raises ValueError, naming the field, for other bit widths, a group size no kernel runs, tensors
        whose dtypes or shapes do not fit together and uneven act-order groups; and, naming the first,
        for scales that are not finite and positive.
        """
        from .checkpoint.gptq import gptq_layer   # runtime.checkpoint imports this module

        layer = gptq_layer(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format, bias, scales.dtype)
        return cls.from_layer(layer, precompile=precompile, max_m=max_m)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes uint8 [K, N], scales [K / group, N]): the inverse of from_codes (see zeros() for the
        zero points)."""
        scales = split_zero_points(self.scales)[0] if self.zero_points else self.scales
        return layout_family(self.layout).unpack(self.qweight, scales)

    def zeros(self) -> torch.Tensor | None:
        """The zero points z [K / group, N] (in the scales' dtype), or None (symmetric: 8)."""
        return split_zero_points(self.scales)[1] if self.zero_points else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """As nn.Module's, for an int32 `qweight` (a cast would change its words) and scales that are
        finite and not negative; then with zero points a check that the loaded zero-point rows of `scales`
        hold what the kernels decode, whole numbers in 0..15 (not, say, pre-scaled offsets), and with
        act-order that `perm` is a permutation of the input features (the gather kernel reads x's row
        at each index unchecked)."""
        stored = state_dict.get(prefix + "qweight")
        if stored is not None and stored.dtype != torch.int32:
            raise ValueError(f"{prefix}qweight must be int32 (eight packed codes a word), got {stored.dtype}: "
                             "a cast of the state dict changes its words' values")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        scales = state_dict.get(prefix + "scales")
        if scales is not None and scales.shape == self.scales.shape and not scales.is_meta:   # else a size error
            try:
                _check_scales(split_zero_points(scales)[0] if self.zero_points else scales, zero_too=True)
            except ValueError as exc:
                raise ValueError(f"{prefix}scales: {exc}") from None
        if self.perm is not None and self.perm.dtype != torch.int32:     # load_state_dict(assign=True)
            self.perm = self.perm.to(torch.int32)                           # takes the stored dtype
        if self.perm is not None and prefix + "perm" in state_dict:
            order = torch.arange(self.in_features, dtype=self.perm.dtype, device=self.perm.device)
            if not torch.equal(self.perm.sort().values, order):
                raise ValueError(f"{prefix}perm must be a permutation of range({self.in_features}), the input features "
                                 "in the order of the stored weight rows")
        if self.zero_points and prefix + "scales" in state_dict:
            scales, zeros = split_zero_points(self.scales)
            try:
                check_zero_points(zeros, scales)
            except ValueError as exc:
                raise ValueError(f"{prefix}scales: its zero-point rows (every second row) must hold the zero "
                                 f"points themselves; {exc}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast:    # as nn.Linear under autocast: any float input, the output in autocast's dtype
            x = x.to(self.scales.dtype)
        y = self._product(x)
        return y.to(torch.get_autocast_dtype(x.device.type)) if autocast else y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = gather_columns(x, self.perm)
        if self.act == "fp8":
            y = w4a8_gemm(x, self.qweight, self.scales, self.out_features, self.in_features, self.group_size,
                          self.layout)
        else:
            y = w4a16_gemm(x, self.qweight, self.scales, self.out_features, self.in_features, self.group_size,
                           self.layout, self.zero_points)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}, layout={self.layout}, "
                f"zero_points={self.zero_points}" + (f", act={self.act}" if self.act != "dtype" else ""))


# Linear layers whose owner reads their weight itself instead of calling them: nn.MultiheadAttention's
# out_proj. Left as they are.
WEIGHT_READ_BY_OWNER = (nn.modules.linear.NonDynamicallyQuantizableLinear,)


def replace_linear(model: nn.Module, filter: Callable[[str, nn.Module], bool] | Iterable[str] | None = None,
                   group_size: int = 128, skip: Iterable[str] = ("lm_head",), precompile: bool = True,
                   max_m: int | None = None, zero_points: bool = False, act: str = "dtype",
                   fuse: bool = True) -> nn.Module:
    """Swap the nn.Linear layers of `model` for QuantLinear (round-to-nearest INT4), in place.

    Parameters
    ----------
    model : e.g. a Hugging Face Llama-style model, already in float16 or bfloat16 on its device.
    filter : which layers to convert: None (all), a callable ``(name, module) -> bool``, or name
        substrings (a layer is converted when its name contains one of them).
    group_size : input rows per scale; -1 for one scale per output column.
    skip : name substrings never converted; the default keeps the (often tied) lm_head in fp16.
        nn.MultiheadAttention's out_proj, whose weight the attention reads itself, is never converted.
    zero_points : a zero point per group and column (QuantLinear.from_linear); symmetric by default.
    act : "fp8" runs the layers as W4A8 (FP8 activations per token, Hopper; see QuantLinear).
    precompile, max_m : build every kernel the converted layers will run for M up to `max_m` (all
        buckets for None), each distinct shape once, in one parallel compile that runs in worker
        processes while the layers are quantized; returns once both are done. Skipped with
        precompile=False, TILEMARLIN_PRECOMPILE=0, or weights not on a CUDA device.
    fuse : converted layers that read the same input (q_proj, k_proj and v_proj; gate_proj and up_proj)
        become one QuantLinear of their columns side by side, run once in each forward of their module
        (runtime/fuse.py; found by a forward of a two-token prompt, for models that take `input_ids`).
        Each keeps its name, as a FusedSlice. The outputs are the same; False keeps them apart.

    Returns the model. Raises ValueError, naming the layer, for a layer the kernels cannot run (its N
    must be a multiple of 64, K of 16, the group size a multiple of 64 dividing K or -1: before
    anything is built; every weight finite: the build then stops after its current kernels), and
    when no layer matched; the model is then left as it was.
    """
    if isinstance(model, nn.Linear):
        raise TypeError("replace_linear converts the nn.Linear layers inside a model; for one layer use "
                        "QuantLinear.from_linear(linear)")
    wanted = _name_filter(filter)
    skip = (skip,) if isinstance(skip, str) else tuple(skip or ())
    places: list[tuple[str, nn.Linear]] = []
    problems: dict[int, Problem] = {}   # a module shared under two names is converted once
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if (not isinstance(module, nn.Linear) or isinstance(module, WEIGHT_READ_BY_OWNER)
                or any(s in name for s in skip) or not wanted(name, module)):
            continue
        try:
            if module.weight.is_meta:
                raise ValueError("its weight is on the meta device: load the model's weights first")
            problems.setdefault(id(module), QuantLinear.problem_of_linear(module, group_size, zero_points, act))
        except (ValueError, TypeError) as exc:
            raise _refusal(name, module, exc) from None
        places.append((name, module))
    if not places:
        raise ValueError("replace_linear found no nn.Linear to convert (already converted, or the filter "
                         "and skip left none)")
    # A fused set is quantized as one layer (its members' weights side by side, made when it is quantized).
    plans = _fusion_plans(model, places) if fuse else []
    in_sets = {id(member) for plan in plans for member in _members(model, plan)}
    alone = [(name, module) for name, module in places if id(module) not in in_sets]
    sets = [(_joined(plan.parent, plan.name), _members(model, plan)) for plan in plans]
    for name, members in sets:
        try:
            problems[id(members)] = problem_of(sum(m.out_features for m in members), members[0].in_features,
                                               group_size, dtype_name(members[0].weight.dtype), DEFAULT_LAYOUT,
                                               zero_points, act)
        except (ValueError, TypeError) as exc:
            raise _refusal(name, members[0], exc) from None
    # The kernels build in worker processes while the layers are quantized here.
    devices = {id(module): module.weight.device for _, module in alone}
    devices.update({id(members): members[0].weight.device for _, members in sets})
    build = start_precompile([(problems[key], device) for key, device in devices.items()], max_m) \
        if precompile else None
    try:
        converted = _quantized([*alone, *sets], group_size, zero_points, act)
        if build is not None:
            build.wait()
    except BaseException:
        if build is not None:
            build.cancel()
        raise
    # swapped in only once every layer is quantized and every kernel built: a refusal or a failed
    # build leaves the model whole
    for name, module in alone:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, converted[id(module)])
    from .fuse import install   # fuse.py imports this module

    for plan, (_, members) in zip(plans, sets):
        install(model, plan, converted[id(members)])
    return model


def _fusion_plans(model: nn.Module, places: list[tuple[str, nn.Linear]]) -> list:
    """replace_linear's sets of layers to fuse, among those it converts (runtime/fuse.py)."""
    from .fuse import plan_fusion   # fuse.py imports this module

    converting = {id(module) for _, module in places}
    return plan_fusion(model, lambda m: (m.in_features, m.weight.dtype, m.weight.device)
                       if id(m) in converting else None)


def _members(model: nn.Module, plan) -> list[nn.Linear]:
    parent = model.get_submodule(plan.parent)
    return [getattr(parent, member) for member in plan.members]


def _joined(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _quantized(jobs: list[tuple[str, nn.Linear | list[nn.Linear]]], group_size: int, zero_points: bool,
               act: str) -> dict[int, QuantLinear]:
    """replace_linear's conversion of each distinct layer or fused set (its members' weights side by
    side), by the id of its nn.Linear or list."""
    from .fuse import concatenated_linear   # fuse.py imports this module

    converted: dict[int, QuantLinear] = {}
    for name, source in jobs:
        if id(source) not in converted:
            linear = concatenated_linear(source) if isinstance(source, list) else source
            try:
                converted[id(source)] = QuantLinear.from_linear(linear, group_size, precompile=False,
                                                                zero_points=zero_points, act=act)
            except (ValueError, TypeError) as exc:
                raise _refusal(name, linear, exc) from None
    return converted


def _refusal(name: str, module: nn.Module, exc: Exception) -> ValueError:
    return ValueError(f"cannot convert {name!r} ({module}): {exc}. Leave it out with skip=(..., {name!r}) or a filter")


def _first_false(ok: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first False in `ok`, or None when all are True (one host sync)."""
    if bool(ok.all()):
        return None
    return tuple((~ok).nonzero()[0].tolist())


def _check_codes(codes: torch.Tensor) -> None:
    """A ValueError naming the first code that is not a whole number in 0..15."""
    ok = (codes >= 0) & (codes <= 15)
    if codes.is_floating_point():
        ok &= codes == codes.round()
    bad = _first_false(ok)
    if bad is not None:
        row, column = bad
        raise ValueError(f"code {codes[row, column].item()} at row {row}, column {column}: INT4 codes are whole "
                         "numbers in 0..15")


def _check_scales(scales: torch.Tensor, zero_too: bool = False) -> None:
    """A ValueError naming the first scale that is not finite and positive (`zero_too`: or zero, a layer
    of zeros, as a state dict of a layer never filled holds), and how many there are."""
    ok = torch.isfinite(scales) & ((scales >= 0) if zero_too else (scales > 0))
    bad = _first_false(ok)
    if bad is not None:
        group, column = bad
        more = int((~ok).sum()) - 1
        allowed = "finite and not negative" if zero_too else "finite and positive"
        raise ValueError(f"scale {scales[group, column].item()} at group {group}, column {column}"
                         + (f" (and {more} more)" if more else "") + f": scales must be {allowed}")


def _name_filter(filter) -> Callable[[str, nn.Module], bool]:
    if filter is None:
        return lambda name, module: True
    if callable(filter):
        return filter
    substrings = (filter,) if isinstance(filter, str) else tuple(filter)
    return lambda name, module: any(s in name for s in substrings)
