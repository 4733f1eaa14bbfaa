"""One GEMM for the layers that read the same input: q_proj, k_proj and v_proj; gate_proj and up_proj.

transformers' modules call such layers one after another on one tensor. Serving engines run each set as
one GEMM whose N is the sum of theirs: one launch instead of two or three, the activations read once,
and these fused shapes are the ones `gen tune --model` tunes and the shipped tables hold.
`replace_linear` and `load_quantized` fuse them (fuse=False keeps the layers apart).

Which layers qualify is probed, not read from class names (runtime/probe.py). The children of one
module that would run the same problem but for N (same K, dtype and device; for QuantLinear layers also
group size, zero points, activations and act-order permutation) are candidates. One forward of a short
prompt records the module's call; the call is repeated with the candidates replaced by stand-ins that
keep what they read, then with another tensor in place of what they read. Those that read one of the
module's arguments itself, unchanged, once per call, in both runs, form a set. A last run serves the set
as it will be served (one stand-in of the summed width, handing each member its columns): the module's
output must equal the first run's. That catches a forward that cannot take a member's output as a
slice of a wider tensor (a view that needs it contiguous).

A fused set becomes one layer (`q_k_v_proj`: the members' columns side by side, in their order) that
the module runs in a forward pre-hook (`FusedInput`) on that argument; each member becomes a
`FusedSlice` handed its columns of the product. A slice called on any other tensor (a direct call, or a
forward that takes another path than the probed one) runs the fused layer on that tensor itself, so
the outputs never depend on the probe. The hook and the slices trace into one graph under
torch.compile and capture in CUDA graphs.
"""
from __future__ import annotations

from typing import Callable, Hashable, NamedTuple

import torch
from torch import nn

from .linear import QuantLinear
from .probe import (Fixed, LinearMap, Returns, argument_slot, copied, equal, forward_parameter, random_like,
                    record_calls, single_owner, swapped, with_argument)


class FusionPlan(NamedTuple):
    parent: str                       # the module's name in the model
    members: tuple[str, ...]          # its children that are fused, in the order of their columns
    argument: tuple[int | None, str]  # (position or None, name) of the forward's parameter they read
    name: str                         # the fused layer's attribute in the module


class FusedSlice(nn.Module):
    """A fused layer's columns [start, stop), in the place of the layer that had them."""

    def __init__(self, fused: nn.Module, start: int, stop: int):
        super().__init__()
        self.in_features, self.out_features, self.start, self.stop = fused.in_features, stop - start, start, stop
        object.__setattr__(self, "_fused", fused)   # not a submodule: its module owns it (one state-dict entry)
        self._source = self._product = None

    def hand(self, x: torch.Tensor, product: torch.Tensor) -> None:
        """Keep `product`, this slice's columns of the fused layer's output for `x`, for the next call."""
        self._source, self._product = x, product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, product = self._source, self._product
        self._source = self._product = None
        if source is not x:
            product = self._fused(x)[..., self.start:self.stop]
        return product

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of a fused layer, in_features={self.in_features}"


class FusedInput:
    """A forward pre-hook (registered with_kwargs): the module's fused layer `fused` (attribute name) run
    on its argument `name` (at `position` where it is passed positionally), each of `members` handed its
    columns of the product. `handle` removes it."""

    def __init__(self, position: int | None, name: str, fused: str, members: tuple[str, ...]):
        self.position, self.name, self.fused, self.members = position, name, fused, members
        self.handle = None

    def __call__(self, module, args, kwargs):
        if self.name in kwargs:
            x = kwargs[self.name]
        elif self.position is not None and self.position < len(args):
            x = args[self.position]
        else:
            return None   # not passed: each member runs the fused layer on what it gets
        product = getattr(module, self.fused)(x)
        for member in self.members:
            piece = getattr(module, member)
            piece.hand(x, product[..., piece.start:piece.stop])
        return None


def quantized_key(layer: nn.Module) -> Hashable | None:
    """What a QuantLinear must share with another to be fused with it (None for other modules)."""
    if not isinstance(layer, QuantLinear):
        return None
    perm = None if layer.perm is None else tuple(layer.perm.tolist())
    return (layer.in_features, layer.group_size, layer.scales.dtype, layer.scales.device, layer.layout,
            layer.zero_points, layer.act, perm)


