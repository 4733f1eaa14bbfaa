"""Act-order with fewer gathers, on the CPU: a down_proj's permutation moved into gate_proj's and
up_proj's output columns (runtime/checkpoint/fold.py), one gather of a module's input for the layers
that share its permutation (runtime/checkpoint/input_gather.py), and that gather moved into the
RMSNorm before the module (runtime/checkpoint/norm_fold.py): which modules qualify, the layers'
weights against the checkpoint's, and the model's logits against the dense model."""
import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from runtime import QuantLinear
import runtime.op as op
from runtime.checkpoint.fold import GatherFolding, feeds_columnwise, gated_mlps
import runtime.checkpoint.loader as loader
from runtime.checkpoint.input_gather import input_argument, input_gathers, unshare_input_gathers
from runtime.checkpoint.loader import load_quantized
from runtime.checkpoint.norm_fold import GatheredRMSNorm, unfold_gathered_norms
from schedules.quant import dequantize
from tests.checkpoint_writers import dense_model, write_checkpoint
from tests.reference import assert_matches_reference
from tests.test_checkpoint_math import MODEL_TOLERANCE

MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")


def llama_mlp(**config) -> LlamaMLP:
    return LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96, **config))


class MixesColumns(nn.Module):
    """down_proj's input column j depends on column 95 - j of up_proj's output."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)

    def forward(self, x):
        return self.down_proj(torch.sigmoid(self.gate_proj(x)) * self.up_proj(x).flip(-1))


class ScalesColumns(MixesColumns):
    """A learned scale per column of the product: columnwise, but not the same function for each."""

    def __init__(self, device=None):
        super().__init__()
        self.column_scale = nn.Parameter(torch.linspace(0.5, 2.0, 96, device=device))

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x) * self.column_scale)


class UsesUp(MixesColumns):
    """Columnwise into down_proj, but up_proj's output reaches the module's output as well."""

    def forward(self, x):
        up = self.up_proj(x)
        return self.down_proj(torch.sigmoid(self.gate_proj(x)) * up) + up[..., :64]


class ReadsWeights(MixesColumns):
    """Slices its layers' weights itself (as tensor-parallel pretraining code does)."""

    def forward(self, x):
        return self.down_proj(torch.relu(x @ self.gate_proj.weight.t()) * self.up_proj(x))


def test_the_gated_mlps_of_transformers_feed_columnwise():
    assert feeds_columnwise(llama_mlp())
    assert feeds_columnwise(llama_mlp(hidden_act="gelu_pytorch_tanh"))


@pytest.mark.parametrize("mlp", [MixesColumns(), ScalesColumns(), ScalesColumns(device="meta"), ReadsWeights(),
                                 UsesUp()],
                         ids=["mixes columns", "scales columns", "parameters on meta", "reads weights", "uses up"])
def test_other_mlps_are_not_folded(mlp):
    layers = [getattr(mlp, name) for name in MLP_LAYERS]
    assert not feeds_columnwise(mlp)
    assert [getattr(mlp, name) for name in MLP_LAYERS] == layers   # the probe put the real layers back


def test_only_mlps_whose_three_layers_are_quantized_fold():
    model = nn.ModuleDict({"mlp": llama_mlp()})
    all_three = {f"mlp.{name}" for name in MLP_LAYERS}
    assert gated_mlps(model, all_three) == {"mlp.down_proj": ("mlp.gate_proj", "mlp.up_proj")}
    assert gated_mlps(model, all_three - {"mlp.up_proj"}) == {}
    # a gate_proj that another module calls too would change that module's output as well
    model["other"] = nn.ModuleDict({"reuses": model["mlp"].gate_proj})
    assert gated_mlps(model, all_three) == {}


