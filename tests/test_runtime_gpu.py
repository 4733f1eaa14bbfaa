"""The runtime on a GPU: the op against the fp32 reference, CUDA graphs, torch.compile, GPTQ import and a
small Llama converted by replace_linear.

Inputs come from seeds fixed per case (printed on failure); the op's output block is filled with NaN
before each call (the op allocates its output itself: `run_op` fills the block torch's caching
allocator hands it next, and checks that the op got that block); outputs are compared with
tests/reference.py's `assert_matches_reference`, in relative norm and element by element.

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

import runtime.dispatch as dispatching
import runtime.op as op
from runtime import QuantLinear, replace_linear, w4a16_gemm
from runtime.table import BUCKETS, bucket_of
from runtime.workspace import split_k_workspace
from schedules import marlin_mma
from schedules.problem import Problem
from schedules.quant import dequantize, quantize_rtn, reference_matmul
from schedules.registry import Schedule
from tests.reference import assert_matches_reference, generator, int4_weights, poison_next_allocation, seed_of

pytestmark = pytest.mark.gpu

LLAMA2_7B = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]   # K x N
ODD_M = (1, 3, 17, 100, 257, 1024, 8192)
# The last M bucket is open: its kernel serves every M above its edge (long prefills). Checked just past
# the edge and at 16384, on the widest N (qkv) and the longest K (down).
LARGE_M = (BUCKETS[-1] + 1, 16384)
LARGE_M_SHAPES = [(4096, 12288), (11008, 4096)]
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
        warnings.simplefilter("ignore", dispatching.UntunedShapeWarning)
        results = op.precompile([Problem(n=n, k=k) for k, n in LLAMA2_7B], ODD_M + SMALL_M + LARGE_M)
        results.update(op.precompile([Problem(n=n, k=k) for k, n in SMALL_SHAPES], SMALL_M))
    for (problem, schedule), error in results.items():
        if error:   # the test that runs it fails and says more
            warnings.warn(f"precompiling {schedule.name} for {problem.name} failed: {error}")


def weight_seed(k: int, n: int, group: int = 128) -> int:
    return seed_of("weight", k, n, group)


@functools.lru_cache(maxsize=None)
def quantized(k: int, n: int, group: int = 128):
    """(codes, scales, packed weight, packed scales) of a random W[K, N] drawn from weight_seed, on the GPU."""
    codes, scales = quantize_rtn(torch.randn(k, n, device="cuda", generator=generator(weight_seed(k, n, group))), group)
    return (codes, scales, *marlin_mma.pack(codes, scales))


def randn(shape, gen):
    return torch.randn(shape, dtype=torch.float16, device="cuda", generator=gen)


def run_op(x, k, n, group=128, poison=True):
    """The op on x; with `poison`, the block its output gets was filled with NaN just before."""
    _, _, qweight, packed_scales = quantized(k, n, group)
    if not poison:
        return w4a16_gemm(x, qweight, packed_scales, n, k, group)
    poisoned = poison_next_allocation((*x.shape[:-1], n), x.dtype, x.device)
    out = w4a16_gemm(x, qweight, packed_scales, n, k, group)
    assert out.numel() == 0 or out.data_ptr() == poisoned, "the op's output is not the NaN-filled block"
    return out


def check(out, x, k, n, context, group=128):
    """out against the fp32 reference of x @ dequant(W[K, N]); `context` names the case and its seed."""
    codes, scales, _, _ = quantized(k, n, group)
    ref = reference_matmul(x.reshape(-1, k), codes, scales).reshape(*x.shape[:-1], n)
    assert out.dtype == x.dtype, f"{context}: output {out.dtype} for x {x.dtype}"
    assert_matches_reference(out, ref, context=f"{context}; x {tuple(x.shape)}, K={k}, N={n}, "
                                               f"W seed={weight_seed(k, n, group)}")


class PinnedTable:
    """A tuned table that names one schedule for everything."""

    def __init__(self, schedule):
        self.schedule = schedule

    def lookup(self, problem, m):
        return self.schedule


@pytest.fixture
def pinned_split_k(monkeypatch):
    monkeypatch.setattr(dispatching, "_tuned_table", lambda device: PinnedTable(SPLIT_K))
    monkeypatch.setattr(op, "_LAUNCHERS", {})


# --- the op --------------------------------------------------------------------------------------

def check_op(k, n, m, seed):
    gen = generator(seed)
    for call in range(2):   # a second call with new inputs finds any split-K workspace zeroed again
        x = randn((m, k), gen)
        check(run_op(x, k, n), x, k, n, f"call {call}, inputs drawn in turn from seed={seed}")


@pytest.mark.parametrize("k, n", LLAMA2_7B, ids=[f"{k}x{n}" for k, n in LLAMA2_7B])
@pytest.mark.parametrize("m", ODD_M)
def test_op_matches_reference(k, n, m):
    check_op(k, n, m, seed_of("op", k, n, m))


@pytest.mark.parametrize("k, n", LARGE_M_SHAPES, ids=[f"{k}x{n}" for k, n in LARGE_M_SHAPES])
@pytest.mark.parametrize("m", LARGE_M)
def test_op_matches_reference_in_the_open_last_bucket(k, n, m):
    assert m > BUCKETS[-1] and bucket_of(m) == BUCKETS[-1]
    check_op(k, n, m, seed_of("op", k, n, m))


def test_pinned_split_k_schedule_matches_reference(pinned_split_k):
    k, n = GRAPH_SHAPE
    seed = seed_of("pinned split-K", k, n)
    gen = generator(seed)
    for m in (1, 17, 3, 17):
        x = randn((m, k), gen)
        check(run_op(x, k, n), x, k, n, f"M={m}, inputs drawn in turn from seed={seed}")
    assert op._launcher(torch.device("cuda", torch.cuda.current_device()), Problem(n=n, k=k), op.DEFAULT_LAYOUT,
                        32).schedule == SPLIT_K


def test_leading_dims_and_non_contiguous_input():
    k, n = GRAPH_SHAPE
    seed = seed_of("leading dims", k, n)
    x = randn((2, 3, 2 * k), generator(seed))[..., ::2]
    assert not x.is_contiguous()
    check(run_op(x, k, n), x, k, n, f"seed={seed}")
    check(run_op(x.transpose(0, 1), k, n), x.transpose(0, 1), k, n, f"transposed, seed={seed}")


def test_empty_input_gives_empty_output():
    k, n = GRAPH_SHAPE
    out = run_op(torch.empty(0, 5, k, dtype=torch.float16, device="cuda"), k, n)
    assert out.shape == (0, 5, n)


def test_weights_on_another_device_are_refused():
    k, n = 512, 512
    codes, scales, qweight, packed_scales = quantized(k, n)
    x = randn((4, k), generator(seed_of("refused", k, n)))
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
        static_y = run_op(static_x, k, n, poison=False)   # poisoned before each replay instead
    return graph, static_y


@pytest.mark.parametrize("schedule", ["op's pick", "split-K"])
def test_cuda_graph_replays_with_new_inputs(schedule, request):
    if schedule == "split-K":
        request.getfixturevalue("pinned_split_k")
    k, n = GRAPH_SHAPE
    seed = seed_of("graph", schedule, k, n)
    gen = generator(seed)
    # Three graphs of one capture stream, replayed in another order than captured: each must find
    # its split-K workspace zeroed on its first replay.
    static = {m: randn((m, k), gen) for m in (1, 17, 3)}
    side = torch.cuda.Stream()   # warm up outside the capture, as torch's CUDA-graph docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in static.values():
            run_op(x, k, n)
    torch.cuda.current_stream().wait_stream(side)
    graphs = {m: _capture(k, n, x) for m, x in static.items()}
    for step, m in enumerate((3, 17, 1, 3, 17)):
        context = f"step {step}, inputs drawn in turn from seed={seed}"
        x = randn((m, k), gen)
        static[m].copy_(x)
        graph, static_y = graphs[m]
        static_y.fill_(float("nan"))
        graph.replay()
        check(static_y, x, k, n, f"replay of M={m}, {context}")
        eager_x = randn((5, k), gen)
        check(run_op(eager_x, k, n), eager_x, k, n, f"eager call, {context}")   # eager calls between replays


class Mlp(nn.Module):
    SEED = 0

    def __init__(self):
        super().__init__()
        torch.manual_seed(self.SEED)
        self.up = QuantLinear.from_linear(nn.Linear(512, 1408, bias=True).half().cuda())
        self.down = QuantLinear.from_linear(nn.Linear(1408, 512, bias=False).half().cuda())

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x))) + x


def test_torch_compile_fullgraph_matches_eager():
    mlp = Mlp()
    compiled = torch.compile(mlp, fullgraph=True)
    seed = seed_of("torch.compile")
    gen = generator(seed)
    with torch.no_grad():
        for m in (8, 3, 8):
            x = randn((m, 512), gen)
            want = mlp(x)
            got = compiled(x)
            assert_matches_reference(got, want.float(), rel_tol=1e-3,
                                     context=f"M={m}, weights seed={Mlp.SEED}, inputs drawn in turn from seed={seed}")


# --- GPTQ ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_checkpoint_multiplies_correctly(checkpoint_format):
    from tests.checkpoint_writers import gptq_tensors, layer_of   # the on-disk layout, from its definition

    k, n = 512, 512
    codes, scales, _, _ = quantized(k, n)
    written = gptq_tensors(layer_of(codes.cpu(), scales.cpu()), checkpoint_format)
    tensors = {name: t.cuda() for name, t in written.items()}
    seed = seed_of("gptq", checkpoint_format)
    gen = generator(seed)
    bias = randn((n,), gen)
    layer = QuantLinear.from_gptq(**tensors, bias=bias, group_size=128, checkpoint_format=checkpoint_format)
    x = randn((8, k), gen)
    want = reference_matmul(x, codes, scales) + bias.float()
    # the kernel's output gets the NaN-filled block (run_op's reasoning); a NaN survives the bias add
    poison_next_allocation((8, n), x.dtype, x.device)
    assert_matches_reference(layer(x), want, context=f"seed={seed}, W seed={weight_seed(k, n)}")


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
    seed = 0
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA))
    model = model.to(device="cuda", dtype=torch.float16).eval()
    twin = copy.deepcopy(model)
    replace_linear(model, group_size=128)
    weights = int4_weights(model)   # q/k/v and gate/up fused, their columns read back per layer
    assert len(weights) == 14 and isinstance(model.lm_head, nn.Linear)
    for name, (codes, scales) in weights.items():   # the twin runs plain fp16 matmuls on the dequantized weights
        twin.get_submodule(name).weight.data.copy_(dequantize(codes, scales).t())

    gen = generator(seed)
    with torch.no_grad():
        batch = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 4), device="cuda", generator=gen)
        # model-level: the twin's fp16 GEMMs round differently, about 1e-3 of the logits' scale
        assert_matches_reference(model(batch).logits, twin(batch).logits.float(), rel_tol=1e-2, elem_tol=2e-2,
                                 context=f"model and inputs from seed={seed}")

        prompt = torch.randint(0, SMALL_LLAMA["vocab_size"], (1, 8), device="cuda", generator=gen)
        steps = 32
        tokens, twin_tokens = greedy(model, prompt, steps), greedy(twin, prompt, steps)
        if not torch.equal(tokens, twin_tokens):
            # Greedy paths may part only where the twin itself is torn between two tokens: every
            # token chosen with INT4 kernels must be the twin's argmax or within a hair of it.
            logits = twin(tokens).logits[0, prompt.shape[1] - 1:-1].float()
            chosen = logits.gather(-1, tokens[0, prompt.shape[1]:, None]).squeeze(-1)
            margin = logits.max(-1).values - chosen
            assert (margin <= 0.02 * logits.std()).all(), f"largest margin {margin.max():.3g} (seed={seed})"


def test_a_fused_llama_runs_one_gemm_per_set_in_cuda_graphs_and_compiled():
    """replace_linear fuses q/k/v and gate/up (runtime/fuse.py): the same logits as the layers apart,
    one GEMM per set and forward, replayed by a CUDA graph, and the fused MLP traced in one graph."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA)).to("cuda", torch.float16).eval()
    apart = replace_linear(copy.deepcopy(model), group_size=128, fuse=False)
    replace_linear(model, group_size=128)
    fused = [m for m in model.modules() if isinstance(m, QuantLinear) and m.out_features in (3 * 512, 2 * 1408)]
    assert len(fused) == 2 * SMALL_LLAMA["num_hidden_layers"]
    calls = []
    for layer in fused:
        layer.register_forward_hook(lambda *args: calls.append(1))
    seed = seed_of("fused llama")
    tokens = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 5), device="cuda", generator=generator(seed))
    with torch.no_grad():
        want = apart(tokens, use_cache=False).logits.float()
        assert_matches_reference(model(tokens, use_cache=False).logits, want, rel_tol=1e-3,
                                 context=f"fused against apart, tokens from seed={seed}")
        assert len(calls) == len(fused)
        graph = torch.cuda.CUDAGraph()
        model(tokens, use_cache=False)   # warm-up before the capture
        with torch.cuda.graph(graph):
            captured = model(tokens, use_cache=False).logits
        tokens.copy_(torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 5), device="cuda", generator=generator(seed + 1)))
        graph.replay()
        assert_matches_reference(captured, apart(tokens, use_cache=False).logits.float(), rel_tol=1e-3,
                                 context=f"graph replay, tokens from seed={seed + 1}")
        mlp = model.model.layers[0].mlp
        x = randn((3, 512), generator(seed))
        assert_matches_reference(torch.compile(mlp, fullgraph=True)(x), mlp(x).float(), rel_tol=1e-3,
                                 context=f"compiled fused MLP, x from seed={seed}")


# --- last: a misaligned input would be a fault, not an exception, if the op did not copy it -------

def test_misaligned_input_is_copied():
    k, n = GRAPH_SHAPE
    seed = seed_of("misaligned", k, n)
    x = randn((3 * k + 1,), generator(seed))[1:].view(3, k)
    assert x.is_contiguous() and x.data_ptr() % 16
    check(run_op(x, k, n), x, k, n, f"seed={seed}")
