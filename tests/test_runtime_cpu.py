"""The runtime without a GPU: QuantLinear, replace_linear, the op's checks, fake tensors and dispatch.

Where a test needs the op to compute on the CPU, it swaps the CUDA launch for the fp32 reference
(the `cpu_op` fixture, tests/cpu_op.py), so that everything around the kernel is checked: shapes, transposes, bias.
"""
import contextlib
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime.dispatch as dispatching
import runtime.op as op
from runtime import QuantLinear, replace_linear, w4a16_gemm
from schedules import marlin_mma
from schedules.problem import Problem
from schedules.quant import dequantize, quantize_rtn, reference_matmul
from schedules.registry import Schedule
from tests.reference import int4_weights

ROOT = Path(__file__).resolve().parent.parent


def _linear(k=256, n=192, bias=True, dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


# --- QuantLinear ---------------------------------------------------------------------------------

def test_from_linear_quantizes_the_transposed_weight():
    linear = _linear()
    layer = QuantLinear.from_linear(linear, group_size=64)
    codes, scales = quantize_rtn(linear.weight.detach().t(), 64)
    got_codes, got_scales = layer.unpack()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    assert torch.equal(layer.bias, linear.bias.detach())
    assert layer.qweight.dtype == torch.int32 and tuple(layer.qweight.shape) == (256 // 16, 2 * 192)
    w = dequantize(got_codes, got_scales).t()
    assert (w - linear.weight.float()).abs().max() <= 0.6 * scales.float().max()   # half a step, and rounding


def test_extra_repr_names_the_layer():
    text = repr(QuantLinear.from_linear(_linear(bias=False), group_size=128))
    for part in ("in_features=256", "out_features=192", "bits=4", "group_size=128", "layout=marlin_mma.v1"):
        assert part in text


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip(bias):
    layer = QuantLinear.from_linear(_linear(bias=bias), group_size=64)
    fresh = QuantLinear(256, 192, bias=bias, group_size=64)
    fresh.load_state_dict(layer.state_dict())
    assert set(layer.state_dict()) == ({"qweight", "scales", "bias"} if bias else {"qweight", "scales"})
    for name, tensor in layer.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor)
    with pytest.raises(RuntimeError, match="size mismatch"):
        QuantLinear(256, 192, bias=bias, group_size=128).load_state_dict(layer.state_dict())


def test_channelwise_is_group_minus_one():
    layer = QuantLinear.from_linear(_linear(), group_size=-1)
    assert layer.group_size == 256 and tuple(layer.scales.shape) == (1, 192)


@pytest.mark.parametrize("k, n, group, match", [
    (256, 100, 128, "N=100 must be a multiple of 64"),
    (200, 128, 8, "K=200 must be a multiple of 16"),
    (256, 128, 96, "not a multiple of the group size 96"),
])
def test_shapes_the_layout_cannot_hold(k, n, group, match):
    with pytest.raises(ValueError, match=match):
        QuantLinear(k, n, group_size=group)


def test_float32_layers_are_refused():
    with pytest.raises(TypeError, match="float16 or bfloat16.*not torch.float32"):
        QuantLinear.from_linear(_linear(dtype=torch.float32))


@pytest.fixture
def no_kernel_build(monkeypatch):
    """Fails a test that builds (or plans) kernels: refusals come before any of that."""
    import runtime.linear

    def refuse(*args, **kwargs):
        raise AssertionError("kernels were planned or built before the refusal")

    monkeypatch.setattr(runtime.linear, "precompile_layers", refuse)


@pytest.mark.parametrize("k, group, match", [
    (3072, 32, r"group size 32 with K=3072 cannot run .* multiple of 64 that divides K .* or -1 \(channelwise\)"),
    (3072, 96, r"group size 96 with K=3072 cannot run .* multiple of 64"),
    (4112, -1, r"group size -1 \(channelwise\) with K=4112 .* K to be a multiple of 64"),
])
def test_group_sizes_no_family_runs_are_refused(no_kernel_build, monkeypatch, k, group, match):
    import runtime.linear

    with pytest.raises(ValueError, match=match):
        QuantLinear(k, 256, group_size=group)
    monkeypatch.setattr(runtime.linear, "quantize_rtn", lambda *a, **kw: pytest.fail("quantized before refusing"))
    with pytest.raises(ValueError, match=match):
        QuantLinear.from_linear(_linear(k=k, n=256), group_size=group)
    codes = torch.full((k, 256), 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        QuantLinear.from_codes(codes, torch.ones(1 if group == -1 else k // group, 256, dtype=torch.float16))


def test_w4a8_group_sizes_its_kernels_cannot_run_are_refused(no_kernel_build):
    """W4A8's kernels take 128-deep k-tiles within one group."""
    for k, group in ((4096, 64), (4160, -1)):
        with pytest.raises(ValueError, match=f"group size {group} with K={k} cannot run as W4A8.*multiple of 128"):
            QuantLinear(k, 256, group_size=group, act="fp8")
    QuantLinear(4096, 256, group_size=128, act="fp8", precompile=False)
    QuantLinear(4096, 256, group_size=64, precompile=False)


@pytest.mark.parametrize("act", ["fp8_rounded", "int8"])
def test_a_layer_takes_only_its_dtypes_or_fp8_activations(no_kernel_build, act):
    """fp8_rounded is what the op runs some W4A8 buckets as, not a layer's choice."""
    with pytest.raises(ValueError, match=f"act='{act}'.*'dtype' \\(W4A16\\) or 'fp8' \\(W4A8\\)"):
        QuantLinear(4096, 256, act=act, precompile=False)


@pytest.mark.parametrize("codes, scales, match", [
    (torch.full((256, 128), 16, dtype=torch.uint8), torch.ones(2, 128), "code 16 at row 0, column 0"),
    (torch.zeros(2, 256, 128, dtype=torch.uint8), torch.ones(2, 128), r"codes must be \[K, N\]"),
    (torch.zeros(256, 128, dtype=torch.uint8), torch.ones(0, 128), r"scales \(0, 128\) do not fit"),
])
def test_codes_and_scales_that_cannot_be_packed_are_refused_before_any_build(no_kernel_build, codes, scales, match):
    with pytest.raises(ValueError, match=match):
        QuantLinear.from_codes(codes, scales.half())


def test_replace_linear_names_a_layer_whose_weights_are_not_loaded():
    with torch.device("meta"):
        model = nn.Sequential(_linear())
    with pytest.raises(ValueError, match="cannot convert '0'.*meta device"):
        replace_linear(model, precompile=False)


def test_a_group_size_of_a_multiple_of_64_dividing_k_is_taken():
    assert QuantLinear(3072, 256, group_size=192).group_size == 192


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.0, -0.5])
def test_scales_that_are_not_finite_and_positive_are_refused_by_place(no_kernel_build, value):
    codes, scales = quantize_rtn(torch.randn(256, 192), 64)
    scales[3, 17] = value
    with pytest.raises(ValueError, match=f"scale {value} at group 3, column 17: scales must be finite and positive"):
        QuantLinear.from_codes(codes, scales)
    scales[1, 5] = value
    with pytest.raises(ValueError, match=f"scale {value} at group 1, column 5 \\(and 1 more\\)"):
        QuantLinear.from_codes(codes, scales)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_weights_that_are_not_finite_are_refused_by_place(no_kernel_build, value):
    linear = _linear()
    with torch.no_grad():
        linear.weight[5, 17] = value
    with pytest.raises(ValueError, match=f"weight {value} at row 5, column 17 .*weights must be finite"):
        QuantLinear.from_linear(linear, group_size=64)


def test_an_all_zero_layer_converts_to_zero_weights():
    linear = _linear(bias=False)
    with torch.no_grad():
        linear.weight.zero_()
    codes, scales = QuantLinear.from_linear(linear, group_size=64).unpack()
    assert bool((scales > 0).all()) and bool((codes == 8).all())


def test_forward_matches_the_reference(cpu_op):
    linear = _linear()
    layer = QuantLinear.from_linear(linear, group_size=64)
    codes, scales = layer.unpack()
    x = torch.randn(2, 5, 256, dtype=torch.float16)
    want = (reference_matmul(x.reshape(-1, 256), codes, scales) + linear.bias.float()).reshape(2, 5, 192)
    got = layer(x)
    assert got.shape == (2, 5, 192) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_any_float_input_runs_and_the_output_takes_autocasts_dtype(cpu_op, x_dtype):
    """As nn.Linear under autocast; the kernel runs in the layer's dtype (fp16 here)."""
    layer = QuantLinear.from_linear(_linear(), group_size=64)
    x = torch.randn(3, 256, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x.to(x_dtype))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), layer(x.to(x_dtype).half()).float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(TypeError, match="torch.float32"):
        layer(x.float())                          # without autocast a dtype mismatch stays an error


# --- replace_linear ------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(128, 128, bias=False)
        self.up_proj = nn.Linear(128, 256, bias=False)
        self.down_proj = nn.Linear(256, 128, bias=True)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(128, 200, bias=False)


def _kinds(model):
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))}


