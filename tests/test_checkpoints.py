"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) read into QuantizedLayer and loaded into models.

The checkpoints are written by tests/checkpoint_writers.py from the formats' definitions; each test
compares what runtime/checkpoint reads with what the writer drew: codes exactly, weights in fp32
exactly (an integer difference times a float16/bfloat16 scale is exact in fp32).
"""
import json

import pytest
import torch
from torch import nn

from runtime import QuantLinear
from runtime.checkpoint.files import LayerTensors, TensorFiles
from runtime.checkpoint.loader import checkpoint_format, load_quantized, read_quantization_config
from tests.checkpoint_writers import (compressed_tensors_tensors, draw_layer, read_tensors, write_checkpoint,
                                     write_tensors)

DTYPES = [torch.float16, torch.bfloat16]


def read_layers(folder, dtype):
    """Every quantized layer of the checkpoint, as the format's reader converts it."""
    fmt = checkpoint_format(*read_quantization_config(folder))
    files = TensorFiles(folder)
    layers = {}
    for name in files.names():
        if name.endswith("." + fmt.marker):
            prefix = name.rsplit(".", 1)[0]
            shape = files.get(f"{prefix}.weight_shape").tolist() if fmt.marker == "weight_packed" else None
            t = LayerTensors(files, prefix)
            if shape is None:   # GPTQ and AWQ: K and N from the scales and, for GPTQ, qweight
                n = files.get(f"{prefix}.scales").shape[1]
                k = files.get(f"{prefix}.qweight").shape[0] * (8 if "gptq" in folder.name else 1)
                shape = [n, k]
            module = nn.Linear(shape[1], shape[0], bias=False, device="meta")
            layers[prefix] = fmt.convert(t, module, None, dtype)
    return layers


def assert_same_layers(read, drawn, dtype):
    assert set(read) == set(drawn)
    for name, layer in read.items():
        want = drawn[name]
        assert layer.codes.dtype == torch.uint8 and layer.scales.dtype == dtype
        perm = torch.arange(want.codes.shape[0]) if layer.perm is None else layer.perm
        assert torch.equal(layer.codes.long(), want.codes[perm]), name
        sorted_groups = want.g_idx[perm]
        assert torch.equal(sorted_groups, torch.arange(len(perm)) // layer.group), f"{name}: groups not contiguous"
        assert torch.equal(layer.dequantize(), want.weight), name


@pytest.mark.parametrize("checkpoint_format, dtype", [("gptq", torch.float16), ("gptq_v2", torch.bfloat16)])
@pytest.mark.parametrize("symmetric, act_order, group", [
    (True, False, 128), (False, False, 128), (True, True, 64), (False, True, 128), (True, False, -1), (False, False, -1)])
def test_gptq(tmp_path, dtype, checkpoint_format, symmetric, act_order, group):
    folder = tmp_path / "gptq"
    drawn = write_checkpoint(folder, "gptq", dtype, group, symmetric, act_order, checkpoint_format)
    layers = read_layers(folder, dtype)
    assert_same_layers(layers, drawn, dtype)
    for layer in layers.values():
        assert (layer.zeros is None) == symmetric
        assert (layer.perm is None) == (not act_order)
        assert layer.group_size == group


def test_gptq_settings_in_quantize_config_json(tmp_path):
    """Older GPTQ folders (AutoGPTQ's) keep their settings in quantize_config.json, without
    quant_method, and none in config.json, and name their one weights file after the quantization:
    read as GPTQ, the same layers."""
    folder = tmp_path / "gptq"
    drawn = write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True)
    config = json.loads((folder / "config.json").read_text())
    settings = config.pop("quantization_config")
    settings.pop("quant_method")
    (folder / "config.json").write_text(json.dumps(config))
    base = "gptq_model-4bit-128g"
    (folder / "quantize_config.json").write_text(json.dumps({**settings, "model_file_base_name": base}))
    (folder / "model.safetensors").rename(folder / f"{base}.safetensors")
    assert_same_layers(read_layers(folder, torch.float16), drawn, torch.float16)
    model = load_quantized(folder, device="cpu", fuse=False)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(drawn)


