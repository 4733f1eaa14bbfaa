"""The runtime on a GPU: the op against the fp32 reference, CUDA graphs, torch.compile, GPTQ import and a
small Llama converted by replace_linear.

The kernels these tests run are compiled up front, in parallel, by `kernels` (the same set of
schedules for all tests: the op's own picks for a few shapes and M buckets, plus one pinned
split-K schedule), so the whole file costs a few nvcc rounds, not one per test.
"""
import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import runtime.op as op
from runtime import QuantLinear, replace_linear, w4a16_gemm
from runtime.workspace import split_k_workspace
from schedules import marlin_mma
from schedules.problem import Problem
from schedules.quant import dequantize, quantize_rtn, reference_matmul, relative_error
from schedules.registry import Schedule

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-3
LLAMA2_7B = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]   # K x N
ODD_M = (1, 3, 17, 100, 257)
# hidden 512 and intermediate 1408 (a multiple of 64 and of the group 128; 1376 is neither)
SMALL_LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=1000, max_position_embeddings=256)
SMALL_SHAPES = [(512, 512), (512, 1408), (1408, 512)]
SMALL_M = (1, 3, 8)        # decode steps, the torch.compile test, prefill of 8 tokens
SPLIT_K = Schedule("marlin_mma", marlin_mma.Knobs(block_m=16, block_n=128, block_k=128, warps_m=1, warps_n=2,
                                                  warps_k=1, num_stages=4, split_k=4))
GRAPH_SHAPE = (4096, 4096)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Compile the op's picks for this file's shapes and M values in parallel, before the first test
    loads one (the pinned SPLIT_K kernel compiles on first use)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", op.UntunedShapeWarning)
        results = op.precompile([Problem(n=n, k=k) for k, n in LLAMA2_7B + SMALL_SHAPES], ODD_M + SMALL_M)
    for (problem, schedule), error in results.items():
        if error:   # the test that runs it fails and says more
            warnings.warn(f"precompiling {schedule.name} for {problem.name} failed: {error}")


@functools.lru_cache(maxsize=None)
def quantized(k: int, n: int, group: int = 128):
    """(codes, scales, packed weight, packed scales) of a random W[K, N], on the GPU."""
    torch.manual_seed(k * 7 + n)
    codes, scales = quantize_rtn(torch.randn(k, n, device="cuda"), group)
    return (codes, scales, *marlin_mma.pack(codes, scales))


def run_op(x, k, n, group=128):
    _, _, qweight, packed_scales = quantized(k, n, group)
    return w4a16_gemm(x, qweight, packed_scales, n, k, group)


def check(out, x, k, n, group=128):
    codes, scales, _, _ = quantized(k, n, group)
    ref = reference_matmul(x.reshape(-1, k), codes, scales).reshape(*x.shape[:-1], n)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = relative_error(out, ref)
    assert err < TOLERANCE, f"relative error {err:.2e} for x {tuple(x.shape)}, K={k}, N={n}"


class PinnedTable:
    """A tuned table that names one schedule for everything."""

    def __init__(self, schedule):
        self.schedule = schedule

    def lookup(self, problem, m):
        return self.schedule


@pytest.fixture
def pinned_split_k(monkeypatch):
    monkeypatch.setattr(op, "_tuned_table", lambda device: PinnedTable(SPLIT_K))
    monkeypatch.setattr(op, "_LAUNCHERS", {})


# --- the op --------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, n", LLAMA2_7B, ids=[f"{k}x{n}" for k, n in LLAMA2_7B])
@pytest.mark.parametrize("m", ODD_M)
def test_op_matches_reference(k, n, m):
    for _ in range(2):   # a second call with new inputs finds any split-K workspace zeroed again
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        check(run_op(x, k, n), x, k, n)


def test_pinned_split_k_schedule_matches_reference(pinned_split_k):
    k, n = GRAPH_SHAPE
    for m in (1, 17, 3, 17):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        check(run_op(x, k, n), x, k, n)
    assert op._launcher(torch.device("cuda", torch.cuda.current_device()), Problem(n=n, k=k), op.DEFAULT_LAYOUT,
                        32).schedule == SPLIT_K


def test_leading_dims_and_non_contiguous_input():
    k, n = GRAPH_SHAPE
    x = torch.randn(2, 3, 2 * k, dtype=torch.float16, device="cuda")[..., ::2]
    assert not x.is_contiguous()
    check(run_op(x, k, n), x, k, n)
    check(run_op(x.transpose(0, 1), k, n), x.transpose(0, 1), k, n)


def test_empty_input_gives_empty_output():
    k, n = GRAPH_SHAPE
    out = run_op(torch.empty(0, 5, k, dtype=torch.float16, device="cuda"), k, n)
    assert out.shape == (0, 5, n)


def test_weights_on_another_device_are_refused():
    k, n = 512, 512
    codes, scales, qweight, packed_scales = quantized(k, n)
    x = torch.randn(4, k, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="packed weight is on cpu"):
        w4a16_gemm(x, qweight.cpu(), packed_scales, n, k, 128)