def test_a_folded_down_proj_is_converted_before_its_gate_and_up():
    model = nn.ModuleDict({"attn": nn.Linear(64, 64), "mlp": llama_mlp()})
    folding = GatherFolding(model, {"attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    names = ["attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert folding.order(names) == ["attn", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]


def effective_weight(module: QuantLinear) -> torch.Tensor:
    """fp32 W[K, N] with y = x @ W + bias, the gather by perm included."""
    codes, scales = module.unpack()
    zeros = module.zeros()
    w = dequantize(codes, scales, zeros=None if zeros is None else zeros.long())
    return w if module.perm is None else torch.empty_like(w).index_copy_(0, module.perm.long(), w)


@pytest.mark.parametrize("fmt, symmetric, dtype", [("gptq", False, torch.float16),
                                                   ("compressed-tensors", True, torch.bfloat16)])
def test_down_proj_hands_its_permutation_to_gate_and_up(cpu_op, tmp_path, fmt, symmetric, dtype):
    folder = tmp_path / "ckpt"
    # gate_proj and up_proj with permutations of their own, so that each keeps its gather
    drawn = write_checkpoint(folder, fmt, dtype, 128, symmetric, act_order=True, mlp_bias=True, shared_orders=False)
    model = load_quantized(folder, dtype=dtype, device="cpu")
    stored = dense_model(folder, drawn)
    for i, block in enumerate(model.model.layers):
        gate, up, down = (getattr(block.mlp, name) for name in MLP_LAYERS)
        assert down.perm is None and gate.perm is not None and up.perm is not None
        assert not hasattr(block.mlp, "input_perm") and not hasattr(block.self_attn, "input_perm")
        # The checkpoint's own order: down_proj's rows sorted by group, stably.
        order = torch.sort(drawn[f"model.layers.{i}.mlp.down_proj"].g_idx, stable=True).indices
        assert torch.equal(effective_weight(down), drawn[f"model.layers.{i}.mlp.down_proj"].weight[order])
        for name, module in (("gate_proj", gate), ("up_proj", up)):
            assert torch.equal(effective_weight(module), drawn[f"model.layers.{i}.mlp.{name}"].weight[:, order])
            bias = stored.get_submodule(f"model.layers.{i}.mlp.{name}").bias
            assert torch.equal(module.bias, bias[order].to(dtype))
        assert block.self_attn.o_proj.perm is not None   # no gated layer before it: it gathers
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, ref = model(tokens).logits, stored(tokens).logits
    assert_matches_reference(logits, ref, **MODEL_TOLERANCE[dtype], context=f"{fmt} {dtype} folded")


def sorted_order(layer) -> torch.Tensor:
    return torch.sort(layer.g_idx, stable=True).indices


@pytest.mark.parametrize("fmt, symmetric, dtype, fuse", [("gptq", False, torch.bfloat16, False),
                                                         ("compressed-tensors", True, torch.float16, False),
                                                         ("gptq", True, torch.float16, True)])
def test_layers_of_one_input_share_one_gather(cpu_op, monkeypatch, tmp_path, fmt, symmetric, dtype, fuse):
    """q_proj, k_proj and v_proj (one permutation, as GPTQ gives them) are fed by one gather of the
    attention's input, gate_proj and up_proj by one of the MLP's; o_proj keeps its own; down_proj's
    went into gate_proj's and up_proj's columns: three gathers a decoder layer instead of seven (before
    the norms take two of them, which this test leaves out). Fused (runtime/fuse.py), each set is one
    layer whose module gathers its input: the same three."""
    monkeypatch.setattr(loader, "fold_gathers_into_norms", lambda model: [])
    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, fmt, dtype, 128, symmetric, act_order=True)
    model = load_quantized(folder, dtype=dtype, device="cpu", fuse=fuse)
    for i, block in enumerate(model.model.layers):
        layer = f"model.layers.{i}"
        q_order = sorted_order(drawn[f"{layer}.self_attn.q_proj"])
        gate_order = sorted_order(drawn[f"{layer}.mlp.gate_proj"])
        assert torch.equal(block.self_attn.input_perm.long(), q_order)
        assert torch.equal(block.mlp.input_perm.long(), gate_order)
        attention = ("q_k_v_proj",) if fuse else ("q_proj", "k_proj", "v_proj")
        for name in attention:
            assert getattr(block.self_attn, name).perm is None
        for name in () if fuse else attention:
            assert torch.equal(effective_weight(getattr(block.self_attn, name)),
                               drawn[f"{layer}.self_attn.{name}"].weight[q_order])
        assert block.self_attn.o_proj.perm is not None
        mlp = ("gate_up_proj", "down_proj") if fuse else MLP_LAYERS
        assert all(getattr(block.mlp, name).perm is None for name in mlp)
    gathers = []
    monkeypatch.setattr(op, "_gather_into", lambda a, perm, out: (gathers.append(perm), out.copy_(a[:, perm.long()])))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, ref = model(tokens).logits, dense_model(folder, drawn)(tokens).logits
    assert len(gathers) == 3 * len(model.model.layers)
    assert_matches_reference(logits, ref, **MODEL_TOLERANCE[dtype], context=f"{fmt} {dtype} shared gathers")


@pytest.mark.parametrize("fmt, symmetric, dtype", [("gptq", False, torch.float16),
                                                   ("compressed-tensors", True, torch.bfloat16)])
def test_the_norms_write_the_shared_inputs_in_the_gathered_order(cpu_op, monkeypatch, tmp_path, fmt, symmetric,
                                                                 dtype):
    """Each decoder layer's input_layernorm and post_attention_layernorm write their outputs in the
    order of the layers they feed: a decoder layer gathers once (o_proj) and runs two norm kernels."""
    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, fmt, dtype, 128, symmetric, act_order=True)
    stored = dense_model(folder, drawn, dtype)
    model = load_quantized(folder, dtype=dtype, device="cpu")
    assert not any(input_gathers(m) or hasattr(m, "input_perm") for m in model.modules())
    for i, block in enumerate(model.model.layers):
        for norm_name, first in (("input_layernorm", "self_attn.q_proj"),
                                 ("post_attention_layernorm", "mlp.gate_proj")):
            norm = getattr(block, norm_name)
            order = sorted_order(drawn[f"model.layers.{i}.{first}"])
            assert isinstance(norm, GatheredRMSNorm) and torch.equal(norm.perm.long(), order)
            assert torch.equal(norm.weight, getattr(stored.model.layers[i], norm_name).weight[order])
        assert block.self_attn.o_proj.perm is not None
    gathers, norms = [], []
    monkeypatch.setattr(op, "_gather_into", lambda a, perm, out: (gathers.append(perm), out.copy_(a[:, perm.long()])))
    norm_gather = op._norm_gather_into
    monkeypatch.setattr(op, "_norm_gather_into", lambda *args: (norms.append(args[2]), norm_gather(*args)))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, ref = model(tokens).logits, dense_model(folder, drawn)(tokens).logits
    assert (len(gathers), len(norms)) == (len(model.model.layers), 2 * len(model.model.layers))
    assert_matches_reference(logits, ref, **MODEL_TOLERANCE[dtype], context=f"{fmt} {dtype} norms gathering")