def test_gptq_rules_that_only_skip_layers_are_read(tmp_path):
    """GPTQModel's `dynamic` "-:" rules leave the layers they match unquantized: dense in the files,
    nn.Linear in the model."""
    folder = tmp_path / "gptq"
    drawn = write_checkpoint(folder, "gptq")
    skipped = "model.layers.0.mlp.gate_proj"
    tensors = read_tensors(folder)
    for field in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{skipped}.{field}"]
    tensors[f"{skipped}.weight"] = drawn[skipped].weight.t().half().contiguous()
    write_tensors(folder, tensors)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"-:model\.layers\.0\.mlp\.gate_proj": {}}
    (folder / "config.json").write_text(json.dumps(config))
    model = load_quantized(folder, device="cpu", fuse=False)
    layer = model.get_submodule(skipped)
    assert type(layer) is nn.Linear and torch.equal(layer.weight, tensors[f"{skipped}.weight"])
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(drawn) - 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [128, -1])
def test_awq(tmp_path, dtype, group):
    folder = tmp_path / "awq"
    drawn = write_checkpoint(folder, "awq", dtype, group, symmetric=False)
    layers = read_layers(folder, dtype)
    assert_same_layers(layers, drawn, dtype)
    assert all(layer.zeros is not None and layer.perm is None for layer in layers.values())


@pytest.mark.parametrize("symmetric, group, act_order, packed_zeros, dtype", [
    (True, 128, False, True, torch.float16), (False, 128, False, True, torch.bfloat16),
    (True, -1, False, True, torch.bfloat16), (False, -1, False, True, torch.float16),
    (True, 64, True, True, torch.bfloat16), (False, 128, True, True, torch.float16),
    (False, 128, False, False, torch.bfloat16)])
def test_compressed_tensors(tmp_path, dtype, symmetric, group, act_order, packed_zeros):
    folder = tmp_path / "ct"
    drawn = write_checkpoint(folder, "compressed-tensors", dtype, group, symmetric, act_order,
                             packed_zeros=packed_zeros)
    layers = read_layers(folder, dtype)
    assert_same_layers(layers, drawn, dtype)
    assert all((layer.zeros is None) == symmetric for layer in layers.values())


