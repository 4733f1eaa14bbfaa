"""The act-order gather of a module's input moved into the RMSNorm that produces it.

After input_gather.py, a Llama decoder layer's self_attn and mlp each gather their input once for the
act-order layers they call. That input is the output of an RMSNorm (input_layernorm,
post_attention_layernorm) that nothing else reads. A norm's mean square does not depend on the order
of the row's columns, so the norm can write its output in the gathered order itself
(`GatheredRMSNorm`, one kernel: schedules/norm_gather.py) and the module's gather goes: a decoder
layer then gathers once, for o_proj, instead of three times.

Which norm qualifies is probed, not read from class names:
- the norm computes transformers' RMSNorm, weight * (x / sqrt(mean(x^2) + eps)) in its rounding (its
  own forward against that formula on a random row, exactly, with its weight and eps and nothing else
  of its own);
- the module's gathered argument is the norm's output itself, unchanged, at each of its calls, and
  nothing else in their parent reads it: the parent's forward (from a recorded call of a short prompt)
  runs twice with the norm returning two different tensors and the gathering modules returning fixed
  outputs; the parent's outputs, the module's other arguments and what the parent's other gathering
  modules read must be equal;
- the norm has no hooks of its own, takes rows of its weight's dtype, and its width is one the kernel
  builds for (schedules/row_kernels.py).
Probes run in eval mode, with the gathers skipped and the INT4 layers replaced (probe.py), and put
every module back. `unfold_gathered_norms` undoes the move (the dense twin of a model, say).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from schedules.row_kernels import norm_gather_supports

from ..linear import QuantLinear
from ..op import rms_norm_gather
from .input_gather import InputGather, gathers_skipped, input_gathers
from ..probe import LinearMap, Zeros, copied, equal, random_like, record_calls, single_owner, swapped

_EPS_NAMES = ("variance_epsilon", "eps")


class GatheredRMSNorm(nn.Module):
    """transformers' RMSNorm written in act-order's gathered order (runtime.op.rms_norm_gather):
    `weight` is the norm's weight in that order, `perm` the order (int32), `eps` float32 [1]. It keeps
    the norm and the gather it replaced, for unfold_gathered_norms."""

    def __init__(self, norm: nn.Module, eps: float, consumer: nn.Module, gather: InputGather):
        super().__init__()
        perm = consumer.input_perm
        self.register_buffer("weight", norm.weight.detach()[perm.long()].contiguous())
        self.register_buffer("perm", perm)
        self.register_buffer("eps", torch.tensor([eps], dtype=torch.float32, device=perm.device))
        self._replaced = (norm, consumer, gather)    # a plain attribute: not a submodule, not in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_gather(x, self.weight, self.perm, self.eps)

    @property
    def fed_layer(self) -> QuantLinear:
        """The first act-order layer its output feeds (its K and dtype are the norm's)."""
        _, consumer, gather = self._replaced
        return getattr(consumer, gather.members[0])

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps.item():g}, act-order gathered"


class _Fold(NamedTuple):
    name: str               # the norm's, in the model
    parent: nn.Module
    attribute: str          # the norm's, in the parent
    norm: nn.Module
    consumer: nn.Module     # the gathering module it feeds
    eps: float


