"""One act-order gather for the layers that read the same input, done by the module that calls them.

GPTQ's act-order permutation sorts a layer's input features by its Hessian's diagonal, and the Hessian
is built from the layer's inputs alone, so the layers that read one tensor (q_proj, k_proj and v_proj;
gate_proj and up_proj) come with one permutation. Each of their QuantLinear layers would gather that
tensor's columns again; instead, the module that calls them gathers its input once (a forward pre-hook,
`InputGather`, reading the module's `input_perm` buffer) and they run without a permutation of their own.
A fused set of them (runtime/fuse.py) is one such layer; its module gathering the input is what lets
norm_fold.py move the gather into the norm before it.

That is exact only where the module's forward reads that input through those layers alone and hands it
to them as it is. `share_input_gathers` learns this from the model itself, not from class names: one
forward of a short prompt records each candidate module's call, every QuantLinear replaced by a
stand-in (no kernel runs, so the model may be on any device); then each call is repeated twice with
the layers that share the permutation returning fixed tensors whatever they read (the other QuantLinear
layers a fixed linear map of their input), once with the recorded input and once with another: the
layers must have received each input itself, and the module's outputs must be equal.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..linear import QuantLinear
from ..op import gather_columns
from ..probe import (Fixed, LinearMap, argument_slot, copied, equal, forward_parameter, random_like, record_calls,
                     single_owner, swapped, with_argument)

class InputGather:
    """A forward pre-hook (registered with_kwargs): the module's argument `name` (at `position` where
    it is passed positionally) replaced by its columns gathered by the module's `input_perm`, for the
    module's act-order layers `members` (attribute names). `handle` removes it; `skip` (set by
    gathers_skipped, for probes) passes the input on as it is."""

    def __init__(self, position: int | None, name: str, members: tuple[str, ...]):
        self.position, self.name, self.members = position, name, members
        self.handle, self.skip = None, False

    def __call__(self, module, args, kwargs):
        if self.skip:
            return None
        if self.name in kwargs:
            return args, {**kwargs, self.name: gather_columns(kwargs[self.name], module.input_perm)}
        if self.position is not None and self.position < len(args):
            i = self.position
            return (*args[:i], gather_columns(args[i], module.input_perm), *args[i + 1:]), kwargs
        raise TypeError(f"{type(module).__name__} was called without its argument {self.name!r}, whose columns "
                        "it gathers for its act-order layers")


def share_input_gathers(model: nn.Module) -> list[str]:
    """For each module with QuantLinear children that share one act-order permutation (one or more)
    and whose forward reads their input through them alone (see the module's docstring): the module
    gathers its input once and the children drop their permutations. Returns the modules' names."""
    groups = sharing_groups(model)
    calls = record_calls(model, groups) if groups else {}
    shared = []
    for name, candidates in groups.items():
        parent = model.get_submodule(name)
        for members in candidates if name in calls else ():
            argument = input_argument(parent, members, *calls[name])
            if argument is not None:
                _share(parent, members, argument)
                shared.append(name)
                break
    return shared


def _share(parent: nn.Module, members: list[str], argument: tuple[int | None, str]) -> None:
    children = [getattr(parent, member) for member in members]
    parent.register_buffer("input_perm", children[0].perm)
    for child in children:
        child.perm = None
    gather = InputGather(*argument, tuple(members))
    gather.handle = parent.register_forward_pre_hook(gather, with_kwargs=True)


def unshare_input_gathers(model: nn.Module) -> list[str]:
    """The inverse of share_input_gathers: each module that gathers its layers' input hands its
    permutation back to those layers (each gathers again) and drops its hook and `input_perm`.
    Returns the modules' names."""
    undone = []
    for name, parent in model.named_modules():
        gathers = input_gathers(parent)
        for gather in gathers:
            for member in gather.members:
                getattr(parent, member).perm = parent.input_perm
            gather.handle.remove()
        if gathers:
            del parent.input_perm
            undone.append(name)
    return undone


@contextlib.contextmanager
def gathers_skipped(model: nn.Module):
    """Every InputGather of `model` passing its input on ungathered (a probe's forward runs no kernel)."""
    gathers = [gather for module in model.modules() for gather in input_gathers(module)]
    for gather in gathers:
        gather.skip = True
    try:
        yield
    finally:
        for gather in gathers:
            gather.skip = False


def input_gathers(module: nn.Module) -> list[InputGather]:
    """The InputGather hooks of `module` (one where share_input_gathers gave it one)."""
    return [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, InputGather)]


def sharing_groups(model: nn.Module) -> dict[str, list[list[str]]]:
    """Module name -> its act-order QuantLinear children (attribute names) by the permutation they share,
    the largest set first, for the modules that have such children; children that appear elsewhere in
    the model too are left out."""
    owned = single_owner(model)
    groups = {}
    for name, module in model.named_modules():
        by_perm: list[list[str]] = []
        for child_name, child in module.named_children():
            if not isinstance(child, QuantLinear) or child.perm is None or id(child) not in owned:
                continue
            same = next((g for g in by_perm if torch.equal(getattr(module, g[0]).perm, child.perm)), None)
            if same is None:
                by_perm.append([child_name])
            else:
                same.append(child_name)
        if by_perm:
            groups[name] = sorted(by_perm, key=len, reverse=True)
    return groups


def input_argument(parent: nn.Module, members: list[str], args: tuple, kwargs: dict) -> tuple[int | None, str] | None:
    """(position or None, name) of `parent.forward`'s parameter that the `members` layers read, where
    the forward reads it through them alone and hands it to them unchanged; None otherwise."""
    others = {name: LinearMap(m.in_features, m.out_features) for name, m in parent.named_modules()
              if isinstance(m, QuantLinear) and name not in members}
    fixed = {name: Fixed(getattr(parent, name).out_features) for name in members}
    try:
        with swapped(parent, {**others, **fixed}):
            first = copied(parent(*args, **kwargs))
            read = [stand_in.seen for stand_in in fixed.values()]
            if not isinstance(read[0], torch.Tensor) or any(r is not read[0] for r in read):
                return None
            slot = argument_slot(read[0], args, kwargs)
            if slot is None:
                return None
            other = random_like(read[0].shape, read[0], seed=1)
            other_args, other_kwargs = with_argument(args, kwargs, slot, other)
            second = parent(*other_args, **other_kwargs)
            if any(stand_in.seen is not other for stand_in in fixed.values()) or not equal(first, second):
                return None
        return forward_parameter(parent, slot)
    except Exception:   # noqa: BLE001 - a call the probe cannot repeat shares no gather
        return None


