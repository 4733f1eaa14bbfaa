"""The models `gen bench --e2e` measures: a Hugging Face causal LM built from its config with random
weights, and the same model with its linear layers converted; or a quantized checkpoint's own model.

Variants of a config (each built afresh from the same seed, so all hold the same weights before
conversion):

- `dense`: the model as it is, in float16 or bfloat16;
- `tilemarlin`: `runtime.replace_linear` (round-to-nearest INT4, one scale per `group` input rows;
  lm_head stays dense), served from the tuned table;
- `humming`: every linear layer but lm_head as a humming-kernels `HummingLayer` (its own INT4
  quantization of the same weights, with the same group size), where humming is importable;
- `tilemarlin_unfused` (not measured unless named): `tilemarlin` with q, k, v, gate and up each
  its own GEMM (`fuse=False`), what fusing them (runtime/fuse.py) gains.

Variants of a checkpoint folder (GPTQ, AWQ or compressed-tensors, read by runtime.load_quantized):

- `tilemarlin`: the model as load_quantized serves it (zero points, act-order gathers and all);
  `tilemarlin_unfused` the same with its layers apart;
- `dense`: the same model with its INT4 layers dequantized into nn.Linear layers: the weights the
  checkpoint stands for, at dense speed;
- `humming`: humming's own INT4 quantization of those dequantized weights (symmetric, the
  checkpoint's group size): the same work, though not the checkpoint's exact weights.

`to_dequantized` turns a tilemarlin model back into plain linear layers holding exactly the weights
the INT4 kernels compute with, the reference of the token check.

The registry (gen/models.py) holds the fields that decide the linear shapes; building a model also
needs its architecture, depth and vocabulary, which ARCHITECTURES adds per registered name, as in each
model's published config.json. Fields that change values but not the work done (the rope base, norm
epsilon) keep transformers' defaults.
"""
from __future__ import annotations

import torch
from torch import nn

VARIANTS = ("dense", "tilemarlin", "humming")      # measured by default
KNOWN_VARIANTS = (*VARIANTS, "tilemarlin_unfused")
TILEMARLIN_VARIANTS = ("tilemarlin", "tilemarlin_unfused")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SEED = 0
# lm_head stays dense in every variant: often tied to the embeddings, and outside what the kernels serve.
KEEP_DENSE = ("lm_head",)

_LLAMA_2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096)
_LLAMA_3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192)
_QWEN_2_5 = dict(model_type="qwen2", vocab_size=152064, max_position_embeddings=32768)
ARCHITECTURES: dict[str, dict] = {
    "llama-2-7b": dict(_LLAMA_2, num_hidden_layers=32),
    "llama-2-13b": dict(_LLAMA_2, num_hidden_layers=40),
    "llama-2-70b": dict(_LLAMA_2, num_hidden_layers=80),
    "llama-3-8b": dict(_LLAMA_3, num_hidden_layers=32),
    "llama-3-70b": dict(_LLAMA_3, num_hidden_layers=80),
    # v0.2 and later: full attention over the whole context (no sliding window)
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, max_position_embeddings=32768, num_hidden_layers=32,
                       sliding_window=None),
    "qwen2.5-7b": dict(_QWEN_2_5, num_hidden_layers=28),
    "qwen2.5-14b": dict(_QWEN_2_5, num_hidden_layers=48),
    "qwen2.5-32b": dict(_QWEN_2_5, num_hidden_layers=64),
    "qwen2.5-72b": dict(_QWEN_2_5, num_hidden_layers=80),
    "qwen2.5-72b-int4": dict(_QWEN_2_5, num_hidden_layers=80),
}
# config.json fields that would make transformers build something other than a dense model
_DROPPED_FIELDS = ("quantization_config", "auto_map", "torch_dtype", "dtype")


class VariantUnavailable(Exception):
    """The variant cannot be built in this environment: skipped for the run, with this reason."""


# --- configs -------------------------------------------------------------------------------------