def test_replace_linear_converts_all_but_lm_head():
    model = TinyModel().half()
    assert replace_linear(model, group_size=64) is model
    kinds = _kinds(model)
    assert kinds.pop("lm_head") == "Linear"
    assert len(kinds) == 6 and set(kinds.values()) == {"QuantLinear"}
    assert model.layers[1].down_proj.bias is not None and model.layers[0].q_proj.bias is None


@pytest.mark.parametrize("filter, converted", [
    (["up_proj", "down_proj"], {"up_proj", "down_proj"}),
    ("q_proj", {"q_proj"}),
    (lambda name, module: module.out_features == 128, {"q_proj", "down_proj"}),
])
def test_replace_linear_filters(filter, converted):
    model = TinyModel().half()
    replace_linear(model, filter=filter, group_size=64)
    for name, kind in _kinds(model).items():
        assert (kind == "QuantLinear") == (name.rsplit(".", 1)[-1] in converted), name


def test_replace_linear_converts_a_shared_layer_once():
    model = TinyModel().half()
    model.layers[1].q_proj = model.layers[0].q_proj
    replace_linear(model, filter="q_proj", group_size=64)
    assert isinstance(model.layers[0].q_proj, QuantLinear) and model.layers[1].q_proj is model.layers[0].q_proj


