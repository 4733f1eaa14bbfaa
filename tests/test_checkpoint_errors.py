"""Checkpoints the loader refuses: every message names the file, the layer (or config field) and the
tensor at fault, and says what would be accepted."""
import json
import shutil

import pytest
import torch

from runtime import CheckpointError, load_quantized
from tests.checkpoint_writers import read_tensors, write_checkpoint, write_tensors

LAYER = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One checkpoint per format, written once; each test edits a copy."""
    root = tmp_path_factory.mktemp("written")
    for fmt in ("gptq", "awq", "compressed-tensors"):
        write_checkpoint(root / fmt, fmt, symmetric=fmt == "gptq")
    return root


@pytest.fixture
def copy_of(written, tmp_path):
    def copy(fmt):
        folder = tmp_path / fmt
        shutil.copytree(written / fmt, folder)
        return folder
    return copy


def edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


def edit_tensors(folder, edit):
    tensors = read_tensors(folder)
    edit(tensors)
    write_tensors(folder, tensors)


def refused(folder, *parts):
    with pytest.raises(CheckpointError) as info:
        load_quantized(folder, device="cpu")
    for part in parts:
        assert part in str(info.value), f"{part!r} not in: {info.value}"
    return str(info.value)


@pytest.mark.parametrize("fmt, field, edit", [
    ("gptq", "quantization_config.bits", lambda q: q.update(bits=8)),
    ("awq", "quantization_config.bits", lambda q: q.update(bits=8)),
    ("compressed-tensors", "quantization_config.config_groups.group_0.weights.num_bits",
     lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8)),
])
def test_other_bit_widths(copy_of, fmt, field, edit):
    folder = copy_of(fmt)
    edit_config(folder, edit)
    refused(folder, "config.json", field, "8-bit", "4-bit")


@pytest.mark.parametrize("fmt, field, edit", [
    ("gptq", "quantization_config.group_size", lambda q: q.update(group_size=32)),
    ("compressed-tensors", "quantization_config.config_groups.group_0.weights.group_size",
     lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32)),
])
def test_group_size_32(copy_of, fmt, field, edit):
    folder = copy_of(fmt)
    edit_config(folder, edit)
    refused(folder, "config.json", field, "group size 32", "multiple of 64", "-1 (channelwise)")


def test_group_size_that_does_not_divide_k(copy_of):
    folder = copy_of("gptq")
    edit_config(folder, lambda q: q.update(group_size=384))
    refused(folder, "model.safetensors", "model.layers.0.self_attn.q_proj.qweight", "group size 384 with K=256",
            "multiple of 64")


def test_unknown_quant_method(copy_of):
    folder = copy_of("gptq")
    edit_config(folder, lambda q: q.update(quant_method="bitsandbytes"))
    refused(folder, "config.json", "quantization_config.quant_method", "'bitsandbytes'", "gptq")


def test_not_a_quantized_checkpoint(copy_of):
    folder = copy_of("gptq")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(folder, "config.json", "quantization_config", "missing")


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_missing_qzeros(copy_of, fmt):
    folder = copy_of(fmt)
    edit_tensors(folder, lambda t: t.pop(f"{LAYER}.qzeros"))
    refused(folder, "model.safetensors", f"{LAYER}.qzeros", "missing")


def test_missing_zero_point_of_an_asymmetric_scheme(copy_of):
    folder = copy_of("compressed-tensors")
    edit_tensors(folder, lambda t: t.pop(f"{LAYER}.weight_zero_point"))
    refused(folder, "model.safetensors", f"{LAYER}.weight_zero_point", "missing")


def test_scales_of_the_wrong_shape(copy_of):
    folder = copy_of("gptq")
    edit_tensors(folder, lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"][:2]}))
    refused(folder, "model.safetensors", f"{LAYER}.scales", "expected shape (4, 256)", "found (2, 256)",
            "in_features=512")


@pytest.mark.parametrize("fmt, field", [("gptq", "scales"), ("awq", "scales"), ("compressed-tensors", "weight_scale")])
def test_scales_that_are_not_floating_point(copy_of, fmt, field):
    folder = copy_of(fmt)
    edit_tensors(folder, lambda t: t.update({f"{LAYER}.{field}": t[f"{LAYER}.{field}"].to(torch.int16)}))
    refused(folder, "model.safetensors", f"{LAYER}.{field}", "expected floating-point values", "torch.int16")


def test_weight_shape_that_disagrees_with_the_config(copy_of):
    folder = copy_of("compressed-tensors")
    edit_tensors(folder, lambda t: t.update({f"{LAYER}.weight_shape": torch.tensor([256, 1024])}))
    refused(folder, "model.safetensors", f"{LAYER}.weight_shape", "[256, 1024]", "[256, 512]")


def test_a_tensor_no_module_reads(copy_of):
    """AutoAWQ's activation scales (`mlp.act.scales`) would change the outputs: refused, not dropped.
    An FP8 KV cache's scales are done without by design (the cache stays in the model's dtype), and the
    per-layer rotary frequencies of older checkpoints are computed at construction now."""
    folder = copy_of("awq")
    edit_tensors(folder, lambda t: t.update({"model.layers.0.mlp.act.scales": torch.ones(512, dtype=torch.float16),
                                             "model.layers.0.self_attn.k_scale": torch.ones(()),
                                             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}))
    refused(folder, "model.safetensors: model.layers.0.mlp.act.scales", "no module", "reads this tensor")
    edit_tensors(folder, lambda t: t.pop("model.layers.0.mlp.act.scales"))
    load_quantized(folder, device="cpu")


@pytest.mark.parametrize("edit, field, words", [
    (lambda q: q.update(version="gemv"), "version", "'gemv'"),
    (lambda q: q.update(version="gemv_fast"), "version", "'gemv_fast'"),
    (lambda q: q.update(version="marlin"), "version", "'marlin'"),
    (lambda q: (q.pop("version"), q.update(format="gemv")), "format", "'gemv'"),
    (lambda q: q.update(backend="llm-awq"), "backend", "'llm-awq'"),
])
def test_awq_layouts_of_other_kernels(copy_of, edit, field, words):
    folder = copy_of("awq")
    edit_config(folder, edit)
    refused(folder, f"config.json: quantization_config.{field}", words)


@pytest.mark.parametrize("fields", [{"version": "exllama"}, {"version": "ipex"}, {"backend": "auto"},
                                    {"backend": "autoawq"}])
def test_awq_versions_that_run_the_gemm_tensors_load(copy_of, fields):
    """Current transformers writes `backend: "auto"` beside `version: "gemm"`."""
    folder = copy_of("awq")
    edit_config(folder, lambda q: q.update(fields))
    load_quantized(folder, device="cpu")


def test_compressed_tensors_transforms(copy_of):
    folder = copy_of("compressed-tensors")
    edit_config(folder, lambda q: q.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}}))
    refused(folder, "config.json: quantization_config.transform_config", "rotations")


def test_qweight_of_the_wrong_dtype(copy_of):
    folder = copy_of("awq")
    edit_tensors(folder, lambda t: t.update({f"{LAYER}.qweight": t[f"{LAYER}.qweight"].to(torch.int64)}))
    refused(folder, "model.safetensors", f"{LAYER}.qweight", "torch.int32", "torch.int64")


def test_weights_files_that_cannot_be_told_apart(copy_of):
    folder = copy_of("gptq")
    shutil.copy(folder / "model.safetensors", folder / "b.safetensors")
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    refused(folder, "no model.safetensors.index.json or model.safetensors, and 2 other .safetensors files: "
                    "a.safetensors, b.safetensors")
    for path in folder.glob("*.safetensors"):
        path.unlink()
    refused(folder, "and 0 other .safetensors files")


def test_gptq_rules_that_change_bits_or_group_size(copy_of):
    folder = copy_of("gptq")
    edit_config(folder, lambda q: q.update(dynamic={r"-:.*\.0\..*": {}, r"+:.*down_proj": {"bits": 8}}))
    refused(folder, "config.json: quantization_config.dynamic", "'+:.*down_proj'", "only '-:' rules")
    edit_config(folder, lambda q: q.update(dynamic={r"+:.*down_proj": {"group_size": 64}}))
    refused(folder, "config.json: quantization_config.dynamic", "'+:.*down_proj'")


def test_gptq_rules_that_repeat_the_global_settings_load(copy_of):
    """auto-round writes a "+:lm_head" rule with the global bits and group size when it quantizes lm_head."""
    folder = copy_of("gptq")
    edit_config(folder, lambda q: q.update(dynamic={"+:lm_head": {"bits": 4, "group_size": 128, "sym": True}}))
    load_quantized(folder, device="cpu")


@pytest.mark.parametrize("field, value, words", [
    ("rotation", "hadamard", "'hadamard'"),
    ("is_marlin_format", True, "Marlin"),
])
def test_gptq_forms_that_need_other_kernels(copy_of, field, value, words):
    folder = copy_of("gptq")
    edit_config(folder, lambda q: q.update({field: value}))
    refused(folder, f"config.json: quantization_config.{field}", words)


def test_autogptq_zero_biases_on_layers_without_one_are_dropped(copy_of):
    """AutoGPTQ up to 0.7 saved a bias for every quantized layer, zeros where the model has none."""
    folder = copy_of("gptq")
    edit_tensors(folder, lambda t: t.update({f"{LAYER}.bias": torch.zeros(256, dtype=torch.float16)}))
    model = load_quantized(folder, device="cpu")
    assert model.get_submodule(LAYER).bias is None
    edit_tensors(folder, lambda t: t[f"{LAYER}.bias"].__setitem__(3, 0.5))
    refused(folder, "model.safetensors", f"{LAYER}.bias", "non-zero bias", "config.json")


def test_settings_where_older_writers_kept_them(copy_of):
    """compressed-tensors up to 0.6 wrote config.json's compression_config; AutoAWQ up to 0.1.5 wrote
    quant_config.json (no quant_method in it) and nothing in config.json."""
    for fmt, move in (("compressed-tensors", "compression_config"), ("awq", "quant_config.json")):
        folder = copy_of(fmt)
        config = json.loads((folder / "config.json").read_text())
        settings = config.pop("quantization_config")
        if move == "compression_config":
            config[move] = settings
        else:
            settings.pop("quant_method")
            (folder / move).write_text(json.dumps({**settings, "bits": 3}))
        (folder / "config.json").write_text(json.dumps(config))
        if move == "quant_config.json":
            refused(folder, "quant_config.json: bits: 3-bit weights")
            (folder / move).write_text(json.dumps(settings))
        model = load_quantized(folder, device="cpu")
        assert type(model.get_submodule(LAYER)).__name__ == "QuantLinear"


def test_errors_in_quantize_config_json_name_that_file(copy_of):
    folder = copy_of("gptq")
    config = json.loads((folder / "config.json").read_text())
    settings = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "quantize_config.json").write_text(json.dumps({**settings, "bits": 3}))
    refused(folder, "quantize_config.json: bits: 3-bit weights")
    (folder / "quantize_config.json").write_text(json.dumps({**settings, "quant_method": "hqq"}))
    refused(folder, "quantize_config.json: quant_method: 'hqq'")
    (folder / "quantize_config.json").unlink()
    refused(folder, "config.json: quantization_config: missing (and no compression_config, quantize_config.json "
                    "or quant_config.json)")


def test_uneven_act_order_groups(copy_of):
    folder = copy_of("gptq")
    def uneven(t):
        g_idx = t[f"{LAYER}.g_idx"]
        g_idx[0] = 1   # group 0 loses a row to group 1
    edit_tensors(folder, uneven)
    refused(folder, "model.safetensors", LAYER, "g_idx", "128 input rows")


def test_layout_only_other_kernels_read(copy_of):
    folder = copy_of("gptq")
    edit_config(folder, lambda q: q.update(checkpoint_format="marlin"))
    refused(folder, "config.json", "quantization_config.checkpoint_format", "'marlin'")


def test_quantized_tensors_of_a_layer_the_model_lacks(copy_of):
    folder = copy_of("gptq")
    edit_tensors(folder, lambda t: t.update({"model.layers.7.mlp.down_proj.qweight": t[f"{LAYER}.qweight"].clone()}))
    refused(folder, "model.safetensors", "model.layers.7.mlp.down_proj.qweight", "does not have")


def test_missing_dense_tensor(copy_of):
    folder = copy_of("gptq")
    edit_tensors(folder, lambda t: t.pop("model.norm.weight"))
    refused(folder, "model.safetensors", "model.norm.weight", "missing")


def test_quantized_activations(copy_of):
    folder = copy_of("compressed-tensors")
    edit_config(folder, lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float"}))
    refused(folder, "config.json", "config_groups.group_0.input_activations", "weight-only")
