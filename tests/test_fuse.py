"""runtime/fuse.py on the CPU (the op computing with the reference): which layers are fused, the same
outputs as the layers apart, one GEMM per set, and the forwards that must not be fused."""
import pytest
import torch
from torch import nn

import runtime.op as op
from runtime import QuantLinear, replace_linear
from runtime.fuse import (FusedSlice, FusionPlan, concatenated_linear, concatenated_quantized, fused_name,
                          install, plan_fusion)
from tests.reference import int4_weights

transformers = pytest.importorskip("transformers")
CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128)


def tiny_llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, **overrides})).half().eval()


def dense_key(module):
    return (module.in_features, module.weight.dtype) if isinstance(module, nn.Linear) else None


def test_q_k_v_and_gate_up_are_planned_and_o_and_down_are_not():
    plans = plan_fusion(tiny_llama(), dense_key)
    assert plans == [(f"model.layers.{i}.{module}", members, name) for i in range(2) for module, members, name
                     in (("self_attn", ("q_proj", "k_proj", "v_proj"), "q_k_v_proj"),
                         ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"))]


@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_llama_gives_the_logits_of_its_layers_apart_with_one_gemm_per_set(cpu_op, monkeypatch, bias):
    model = tiny_llama(attention_bias=bias)
    apart = replace_linear(tiny_llama(attention_bias=bias), group_size=64, fuse=False)
    replace_linear(model, group_size=64)
    weights, apart_weights = int4_weights(model), int4_weights(apart)
    assert weights.keys() == apart_weights.keys() and len(weights) == 14
    for name, (codes, scales) in weights.items():   # quantizing the set quantizes each member alike
        assert torch.equal(codes, apart_weights[name][0]) and torch.equal(scales, apart_weights[name][1])
    gemms = []
    launch = op._launch
    monkeypatch.setattr(op, "_launch", lambda *args, **kwargs: (gemms.append(1), launch(*args, **kwargs))[1])
    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fused_logits = model(tokens).logits
        assert len(gemms) == 4 * 2   # qkv, o, gate_up and down in each layer
        assert torch.equal(fused_logits, apart(tokens).logits)


def test_a_slice_called_outside_its_module_runs_the_fused_layer_itself(cpu_op):
    model = replace_linear(tiny_llama(), group_size=64)
    apart = replace_linear(tiny_llama(), group_size=64, fuse=False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).half()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            got = getattr(model.model.layers[1].self_attn, name)(x)
            assert torch.equal(got, getattr(apart.model.layers[1].self_attn, name)(x))


def test_a_fused_model_traces_in_one_graph(cpu_op):
    model = replace_linear(tiny_llama(), group_size=64)
    tokens = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens, use_cache=False).logits, model(tokens, use_cache=False).logits)


class Block(nn.Module):
    """Two layers on the block's input; `how` says what else its forward does."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a_proj, self.b_proj = nn.Linear(64, 64), nn.Linear(64, 128)

    def forward(self, x):
        if self.how == "in place":
            x.mul_(2)
        if self.how == "twice":
            return self.a_proj(x) + self.a_proj(x) + self.b_proj(x)[..., :64]
        if self.how == "flattened":    # a view of its output that a column slice cannot give
            return self.a_proj(x).view(-1).view_as(x) + self.b_proj(x)[..., :64]
        if self.how == "other input":
            return self.a_proj(x) + self.b_proj(x + 1)[..., :64]
        if self.how == "no layers":
            return x
        if self.how == "clamped":
            x.clamp_(-4, 4)
        return self.a_proj(x) * self.b_proj(x)[..., 64:]


class TinyLm(nn.Module):
    """What the probe runs: input_ids in, embeddings to one Block."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block = nn.Embedding(16, 64), Block(how)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, use_cache=False):
        return self.block(self.embed(input_ids))


@pytest.mark.parametrize("how, fused", [("plain", True), ("in place", False), ("twice", False), ("flattened", False),
                                        ("other input", False)])
def test_only_layers_that_read_the_modules_input_as_it_is_once_are_fused(how, fused):
    model = TinyLm(how)
    plans = plan_fusion(model, dense_key)
    assert [p.members for p in plans] == ([("a_proj", "b_proj")] if fused else [])


def test_a_model_the_probe_cannot_run_and_a_taken_name_are_handled():
    assert plan_fusion(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), dense_key) == []
    block = Block("plain")
    block.a_b_proj = nn.Identity()
    assert fused_name(block, ("a_proj", "b_proj")) == "fused_a_b_proj"
    assert fused_name(block, ("first", "second")) == "first_second"