def fold_gathers_into_norms(model: nn.Module) -> list[str]:
    """For each module that gathers its input (input_gather.py) whose input is the output of an RMSNorm
    beside it that nothing else reads: the norm writes the gathered columns and the module's gather
    goes. Every pair is probed before any is folded. Returns the folded norms' names."""
    owned = single_owner(model)
    consumers = {name: [child for child, module in parent.named_children() if input_gathers(module)]
                 for name, parent in model.named_modules()}
    consumers = {name: children for name, children in consumers.items() if children}
    folds: list[_Fold] = []
    with gathers_skipped(model):
        norms = [_joined(name, child) for name in consumers
                 for child, module in model.get_submodule(name).named_children() if id(module) in owned]
        calls = record_calls(model, [*consumers, *norms]) if consumers else {}
        for name, children in consumers.items():
            parent = model.get_submodule(name)
            widths = {getattr(parent, child).input_perm.numel() for child in children}
            for attribute, norm in parent.named_children():
                full = _joined(name, attribute)
                if (name not in calls or full not in calls or id(norm) not in owned or not _plain(norm, calls[full])
                        or all(rms_norm_eps(norm, k) is None for k in widths)):    # the cheap tests first
                    continue
                fed = _fed_consumer(parent, attribute, children, calls[name], calls[full])
                consumer = None if fed is None else getattr(parent, fed)
                if consumer is None or any(f.consumer is consumer for f in folds):
                    continue
                eps = rms_norm_eps(norm, consumer.input_perm.numel())
                if eps is not None:
                    folds.append(_Fold(full, parent, attribute, norm, consumer, eps))
    for fold in folds:
        _fold(fold)
    return [fold.name for fold in folds]


def _plain(norm: nn.Module, call) -> bool:
    """No hook of its own would be lost with the module, its kernel can be built for the row's width,
    and it was called on a tensor of its weight's dtype (the kernel's one dtype)."""
    args, _ = call
    weight = getattr(norm, "weight", None)
    return (not (norm._forward_hooks or norm._forward_pre_hooks) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and norm_gather_supports(weight.shape[0])
            and bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype == weight.dtype)


