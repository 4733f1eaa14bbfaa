"""Tiny quantized checkpoints written the way each format's own tools write them, for the loader tests.

Written from the formats' definitions, apart from runtime/checkpoint: every packer here loops over
the eight slots of a word and names the row or column each slot holds, and every dequantization is
the format's formula evaluated directly. The model is a small Llama (hidden 256, intermediate 512,
2 layers, 4 heads of 64, 2 KV heads, vocab 128), so that every linear layer has K and N the kernels
take: K in {256, 512}, N in {128, 256, 512}; or another architecture of the same layer names and
sizes (`model_type`: qwen2, mistral, gemma).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # slot i of an AWQ word holds column 8c + AWQ_ORDER[i]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_slots(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim`: slot i (bits 4i..4i+3) of word j holds index
    8j + order[i] of that dimension."""
    values = values.to(torch.int64).movedim(dim, -1)
    words = torch.zeros(*values.shape[:-1], values.shape[-1] // 8, dtype=torch.int64)
    for slot, offset in enumerate(order):
        words |= values[..., offset::8] << (4 * slot)
    return to_int32(words).movedim(-1, dim).contiguous()


@dataclass
class Layer:
    """One layer as drawn: codes [K, N] in the input features' order, scales and zeros [G, N],
    the group of each input row, and the fp32 weight the format's definition gives."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor        # all 8 when symmetric
    g_idx: torch.Tensor
    weight: torch.Tensor       # fp32 [K, N]: scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n])


def layer_of(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
             g_idx: torch.Tensor | None = None) -> Layer:
    """The Layer of given codes [K, N] and scales [G, N]: zero points 8 and contiguous groups
    (g_idx = k // (K / G)) unless given."""
    k, n = codes.shape
    groups = scales.shape[0]
    codes = codes.to(torch.int64)
    zeros = torch.full((groups, n), 8) if zeros is None else zeros
    g_idx = torch.arange(k) // (k // groups) if g_idx is None else g_idx
    weight = scales.float()[g_idx] * (codes - zeros[g_idx]).float()
    return Layer(codes, scales, zeros, g_idx, weight)


def draw_layer(k: int, n: int, group: int, symmetric: bool, act_order: bool, dtype, gen,
               g_idx: torch.Tensor | None = None) -> Layer:
    """Random codes, scales and zero points; with act-order a random g_idx unless one is given."""
    group = k if group == -1 else group
    groups = k // group
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.004 + 0.002).to(dtype)
    zeros = torch.full((groups, n), 8) if symmetric else torch.randint(0, 16, (groups, n), generator=gen)
    if g_idx is None:
        g_idx = torch.arange(k) // group
        if act_order:   # what GPTQ's desc_act leaves: the groups of a permutation, in the original order
            g_idx = g_idx[torch.randperm(k, generator=gen)]
    return layer_of(codes, scales, zeros, g_idx)


# GPTQ's act-order permutation comes from the Hessian of a layer's input, so the layers that read one
# tensor share it: each of these takes the g_idx of the layer named beside it.
SAME_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
              "mlp.up_proj": "mlp.gate_proj"}


# --- the formats --------------------------------------------------------------------------------

def gptq_tensors(layer: Layer, checkpoint_format: str) -> dict[str, torch.Tensor]:
    """v2 packs z; v1 stores z - 1, written as v1's writers do it: one subtracted from every nibble of
    the packed word at once, so that z = 0 borrows from the nibble above."""
    qzeros = pack_slots(layer.zeros, dim=1)
    if checkpoint_format == "gptq":
        qzeros = to_int32((qzeros.to(torch.int64) - 0x11111111) % 2 ** 32)
    return {"qweight": pack_slots(layer.codes, dim=0), "qzeros": qzeros,
            "scales": layer.scales, "g_idx": layer.g_idx.to(torch.int32)}


def awq_tensors(layer: Layer) -> dict[str, torch.Tensor]:
    return {"qweight": pack_slots(layer.codes, dim=1, order=AWQ_ORDER),
            "qzeros": pack_slots(layer.zeros, dim=1, order=AWQ_ORDER), "scales": layer.scales}