def test_the_slices_keep_no_state_and_the_fused_layer_is_saved_once(cpu_op):
    model = replace_linear(tiny_llama(), group_size=64)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, FusedSlice) and isinstance(attention.q_k_v_proj, QuantLinear)
    keys = [key for key in model.state_dict() if key.startswith("model.layers.0.self_attn.")]
    assert sorted(keys) == [f"model.layers.0.self_attn.{layer}.{buffer}" for layer in ("o_proj", "q_k_v_proj")
                            for buffer in ("qweight", "scales")]
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert all(m.shared._product is None and m.shared._source is None
               for m in model.modules() if isinstance(m, FusedSlice))


def _fused_block(how: str) -> Block:
    """A Block whose a_proj and b_proj are fused (dense layers: the slices work on any layer)."""
    model = TinyLm(how)
    (plan,) = plan_fusion(model, dense_key)
    install(model, plan, concatenated_linear([model.block.a_proj, model.block.b_proj]))
    return model.block


def _apart(how: str) -> Block:
    return TinyLm(how).block


def test_a_forward_that_calls_no_member_computes_nothing_and_keeps_nothing():
    """As cross-attention does once its keys and values are cached."""
    block = _fused_block("plain")
    calls = []
    block.a_b_proj.register_forward_hook(lambda *args: calls.append(1))
    block.how = "no layers"
    x = torch.randn(3, 64)
    with torch.no_grad():
        block(x)
    assert calls == [] and block.a_proj.shared._source is None


def test_an_input_changed_in_place_after_the_first_member_is_computed_again():
    """A pre-hook of a member (or a forward) that changes the input in place between the members' calls:
    the next member sees the tensor's new version and computes the product of what it holds now."""
    def halve(layer, args):
        args[0].mul_(0.5)

    block, apart = _fused_block("plain"), _apart("plain")
    for module in (block, apart):
        module.b_proj.register_forward_pre_hook(halve)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(block(x.clone()), apart(x.clone()))


def test_the_probe_misses_an_in_place_clamp_the_version_counter_does_not():
    """The probe's small input passes a clamp unchanged, so the set is fused; at run time the clamp
    bumps the input's version and each member computes from what it reads."""
    block, apart = _fused_block("clamped"), _apart("clamped")
    x = 10 * torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(block(x.clone()), apart(x.clone()))


def test_the_slices_follow_a_replaced_fused_layer():
    block = _fused_block("plain")
    block.a_b_proj = nn.Linear(64, 192).requires_grad_(False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(block.a_proj(x), block.a_b_proj(x)[..., :64])


def test_the_last_member_drops_the_product():
    """Once every member has its columns, the set holds no product (the columns keep what they need)."""
    block = _fused_block("plain")
    held = []
    block.b_proj.register_forward_hook(lambda *args: held.append(block.b_proj.shared._product))
    with torch.no_grad():
        block(torch.randn(3, 64))
    assert held == [None]


def test_a_fused_model_runs_and_is_made_under_inference_mode(cpu_op):
    """Inference tensors keep no version counter: the members take the same tensor as unchanged."""
    with torch.inference_mode():
        model = replace_linear(tiny_llama(), group_size=64)
        apart = replace_linear(tiny_llama(), group_size=64, fuse=False)
        assert sum(isinstance(m, FusedSlice) for m in model.modules()) == 10
        tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(7))
        assert torch.equal(model(tokens).logits, apart(tokens).logits)