def _joined(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _fold(fold: _Fold) -> None:
    (gather,) = input_gathers(fold.consumer)
    fold.parent.set_submodule(fold.attribute, GatheredRMSNorm(fold.norm, fold.eps, fold.consumer, gather))
    gather.handle.remove()
    del fold.consumer.input_perm


def unfold_gathered_norms(model: nn.Module) -> list[str]:
    """The inverse of fold_gathers_into_norms: each GatheredRMSNorm gives way to the norm it replaced,
    and the module it fed gathers its input again. Returns the norms' names."""
    undone = []
    for name, module in list(model.named_modules()):
        if isinstance(module, GatheredRMSNorm):
            norm, consumer, gather = module._replaced
            norm.to(module.weight.device)
            consumer.register_buffer("input_perm", module.perm)
            gather.handle = consumer.register_forward_pre_hook(gather, with_kwargs=True)
            model.set_submodule(name, norm)
            undone.append(name)
    return undone


def rms_norm_eps(norm: nn.Module, k: int) -> float | None:
    """The norm's eps where its forward is transformers' RMSNorm over K features (a float16 or bfloat16
    weight [K], the activations' dtype; eps; no other parameter, buffer or submodule of its own), else
    None."""
    weight = getattr(norm, "weight", None)
    eps = next((getattr(norm, n) for n in _EPS_NAMES if isinstance(getattr(norm, n, None), float)), None)
    if (eps is None or not isinstance(weight, torch.Tensor) or weight.shape != (k,) or weight.device.type == "meta"
            or weight.dtype not in (torch.float16, torch.bfloat16)
            or list(norm.children()) or list(norm.buffers()) or any(p is not weight for p in norm.parameters())):
        return None
    x = random_like((3, k), weight, seed=2) * 4
    try:
        with swapped(norm, {}):
            out = norm(x)
    except Exception:   # noqa: BLE001 - a module that cannot take a row is no norm of a row
        return None
    return eps if isinstance(out, torch.Tensor) and torch.equal(out, reference_rms_norm(x, weight, eps)) else None


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama, Mistral, Qwen2): the row in fp32, normalized, rounded to x's dtype,
    times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _Emits(nn.Module):
    """A stand-in norm that returns a fresh copy of `value` at each call, and keeps each one it returned
    with a copy of it (what it held then)."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value, self.emitted = value, []

    def forward(self, *args, **kwargs):
        out = self.value.clone()
        self.emitted.append((out, out.clone()))
        return out


class _Call(NamedTuple):
    gathered: object        # the tensor passed as the gathered argument (None where it was not passed)
    gathered_then: object   # a copy of it, taken at the call
    rest: object            # copies of the other arguments: (args, kwargs)


class _Canned(nn.Module):
    """A stand-in for a gathering module: random tensors in the form of the real module's output (its
    first call's, with its INT4 layers returning zeros), returned again whatever later calls pass;
    keeps what each call passed (_Call)."""

    def __init__(self, real: nn.Module, gather: InputGather):
        super().__init__()
        self.real, self.gather, self.output, self.calls = real, gather, None, []

    def forward(self, *args, **kwargs):
        name, position = self.gather.name, self.gather.position
        if name in kwargs:
            gathered, rest = kwargs[name], (args, {k: v for k, v in kwargs.items() if k != name})
        elif position is not None and position < len(args):
            gathered, rest = args[position], ((*args[:position], *args[position + 1:]), kwargs)
        else:
            gathered, rest = None, (args, kwargs)
        self.calls.append(_Call(gathered, copied(gathered), copied(rest)))
        if self.output is None:
            zeros = {n: Zeros(m.out_features) for n, m in self.real.named_modules() if isinstance(m, QuantLinear)}
            with swapped(self.real, zeros):
                self.output = _randomized(self.real(*args, **kwargs))
        return copied(self.output)


def _randomized(value, seed: int = 5):
    """`value` with each floating tensor in it (tuples, lists and dicts followed) replaced by seeded
    random values of its shape."""
    if isinstance(value, torch.Tensor):
        return random_like(value.shape, value, seed) if value.is_floating_point() else value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_randomized(v, seed + i) for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: _randomized(v, seed + i) for i, (k, v) in enumerate(value.items())}
    return value


class _Run(NamedTuple):
    output: object
    emitted: list                  # the norm stand-in's (tensor, copy) per call
    calls: dict[str, list[_Call]]  # per gathering child


def _fed_consumer(parent: nn.Module, norm_name: str, consumers: list[str], parent_call, norm_call) -> str | None:
    """The one gathering child of `parent` that receives the output of `norm_name` as its gathered
    argument (at every call, unchanged), where nothing else in the parent's forward reads that output:
    not the child's other arguments, not the other children, not the parent's outputs. None otherwise."""
    args, _ = norm_call
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    inside = tuple(f"{name}." for name in consumers)
    maps = {name: LinearMap(m.in_features, m.out_features) for name, m in parent.named_modules()
            if isinstance(m, QuantLinear) and not name.startswith(inside)}
    runs = []
    try:
        for seed in (3, 4):
            canned = {name: _Canned(getattr(parent, name), input_gathers(getattr(parent, name))[0])
                      for name in consumers}
            emits = _Emits(random_like(args[0].shape, args[0], seed=seed))
            with swapped(parent, {**maps, **canned, norm_name: emits}):
                out = copied(parent(*parent_call[0], **parent_call[1]))
            runs.append(_Run(out, emits.emitted, {name: stand_in.calls for name, stand_in in canned.items()}))
    except Exception:   # noqa: BLE001 - a call the probe cannot repeat folds nothing
        return None
    first, second = runs
    if len(first.emitted) != 1 or len(second.emitted) != 1 or not equal(first.output, second.output):
        return None
    fed = [name for name in consumers if _receives(first.calls[name], first.emitted[0])
           and _receives(second.calls[name], second.emitted[0])]
    if len(fed) != 1:
        return None
    for name in consumers:
        one, two = first.calls[name], second.calls[name]
        if len(one) != len(two) or not all(equal(a.rest, b.rest) for a, b in zip(one, two)):
            return None     # the norm's output reaches another argument, or changes how often it is called
        if name != fed[0] and not all(equal(a.gathered_then, b.gathered_then) for a, b in zip(one, two)):
            return None     # ... or another child's input
    return fed[0]


def _receives(calls: list[_Call], emitted) -> bool:
    """Every call passed the emitted tensor itself as the gathered argument, as it was emitted."""
    tensor, then = emitted
    return bool(calls) and all(c.gathered is tensor and equal(c.gathered_then, then) for c in calls)