def plan_fusion(model: nn.Module, key: Callable[[nn.Module], Hashable | None]) -> list[FusionPlan]:
    """The sets of layers to fuse (see the module's docstring): children of one module with the same
    `key` (None: not a candidate) that the probes find reading one argument of the module. Changes
    nothing; [] where the model cannot run a forward of a short prompt."""
    owned = single_owner(model)
    candidates: dict[str, list[list[str]]] = {}
    for name, module in model.named_modules():
        by_key: dict = {}
        for child_name, child in module.named_children():
            child_key = key(child) if id(child) in owned else None
            if child_key is not None:
                by_key.setdefault(child_key, []).append(child_name)
        sets = [names for names in by_key.values() if len(names) >= 2]
        if sets:
            candidates[name] = sets
    calls = record_calls(model, candidates) if candidates else {}
    plans = []
    for name, sets in candidates.items():
        if name in calls:
            parent = model.get_submodule(name)
            for names in sets:
                plans += [FusionPlan(name, members, argument, fused_name(parent, members))
                          for members, argument in _sets_reading_an_argument(parent, names, *calls[name])]
    return plans


def fused_name(parent: nn.Module, members: tuple[str, ...]) -> str:
    """The fused layer's attribute: the members' names joined on their common suffix from an underscore
    (q_proj, k_proj, v_proj -> q_k_v_proj), "fused_" before it while the module has one of that name."""
    suffix = members[0][members[0].rfind("_"):] if "_" in members[0] else ""
    if not suffix or not all(m.endswith(suffix) and len(m) > len(suffix) for m in members):
        suffix = ""
    name = "_".join(m[:len(m) - len(suffix)] for m in members) + suffix
    while hasattr(parent, name):
        name = "fused_" + name
    return name


def _sets_reading_an_argument(parent: nn.Module, names: list[str], args: tuple, kwargs: dict):
    """[(members, argument)]: the sets of `names` (two or more) that read one argument of `parent`'s
    forward as it is, once per call, each checked served fused."""
    others = {n: LinearMap(m.in_features, m.out_features) for n, m in parent.named_modules()
              if isinstance(m, QuantLinear) and n not in names}
    found = []
    try:
        with swapped(parent, others):
            output, reads = _reads(parent, names, args, kwargs)
            for x, members in reads:
                slot = argument_slot(x, args, kwargs)
                argument = None if slot is None else forward_parameter(parent, slot)
                if len(members) < 2 or argument is None:
                    continue
                other = random_like(x.shape, x, seed=1)
                _, other_reads = _reads(parent, names, *with_argument(args, kwargs, slot, other))
                if [read for read in other_reads if read[0] is other] != [(other, members)]:
                    continue
                served = _served_fused(parent, names, members, argument, args, kwargs)
                if equal(served, output):
                    found.append((members, argument))
    except Exception:   # noqa: BLE001 - a call the probe cannot repeat fuses nothing
        return []
    return found


def _stand_ins(parent: nn.Module, names) -> dict[str, Fixed]:
    return {n: Fixed(getattr(parent, n).out_features, seed=i) for i, n in enumerate(names)}


def _reads(parent: nn.Module, names: list[str], args: tuple, kwargs: dict) -> tuple[object, list]:
    """(a copy of parent's output with `names` returning fixed tensors, [(x, layers)]): each tensor x
    passed to `parent` that some of `names` read as it was passed (unchanged, once in the call), with
    those layers in `names`' order."""
    passed_then = copied([*args, *kwargs.values()])
    stand_ins = _stand_ins(parent, names)
    with swapped(parent, stand_ins):
        output = copied(parent(*args, **kwargs))
    passed = [*args, *kwargs.values()]
    reads: list[tuple[torch.Tensor, tuple[str, ...]]] = []
    for n, stand_in in stand_ins.items():
        at = next((i for i, a in enumerate(passed) if a is stand_in.seen), None)
        if stand_in.calls != 1 or at is None or not equal(stand_in.seen_then, passed_then[at]):
            continue
        same = next((i for i, (x, _) in enumerate(reads) if x is stand_in.seen), None)
        if same is None:
            reads.append((stand_in.seen, (n,)))
        else:
            reads[same] = (stand_in.seen, reads[same][1] + (n,))
    return output, reads


