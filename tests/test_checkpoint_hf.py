"""transformers' from_pretrained through the "tilemarlin" quantization method (runtime/checkpoint/hf.py):
the same model as load_quantized, tensor for tensor."""
import pytest
import torch

from runtime import QuantLinear
from runtime.checkpoint.loader import load_quantized
from tests.checkpoint_writers import write_checkpoint


@pytest.mark.parametrize("fmt, symmetric, act_order", [("gptq", False, True), ("compressed-tensors", True, False)])
def test_from_pretrained_matches_load_quantized(tmp_path, fmt, symmetric, act_order):
    from transformers import AutoModelForCausalLM

    from runtime.checkpoint.hf import TileMarlinConfig, tilemarlin_config

    folder = tmp_path / "ckpt"
    write_checkpoint(folder, fmt, torch.bfloat16, 128, symmetric, act_order, attention_bias=True)
    model = AutoModelForCausalLM.from_pretrained(folder, config=tilemarlin_config(folder), dtype=torch.bfloat16)
    expected = load_quantized(folder, dtype=torch.bfloat16, device="cpu")
    assert isinstance(model.config.quantization_config, TileMarlinConfig)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8   # fused: qkv, o, gate_up, down
    got, want = model.state_dict(), expected.state_dict()
    assert set(got) == set(want)
    # act-order: in both, the norms before the attention and the MLP write their inputs in the gathered
    # order (runtime/checkpoint/norm_fold.py), and no module gathers for its layers
    layer = "model.layers.0"
    assert {f"{layer}.input_layernorm.perm", f"{layer}.post_attention_layernorm.perm"} <= set(want) if act_order \
        else not any(name.endswith("perm") for name in want)
    assert not any(name.endswith("input_perm") for name in want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_the_checkpoints_own_method_is_needed(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.checkpoint.hf import TileMarlinConfig

    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq")
    config = AutoConfig.from_pretrained(folder)
    config.quantization_config = TileMarlinConfig().to_dict()
    with pytest.raises(ValueError, match="source"):
        AutoModelForCausalLM.from_pretrained(folder, config=config)