def test_unfolding_and_unsharing_hand_each_layer_its_permutation_back(cpu_op, monkeypatch, tmp_path):
    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True)
    model = load_quantized(folder, device="cpu", fuse=False)
    tokens = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    gathers = []
    monkeypatch.setattr(op, "_gather_into", lambda a, perm, out: (gathers.append(perm), out.copy_(a[:, perm.long()])))
    with torch.no_grad():
        folded = model(tokens).logits
    blocks = len(model.model.layers)
    norms = [f"model.layers.{i}.{m}" for i in range(blocks) for m in ("input_layernorm", "post_attention_layernorm")]
    assert unfold_gathered_norms(model) == norms
    assert not any(isinstance(m, GatheredRMSNorm) for m in model.modules())
    gathers.clear()
    with torch.no_grad():
        shared = model(tokens).logits
    assert len(gathers) == 3 * blocks                # self_attn, o_proj and mlp gather again
    assert_matches_reference(shared, folded, **MODEL_TOLERANCE[torch.float16], context="unfolded norms")
    modules = [f"model.layers.{i}.{m}" for i in range(blocks) for m in ("self_attn", "mlp")]
    assert unshare_input_gathers(model) == modules
    for i, block in enumerate(model.model.layers):
        assert not hasattr(block.self_attn, "input_perm") and not hasattr(block.mlp, "input_perm")
        assert not block.self_attn._forward_pre_hooks and not block.mlp._forward_pre_hooks
        q_order = sorted_order(drawn[f"model.layers.{i}.self_attn.q_proj"])
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(block.self_attn, name).perm.long(), q_order)
        assert {"mlp.gate_proj.perm", "mlp.up_proj.perm"} < set(block.state_dict())
        assert block.mlp.down_proj.perm is None      # folded, not shared: it stays without a gather
    gathers.clear()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, shared)
    assert len(gathers) == 6 * blocks                # q, k, v, o, gate and up each gather again
    assert unshare_input_gathers(model) == []


def test_a_module_with_a_shared_gather_traces_in_one_graph(cpu_op, monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "fold_gathers_into_norms", lambda model: [])
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True)
    mlp = load_quantized(folder, device="cpu").model.layers[0].mlp
    assert hasattr(mlp, "input_perm")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).half()
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), mlp(x))
    assert torch.equal(mlp(x=x), mlp(x))   # the hook finds its argument however it is passed