def test_replace_linear_names_a_layer_it_cannot_convert():
    model = TinyModel().half()
    with pytest.raises(ValueError, match="'lm_head'.*N=200 must be a multiple of 64"):
        replace_linear(model, skip=(), group_size=64)


def test_replace_linear_refuses_a_group_size_naming_the_first_layer(no_kernel_build):
    model = TinyModel().half()
    with pytest.raises(ValueError, match="'layers.0.q_proj'.*group size 32 with K=128 cannot run"):
        replace_linear(model, group_size=32)
    assert set(_kinds(model).values()) == {"Linear"}


def test_replace_linear_names_a_layer_with_a_nan_weight_and_leaves_the_model_whole(no_kernel_build):
    model = TinyModel().half()
    with torch.no_grad():
        model.layers[1].down_proj.weight[3, 200] = float("nan")
    with pytest.raises(ValueError, match="'layers.1.down_proj'.*weight nan at row 3, column 200"):
        replace_linear(model, group_size=64)
    assert set(_kinds(model).values()) == {"Linear"}      # not half converted


def test_replace_linear_without_a_match_says_so():
    with pytest.raises(ValueError, match="no nn.Linear"):
        replace_linear(TinyModel().half(), filter="o_proj")


def test_replace_linear_of_one_layer_points_to_from_linear():
    with pytest.raises(TypeError, match="QuantLinear.from_linear"):
        replace_linear(_linear())