def config_fields(name_or_path: str) -> dict:
    """The config.json fields of a registered model (gen.models.MODELS + ARCHITECTURES) or of a
    config.json given by path, with `model_type`."""
    from gen import models

    fields, registered = models.read_config(name_or_path)
    if registered:
        return {**fields, **ARCHITECTURES[str(name_or_path).lower()]}
    if not isinstance(fields.get("model_type"), str):
        raise ValueError(f"model config {name_or_path} has no model_type, which says which architecture to build")
    models.layers_from_config(fields)   # a malformed shape field is named here, before any GPU work
    return {key: value for key, value in fields.items() if key not in _DROPPED_FIELDS}


def hf_config(fields: dict):
    """The transformers config object of `fields`."""
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def kv_bytes(config, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of a static KV cache of `batch` x `context` positions (keys and values, every layer)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * batch * context * kv_heads * head_dim * dtype.itemsize


# --- building ------------------------------------------------------------------------------------

def _dtype_keyword() -> str:
    """transformers 5 calls the model dtype `dtype`; 4.x calls it `torch_dtype`."""
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def build_dense(config, dtype: torch.dtype, device="cuda") -> nn.Module:
    """The model of `config` with random weights (seeded), created on `device` in `dtype`: its layers
    are allocated and initialized there, not on the CPU first."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **{_dtype_keyword(): dtype})
    return model.eval().requires_grad_(False)


def _converted_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not any(keep in name for keep in KEEP_DENSE)]


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def to_tilemarlin(model: nn.Module, group: int, max_m: int | None = None, fuse: bool = True) -> nn.Module:
    """replace_linear, which on a GPU also builds every kernel the layers will run for M up to `max_m`."""
    from runtime import replace_linear

    return replace_linear(model, group_size=group, skip=KEEP_DENSE, max_m=max_m, fuse=fuse)


def to_dequantized(model: nn.Module) -> nn.Module:
    """Every QuantLinear of `model` as an nn.Linear holding dequantize(codes, scales, zero points), in
    place. An act-order layer's rows go back to the input features' order, so no gather is left: a norm
    that wrote its output in the gathered order (runtime/checkpoint/norm_fold.py) gives way to the
    norm it replaced, and a module that gathered the input of the layers it calls
    (runtime/checkpoint/input_gather.py) hands its permutation back to them first. A dense model is
    then plain torch, its speed dense speed."""
    from runtime import QuantLinear
    from runtime.checkpoint.input_gather import unshare_input_gathers
    from runtime.checkpoint.norm_fold import unfold_gathered_norms
    from schedules.quant import dequantize

    unfold_gathered_norms(model)
    unshare_input_gathers(model)
    names = [name for name, module in model.named_modules() if isinstance(module, QuantLinear)]
    for name in names:
        quant = model.get_submodule(name)
        codes, scales = quant.unpack()
        weight = dequantize(codes, scales, quant.bits, quant.zeros())
        if quant.perm is not None:   # stored row i meets input feature perm[i]
            weight = torch.empty_like(weight).index_copy_(0, quant.perm.long(), weight)
        linear = nn.utils.skip_init(nn.Linear, quant.in_features, quant.out_features, bias=quant.bias is not None,
                                    device=scales.device, dtype=scales.dtype)
        linear.weight.data.copy_(weight.t())
        if quant.bias is not None:
            linear.bias.data.copy_(quant.bias)
        _swap(model, name, linear.requires_grad_(False))
    return model


class HummingLinear(nn.Module):
    """A HummingLayer in an nn.Linear's place: humming takes 2-D activations, so the leading
    dimensions are flattened and restored around it; the bias is added after it."""

    def __init__(self, layer: nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.layer, self.in_features, self.out_features = layer, layer.shape_k, layer.shape_n
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _humming_layer_class():
    try:
        from humming.layer import HummingLayer
    except ImportError as exc:
        raise VariantUnavailable(f"humming is not importable: {exc}") from None
    return HummingLayer


def to_humming(model: nn.Module, group: int) -> nn.Module:
    """Every linear layer but lm_head as a humming INT4 layer of the same weights, in place."""
    HummingLayer = _humming_layer_class()
    for name in _converted_names(model):
        linear = model.get_submodule(name)
        config = {"dtype": "int4", "group_size": 0 if group == -1 else group}   # 0: one scale per column
        layer = HummingLayer(shape_n=linear.out_features, shape_k=linear.in_features, weight_config=config,
                             torch_dtype=linear.weight.dtype).cuda()
        layer.load_from_unquantized(linear.weight)
        layer.transform()
        bias = None if linear.bias is None else linear.bias.detach()
        _swap(model, name, HummingLinear(layer, bias))
    return model


def load_checkpoint(folder, dtype: torch.dtype, device="cuda", precompile: bool = True, fuse: bool = True) -> nn.Module:
    """runtime.load_quantized of a checkpoint folder on `device` (its kernels built with `precompile`)."""
    from runtime import load_quantized

    return load_quantized(folder, dtype, device, precompile=precompile, fuse=fuse)


def checkpoint_variant(variant: str, folder, dtype: torch.dtype, device="cuda") -> nn.Module:
    """The checkpoint's model as `variant` (see the module's docstring) on `device`. Raises
    VariantUnavailable where it cannot be built here."""
    if variant == "humming":
        _humming_layer_class()
    model = load_checkpoint(folder, dtype, device, precompile=variant in TILEMARLIN_VARIANTS,
                            fuse=variant != "tilemarlin_unfused")
    if variant in TILEMARLIN_VARIANTS:
        return model
    groups = layer_summary(model)["group_sizes"]
    to_dequantized(model)
    if variant == "dense":
        return model
    if len(groups) != 1:
        raise VariantUnavailable(f"humming takes one group size per model; the checkpoint's layers have {groups}")
    return to_humming(model, groups[0])


def layer_summary(model: nn.Module) -> dict:
    """What a tilemarlin model's INT4 layers hold: how many, how many with zero points of their own,
    their group sizes (-1 for one group over K), the act-order gathers of one forward (the layers'
    own, and those of modules that gather for the layers they call) and the norms that write act-order
    layers' input in their order instead."""
    from runtime import QuantLinear
    from runtime.checkpoint.norm_fold import GatheredRMSNorm

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    shared = [m for m in model.modules() if isinstance(getattr(m, "input_perm", None), torch.Tensor)]
    return {"int4_layers": len(layers), "zero_points": sum(m.zero_points for m in layers),
            "group_sizes": sorted({-1 if m.group_size == m.in_features else m.group_size for m in layers}),
            "gathers": sum(m.perm is not None for m in layers) + len(shared),
            "gathering_norms": sum(isinstance(m, GatheredRMSNorm) for m in model.modules())}


def build_variant(variant: str, config, dtype: torch.dtype, group: int, max_m: int | None = None) -> nn.Module:
    """The model of `variant` on the GPU, its kernels built for M up to `max_m`. Raises
    VariantUnavailable where it cannot be built here."""
    if variant == "humming":
        _humming_layer_class()   # before building anything
    model = build_dense(config, dtype)
    if variant in TILEMARLIN_VARIANTS:
        return to_tilemarlin(model, group, max_m, fuse=variant == "tilemarlin")
    if variant == "humming":
        return to_humming(model, group)
    return model


# --- what a variant holds ------------------------------------------------------------------------

def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (tied and shared tensors count once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a QuantLinear's packed weights and scales are buffers)."""
    return _tensor_bytes([*model.parameters(), *model.buffers()])


def quantized_bytes(model: nn.Module) -> int:
    """Bytes held by the converted layers (QuantLinear or HummingLinear); 0 for a dense model."""
    from runtime import QuantLinear

    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, HummingLinear))]
    return _tensor_bytes([t for m in layers for t in (*m.parameters(), *m.buffers())])