def test_a_gathered_norm_traces_in_one_graph(cpu_op, tmp_path):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq", torch.bfloat16, 128, symmetric=False, act_order=True)
    norm = load_quantized(folder, dtype=torch.bfloat16, device="cpu").model.layers[1].post_attention_layernorm
    assert isinstance(norm, GatheredRMSNorm)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), norm(x))


class Reads(nn.Module):
    """q and k read the input; `how` says what else the forward does with it."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.q, self.k, self.o = how, nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x=None, scale=1.0, hidden=None, other=None):
        x = hidden if self.how == "keyword" else x
        if self.how == "changes it":
            x = x * 2
        q = self.q(x)
        if self.how == "edits q's output":
            q.add_(x)
        k = self.k(other if self.how == "two inputs" else x)
        out = self.o(q * k) * scale
        return out + x if self.how == "adds it" else out


ONES = torch.ones(2, 8)


@pytest.mark.parametrize("how, call, argument", [
    ("through q and k", ((ONES,), {}), (0, "x")),
    ("keyword", ((), {"hidden": ONES}), (2, "hidden")),
    ("adds it", ((ONES,), {}), None),
    ("changes it", ((ONES,), {}), None),
    ("edits q's output", ((ONES,), {}), None),
    ("two inputs", ((ONES,), {"other": ONES.clone()}), None),
])
def test_a_gather_moves_to_the_input_only_where_the_layers_alone_read_it(how, call, argument):
    module = Reads(how)
    layers = (module.q, module.k, module.o)
    assert input_argument(module, ["q", "k"], *call) == argument
    assert (module.q, module.k, module.o) == layers and module.training


# --- which norms may write the gathered order --------------------------------------------------------

class ScalesByOnePlusWeight(nn.Module):
    """Gemma's form of RMSNorm, (1 + w) in fp32: another function than the kernel's."""

    def __init__(self, k: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(k)), 1e-6

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def test_only_transformers_rms_norm_writes_the_gathered_order():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from runtime.checkpoint.norm_fold import rms_norm_eps

    norm = LlamaRMSNorm(64, eps=1e-6)
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    assert rms_norm_eps(norm, 64) is None                 # an fp32 weight: the kernel's dtypes are 16-bit
    assert rms_norm_eps(norm.half(), 64) == 1e-6 and rms_norm_eps(norm.bfloat16(), 64) == 1e-6
    assert rms_norm_eps(norm, 128) is None
    assert rms_norm_eps(ScalesByOnePlusWeight(64).half(), 64) is None
    assert rms_norm_eps(nn.LayerNorm(64).half(), 64) is None
    norm.shift = nn.Parameter(torch.zeros(64))      # a parameter of its own besides the weight
    assert rms_norm_eps(norm, 64) is None


class SharesItsInput(nn.Module):
    """Two act-order layers reading one input, gathered once by the module (as self_attn's q and k)."""

    def __init__(self):
        super().__init__()
        self.q = QuantLinear(64, 64, group_size=64, act_order=True, precompile=False)
        self.k = QuantLinear(64, 64, group_size=64, act_order=True, precompile=False)

    def forward(self, x):
        return self.q(x) * self.k(x)


class NormThenShared(nn.Module):
    """norm -> attn, and `how` says what else reads the norm's output."""

    def __init__(self, how: str, attn: nn.Module | None = None):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        from runtime.checkpoint.input_gather import _share

        super().__init__()
        self.how, self.norm, self.attn, self.other = how, LlamaRMSNorm(64), attn or SharesItsInput(), SharesItsInput()
        for module in (self.attn, self.other):
            _share(module, ["q", "k"], (0, "x"))

    def forward(self, x):
        h = self.norm(x)
        out = x + self.attn(h)
        if self.how == "adds it":
            out = out + h
        return out + self.other(h if self.how == "feeds two" else out)


class ReadsItTwice(SharesItsInput):
    """Takes a second tensor, which the probe must see depend on the norm's output."""

    def forward(self, x, extra=None):
        out = self.q(x) * self.k(x)
        return out if extra is None else out + extra


class Uses(NormThenShared):
    """norm -> attn as NormThenShared does, but `how` says what else happens to the norm's output."""

    def __init__(self, how: str):
        super().__init__(how, ReadsItTwice())

    def forward(self, x):
        h = self.norm(x)
        if self.how == "calls attn on x too":
            return self.attn(x) + self.attn(h) + self.other(x)
        if self.how == "passes it twice":
            return x + self.attn(h, h * 2) + self.other(x)
        if self.how == "changes it in place":
            h.mul_(torch.linspace(0.5, 2, 64))
        return x + self.attn(h) + self.other(x)


@pytest.mark.parametrize("how", ["calls attn on x too", "passes it twice", "changes it in place"])
def test_a_norm_whose_output_the_module_does_not_take_as_it_is_is_not_folded(how):
    from runtime.checkpoint.input_gather import gathers_skipped
    from runtime.checkpoint.norm_fold import _fed_consumer

    block = Uses(how)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    with gathers_skipped(block):
        assert _fed_consumer(block, "norm", ["attn", "other"], ((x,), {}), ((x,), {})) is None
        block.how = "plain"
        assert _fed_consumer(block, "norm", ["attn", "other"], ((x,), {}), ((x,), {})) == "attn"


def test_a_norm_with_hooks_or_of_a_width_the_kernel_cannot_take_is_not_folded(cpu_op, tmp_path):
    from runtime.checkpoint.norm_fold import _plain

    folder = tmp_path / "ckpt"
    # hidden size 576: a multiple of 64 that the norm kernel's 128 threads do not split
    write_checkpoint(folder, "gptq", torch.float16, 64, symmetric=False, act_order=True, hidden_size=576,
                     num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    model = load_quantized(folder, device="cpu")
    assert not any(isinstance(m, GatheredRMSNorm) for m in model.modules())
    assert all(hasattr(block.self_attn, "input_perm") and hasattr(block.mlp, "input_perm")
               for block in model.model.layers)
    norm, x = model.model.layers[0].input_layernorm, torch.zeros(1, 576, dtype=torch.float16)
    assert not _plain(norm, ((x,), {}))
    norm.weight.data = torch.ones(256, dtype=torch.float16)
    assert _plain(norm, ((x[:, :256],), {})) and not _plain(norm, ((x[:, :256].float(),), {}))
    norm.register_forward_hook(lambda module, args, out: None)
    assert not _plain(norm, ((x[:, :256],), {}))


@pytest.mark.parametrize("how, fed", [("only attn", "attn"), ("adds it", None), ("feeds two", None)])
def test_a_norm_writes_the_gathered_order_only_for_the_one_module_that_reads_its_output(how, fed):
    from runtime.checkpoint.input_gather import gathers_skipped
    from runtime.checkpoint.norm_fold import _fed_consumer

    block = NormThenShared(how)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    with gathers_skipped(block):
        assert _fed_consumer(block, "norm", ["attn", "other"], ((x,), {}), ((x,), {})) == fed
    assert block.norm.__class__.__name__ == "LlamaRMSNorm" and input_gathers(block.attn)   # put back as it was


class MultipliesBy(NormThenShared):
    """The norm's output also scales the attention's: it reaches the output through more than attn."""

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h) * h + self.other(x)


def test_a_norm_whose_output_meets_the_modules_output_is_not_folded():
    from runtime.checkpoint.input_gather import gathers_skipped
    from runtime.checkpoint.norm_fold import _fed_consumer

    block = MultipliesBy("only attn")
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    with gathers_skipped(block):
        assert _fed_consumer(block, "norm", ["attn", "other"], ((x,), {}), ((x,), {})) is None


@pytest.mark.parametrize("model_type, gathering_norms, gathers", [
    ("qwen2", 2, 1),      # q/k/v with biases: the norms write their input, o_proj gathers
    ("mistral", 2, 1),
    ("gemma", 0, 3),      # its RMSNorm scales by (1 + w): the modules gather their inputs themselves
])
def test_other_architectures_fold_where_their_norms_are_transformers_rms_norm(cpu_op, monkeypatch, tmp_path,
                                                                                model_type, gathering_norms,
                                                                                gathers):
    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, "gptq", torch.bfloat16, 128, symmetric=False, act_order=True,
                             model_type=model_type)
    model = load_quantized(folder, dtype=torch.bfloat16, device="cpu")
    blocks = len(model.model.layers)
    assert sum(isinstance(m, GatheredRMSNorm) for m in model.modules()) == gathering_norms * blocks
    calls = []
    monkeypatch.setattr(op, "_gather_into", lambda a, perm, out: (calls.append(perm), out.copy_(a[:, perm.long()])))
    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, ref = model(tokens).logits, dense_model(folder, drawn)(tokens).logits
    assert len(calls) == gathers * blocks
    assert_matches_reference(logits, ref, **MODEL_TOLERANCE[torch.bfloat16], context=f"{model_type} act-order")