def test_replace_linear_leaves_multihead_attentions_own_projection_and_takes_no_skip():
    """nn.MultiheadAttention reads out_proj.weight itself instead of calling out_proj."""
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=512).half()
    replace_linear(layer, group_size=64, skip=None)
    assert type(layer.self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(layer.linear1, QuantLinear) and isinstance(layer.linear2, QuantLinear)


def test_a_bias_that_does_not_fit_n_is_refused():
    codes, scales = torch.randint(0, 16, (256, 128)), torch.full((2, 128), 0.01, dtype=torch.float16)
    for bias in (torch.zeros(64, dtype=torch.float16), torch.zeros(1, dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"bias \(\d+,\) does not fit N=128"):
            QuantLinear.from_codes(codes, scales, bias, precompile=False)


def test_a_state_dict_of_cast_words_or_bad_scales_is_refused():
    state = QuantLinear.from_linear(_linear(), group_size=64).state_dict()
    with pytest.raises(ValueError, match="qweight must be int32.*torch.float32"):
        QuantLinear(256, 192, group_size=64).load_state_dict({**state, "qweight": state["qweight"].float()})
    scales = state["scales"].clone()
    scales[1, 5] = float("nan")
    with pytest.raises(ValueError, match="scales: scale nan at group 1, column 5"):
        QuantLinear(256, 192, group_size=64).load_state_dict({**state, "scales": scales})


@pytest.mark.parametrize("fuse", [True, False])
def test_replace_linear_on_a_tiny_llama_matches_fake_quantized_weights(cpu_op, fuse):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float16).eval()
    fake_quantized = transformers.LlamaForCausalLM(config).to(torch.float16).eval()
    fake_quantized.load_state_dict(model.state_dict())
    replace_linear(model, group_size=64, fuse=fuse)
    # q, k, v, o, gate, up, down in each of 2 layers; fused: qkv, o, gate_up, down
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == (8 if fuse else 14)
    dense = dict(fake_quantized.named_modules())
    for name, (codes, scales) in int4_weights(model).items():
        dense[name].weight.data.copy_(dequantize(codes, scales).t())
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        got, want = model(ids).logits.float(), fake_quantized(ids).logits.float()
    assert (got - want).norm() / want.norm() < 1e-2


# --- the op's checks -----------------------------------------------------------------------------

def _op_args(m=3, k=256, n=128, group=128, dtype=torch.float16):
    qweight, scales = marlin_mma.pack(torch.randint(0, 16, (k, n), dtype=torch.uint8), torch.rand(k // group, n).to(dtype))
    return torch.randn(m, k, dtype=dtype), qweight, scales, n, k, group


def test_cpu_tensors_are_refused_naming_the_device():
    with pytest.raises(RuntimeError, match="runs on CUDA GPUs, but x is on cpu"):
        w4a16_gemm(*_op_args())


def test_a_launch_makes_xs_gpu_current_and_a_cpu_tensor_gets_no_guard():
    """Kernel libraries make their tensors' device current and leave it so: the op's launches run
    under a guard that makes x's GPU current and gives the caller's back (tests/test_multi_gpu.py runs
    it on two GPUs)."""
    guard = op._current_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(op._current_device(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: (a[0].float(),) + a[1:], TypeError, "not torch.float32"),
    (lambda a: (a[0].bfloat16(),) + a[1:], TypeError, "x is torch.bfloat16 but the weights' scales are torch.float16"),
    (lambda a: (a[0][:, :128],) + a[1:], ValueError, "does not end in the weight's K=256"),
    (lambda a: a[:3] + (100, 256, 128), ValueError, "N=100 must be a multiple of 64"),
    (lambda a: a[:3] + (128, 256, 96), ValueError, "not a multiple of the group size 96"),
    (lambda a: (a[0], a[1][:, :128]) + a[2:], ValueError, "packed weight must be int32"),
    (lambda a: a[:2] + (a[2][:, :64],) + a[3:], ValueError, "scales must be"),
])
def test_bad_arguments_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        w4a16_gemm(*change(_op_args()))


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unknown weight layout 'marlin_mma.v0'"):
        w4a16_gemm(*_op_args(), layout="marlin_mma.v0")


def test_fake_tensors_give_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 9, 256, dtype=torch.float16, device="cuda")
        qweight = torch.empty(16, 256, dtype=torch.int32, device="cuda")
        scales = torch.empty(2, 128, dtype=torch.float16, device="cuda")
        y = w4a16_gemm(x, qweight, scales, 128, 256, 128)
        assert y.shape == (2, 9, 128) and y.dtype == torch.float16 and y.device.type == "cuda"
        with pytest.raises(ValueError, match="K=256"):
            w4a16_gemm(torch.empty(9, 128, dtype=torch.float16, device="cuda"), qweight, scales, 128, 256, 128)


def test_sizes_traced_as_symbols_are_taken(cpu_op):
    """Under torch.compile(dynamic=True) a K read off x's shape arrives as a SymInt."""
    from schedules import marlin_mma

    k, n, group = 256, 128, 128
    qweight, scales = marlin_mma.pack(torch.randint(0, 16, (k, n), dtype=torch.uint8), torch.rand(k // group, n).half())
    compiled = torch.compile(lambda x: w4a16_gemm(x, qweight, scales, n, x.shape[-1], group), fullgraph=True,
                             dynamic=True, backend="aot_eager")
    assert compiled(torch.randn(3, k).half()).shape == (3, n)


def test_w4a8_fake_tensors_give_the_output_shape_and_trace_into_one_node():
    """tilemarlin::w4a8_gemm's fake implementation: the output's shape and dtype, its checks, and a
    graph that dynamo traces through it (W4A8 runs on the GPU only; this is the tracing side)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runtime import w4a8_gemm

    with FakeTensorMode():
        x = torch.empty(2, 9, 256, dtype=torch.bfloat16, device="cuda")
        qweight = torch.empty(16, 256, dtype=torch.int32, device="cuda")
        scales = torch.empty(2, 128, dtype=torch.bfloat16, device="cuda")
        y = w4a8_gemm(x, qweight, scales, 128, 256, 128)
        assert y.shape == (2, 9, 128) and y.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="K=256"):
            w4a8_gemm(torch.empty(9, 128, dtype=torch.bfloat16, device="cuda"), qweight, scales, 128, 256, 128)

    qweight, scales = marlin_mma.pack(torch.randint(0, 16, (256, 128), dtype=torch.uint8), torch.rand(2, 128).half())
    graph, _ = torch._dynamo.export(lambda x: w4a8_gemm(x, qweight, scales, 128, 256, 128) * 2)(
        torch.randn(4, 256, dtype=torch.float16))
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "tilemarlin.w4a8_gemm.default" in targets


def test_an_ops_first_call_does_not_import_torch_dynamo():
    """The ops are plain dispatcher registrations: torch.library.custom_op's wrapper would import
    torch._dynamo (and with it sympy and FSDP) at the first request, seconds on a serving path."""
    code = ("import sys, torch\n"
            "from runtime.op import w4a16_gemm\n"
            "x, scales = torch.randn(3, 256, dtype=torch.float16), torch.rand(2, 128, dtype=torch.float16)\n"
            "try:\n    w4a16_gemm(x, torch.zeros(16, 256, dtype=torch.int32), scales, 128, 256, 128)\n"
            "except RuntimeError as exc:\n    assert 'runs on CUDA GPUs' in str(exc)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]


def test_a_reloaded_op_module_keeps_its_ops_and_runs_its_new_code():
    """importlib.reload (IPython's autoreload) runs runtime/op.py again: the op namespace, defined
    once per process, is kept, and the ops call the reloaded module's functions."""
    code = ("import importlib, torch\n"
            "import runtime.op as op\n"
            "op = importlib.reload(op)\n"
            "def refuse(*args):\n    raise RuntimeError('reloaded code ran')\n"
            "op._check_device = refuse\n"
            "x, scales = torch.randn(3, 256, dtype=torch.float16), torch.rand(2, 128, dtype=torch.float16)\n"
            "try:\n    op.w4a16_gemm(x, torch.zeros(16, 256, dtype=torch.int32), scales, 128, 256, 128)\n"
            "except RuntimeError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "reloaded code ran"


def test_dynamo_traces_a_quant_linear_into_one_graph():
    layer = QuantLinear.from_linear(_linear(), group_size=64)
    model = nn.Sequential(nn.LayerNorm(256).half(), layer, nn.SiLU())
    graph, _ = torch._dynamo.export(model)(torch.randn(4, 256, dtype=torch.float16))
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "tilemarlin.w4a16_gemm.default" in targets


@pytest.mark.parametrize("name", ["w4a16_gemm", "w4a8_gemm"])
def test_a_backward_through_the_op_is_refused_not_silently_zero(cpu_op, name):
    """The ops have no gradient (frozen INT4 weights): where x requires one, the output carries a
    backward that raises, naming the op, also beside another path to x; under no_grad nothing is
    recorded."""
    gemm = getattr(op, name)
    x, qweight, scales, n, k, group = _op_args()
    x.requires_grad_(True)
    y = gemm(x, qweight, scales, n, k, group)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=f"tilemarlin::{name} has no gradient.*torch.no_grad"):
        (y.float().sum() + x.float().sum()).backward()
    with torch.no_grad():
        assert not gemm(x, qweight, scales, n, k, group).requires_grad
    assert not gemm(x.detach(), qweight, scales, n, k, group).requires_grad


def test_a_compiled_model_with_trainable_parameters_runs_its_forward_and_refuses_a_backward(cpu_op):
    """torch.compile traces the backward of a forward that records one (a LayerNorm's weight requires a
    gradient, as in any model): the refusal comes when a backward runs, not at the forward's compile."""
    torch.manual_seed(0)
    model = replace_linear(nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 256)).half(), group_size=64,
                           precompile=False)
    x = torch.randn(4, 256, dtype=torch.float16)
    y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(y, model(x))
    with pytest.raises(RuntimeError, match="tilemarlin::w4a16_gemm has no gradient"):
        y.float().sum().backward()


def test_op_passes_torch_library_checks(cpu_op):
    x, qweight, scales, n, k, group = _op_args()
    torch.library.opcheck(torch.ops.tilemarlin.w4a16_gemm.default, (x, qweight, scales, n, k, group),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# --- dispatch: tuned table, cost-model fallback, caching ----------------------------------------

PROBLEM = Problem(n=128, k=256, group=128)
TUNED = Schedule("marlin_mma", marlin_mma.Knobs(block_n=128, split_k=1))
FALLBACK = Schedule("marlin_mma", marlin_mma.Knobs(block_n=64, split_k=2))


class StubTable:
    def __init__(self, entries):
        self.entries, self.lookups = entries, []

    def lookup(self, problem, m):
        self.lookups.append((problem, m))
        return self.entries.get((problem, m))


@pytest.fixture
def dispatch(monkeypatch):
    """Dispatch with a stub table, a counting compiler and a stub cost model; no GPU."""
    import runtime.fallback
    import runtime.kernels
    import runtime.selfcheck
    import schedules.arch
    import schedules.cost

    calls = {"compile": [], "fallback": [], "excluded": [], "tables": []}
    table = StubTable({(PROBLEM, 16): TUNED})
    monkeypatch.setattr(op, "_LAUNCHERS", {})
    monkeypatch.setattr(op, "_UNCHECKED", {})
    monkeypatch.setattr(dispatching, "_WARNED", set())
    monkeypatch.setattr(dispatching, "_tuned_table", lambda device: table)
    monkeypatch.setattr(schedules.arch, "current_arch", lambda device=None: schedules.arch.get_arch("sm_90a"))
    monkeypatch.setattr(schedules.cost.GpuSpec, "current", classmethod(lambda cls, device=None: None))
    monkeypatch.setattr(dispatching, "_winners", lambda arch: ())
    monkeypatch.setattr(runtime.selfcheck, "check_once", lambda kernel, problem, schedule, bucket, device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    def fallback(problem, m, arch, gpu, winners, table=None, exclude=frozenset()):
        calls["fallback"].append(m)
        calls["excluded"].append(exclude)
        calls["tables"].append(table)
        return FALLBACK, "a stub"

    monkeypatch.setattr(runtime.fallback, "fallback_schedule", fallback)
    monkeypatch.setattr(runtime.kernels, "compile_schedule",
                        lambda problem, schedule, arch: calls["compile"].append(schedule) or f"kernel {schedule.name}")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stub GPU")
    return table, calls


CUDA0 = torch.device("cuda", 0)


def test_tuned_bucket_runs_the_tuned_schedule_compiled_once(dispatch):
    table, calls = dispatch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16)
        assert op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16) is first
    assert first.schedule == TUNED and calls["compile"] == [TUNED] and len(table.lookups) == 1


def test_untuned_bucket_falls_back_to_the_cost_model_warning_once_per_problem(dispatch):
    _, calls = dispatch
    with pytest.warns(dispatching.UntunedShapeWarning, match="gen tune --shapes 256x128 --group 128") as record:
        for bucket in (1, 1, 4, 1024):
            assert op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, bucket).schedule == FALLBACK
    assert len([w for w in record if issubclass(w.category, dispatching.UntunedShapeWarning)]) == 1
    assert calls["fallback"] == [1, 4, 1024]


def test_concurrent_first_calls_compile_once(dispatch):
    _, calls = dispatch
    barrier = threading.Barrier(8)
    found = []

    def first_call():
        barrier.wait()
        found.append(op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 8 and len({id(f) for f in found}) == 1 and calls["compile"] == [TUNED]


def test_a_schedule_for_another_layout_is_refused(dispatch):
    with pytest.raises(ValueError, match="reads weights in layout marlin_mma.v1, but these are packed in other.v9"):
        dispatching.schedule_for(PROBLEM, 16, CUDA0, layout="other.v9")


def test_resolving_one_shape_never_blocks_another(dispatch, monkeypatch):
    """A slow first call (a fallback or a build) holds only its own key's lock."""
    import runtime.fallback

    other = Problem(n=256, k=256, group=128)
    entered, release = threading.Event(), threading.Event()

    def slow_fallback(problem, m, arch, gpu, winners, table=None, exclude=frozenset()):
        if problem == other:
            entered.set()
            assert release.wait(30), "the other shape was never resolved"
        return FALLBACK, "a stub"

    monkeypatch.setattr(runtime.fallback, "fallback_schedule", slow_fallback)
    slow = threading.Thread(target=op._launcher, args=(CUDA0, other, op.DEFAULT_LAYOUT, 1))
    slow.start()
    assert entered.wait(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatching.UntunedShapeWarning)
        assert op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16).schedule == TUNED   # while the other waits
        assert op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 1).schedule == FALLBACK
    release.set()
    slow.join(30)
    assert not slow.is_alive()


