"""Running a module's own forward with stand-ins for some of its layers: how the act-order folds
(runtime/checkpoint: fold.py, input_gather.py, norm_fold.py) and the fusion of layers that read one
input (fuse.py) learn what a module does with its layers' inputs and outputs without knowing its
class. Every probe runs in eval mode, puts the real layers back, and leaves the global random
generators as they were."""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from .linear import QuantLinear

_PROMPT_TOKENS = 2
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@contextlib.contextmanager
def swapped(root: nn.Module, replacements: dict[str, nn.Module]):
    """The named submodules of `root` replaced, every module of `root` in eval mode (dropout would
    make two equal calls differ); the layers and each module's mode are put back afterwards."""
    originals = {name: root.get_submodule(name) for name in replacements}
    modes = {module: module.training for module in root.modules()}
    for name, module in replacements.items():
        root.set_submodule(name, module)
    root.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for name, module in originals.items():
            root.set_submodule(name, module)
        for module, training in modes.items():
            module.training = training


def random_like(shape, like: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Seeded normal values in `like`'s dtype and device, from a generator of their own."""
    gen = torch.Generator(device=like.device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=like.device).to(like.dtype)


def copied(value):
    """`value` with every tensor in it cloned (tuples, lists and dicts followed), so that a later call
    cannot change it in place."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(copied(v) for v in value)
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    return value


def equal(a, b) -> bool:
    """Tensors equal element for element, followed through tuples, lists and dicts; anything else
    compared with ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a is b or a == b


def single_owner(model: nn.Module) -> set[int]:
    """ids of the modules that appear once in `model`: a layer shared by two modules is not folded,
    since a change made for one of them would reach the other."""
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        seen[id(module)] = seen.get(id(module), 0) + 1
    return {key for key, count in seen.items() if count == 1}


class Fixed(nn.Module):
    """A stand-in layer that keeps what it reads (the tensor, a copy of it as it was then, and how many
    calls there were) and returns a copy of the same random tensor whatever that was."""

    def __init__(self, out_features: int, seed: int = 0):
        super().__init__()
        self.out_features, self.seed, self.seen, self.value = out_features, seed, None, None
        self.seen_then, self.calls = None, 0

    def forward(self, x):
        self.seen, self.seen_then, self.calls = x, copied(x), self.calls + 1
        if self.value is None:
            self.value = random_like((*x.shape[:-1], self.out_features), x, self.seed)
        return self.value.clone()


class Returns(nn.Module):
    """A stand-in layer that returns a copy of a given tensor."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value.clone()


class Zeros(nn.Module):
    """A stand-in layer that returns zeros of its output width."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


class LinearMap(nn.Module):
    """A stand-in layer returning x @ U @ V for random U [in, RANK] and V [RANK, out]: an output that
    depends on every input column, at a small fraction of a full map's cost (a probe of a 7B model's
    layers on the CPU would otherwise draw gigabytes of random weights)."""

    RANK = 8

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features, self.maps = in_features, out_features, None

    def forward(self, x):
        if self.maps is None:
            self.maps = (random_like((self.in_features, self.RANK), x) / self.in_features ** 0.5,
                         random_like((self.RANK, self.out_features), x, seed=1) / self.RANK ** 0.5)
        return x @ self.maps[0] @ self.maps[1]


def record_calls(model: nn.Module, names) -> dict[str, tuple[tuple, dict]]:
    """Name -> (args, kwargs) of each named module's first call in a forward of a short prompt, every
    QuantLinear replaced by a stand-in that returns zeros; {} where the model cannot run that forward
    (the probe runs without a cache: a module that kept its input in one would pass it unseen)."""
    calls: dict[str, tuple[tuple, dict]] = {}

    def recorder(name):
        def record(module, args, kwargs):
            calls.setdefault(name, (args, kwargs))
        return record

    handles = [model.get_submodule(name).register_forward_pre_hook(recorder(name), with_kwargs=True)
               for name in names]
    quantized = {name: Zeros(m.out_features) for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    try:
        prompt = torch.zeros(1, _PROMPT_TOKENS, dtype=torch.long, device=model.get_input_embeddings().weight.device)
        with swapped(model, quantized):
            model(input_ids=prompt, use_cache=False)
    except Exception:   # noqa: BLE001 - a model that this forward cannot run shares no gathers
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return calls


def argument_slot(tensor, args, kwargs) -> int | str | None:
    """Where `tensor` is among the call's arguments: its position or keyword, if it is there once."""
    found = [i for i, a in enumerate(args) if a is tensor] + [k for k, v in kwargs.items() if v is tensor]
    return found[0] if len(found) == 1 else None


def with_argument(args, kwargs, slot, value):
    """The call's (args, kwargs) with `value` at `slot` (argument_slot's)."""
    if isinstance(slot, int):
        return (*args[:slot], value, *args[slot + 1:]), kwargs
    return args, {**kwargs, slot: value}


def forward_parameter(parent: nn.Module, slot: int | str) -> tuple[int | None, str] | None:
    """(position or None, name) of the forward's parameter that a call filled at `slot` (a position
    or a keyword), so that a hook finds it however a later call passes it; None where it is caught
    by *args or **kwargs."""
    params = list(inspect.signature(parent.forward).parameters.values())
    if isinstance(slot, int):
        return (slot, params[slot].name) if slot < len(params) and params[slot].kind in _POSITIONAL else None
    position = next((i for i, p in enumerate(params) if p.name == slot), None)
    if position is None:
        return None
    return (position if params[position].kind in _POSITIONAL else None), slot
