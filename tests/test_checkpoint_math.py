"""Checkpoint layers (act-order, zero points) through QuantLinear against dense fp32 references, on
the CPU.

Where QuantLinear's forward must compute, the op's CUDA launch is replaced by the fp32 reference of
what the kernel computes from the packed tensors (the `cpu_op` fixture, tests/cpu_op.py: the codes
less their zero points, 8 or the zero-point rows', times the scales), so that everything around the
kernel is what runs: the gather by perm, the packing of the zero points, the op's shapes, the bias.
"""
import pytest
import torch

from runtime import QuantLinear
from runtime.checkpoint.layer import build_layer
from runtime.checkpoint.loader import load_quantized
from tests.checkpoint_writers import dense_model, draw_layer, write_checkpoint
from tests.reference import assert_matches_reference


def test_a_layer_with_zero_points_keeps_them_after_its_scale_rows():
    gen = torch.Generator().manual_seed(9)
    drawn = draw_layer(256, 64, 128, False, False, torch.float16, gen)
    layer = build_layer(drawn.codes, drawn.scales, drawn.zeros, drawn.g_idx, 128, None, torch.float16)
    module = QuantLinear.from_layer(layer)
    assert module.zero_points and module.problem.zero_points and tuple(module.scales.shape) == (4, 64)
    assert torch.equal(module.unpack()[1], layer.scales)
    assert module.zeros().dtype == torch.float16 and torch.equal(module.zeros().long(), layer.zeros.long())
    symmetric = QuantLinear.from_layer(build_layer(drawn.codes, drawn.scales, None, drawn.g_idx, 128, None,
                                                   torch.float16))
    assert not symmetric.zero_points and symmetric.zeros() is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric, act_order, group", [
    (True, True, 128), (False, False, 64), (False, True, 128), (False, False, -1)])
def test_quant_linear_matches_the_dense_weight(cpu_op, dtype, symmetric, act_order, group):
    gen = torch.Generator().manual_seed(7)
    k, n = 512, 256
    drawn = draw_layer(k, n, group, symmetric, act_order, dtype, gen)
    bias = torch.randn(n, generator=gen).to(dtype)
    layer = build_layer(drawn.codes, drawn.scales, drawn.zeros, drawn.g_idx, group, bias, dtype)
    module = QuantLinear.from_layer(layer)
    x = torch.randn(3, 5, k, generator=gen).to(dtype)
    ref = x.float() @ drawn.weight + bias.float()
    assert_matches_reference(module(x), ref, context=f"{dtype} sym={symmetric} act_order={act_order} g={group}")


def test_act_order_gathers_the_input_columns(cpu_op):
    """Row i of the stored codes is input feature perm[i]: a one-hot x picks that row."""
    gen = torch.Generator().manual_seed(3)
    drawn = draw_layer(256, 64, 128, True, True, torch.float16, gen)
    layer = build_layer(drawn.codes, drawn.scales, drawn.zeros, drawn.g_idx, 128, None, torch.float16)
    module = QuantLinear.from_layer(layer)
    feature = int(layer.perm[5])
    x = torch.zeros(1, 256, dtype=torch.float16)
    x[0, feature] = 1
    torch.testing.assert_close(module(x).float()[0], drawn.weight[feature], rtol=1e-3, atol=1e-5)


# Logits of the two-layer model in float16 / bfloat16 against the fp32 dense model: measured on the
# CPU with the reference in place of the kernel, 8e-4 / 6.3e-3 in norm and 8e-4 / 8.3e-3 of the largest
# logit element-wise; twice tests/reference.py's tolerance of one GEMM leaves room for the GPU's
# attention and norm kernels.
MODEL_TOLERANCE = {torch.float16: dict(rel_tol=4e-3, elem_tol=8e-3), torch.bfloat16: dict(rel_tol=2e-2, elem_tol=4e-2)}


@pytest.mark.parametrize("fmt, symmetric, act_order, dtype, bias", [
    ("gptq", False, True, torch.float16, True), ("awq", False, False, torch.bfloat16, False),
    ("compressed-tensors", True, True, torch.bfloat16, True), ("compressed-tensors", False, False, torch.float16, False)])
def test_loaded_model_logits_on_cpu(cpu_op, tmp_path, fmt, symmetric, act_order, dtype, bias):
    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, fmt, dtype, 128, symmetric, act_order, attention_bias=bias)
    model = load_quantized(folder, dtype=dtype, device="cpu")
    reference = dense_model(folder, drawn)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
        ref = reference(tokens).logits
    assert logits.dtype == dtype
    assert (model.model.layers[0].self_attn.q_k_v_proj.bias is not None) == bias   # fused (runtime/fuse.py)
    assert_matches_reference(logits, ref, **MODEL_TOLERANCE[dtype], context=f"{fmt} {dtype}")


def test_checkpoint_layer_traces_in_one_graph(cpu_op):
    """The gather adds no graph break: torch.compile(fullgraph=True) traces it with the op, zero
    points and all (aot_eager: the trace without code generation)."""
    gen = torch.Generator().manual_seed(5)
    drawn = draw_layer(256, 128, 128, False, True, torch.float16, gen)
    layer = build_layer(drawn.codes, drawn.scales, drawn.zeros, drawn.g_idx, 128, None, torch.float16)
    module = QuantLinear.from_layer(layer)
    x = torch.randn(4, 256, generator=gen).half()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), module(x))