def test_a_kernel_that_fails_its_first_run_check_is_replaced_with_a_warning(dispatch, monkeypatch):
    import runtime.selfcheck

    _, calls = dispatch
    checked = []

    def check(kernel, problem, schedule, bucket, device):
        checked.append(schedule)
        if schedule == TUNED:
            raise runtime.selfcheck.KernelCheckError(f"{schedule.name}: relative error 0.5 over the tolerance 0.002")

    monkeypatch.setattr(runtime.selfcheck, "check_once", check)
    with pytest.warns(op.KernelCheckWarning, match=f"{TUNED.name}.*relative error 0.5.*running {FALLBACK.name}"):
        launcher = op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16)
    assert launcher.schedule == FALLBACK and checked == [TUNED, FALLBACK] and calls["compile"] == [TUNED, FALLBACK]
    assert calls["excluded"] == [frozenset({TUNED})]          # the kernel that failed is not its own replacement
    assert calls["tables"] == [dispatch[0]]                   # the twins' winners are offered too


def test_a_first_call_inside_a_capture_is_checked_at_the_next_call_outside(dispatch, monkeypatch):
    """Inside CUDA-graph capture the check cannot run: the kernel serves the capture unchecked (chosen and
    loaded once for all the capture's calls), and the first call outside capture checks it."""
    import runtime.selfcheck

    checked, capturing = [], [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(runtime.selfcheck, "is_verified", lambda kernel, bucket, device: False)
    monkeypatch.setattr(runtime.selfcheck, "check_once", lambda kernel, problem, schedule, bucket, device:
                        checked.append(schedule))
    _, calls = dispatch
    for _ in range(2):
        assert op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16).schedule == TUNED and checked == []
    assert calls["compile"] == [TUNED] and not op._LAUNCHERS
    capturing[0] = False
    first = op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16)
    assert checked == [TUNED] and op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16) is first
    assert checked == [TUNED] and calls["compile"] == [TUNED] and not op._UNCHECKED


