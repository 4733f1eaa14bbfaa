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
as it will be served (one stand-in of the summed width, each member its columns): the module's
output must equal the first run's. That catches a forward that cannot take a member's output as a
slice of a wider tensor (a view that needs it contiguous).

A fused set becomes one layer (`q_k_v_proj`: the members' columns side by side, in their order) beside
them in their module, and each member a `FusedSlice` that returns its columns of the fused layer's
product (`FusedSet.product`): the first member called in a forward of the module computes it, the
others called on the same tensor, unchanged since (its version counter; inference tensors and
torch.compile's tracing have none, and there the same tensor is taken as unchanged), take their columns
of it, and the last of them drops it. A member called on another tensor computes the product of that
one; outside the module's forward (a direct call) the product is computed and not kept, and the
module's forward hooks drop what is left when the forward ends. So nothing is
computed for members that a forward does not call (cross-attention's keys and values once they are
cached), and no output depends on the probe. The slices and hooks trace into one graph under
torch.compile and capture in CUDA graphs.
"""
from __future__ import annotations

from typing import Callable, Hashable, NamedTuple

import torch
from torch import nn

from .linear import QuantLinear
from .probe import (Fixed, LinearMap, Returns, argument_slot, copied, equal, random_like, record_calls,
                    single_owner, swapped, with_argument)


class FusionPlan(NamedTuple):
    parent: str                       # the module's name in the model
    members: tuple[str, ...]          # its children that are fused, in the order of their columns
    name: str                         # the fused layer's attribute in the module


class FusedSet:
    """What the members of one fused set share: their module, the fused layer's name in it and the
    members' names; while the module's forward runs (`begin` and `end`, its pre- and post-hook), the
    product computed for the first member's tensor, until every other member has taken its columns.
    A state dict that holds the members apart (saved with fuse=False) loads into the module too
    (`join_members`, its load_state_dict pre-hook). `remove` takes the hooks off."""

    def __init__(self, module: nn.Module, name: str, members: tuple[str, ...]):
        self.module, self.name, self.members = module, name, members
        self.handles = (module.register_forward_pre_hook(self.begin),
                        module.register_forward_hook(self.end, always_call=True),
                        module.register_load_state_dict_pre_hook(self.join_members))
        self._running = False
        self._drop()

    @property
    def layer(self) -> nn.Module:
        return getattr(self.module, self.name)

    def begin(self, module, args) -> None:
        self._running = True
        self._drop()

    def end(self, module, args, output) -> None:
        self._running = False
        self._drop()

    def _drop(self) -> None:
        self._source = self._version = self._product = None
        self._left = 0

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The fused layer's output for `x`, kept during the module's forward for the other members. A
        tensor changed in place since shows it in its version counter; inference tensors and
        torch.compile's tracing keep none, so there the same tensor is taken as unchanged (transformers'
        modules call the members back to back)."""
        if not self._running:
            return self.layer(x)
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        if self._left and x is self._source and version == self._version:
            product, self._left = self._product, self._left - 1
            if not self._left:      # the last member: its columns keep the product alive as long as needed
                self._drop()
            return product
        product = self.layer(x)
        self._source, self._version, self._product, self._left = x, version, product, len(self.members) - 1
        return product

    def join_members(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
        """Where `state_dict` holds entries of every member and none of the fused layer's, the fused
        layer's entries in their place (joined_quantized_state), what the members' entries lack or
        have too many reported under the members' keys, as load_state_dict reports them for layers
        apart (an error under strict, a list otherwise); anything else is left for load_state_dict."""
        fused_prefix = f"{prefix}{self.name}."
        if not isinstance(self.layer, QuantLinear) or any(key.startswith(fused_prefix) for key in state_dict):
            return
        entries = {member: {key[len(prefix) + len(member) + 1:]: value for key, value in state_dict.items()
                            if key.startswith(f"{prefix}{member}.")} for member in self.members}
        if not all(entries.values()):
            return
        for member, entry in entries.items():
            for key in entry:
                del state_dict[f"{prefix}{member}.{key}"]
        widths = [getattr(module, member).out_features for member in self.members]
        joined = joined_quantized_state(self.layer, entries, widths, prefix, missing_keys, unexpected_keys)
        state_dict.update({fused_prefix + key: value for key, value in joined.items()})

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class FusedSlice(nn.Module):
    """A fused layer's columns [start, stop), in the place of the layer that had them."""

    def __init__(self, shared: FusedSet, in_features: int, start: int, stop: int):
        super().__init__()
        self.in_features, self.out_features, self.start, self.stop = in_features, stop - start, start, stop
        self.shared = shared

    @property
    def fused(self) -> nn.Module:
        return self.shared.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.product(x)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of {self.shared.name}, in_features={self.in_features}"


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
                plans += [FusionPlan(name, members, fused_name(parent, members))
                          for members in _sets_reading_an_argument(parent, names, *calls[name])]
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
    """The sets of `names` (two or more) that read one argument of `parent`'s forward as it is, once per
    call, each checked served fused."""
    others = {n: LinearMap(m.in_features, m.out_features) for n, m in parent.named_modules()
              if isinstance(m, QuantLinear) and n not in names}
    found = []
    try:
        with swapped(parent, others):
            output, reads = _reads(parent, names, args, kwargs)
            for x, members in reads:
                slot = argument_slot(x, args, kwargs)
                if len(members) < 2 or slot is None:
                    continue
                other = random_like(x.shape, x, seed=1)
                _, other_reads = _reads(parent, names, *with_argument(args, kwargs, slot, other))
                if [read for read in other_reads if read[0] is other] != [(other, members)]:
                    continue
                if equal(_served_fused(parent, names, members, x, args, kwargs), output):
                    found.append(members)
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


def _served_fused(parent: nn.Module, names: list[str], members: tuple[str, ...], x: torch.Tensor, args, kwargs):
    """parent's output with `members` served fused by a layer that returns their stand-ins' fixed tensors
    (for x, what they read) side by side, the other `names` returning theirs, as in _reads."""
    stand_ins = _stand_ins(parent, names)
    widths = [stand_ins[m].out_features for m in members]
    fused = Returns(torch.cat([random_like((*x.shape[:-1], stand_ins[m].out_features), x, stand_ins[m].seed)
                               for m in members], dim=-1))
    rest = {n: stand_in for n, stand_in in stand_ins.items() if n not in members}
    name = fused_name(parent, members)
    parent.add_module(name, fused)
    shared = FusedSet(parent, name, members)
    try:
        with swapped(parent, {**rest, **_slices(shared, x.shape[-1], members, widths)}):
            return copied(parent(*args, **kwargs))
    finally:
        shared.remove()
        delattr(parent, name)


def _slices(shared: FusedSet, in_features: int, members: tuple[str, ...], widths: list[int]) -> dict[str, FusedSlice]:
    slices, start = {}, 0
    for member, width in zip(members, widths):
        slices[member], start = FusedSlice(shared, in_features, start, start + width), start + width
    return slices


def install(model: nn.Module, plan: FusionPlan, fused: nn.Module) -> None:
    """Serve `plan`'s members from `fused` (their columns side by side, `plan.name` in their module)."""
    parent = model.get_submodule(plan.parent)
    widths = [getattr(parent, member).out_features for member in plan.members]
    parent.add_module(plan.name, fused)
    shared = FusedSet(parent, plan.name, plan.members)
    for member, piece in _slices(shared, fused.in_features, plan.members, widths).items():
        setattr(parent, member, piece)


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
    # (_packed: the layers' codes and scales passed their checks when the layers were made or loaded;
    # a loaded layer may hold zero scales, which from_codes refuses)
    fused = QuantLinear._packed(torch.cat(codes, 1), torch.cat(scales, 1), _concatenated_bias(layers), first.layout,
                                precompile=False, max_m=None,
                                zeros=None if first.zeros() is None else torch.cat(zeros, 1), act=first.act)
    fused.perm = first.perm
    return fused


def joined_quantized_state(fused: QuantLinear, entries: dict[str, dict], widths: list[int], prefix: str,
                           missing_keys: list[str], unexpected_keys: list[str]) -> dict:
    """The state dict of `fused`'s form holding the members' entries (by member name, keys without
    the member's prefix; `widths` their out_features) side by side, each first loaded into a layer of
    its own, so that every check of QuantLinear's loading applies, its message naming the member. Keys
    a member's entry lacks or has too many are added to `missing_keys` / `unexpected_keys` under the
    member's name (nothing is joined where one is missing). Meta tensors give meta tensors of the fused
    form (their values are not there to join)."""
    members, lacking = [], []
    for (member, entry), width in zip(entries.items(), widths):
        where = f"{prefix}{member}."
        if "bias" in entry and fused.bias is None:      # the fused layer keeps no columns of a bias
            entry = {key: value for key, value in entry.items() if key != "bias"}
            unexpected_keys.append(where + "bias")
        on_meta = any(value.is_meta for value in entry.values())
        layer = _member_like(fused, width, "bias" in entry, "meta" if on_meta else entry.get("qweight"))
        if on_meta:
            expected = set(layer.state_dict())
            missing, unexpected = sorted(expected - set(entry)), sorted(set(entry) - expected)
        else:
            try:
                missing, unexpected = layer.load_state_dict(entry, strict=False)
            except (RuntimeError, ValueError) as exc:
                raise type(exc)(f"{prefix}{member}: {exc}") from None
        lacking += [where + key for key in missing]
        unexpected_keys += [where + key for key in unexpected]
        members.append(layer)
    if lacking:
        missing_keys += lacking
        return {}
    if any(layer.qweight.is_meta for layer in members):
        return {key: torch.empty_like(value, device="meta") for key, value in fused.state_dict().items()}
    if fused.perm is not None and not all(torch.equal(m.perm, members[0].perm) for m in members):
        raise ValueError(f"{prefix}{', '.join(entries)}: the members' perm differ, so they cannot be one layer")
    return concatenated_quantized(members).state_dict()


def _member_like(fused: QuantLinear, width: int, bias: bool, where) -> QuantLinear:
    """An empty QuantLinear of `fused`'s form and `width` output features, on the device of `where` (a
    device or a tensor; the default for None)."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return QuantLinear(fused.in_features, width, bias=bias, group_size=fused.group_size, dtype=fused.scales.dtype,
                       device=device, layout=fused.layout, act_order=fused.perm is not None,
                       zero_points=fused.zero_points, precompile=False, act=fused.act)


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