def compressed_tensors_tensors(layer: Layer, symmetric: bool, act_order: bool, packed_zeros: bool = True):
    """nn.Linear orientation [N, K]; signed values q - 8 stored offset-binary (q - 8 + 8)."""
    signed = layer.codes.t() - 8
    tensors = {"weight_packed": pack_slots(signed + 8, dim=1),
               "weight_scale": layer.scales.t().contiguous(),
               "weight_shape": torch.tensor([layer.codes.shape[1], layer.codes.shape[0]])}
    if not symmetric:
        signed_zp = (layer.zeros - 8).t()      # [N, G]
        tensors["weight_zero_point"] = (pack_slots(signed_zp + 8, dim=0) if packed_zeros
                                        else signed_zp.to(torch.int8).contiguous())
    if act_order:
        tensors["weight_g_idx"] = layer.g_idx.to(torch.int32)
    return tensors


def quantization_config(fmt: str, group: int, symmetric: bool, act_order: bool, checkpoint_format="gptq",
                        bits: int = 4) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric, "desc_act": act_order,
                "checkpoint_format": checkpoint_format}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"]}


def write_checkpoint(folder: Path, fmt: str, dtype=torch.float16, group: int = 128, symmetric: bool = True,
                     act_order: bool = False, checkpoint_format: str = "gptq", shards: int = 1,
                     packed_zeros: bool = True, seed: int = 0, shared_orders: bool = True,
                     **config_overrides) -> dict[str, Layer]:
    """A Llama checkpoint folder in `fmt` ("gptq", "awq", "compressed-tensors"); returns the layers
    drawn, by module name. With act-order, layers that read one input share one g_idx as GPTQ's do
    (SAME_INPUT), unless `shared_orders` is False. Dense parameters (biases too, e.g. with
    attention_bias=True in `config_overrides`) are random, in `dtype`; lm_head stays dense. Another
    architecture than Llama: model_type="qwen2" (say) in `config_overrides`."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = _config({**LLAMA, **config_overrides})
    dense = _model(config).to(dtype).state_dict()
    tensors = {name: t.contiguous() for name, t in dense.items()
               if not any(name.endswith(f".{lin}.weight") for lin in LINEARS)}
    layers = {}
    for i in range(config.num_hidden_layers):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            n, k = dense[f"{name}.weight"].shape
            same = layers.get(f"model.layers.{i}.{SAME_INPUT[lin]}") if shared_orders and lin in SAME_INPUT else None
            layer = layers[name] = draw_layer(k, n, group, symmetric, act_order, dtype, gen,
                                              None if same is None else same.g_idx)
            if fmt == "gptq":
                parts = gptq_tensors(layer, checkpoint_format)
            elif fmt == "awq":
                parts = awq_tensors(layer)
            else:
                parts = compressed_tensors_tensors(layer, symmetric, act_order, packed_zeros)
            tensors.update({f"{name}.{field}": t for field, t in parts.items()})
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg["quantization_config"] = quantization_config(fmt, group, symmetric, act_order, checkpoint_format)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tensors(folder, tensors, shards)
    return layers


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    from safetensors.torch import save_file

    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[s::shards]}
        save_file(part, str(folder / file))
        weight_map.update({name: file for name in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def dense_model(folder: Path, drawn: dict[str, Layer], dtype=torch.float32):
    """The checkpoint's model with every quantized layer as an nn.Linear holding the weight the
    format's definition gives (the reference the loaded model is compared with)."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    model = _model(_config(config))
    state = {name: t.to(dtype) for name, t in read_tensors(folder).items() if name in model.state_dict()}
    state.update({f"{name}.weight": layer.weight.t().to(dtype) for name, layer in drawn.items()})
    model.load_state_dict(state, strict=False)
    missing = set(model.state_dict()) - set(state) - {"lm_head.weight"} if config["tie_word_embeddings"] else set()
    assert not {m for m in missing if not m.endswith("inv_freq")}, missing
    return model.to(dtype).eval()


def _config(fields: dict):
    from transformers import AutoConfig

    fields = {"model_type": "llama", "head_dim": fields["hidden_size"] // fields["num_attention_heads"], **fields}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)