def _scaled(model: nn.Module) -> nn.Module:
    """`model` with every parameter changed, so that only a loaded state dict can make it compute as another."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    return model


@pytest.mark.parametrize("bias, zero_points", [(False, False), (True, True)])
def test_a_state_dict_saved_apart_loads_into_a_fused_model(cpu_op, bias, zero_points):
    apart = replace_linear(tiny_llama(attention_bias=bias), group_size=64, fuse=False, zero_points=zero_points)
    model = replace_linear(_scaled(tiny_llama(attention_bias=bias)), group_size=64, zero_points=zero_points)
    fused_keys = set(model.state_dict())
    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert not torch.equal(model(tokens).logits, apart(tokens).logits)
        model.load_state_dict(apart.state_dict())
        assert torch.equal(model(tokens).logits, apart(tokens).logits)
    assert set(model.state_dict()) == fused_keys and "model.layers.1.mlp.gate_up_proj.qweight" in fused_keys
    assert "model.layers.1.mlp.gate_proj.qweight" in apart.state_dict()


def test_a_member_entry_that_cannot_load_is_named_and_a_partial_set_is_left_to_load_state_dict(cpu_op):
    apart = replace_linear(tiny_llama(), group_size=64, fuse=False).state_dict()
    model = replace_linear(tiny_llama(), group_size=64)
    bad = dict(apart)
    bad["model.layers.1.self_attn.k_proj.qweight"] = bad["model.layers.1.self_attn.k_proj.qweight"].float()
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.self_attn\.k_proj: qweight must be int32"):
        model.load_state_dict(bad)
    short = dict(apart)
    short["model.layers.0.self_attn.v_proj.scales"] = short["model.layers.0.self_attn.v_proj.scales"][:1]
    with pytest.raises(RuntimeError, match=r"(?s)model\.layers\.0\.self_attn\.v_proj: .*size mismatch for scales"):
        model.load_state_dict(short)
    partial = {key: value for key, value in apart.items() if not key.startswith("model.layers.0.mlp.up_proj.")}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model\.layers\.0\.mlp\.gate_up_proj\.qweight"):
        model.load_state_dict(partial)


def test_an_act_order_checkpoint_loaded_apart_saves_a_state_dict_its_fused_twin_loads(cpu_op, tmp_path):
    from runtime.checkpoint.loader import load_quantized
    from tests.checkpoint_writers import write_checkpoint

    for seed in (0, 1):
        write_checkpoint(tmp_path / str(seed), "gptq", symmetric=False, act_order=True, seed=seed)
    apart = load_quantized(tmp_path / "0", device="cpu", fuse=False)
    model = load_quantized(tmp_path / "1", device="cpu")
    tokens = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        model.load_state_dict(apart.state_dict())
        assert torch.equal(model(tokens).logits, apart(tokens).logits)


def test_a_state_dict_apart_loads_into_a_fused_model_as_into_one_apart(cpu_op):
    """strict=False reports what a member's entry lacks or has too many under the member's keys, as for
    the model apart; a member never filled (zero scales) loads; meta tensors load (assign=True) as
    meta tensors of the fused form."""
    apart_model = replace_linear(tiny_llama(), group_size=64, fuse=False)
    apart, model = apart_model.state_dict(), replace_linear(tiny_llama(), group_size=64)
    k_proj, v_proj = "model.layers.1.self_attn.k_proj.", "model.layers.1.self_attn.v_proj."
    odd = {key: value for key, value in apart.items() if key != v_proj + "scales"}
    odd[k_proj + "g_idx"] = torch.zeros(128, dtype=torch.int32)
    for target in (model, replace_linear(tiny_llama(), group_size=64, fuse=False)):
        found = target.load_state_dict(odd, strict=False)
        assert v_proj + "scales" in found.missing_keys and found.unexpected_keys == [k_proj + "g_idx"]
    empty = dict(apart)
    empty[k_proj + "scales"] = torch.zeros_like(empty[k_proj + "scales"])
    model.load_state_dict(empty)
    assert not model.model.layers[1].self_attn.q_k_v_proj.unpack()[1][:, 128:192].any()
    meta = {key: torch.empty_like(value, device="meta") for key, value in apart.items()}
    model.load_state_dict(meta, assign=True)
    fused = model.model.layers[0].self_attn.q_k_v_proj
    assert fused.qweight.is_meta and fused.scales.shape == (2, 256)


def test_act_order_members_join_with_their_permutation_and_unlike_ones_are_refused():
    gen = torch.Generator().manual_seed(10)
    perm = torch.randperm(128, generator=gen).int()

    def member(n: int) -> QuantLinear:
        codes = torch.randint(0, 16, (128, n), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(2, n, generator=gen) + 0.5).half()
        layer = QuantLinear.from_codes(codes, scales, precompile=False)
        layer.perm = perm.clone()
        return layer

    def pair(a: QuantLinear, b: QuantLinear) -> nn.Module:
        model = nn.Module()
        model.a_proj, model.b_proj = a, b
        install(model, FusionPlan("", ("a_proj", "b_proj"), "a_b_proj"), concatenated_quantized([a, b]))
        return model

    apart = {f"{name}.{key}": value for name, layer in (("a_proj", member(64)), ("b_proj", member(128)))
             for key, value in layer.state_dict().items()}
    model = pair(member(64), member(128))
    model.load_state_dict(apart)
    want = concatenated_quantized([_loaded(apart, "a_proj", 64), _loaded(apart, "b_proj", 128)]).state_dict()
    assert model.a_b_proj.state_dict().keys() == want.keys() == {"qweight", "scales", "perm"}
    assert all(torch.equal(model.a_b_proj.state_dict()[key], value) for key, value in want.items())
    apart["b_proj.perm"] = apart["b_proj.perm"].flip(0)
    with pytest.raises(ValueError, match="a_proj, b_proj: the members' perm differ"):
        model.load_state_dict(apart)


def _loaded(state: dict, name: str, n: int) -> QuantLinear:
    layer = QuantLinear(128, n, group_size=64, act_order=True, precompile=False)
    layer.load_state_dict({key[len(name) + 1:]: value for key, value in state.items() if key.startswith(name + ".")})
    return layer
