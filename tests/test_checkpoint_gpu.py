"""Synthetic checkpoints of each format loaded on the GPU: the model's logits against the same model
with the format's dequantized weights as dense fp32 layers. Skipped without CUDA."""
import pytest
import torch

from runtime import QuantLinear, load_quantized
from runtime.checkpoint.layer import build_layer
from tests.checkpoint_writers import dense_model, draw_layer, write_checkpoint
from tests.reference import assert_matches_reference, generator, seed_of
from tests.test_checkpoint_math import MODEL_TOLERANCE

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt, symmetric, act_order, group", [
    ("gptq", True, False, 128),                  # the kernels alone
    ("gptq", False, True, 128),                  # gather + zero-point correction
    ("awq", False, False, 128),
    ("compressed-tensors", True, True, 64),
    ("compressed-tensors", False, False, -1),    # channelwise zero points
])
def test_logits_match_the_dense_model(tmp_path, dtype, fmt, symmetric, act_order, group):
    case = (fmt, symmetric, act_order, group, str(dtype))
    folder = tmp_path / "ckpt"
    drawn = write_checkpoint(folder, fmt, dtype, group, symmetric, act_order, seed=seed_of(*case) % 1000)
    model = load_quantized(folder, dtype=dtype, device="cuda")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 2 * 4   # qkv, o, gate_up, down fused
    reference = dense_model(folder, drawn).cuda()
    for batch, length in ((1, 1), (3, 17)):
        tokens = torch.randint(0, 128, (batch, length), device="cuda", generator=generator(seed_of(*case, length)))
        with torch.no_grad():
            logits = model(tokens).logits
            ref = reference(tokens).logits
        assert_matches_reference(logits, ref, **MODEL_TOLERANCE[dtype], context=f"{case} tokens {batch}x{length}")


def test_checkpoint_layer_in_a_cuda_graph(tmp_path):
    """The gather and the correction replay inside a CUDA graph (no host synchronization)."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True)
    layer = load_quantized(folder, device="cuda").model.layers[0].self_attn.o_proj   # gathers for itself
    assert layer.perm is not None
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16, generator=generator(11))
    expected = layer(x)   # the first call loads and checks the kernel, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, expected.float(), context="replayed graph")   # split-K sums may add in any order


def test_gathering_norms_in_a_cuda_graph(tmp_path):
    """A decoder layer whose norms write the attention's and the MLP's inputs in their layers' order
    (runtime/checkpoint/norm_fold.py) replays inside a CUDA graph, and the replay gives the eager
    result."""
    from runtime.checkpoint.norm_fold import GatheredRMSNorm

    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True)
    block = load_quantized(folder, device="cuda").model.layers[0]
    assert isinstance(block.input_layernorm, GatheredRMSNorm) and isinstance(block.post_attention_layernorm,
                                                                              GatheredRMSNorm)
    x = torch.randn(1, 5, 256, device="cuda", dtype=torch.float16, generator=generator(12))
    cos = torch.ones(1, 5, 64, device="cuda", dtype=torch.float16)   # the rotary embedding at angle 0
    sin = torch.zeros_like(cos)

    def layer():
        out = block(x, attention_mask=None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        expected = layer()   # the first calls load and check the kernels, outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, expected.float(), context="replayed graph with gathering norms")


LLAMA_2_7B = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}
ODD_M = (1, 3, 17, 100, 257, 1024)


@pytest.fixture(scope="module")
def llama_kernels():
    """Every kernel the layer tests below run, built in one parallel compile instead of one build per
    test: the zero-point problems grouped and channelwise, the symmetric grouped one (act-order)."""
    from runtime.op import problem_of, precompile

    problems = [problem_of(n, k, group, "float16", zero_points=zp) for k, n in LLAMA_2_7B.values()
                for group, zp in ((128, True), (-1, True), (128, False))]
    failed = {job: error for job, error in precompile(problems, ODD_M).items() if error}
    assert not failed, failed


@pytest.mark.parametrize("layer", list(LLAMA_2_7B))
@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("symmetric, act_order", [(False, False), (False, True), (True, True)])
def test_checkpoint_layers_on_llama_shapes(llama_kernels, layer, group, symmetric, act_order):
    """Zero points and act-order on Llama-2-7B's layers, as a checkpoint holds them, against the fp32
    product with the format's dense weights, at odd M."""
    if act_order and group == -1:
        pytest.skip("act-order permutes the rows of groups: channelwise has one")
    k, n = LLAMA_2_7B[layer]
    case = (layer, group, symmetric, act_order)
    drawn = draw_layer(k, n, group, symmetric, act_order, torch.float16,
                       torch.Generator().manual_seed(seed_of(*case) % 2 ** 31))
    built = build_layer(drawn.codes.cuda(), drawn.scales.cuda(), drawn.zeros.cuda(), drawn.g_idx.cuda(), group, None,
                        torch.float16)
    module = QuantLinear.from_layer(built, precompile=False)   # llama_kernels built its kernels
    assert module.zero_points == (not symmetric) and (module.perm is not None) == act_order
    weight = drawn.weight.cuda()
    for m in ODD_M:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=generator(seed_of(*case, m)))
        with torch.no_grad():
            out = module(x)
        assert_matches_reference(out, x.float() @ weight, context=f"{case} M={m}")