def test_a_kernel_checked_before_is_remembered_even_inside_a_capture(dispatch, monkeypatch):
    import runtime.selfcheck

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(runtime.selfcheck, "is_verified", lambda kernel, bucket, device: True)
    first = op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16)
    assert op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16) is first


def test_when_the_replacement_fails_too_the_call_fails(dispatch, monkeypatch):
    import runtime.selfcheck

    def check(kernel, problem, schedule, bucket, device):
        raise runtime.selfcheck.KernelCheckError(f"{schedule.name} is wrong")

    monkeypatch.setattr(runtime.selfcheck, "check_once", check)
    with pytest.warns(op.KernelCheckWarning), pytest.raises(runtime.selfcheck.KernelCheckError, match=FALLBACK.name):
        op._launcher(CUDA0, PROBLEM, op.DEFAULT_LAYOUT, 16)
    assert (op.DEFAULT_LAYOUT, 16) not in {(k[2], k[3]) for k in op._LAUNCHERS}


def test_the_untuned_warning_names_the_tune_of_a_zero_point_bf16_layer(dispatch):
    problem = Problem.make(n=128, k=256, group=128, dtype="bfloat16", zero_points=True)
    with pytest.warns(dispatching.UntunedShapeWarning,
                      match="gen tune --shapes 256x128 --group 128 --dtype bfloat16 --zero-points"):
        op._launcher(CUDA0, problem, op.DEFAULT_LAYOUT, 1)