def _served_fused(parent: nn.Module, names: list[str], members: tuple[str, ...], argument, args, kwargs):
    """parent's output with `members` served fused by a layer that returns their stand-ins' fixed tensors
    side by side (the other `names` returning theirs, as in _reads)."""
    position, keyword = argument
    x = kwargs[keyword] if keyword in kwargs else args[position]
    stand_ins = _stand_ins(parent, names)
    widths = [stand_ins[m].out_features for m in members]
    fused = Returns(torch.cat([random_like((*x.shape[:-1], stand_ins[m].out_features), x, stand_ins[m].seed)
                               for m in members], dim=-1))
    fused.in_features = x.shape[-1]
    rest = {n: stand_in for n, stand_in in stand_ins.items() if n not in members}
    name = fused_name(parent, members)
    parent.add_module(name, fused)
    try:
        with swapped(parent, {**rest, **_slices(fused, members, widths)}):
            hook = _hook(parent, argument, name, members)
            try:
                return copied(parent(*args, **kwargs))
            finally:
                hook.handle.remove()
    finally:
        delattr(parent, name)


def _slices(fused: nn.Module, members: tuple[str, ...], widths: list[int]) -> dict[str, FusedSlice]:
    slices, start = {}, 0
    for member, width in zip(members, widths):
        slices[member], start = FusedSlice(fused, start, start + width), start + width
    return slices


def _hook(parent: nn.Module, argument: tuple[int | None, str], name: str, members: tuple[str, ...]) -> FusedInput:
    hook = FusedInput(*argument, name, members)
    hook.handle = parent.register_forward_pre_hook(hook, with_kwargs=True)
    return hook


def install(model: nn.Module, plan: FusionPlan, fused: nn.Module) -> None:
    """Serve `plan`'s members from `fused` (their columns side by side, `plan.name` in their module)."""
    parent = model.get_submodule(plan.parent)
    widths = [getattr(parent, member).out_features for member in plan.members]
    parent.add_module(plan.name, fused)
    for member, piece in _slices(fused, plan.members, widths).items():
        setattr(parent, member, piece)
    _hook(parent, plan.argument, plan.name, plan.members)


def fuse_quantized(model: nn.Module) -> list[str]:
    """Fuse the QuantLinear layers of `model` that read the same input (plan_fusion with quantized_key);
    returns the fused layers' names."""
    plans = plan_fusion(model, quantized_key)
    for plan in plans:
        parent = model.get_submodule(plan.parent)
        install(model, plan, concatenated_quantized([getattr(parent, m) for m in plan.members]))
    return [f"{plan.parent}.{plan.name}" if plan.parent else plan.name for plan in plans]


def concatenated_quantized(layers: list[QuantLinear]) -> QuantLinear:
    """One QuantLinear holding `layers`' output columns side by side (they share quantized_key), its
    kernels not built."""
    first = layers[0]
    codes, scales, zeros = zip(*((*layer.unpack(), layer.zeros()) for layer in layers))
    fused = QuantLinear.from_codes(torch.cat(codes, 1), torch.cat(scales, 1), _concatenated_bias(layers),
                                   first.layout, precompile=False,
                                   zeros=None if first.zeros() is None else torch.cat(zeros, 1), act=first.act)
    fused.perm = first.perm
    return fused


def concatenated_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear holding `linears`' output features side by side (same in_features, dtype and
    device)."""
    weight = torch.cat([linear.weight.detach() for linear in linears], 0)
    bias = _concatenated_bias(linears)
    fused = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                               device=weight.device, dtype=weight.dtype)
    fused.weight.data.copy_(weight)
    if bias is not None:
        fused.bias.data.copy_(bias)
    return fused.requires_grad_(False)


def _concatenated_bias(layers) -> torch.Tensor | None:
    """The layers' biases side by side, zeros for a layer without one; None when none has one."""
    if all(layer.bias is None for layer in layers):
        return None
    like = next(layer.bias for layer in layers if layer.bias is not None)
    return torch.cat([layer.bias.detach() if layer.bias is not None else like.new_zeros(layer.out_features)
                      for layer in layers])
