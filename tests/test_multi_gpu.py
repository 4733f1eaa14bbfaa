"""Layers on two GPUs of one process, as transformers' device_map="auto" spreads a model too large
for one GPU: each layer runs on the GPU that holds it, whichever device is current, against the fp32
reference of its own dequantized weights (NaN-poisoned outputs), and a call leaves the current device
as it found it. Skipped without two CUDA GPUs."""
import pytest
import torch
from torch import nn

from runtime import QuantLinear
from schedules.quant import problem_reference
from tests.reference import assert_matches_reference, generator, poison_next_allocation, seed_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

K, N = 4096, 4096
FORMS = ("symmetric", "zero_points", "act_order", "fp8")
# decode steps, a short prefill, and one past a bucket edge
MS = (1, 17, 257)


def _layer(form: str, device: torch.device) -> QuantLinear:
    """A seeded layer of `form` on `device` (act_order: a random permutation of x's columns)."""
    gen = generator(seed_of("multi-gpu layer", form), device=device)
    linear = nn.Linear(K, N, bias=False, device=device, dtype=torch.float16)
    linear.weight.data.copy_(torch.randn(N, K, device=device, generator=gen) * 0.02)
    layer = QuantLinear.from_linear(linear, zero_points=form == "zero_points", act="fp8" if form == "fp8" else "dtype")
    if form != "act_order":
        return layer
    ordered = QuantLinear(K, N, device=device, act_order=True)
    ordered.qweight.copy_(layer.qweight)
    ordered.scales.copy_(layer.scales)
    ordered.perm.copy_(torch.randperm(K, device=device, generator=gen).to(torch.int32))
    return ordered


def _reference(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    codes, scales = layer.unpack()
    if layer.perm is not None:
        x = x[:, layer.perm.long()]
    return problem_reference(layer.problem, x, codes, scales, layer.zeros())


@pytest.fixture(scope="module")
def layers():
    """{(form, device index): layer} for both GPUs, built while GPU 0 is current."""
    torch.cuda.set_device(0)
    return {(form, index): _layer(form, torch.device("cuda", index)) for form in FORMS for index in (0, 1)}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("current, held", [(0, 1), (1, 0)], ids=["current-0-layer-1", "current-1-layer-0"])
def test_a_layer_runs_on_its_own_gpu_whichever_is_current(layers, form, m, current, held):
    layer = layers[(form, held)]
    device = torch.device("cuda", held)
    seed = seed_of("multi-gpu x", form, m)
    x = torch.randn(m, K, dtype=torch.float16, device=device, generator=generator(seed, device=device))
    torch.cuda.set_device(current)
    try:
        poisoned = poison_next_allocation((m, N), x.dtype, device)
        with torch.no_grad():
            out = layer(x)
        torch.cuda.synchronize(device)
        assert torch.cuda.current_device() == current, "the call changed the current device"
        assert out.device == device and out.data_ptr() == poisoned, "the output is not the NaN-filled block"
        assert_matches_reference(out, _reference(layer, x),
                                 context=f"{form} layer on cuda:{held}, cuda:{current} current, M={m}, seed={seed}")
    finally:
        torch.cuda.set_device(0)


def test_each_gpu_serves_its_layers_in_one_model(layers):
    """Two layers in sequence on different GPUs, as a model split across them runs: x moves between
    them as accelerate's hooks move it, and the result matches the two references chained."""
    first, second = layers[("symmetric", 0)], layers[("symmetric", 1)]
    seed = seed_of("multi-gpu chain")
    x = torch.randn(8, K, dtype=torch.float16, device="cuda:0", generator=generator(seed, device="cuda:0"))
    torch.cuda.set_device(0)
    with torch.no_grad():
        hidden = first(x)
        moved = hidden.to("cuda:1")
        out = second(moved)
    assert torch.cuda.current_device() == 0 and out.device == torch.device("cuda", 1)
    assert_matches_reference(hidden, _reference(first, x), context=f"first layer, on cuda:0, seed={seed}")
    assert_matches_reference(out, _reference(second, moved), context=f"second layer, on cuda:1, seed={seed}")
