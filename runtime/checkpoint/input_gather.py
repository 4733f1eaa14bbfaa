"""One act-order gather for the layers that read the same input.

GPTQ's act-order permutation sorts a layer's input features by its Hessian's diagonal, and the Hessian
is built from the layer's inputs alone, so the layers that read one tensor (q_proj, k_proj and v_proj;
gate_proj and up_proj) come with one permutation. Each of their QuantLinear layers would gather that
tensor's columns again; instead, the module that calls them gathers its input once (a forward pre-hook,
`InputGather`, reading the module's `input_perm` buffer) and they run without a permutation of their own.

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

PROMPT_TOKENS = 2


class InputGather:
    """A forward pre-hook (registered with_kwargs): the module's argument at `slot`, a position or a
    keyword, replaced by its columns gathered by the module's `input_perm`."""

    def __init__(self, slot: int | str):
        self.slot = slot

    def __call__(self, module, args, kwargs):
        if isinstance(self.slot, int):
            gathered = gather_columns(args[self.slot], module.input_perm)
            return (*args[:self.slot], gathered, *args[self.slot + 1:]), kwargs
        return args, {**kwargs, self.slot: gather_columns(kwargs[self.slot], module.input_perm)}


def share_input_gathers(model: nn.Module) -> list[str]:
    """For each module whose QuantLinear children share one act-order permutation and whose forward
    reads their input through them alone (see the module's docstring): the module gathers its input
    once and the children drop their permutations. Returns the modules' names. The probes run in
    eval mode (dropout would make equal calls differ); the model's mode is kept."""
    groups = sharing_groups(model)
    if not groups:
        return []
    training = model.training
    model.eval()
    try:
        calls = record_calls(model, groups)
        slots = {name: input_slot(model.get_submodule(name), members, *calls[name])
                 for name, members in groups.items() if name in calls}
    finally:
        model.train(training)
    shared = []
    for name, slot in slots.items():
        if slot is None:
            continue
        parent = model.get_submodule(name)
        children = [getattr(parent, member) for member in groups[name]]
        parent.register_buffer("input_perm", children[0].perm)
        for child in children:
            child.perm = None
        parent.register_forward_pre_hook(InputGather(slot), with_kwargs=True)
        shared.append(name)
    return shared


def sharing_groups(model: nn.Module) -> dict[str, list[str]]:
    """Module name -> its act-order QuantLinear children (attribute names) that share one permutation,
    where two or more do (the largest such set of each module)."""
    groups = {}
    for name, module in model.named_modules():
        by_perm: list[list[str]] = []
        for child_name, child in module.named_children():
            if not isinstance(child, QuantLinear) or child.perm is None:
                continue
            same = next((g for g in by_perm if torch.equal(getattr(module, g[0]).perm, child.perm)), None)
            if same is None:
                by_perm.append([child_name])
            else:
                same.append(child_name)
        largest = max(by_perm, key=len, default=[])
        if len(largest) >= 2:
            groups[name] = largest
    return groups


def record_calls(model: nn.Module, names) -> dict[str, tuple[tuple, dict]]:
    """Name -> (args, kwargs) of each named module's first call in a forward of a short prompt, with every
    QuantLinear replaced by a stand-in that returns zeros; {} where the model cannot run that forward."""
    calls: dict[str, tuple[tuple, dict]] = {}

    def recorder(name):
        def record(module, args, kwargs):
            calls.setdefault(name, (args, kwargs))
        return record

    handles = [model.get_submodule(name).register_forward_pre_hook(recorder(name), with_kwargs=True)
               for name in names]
    quantized = {name: _Zeros(m.out_features) for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    device = model.get_input_embeddings().weight.device
    try:
        with _swapped(model, quantized), torch.no_grad():
            model(input_ids=torch.zeros(1, PROMPT_TOKENS, dtype=torch.long, device=device), use_cache=False)
    except Exception:   # noqa: BLE001 - a model that this forward cannot run shares no gathers
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return calls


def input_slot(parent: nn.Module, members: list[str], args: tuple, kwargs: dict) -> int | str | None:
    """The position or keyword of the argument that the `members` layers read, where `parent`'s forward
    reads it through them alone and hands it to them unchanged; None otherwise."""
    others = {name: _LinearMap(m.in_features, m.out_features) for name, m in parent.named_modules()
              if isinstance(m, QuantLinear) and name not in members}
    fixed = {name: _Fixed(getattr(parent, name).out_features) for name in members}
    try:
        with _swapped(parent, {**others, **fixed}), torch.no_grad():
            first = parent(*args, **kwargs)
            read = [stand_in.seen for stand_in in fixed.values()]
            if not isinstance(read[0], torch.Tensor) or any(r is not read[0] for r in read):
                return None
            slot = _slot_of(read[0], args, kwargs)
            if slot is None:
                return None
            other = _random(read[0].shape, read[0], seed=1)
            args, kwargs = _replaced(args, kwargs, slot, other)
            second = parent(*args, **kwargs)
            if any(stand_in.seen is not other for stand_in in fixed.values()) or not _equal(first, second):
                return None
            return slot
    except Exception:   # noqa: BLE001 - a call the probe cannot repeat shares no gather
        return None


def _slot_of(tensor, args, kwargs):
    positions = [i for i, a in enumerate(args) if a is tensor]
    keywords = [k for k, v in kwargs.items() if v is tensor]
    found = positions + keywords
    return found[0] if len(found) == 1 else None


def _replaced(args, kwargs, slot, value):
    if isinstance(slot, int):
        return (*args[:slot], value, *args[slot + 1:]), kwargs
    return args, {**kwargs, slot: value}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a is b or a == b


@contextlib.contextmanager
def _swapped(root: nn.Module, replacements: dict[str, nn.Module]):
    """The named submodules of `root` replaced, and put back afterwards."""
    originals = {name: root.get_submodule(name) for name in replacements}
    for name, module in replacements.items():
        _set(root, name, module)
    try:
        yield
    finally:
        for name, module in originals.items():
            _set(root, name, module)


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


class _Zeros(nn.Module):
    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


class _Fixed(nn.Module):
    """Keeps what it reads; returns the same random tensor whatever that was."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features, self.seen, self.value = out_features, None, None

    def forward(self, x):
        self.seen = x
        if self.value is None:
            self.value = _random((*x.shape[:-1], self.out_features), x)
        return self.value


class _LinearMap(nn.Module):
    """x @ R for a random R: an output that depends on every input column."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features, self.map = in_features, out_features, None

    def forward(self, x):
        if self.map is None:
            self.map = _random((self.in_features, self.out_features), x) / self.in_features ** 0.5
        return x @ self.map


def _random(shape, like: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Seeded normal values in `like`'s dtype and device (the global generator left as it is)."""
    gen = torch.Generator(device=like.device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=like.device).to(like.dtype)