def test_compressed_tensors_layer_takes_its_best_matching_group(tmp_path):
    """Symmetric "Linear" layers, but down_proj asymmetric by a regular expression and layer 0's
    o_proj channelwise by its exact name, in groups listed after "Linear": each layer reads its own
    scheme, as compressed-tensors ranks the matches."""
    folder = tmp_path / "ct"
    drawn = write_checkpoint(folder, "compressed-tensors", torch.float16, 128, symmetric=True)
    tensors = read_tensors(folder)
    gen = torch.Generator().manual_seed(5)
    for name, layer in list(drawn.items()):
        exact, regex = name == "model.layers.0.self_attn.o_proj", name.endswith("mlp.down_proj")
        if exact or regex:
            k, n = layer.codes.shape
            drawn[name] = draw_layer(k, n, -1 if exact else 128, exact, False, torch.float16, gen)
            tensors = {key: t for key, t in tensors.items() if not key.startswith(name + ".")}
            parts = compressed_tensors_tensors(drawn[name], symmetric=exact, act_order=False)
            tensors.update({f"{name}.{field}": t for field, t in parts.items()})
    write_tensors(folder, tensors)
    config = json.loads((folder / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    weights = groups["group_0"]["weights"]
    groups["group_1"] = {"targets": [r"re:.*mlp\.down_proj$"], "weights": {**weights, "symmetric": False}}
    groups["group_2"] = {"targets": ["model.layers.0.self_attn.o_proj"],
                         "weights": {**weights, "strategy": "channel", "group_size": None}}
    (folder / "config.json").write_text(json.dumps(config))
    layers = read_layers(folder, torch.float16)
    assert_same_layers(layers, drawn, torch.float16)
    assert layers["model.layers.1.mlp.down_proj"].zeros is not None
    assert layers["model.layers.0.self_attn.o_proj"].group_size == -1
    assert layers["model.layers.1.self_attn.o_proj"].zeros is None and layers["model.layers.1.self_attn.o_proj"].group_size == 128


@pytest.mark.parametrize("group", [128, -1])
def test_compressed_tensors_strategy_implied_by_the_group_size(tmp_path, group):
    """A scheme without `strategy` takes the one compressed-tensors infers: "group" for a positive
    group size, "channel" for -1."""
    folder = tmp_path / "ct"
    drawn = write_checkpoint(folder, "compressed-tensors", torch.float16, group, symmetric=False)
    config = json.loads((folder / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.pop("strategy")
    weights["group_size"] = group
    (folder / "config.json").write_text(json.dumps(config))
    assert_same_layers(read_layers(folder, torch.float16), drawn, torch.float16)


def test_awq_slot_order_by_hand():
    """Word 0x76543210 holds slots 0..7 = 0..7; in AWQ order slot i is column AWQ_ORDER[i]."""
    from runtime.checkpoint.awq import AWQ_ORDER
    from runtime.checkpoint.layer import unpack_columns

    words = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_columns(words).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    columns = unpack_columns(words, AWQ_ORDER)[0].tolist()
    assert [columns[AWQ_ORDER[i]] for i in range(8)] == list(range(8))
    assert columns == [0, 4, 1, 5, 2, 6, 3, 7]


# --- the loader ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, symmetric, act_order, shards", [
    ("gptq", True, False, 1), ("gptq", False, True, 2), ("awq", False, False, 1), ("compressed-tensors", False, True, 3)])
def test_load_quantized_on_cpu(tmp_path, fmt, symmetric, act_order, shards):
    from runtime import QuantLinear

    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, fmt, torch.bfloat16, 128, symmetric, act_order, shards=shards)
    model = load_quantized(folder, dtype=torch.bfloat16, device="cpu", fuse=False)
    stored = read_tensors(folder)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert set(quantized) == set(drawn)
    for name, module in quantized.items():
        assert module.qweight.device.type == "cpu" and module.scales.dtype == torch.bfloat16
        # Act-order: only o_proj gathers for itself; the others' gathers moved to their modules' inputs or
        # into gate_proj's and up_proj's columns (tests/test_checkpoint_fold.py).
        assert (module.perm is not None) == (act_order and name.endswith("o_proj"))
        assert module.zero_points == (not symmetric) and (module.zeros() is not None) == (not symmetric)
    assert isinstance(model.lm_head, nn.Linear)
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert not any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    assert not model.training


def test_tied_embeddings_load_once(tmp_path):
    folder = tmp_path / "tied"
    write_checkpoint(folder, "gptq")
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    tensors = read_tensors(folder)
    del tensors["lm_head.weight"]
    write_tensors(folder, tensors)
    model = load_quantized(folder, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_state_dict_round_trip_keeps_perm_and_zero_points(tmp_path):
    from runtime import QuantLinear

    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq", symmetric=False, act_order=True)
    layer = load_quantized(folder, device="cpu").model.layers[0].self_attn.o_proj
    fresh = QuantLinear(256, 256, group_size=128, act_order=True, zero_points=True)
    fresh.load_state_dict(layer.state_dict())
    for name, tensor in layer.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_a_state_dict_whose_zero_point_rows_are_not_zero_points_is_refused(tmp_path):
    """Every second row of a zero-point layer's `scales` must hold the zero points themselves (whole
    numbers 0..15): anything else, pre-scaled offsets say, would decode to wrong weights silently."""
    from runtime import QuantLinear

    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq", symmetric=False, act_order=False)
    state = load_quantized(folder, device="cpu").model.layers[0].mlp.down_proj.state_dict()
    state["scales"] = state["scales"].clone()
    state["scales"][3, 7] = 0.375
    fresh = QuantLinear(512, 256, group_size=128, zero_points=True)
    with pytest.raises(ValueError, match=r"scales: its zero-point rows .* zero point 0.375 at group 1, column 7"):
        fresh.load_state_dict(state)