def test_workspace_grows_stays_zero_and_is_per_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        partials, counters = split_k_workspace(device, 1000, 10)
        assert partials.numel() >= 1000 and counters.numel() >= 10
        assert split_k_workspace(device, 500, 5)[0].data_ptr() == partials.data_ptr()
        bigger, more = split_k_workspace(device, partials.numel() + 1, counters.numel() + 1)
        assert bigger.numel() > partials.numel() and more.numel() > counters.numel()
        assert not bigger.any() and not more.any()
    other, _ = split_k_workspace(device, 1000, 10)
    assert other.data_ptr() not in (partials.data_ptr(), bigger.data_ptr())


# --- CUDA graphs and torch.compile ---------------------------------------------------------------

def _capture(k, n, static_x):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run_op(static_x, k, n)
    return graph, static_y


@pytest.mark.parametrize("schedule", ["op's pick", "split-K"])
def test_cuda_graph_replays_with_new_inputs(schedule, request):
    if schedule == "split-K":
        request.getfixturevalue("pinned_split_k")
    k, n = GRAPH_SHAPE
    # Three graphs of one capture stream, replayed in another order than captured: each must find
    # its split-K workspace zeroed on its first replay.
    static = {m: torch.randn(m, k, dtype=torch.float16, device="cuda") for m in (1, 17, 3)}
    side = torch.cuda.Stream()   # warm up outside the capture, as torch's CUDA-graph docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in static.values():
            run_op(x, k, n)
    torch.cuda.current_stream().wait_stream(side)
    graphs = {m: _capture(k, n, x) for m, x in static.items()}
    for m in (3, 17, 1, 3, 17):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        static[m].copy_(x)
        graph, static_y = graphs[m]
        graph.replay()
        check(static_y, x, k, n)
        eager_x = torch.randn(5, k, dtype=torch.float16, device="cuda")
        check(run_op(eager_x, k, n), eager_x, k, n)   # eager calls between replays


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = QuantLinear.from_linear(nn.Linear(512, 1408, bias=True).half().cuda())
        self.down = QuantLinear.from_linear(nn.Linear(1408, 512, bias=False).half().cuda())

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x))) + x


def test_torch_compile_fullgraph_matches_eager():
    mlp = Mlp()
    compiled = torch.compile(mlp, fullgraph=True)
    with torch.no_grad():
        for m in (8, 3, 8):
            x = torch.randn(m, 512, dtype=torch.float16, device="cuda")
            want = mlp(x)
            got = compiled(x)
            assert got.shape == want.shape and relative_error(got, want.float()) < 1e-3


# --- GPTQ ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_checkpoint_multiplies_correctly(checkpoint_format):
    from test_gptq import gptq_tensors   # the on-disk layout, built with plain loops

    k, n = 512, 512
    codes, scales, _, _ = quantized(k, n)
    tensors = {name: t.cuda() for name, t in gptq_tensors(codes.cpu(), scales.cpu(), checkpoint_format=checkpoint_format).items()}
    bias = torch.randn(n, dtype=torch.float16, device="cuda")
    layer = QuantLinear.from_gptq(**tensors, bias=bias, group_size=128, checkpoint_format=checkpoint_format)
    x = torch.randn(8, k, dtype=torch.float16, device="cuda")
    want = reference_matmul(x, codes, scales) + bias.float()
    assert relative_error(layer(x), want) < TOLERANCE


# --- a small Llama -------------------------------------------------------------------------------

def greedy(model, prompt, steps):
    """Greedy decoding with the KV cache: one prefill, then one token per step."""
    out = model(input_ids=prompt, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(steps - 1):
        out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([prompt, *tokens], dim=1)


def test_small_llama_matches_its_fake_quantized_twin():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA))
    model = model.to(device="cuda", dtype=torch.float16).eval()
    twin = copy.deepcopy(model)
    replace_linear(model, group_size=128)
    names = [name for name, module in model.named_modules() if isinstance(module, QuantLinear)]
    assert len(names) == 14 and isinstance(model.lm_head, nn.Linear)
    for name in names:   # the twin runs plain fp16 matmuls on the dequantized weights
        codes, scales = model.get_submodule(name).unpack()
        twin.get_submodule(name).weight.data.copy_(dequantize(codes, scales).t())

    with torch.no_grad():
        batch = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 4), device="cuda")
        assert relative_error(model(batch).logits, twin(batch).logits.float()) < 1e-2

        prompt = torch.randint(0, SMALL_LLAMA["vocab_size"], (1, 8), device="cuda")
        steps = 32
        tokens, twin_tokens = greedy(model, prompt, steps), greedy(twin, prompt, steps)
        if not torch.equal(tokens, twin_tokens):
            # Greedy paths may part only where the twin itself is torn between two tokens: every
            # token chosen with INT4 kernels must be the twin's argmax or within a hair of it.
            logits = twin(tokens).logits[0, prompt.shape[1] - 1:-1].float()
            chosen = logits.gather(-1, tokens[0, prompt.shape[1]:, None]).squeeze(-1)
            margin = logits.max(-1).values - chosen
            assert (margin <= 0.02 * logits.std()).all(), f"largest margin {margin.max():.3g}"


# --- last: a misaligned input would be a fault, not an exception, if the op did not copy it -------

def test_misaligned_input_is_copied():
    k, n = GRAPH_SHAPE
    x = torch.randn(3 * k + 1, dtype=torch.float16, device="cuda")[1:].view(3, k)
    assert x.is_contiguous() and x.data_ptr() % 16
    check(run_op(x, k, n), x, k, n)
