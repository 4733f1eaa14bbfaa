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
- the module's gathered argument is the norm's output itself, and nothing else in their parent reads
  it: the parent's forward (from a recorded call of a short prompt) runs twice with the norm returning
  two different tensors and the gathering modules returning fixed outputs; the parent's outputs, and
  what the parent's other gathering modules read, must be equal.
Probes run in eval mode, with the gathers skipped and the INT4 layers replaced (probe.py), and put
every module back. `unfold_gathered_norms` undoes the move (the dense twin of a model, say).
"""
from __future__ import annotations

import torch
from torch import nn

from ..op import rms_norm_gather
from .input_gather import InputGather, gathers_skipped, input_gathers, record_calls
from .probe import LinearMap, Zeros, copied, equal, random_like, single_owner, swapped

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
    def fed_problem(self):
        """The problem of the first act-order layer its output feeds (its K and dtype are the norm's)."""
        _, consumer, gather = self._replaced
        return getattr(consumer, gather.members[0]).problem

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps.item():g}, act-order gathered"


def fold_gathers_into_norms(model: nn.Module) -> list[str]:
    """For each module that gathers its input (input_gather.py) whose input is the output of an RMSNorm
    beside it that nothing else reads: the norm writes the gathered columns and the module's gather
    goes. Every pair is probed before any is folded. Returns the folded norms' names."""
    owned = single_owner(model)
    consumers = {name: [child for child, module in parent.named_children() if input_gathers(module)]
                 for name, parent in model.named_modules()}
    consumers = {name: children for name, children in consumers.items() if children}
    folds = []
    with gathers_skipped(model):
        norms = [_joined(name, child) for name in consumers
                 for child, module in model.get_submodule(name).named_children() if id(module) in owned]
        calls = record_calls(model, [*consumers, *norms]) if consumers else {}
        for name, children in consumers.items():
            parent = model.get_submodule(name)
            widths = {getattr(parent, child).input_perm.numel() for child in children}
            for norm_name, norm in parent.named_children():
                full = _joined(name, norm_name)
                if (name not in calls or full not in calls or id(norm) not in owned
                        or all(rms_norm_eps(norm, k) is None for k in widths)):    # the cheap test first
                    continue
                consumer_name = _fed_consumer(parent, norm_name, children, calls[name], calls[full])
                if consumer_name is None or any(f[4] is getattr(parent, consumer_name) for f in folds):
                    continue
                consumer = getattr(parent, consumer_name)
                eps = rms_norm_eps(norm, consumer.input_perm.numel())
                if eps is not None:
                    folds.append((full, parent, norm_name, norm, consumer, eps))
    for full, parent, norm_name, norm, consumer, eps in folds:
        _fold(parent, norm_name, norm, eps, consumer)
    return [f[0] for f in folds]


def _joined(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _fold(parent: nn.Module, norm_name: str, norm: nn.Module, eps: float, consumer: nn.Module) -> None:
    (gather,) = input_gathers(consumer)
    parent.set_submodule(norm_name, GatheredRMSNorm(norm, eps, consumer, gather))
    gather.handle.remove()
    del consumer.input_perm


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
    """A stand-in norm that returns a fresh copy of `value` and keeps the last one it returned."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value, self.last = value, None

    def forward(self, *args, **kwargs):
        self.last = self.value.clone()
        return self.last


class _Canned(nn.Module):
    """A stand-in for a gathering module: random tensors in the form of the real module's output (its
    first call's, with its INT4 layers returning zeros), returned again whatever later calls pass;
    keeps the tensor each call passed as the gathered argument."""

    def __init__(self, real: nn.Module, gather: InputGather):
        super().__init__()
        self.real, self.gather, self.output, self.seen = real, gather, None, None

    def forward(self, *args, **kwargs):
        self.seen = kwargs.get(self.gather.name, args[self.gather.position] if self.gather.position is not None
                               and self.gather.position < len(args) else None)
        if self.output is None:
            from ..linear import QuantLinear

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


def _fed_consumer(parent: nn.Module, norm_name: str, consumers: list[str], parent_call, norm_call) -> str | None:
    """The one gathering child of `parent` whose gathered argument is the output of `norm_name`, where
    nothing else in the parent's forward reads that output; None otherwise."""
    from ..linear import QuantLinear

    args, kwargs = norm_call
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    canned = {name: _Canned(getattr(parent, name), input_gathers(getattr(parent, name))[0]) for name in consumers}
    inside = tuple(f"{name}." for name in consumers)
    maps = {name: LinearMap(m.in_features, m.out_features) for name, m in parent.named_modules()
            if isinstance(m, QuantLinear) and not name.startswith(inside)}
    runs = []
    try:
        for seed in (3, 4):
            emits = _Emits(random_like(args[0].shape, args[0], seed=seed))
            with swapped(parent, {**maps, **canned, norm_name: emits}):
                out = copied(parent(*parent_call[0], **parent_call[1]))
            runs.append((out, emits.last, {name: copied(stand_in.seen) for name, stand_in in canned.items()},
                         {name: stand_in.seen for name, stand_in in canned.items()}))
    except Exception:   # noqa: BLE001 - a call the probe cannot repeat folds nothing
        return None
    (out1, emitted1, seen1, raw1), (out2, emitted2, seen2, raw2) = runs
    fed = [name for name in consumers if raw1[name] is emitted1 and raw2[name] is emitted2]
    if len(fed) != 1 or not equal(out1, out2):
        return None
    others_unchanged = all(equal(seen1[name], seen2[name]) for name in consumers if name != fed[0])
    return fed[0] if others_unchanged else None