@pytest.mark.parametrize("served_act, kinds", [("fp8_rounded", []), ("fp8", ["fp8_activations"])])
def test_w4a8_feeds_the_kernel_that_serves_its_bucket(monkeypatch, served_act, kinds):
    """A W4A8 call whose bucket the W4A16 twin serves hands x itself to the twin's kernel, which rounds
    it to its FP8 values (no activation kernel); otherwise it quantizes x for the FP8 kernel."""
    fp8 = Problem(n=128, k=256, group=128, act="fp8")
    served = Problem(n=128, k=256, group=128, act=served_act)
    ran, built = [], []

    def activation_kernel(kind, device, k, dtype):
        built.append(kind)
        return lambda a, *outputs: [o.copy_(a.to(o.dtype)) for o in outputs[:1]]

    monkeypatch.setattr(op, "_check_fp8_gpu", lambda device: None)
    monkeypatch.setattr(op, "_launcher", lambda device, problem, layout, bucket: op._Launcher(served, TUNED, "kernel"))
    monkeypatch.setattr(op, "_activation_kernel", activation_kernel)
    monkeypatch.setattr(op, "launch_schedule", lambda kernel, schedule, problem, a, *rest: ran.append((problem, a)))
    a = torch.randn(3, 256).half()
    op._launch(a, None, None, torch.empty(3, 128).half(), fp8, op.DEFAULT_LAYOUT)
    (problem, fed), = ran
    assert problem == served and built == kinds
    if served_act == "fp8_rounded":
        assert fed is a
    else:
        values, token_scales, tile_sums = fed     # (no k-tile sums: the kernel has no offset_decode)
        assert values.dtype == torch.float8_e4m3fn and token_scales.shape == (3, 1) and tile_sums is None


def test_an_act_order_layer_keeps_its_permutation_as_int32_and_loads_an_int64_one():
    """The gather kernel reads int32 indices; state dicts written with int64 ones still load."""
    layer = QuantLinear(256, 128, group_size=128, act_order=True, precompile=False)
    assert layer.perm.dtype == torch.int32 and torch.equal(layer.perm, torch.arange(256, dtype=torch.int32))
    state = layer.state_dict()
    state["perm"] = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    layer.load_state_dict(state)
    assert layer.perm.dtype == torch.int32 and torch.equal(layer.perm.long(), state["perm"])
    layer.load_state_dict(state, assign=True)      # assign takes the stored tensor: cast back to int32
    assert layer.perm.dtype == torch.int32 and torch.equal(layer.perm.long(), state["perm"])


