"""The model-shape registry, config.json reading, tensor-parallel splits and --shapes parsing."""
import json

import pytest

from gen.models import MODELS, Layer, model_layers, parse_shapes


def shapes(layers):
    return {layer.name: (layer.k, layer.n) for layer in layers}


def test_llama_2_7b():
    assert shapes(model_layers("llama-2-7b")) == {
        "qkv_proj": (4096, 12288), "o_proj": (4096, 4096), "gate_up_proj": (4096, 22016), "down_proj": (11008, 4096)}


def test_gqa_models():
    # 8 KV heads of 128: qkv = 4096 + 2 * 1024
    assert shapes(model_layers("llama-3-8b"))["qkv_proj"] == (4096, 6144)
    assert shapes(model_layers("mistral-7b")) == shapes(model_layers("llama-3-8b"))
    assert shapes(model_layers("llama-2-70b"))["qkv_proj"] == (8192, 10240)
    assert shapes(model_layers("qwen2.5-7b")) == {
        "qkv_proj": (3584, 4608), "o_proj": (3584, 3584), "gate_up_proj": (3584, 37888), "down_proj": (18944, 3584)}


def test_unfused_layers_are_the_modules_transformers_runs():
    assert shapes(model_layers("llama-3-8b", fused=False)) == {
        "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
        "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
    # the fused projections are the unfused ones side by side
    for tp in (1, 4):
        fused, unfused = shapes(model_layers("qwen2.5-72b", tp=tp)), shapes(model_layers("qwen2.5-72b", tp, fused=False))
        assert fused["qkv_proj"][1] == unfused["q_proj"][1] + unfused["k_proj"][1] + unfused["v_proj"][1]
        assert fused["gate_up_proj"][1] == unfused["gate_proj"][1] + unfused["up_proj"][1]


def test_unfused_tune_targets_share_a_problem_per_shape():
    from gen.cli import build_parser
    from gen.tune.options import targets_from_args

    args = build_parser().parse_args(["tune", "--model", "llama-2-7b", "--unfused"])
    assert {(t.problem.k, t.problem.n): t.layers for t in targets_from_args(args)} == {
        (4096, 4096): ["q_proj", "k_proj", "v_proj", "o_proj"], (4096, 11008): ["gate_proj", "up_proj"],
        (11008, 4096): ["down_proj"]}
    for command in (["precompile"], ["sweep", "--family", "stream_mma"]):
        assert build_parser().parse_args([*command, "--model", "llama-2-7b", "--unfused"]).unfused


def test_required_models_are_registered():
    for name in ("llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b"):
        assert len(model_layers(name)) == 4
    assert model_layers("Llama-2-7B") == model_layers("llama-2-7b")


def test_tensor_parallel_splits():
    tp2 = shapes(model_layers("llama-2-7b", tp=2))
    assert tp2 == {"qkv_proj": (4096, 6144), "o_proj": (2048, 4096), "gate_up_proj": (4096, 11008),
                   "down_proj": (5504, 4096)}
    # 8 KV heads over 16 ranks: one replicated KV head per rank
    assert shapes(model_layers("llama-3-70b", tp=16))["qkv_proj"] == (8192, (4 + 2) * 128)


def test_qwen_72b_int4_checkpoints_pad_the_mlp_to_split_whole_groups():
    """Qwen's INT4 72B checkpoints hold 29696 MLP rows, 232 groups of 128: down_proj's K splits into
    whole groups over 4 and 8 ranks, where the unpadded 29568 leaves 57.75 and 28.875 groups."""
    for tp, k in ((4, 7424), (8, 3712)):
        layers = shapes(model_layers("qwen2.5-72b-int4", tp=tp))
        assert layers["down_proj"] == (k, 8192) and k % 128 == 0
        assert layers["gate_up_proj"] == (8192, 2 * k)
        assert shapes(model_layers("qwen2.5-72b", tp=tp))["down_proj"][0] % 128 != 0


def test_tensor_parallel_not_divisible():
    with pytest.raises(ValueError, match="not divisible by --tp 3"):
        model_layers("llama-2-7b", tp=3)
    with pytest.raises(ValueError, match="at least 1"):
        model_layers("llama-2-7b", tp=0)


def test_config_json(tmp_path):
    cfg = dict(MODELS["llama-3-8b"], architectures=["LlamaForCausalLM"], head_dim=None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert model_layers(str(path)) == model_layers("llama-3-8b")
    path.write_text(json.dumps(dict(cfg, head_dim=256)))       # an explicit head_dim wins (Gemma-style)
    assert shapes(model_layers(str(path)))["qkv_proj"] == (4096, (32 + 16) * 256)
    assert shapes(model_layers(str(path)))["o_proj"] == (32 * 256, 4096)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        model_layers("no-such-model")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ValueError, match="intermediate_size"):
        model_layers(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        model_layers(str(path))


def test_parse_shapes():
    assert parse_shapes("4096x12288, 11008x4096,") == [Layer("4096x12288", 4096, 12288, "column"),
                                                        Layer("11008x4096", 11008, 4096, "column")]
    for bad in ("4096", "4096x", "axb", "", "0x64"):
        with pytest.raises(ValueError):
            parse_shapes(bad)


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": None}, "hidden_size is null"),
    ({"hidden_size": "4096"}, "hidden_size='4096' is not a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 is not a positive integer"),
    ({"intermediate_size": -1}, "intermediate_size=-1"),
    ({"num_key_value_heads": 2.5}, "num_key_value_heads=2.5"),
    ({"hidden_size": 4000, "num_attention_heads": 3}, "not divisible by num_attention_heads=3"),
])
def test_malformed_config_fields_are_named(tmp_path, fields, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(MODELS["llama-2-7b"], **fields)))
    with pytest.raises(ValueError, match=message):
        model_layers(str(path))


@pytest.mark.parametrize("fields, message", [
    ({"num_local_experts": 8}, "num_local_experts=8: a mixture of experts model"),
    ({"num_experts": 128, "moe_intermediate_size": 768}, "num_experts=128: a mixture of experts model"),
    ({"n_routed_experts": 64}, "n_routed_experts=64"),
    ({"kv_lora_rank": 512}, "kv_lora_rank=512: a multi-head latent attention model"),
])
def test_configs_of_other_architectures_are_refused(tmp_path, fields, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(MODELS["llama-2-7b"], **fields)))
    with pytest.raises(ValueError, match=message):
        model_layers(str(path))
    path.write_text(json.dumps(dict(MODELS["llama-2-7b"], num_local_experts=None, num_experts=0)))
    assert model_layers(str(path)) == model_layers("llama-2-7b")     # unset fields of a dense model


def test_a_config_by_its_folder_and_phi3s_own_fused_modules(tmp_path):
    """Phi-3's transformers modules are qkv_proj and gate_up_proj: unfused, it is what it is fused."""
    (tmp_path / "config.json").write_text(json.dumps(dict(MODELS["llama-3-8b"], model_type="phi3")))
    assert model_layers(str(tmp_path)) == model_layers("llama-3-8b")
    assert model_layers(str(tmp_path), fused=False) == model_layers("llama-3-8b")
    (tmp_path / "config.json").write_text(json.dumps(dict(MODELS["llama-3-8b"], model_type="llama")))
    assert model_layers(str(tmp_path), fused=False) == model_layers("llama-3-8b", fused=False)