def test_a_state_dict_whose_perm_is_not_a_permutation_is_refused():
    layer = QuantLinear(256, 128, group_size=128, act_order=True, precompile=False)
    state = layer.state_dict()
    state["perm"] = torch.arange(256)
    state["perm"][7] = 300                          # out of range: the kernel would read past the row
    with pytest.raises(ValueError, match="perm must be a permutation of range"):
        layer.load_state_dict(state)
    state["perm"][7] = 8                            # a repeat
    with pytest.raises(ValueError, match="perm must be a permutation of range"):
        layer.load_state_dict(state)


# --- the first-run check's plan (runtime/selfcheck.py; its runs need a GPU) ------------------------------------

def test_each_bucket_is_checked_at_a_ragged_m_of_its_own():
    from runtime.selfcheck import checked_m
    from runtime.table import BUCKETS, bucket_of

    assert [checked_m(b) for b in (1, 2, 4, 8, 16, 4096)] == [1, 2, 3, 7, 15, 4097]
    assert all(bucket_of(checked_m(b)) == b for b in BUCKETS)


def test_a_kernels_check_is_stamped_per_bucket(monkeypatch, tmp_path):
    """A kernel serving two buckets is checked in each: a stamp for M = 15 says nothing of M = 31."""
    import runtime.selfcheck as selfcheck

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stub GPU")
    kernel = type("Kernel", (), {"folder": tmp_path})()
    runs = []
    monkeypatch.setattr(selfcheck, "run_check", lambda kernel, problem, schedule, m, device: runs.append(m))
    for bucket in (16, 16, 32):
        selfcheck.check_once(kernel, PROBLEM, TUNED, bucket, CUDA0)
    assert runs == [15, 31] and selfcheck.is_verified(kernel, 32, CUDA0)


def test_the_reference_is_computed_in_float64_whatever_the_caller_set(monkeypatch):
    """Under the caller's autocast, or with TF32 on (by the API that makes the old precision getter
    raise), the check neither fails a right kernel nor touches the caller's settings."""
    import runtime.selfcheck as selfcheck
    from schedules.quant import dequantize

    def exact_kernel(kernel, schedule, problem, a, qweight, scales, out):
        codes, packed = schedule.module.unpack(qweight, scales)
        out.copy_((a.double() @ dequantize(codes, packed).double()).to(out.dtype))

    monkeypatch.setattr(selfcheck, "launch_schedule", exact_kernel)
    schedule = TUNED
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert selfcheck.run_check(None, Problem(n=256, k=256), schedule, 37, torch.device("cpu")) is None
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_the_check_of_a_zero_point_kernel_runs_under_the_callers_autocast(monkeypatch):
    """The drawing, packing and launch run with autocast off too: under a caller's bf16 autocast the
    packing of fp16 zero points used to fail inside torch.stack."""
    import runtime.selfcheck as selfcheck
    from schedules.quant import dequantize

    seen = []

    def exact_kernel(kernel, schedule, problem, a, qweight, scales, out):
        seen.append(torch.is_autocast_enabled("cpu"))
        codes, stacked = schedule.module.unpack(qweight, scales)     # each group's scale row, then its zeros
        weights = dequantize(codes, stacked[0::2], zeros=stacked[1::2])
        out.copy_((a.double() @ weights.double()).to(out.dtype))

    monkeypatch.setattr(selfcheck, "launch_schedule", exact_kernel)
    problem = Problem(n=256, k=256, zero_points=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert selfcheck.run_check(None, problem, TUNED, 7, torch.device("cpu")) is None
        assert torch.is_autocast_enabled("cpu")           # the caller's setting, as it was
    assert seen == [False]


def test_a_read_only_store_checks_again_instead_of_failing(monkeypatch, tmp_path):
    import pathlib

    import runtime.selfcheck as selfcheck

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100/PCIe")
    runs = []
    monkeypatch.setattr(selfcheck, "run_check", lambda kernel, problem, schedule, m, device: runs.append(m))

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "read-only", str(self))

    kernel = type("Kernel", (), {"folder": tmp_path})()
    with monkeypatch.context() as patched:
        patched.setattr(pathlib.Path, "write_text", read_only)
        for _ in range(2):
            selfcheck.check_once(kernel, PROBLEM, TUNED, 16, CUDA0)
    assert runs == [15, 15] and not selfcheck.is_verified(kernel, 16, CUDA0)
    selfcheck.check_once(kernel, PROBLEM, TUNED, 16, CUDA0)    # writable again: stamped, under a safe name
    assert selfcheck.is_verified(kernel, 16, CUDA0)
    monkeypatch.setattr(torch, "__version__", "9.9.9")       # another torch checks again
    assert not selfcheck.is_verified(kernel, 16, CUDA0)
