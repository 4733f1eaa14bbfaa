"""The one way tilemarlin times a kernel: CUDA-graph replays over weight copies that L2 cannot hold.

Each call site gets its own copy of the weights; the copies are captured round-robin into one CUDA
graph, so a replay streams every copy from HBM once and Python's launch overhead is not timed; a
spinning kernel ahead of each timed replay keeps the graph's own launch out of the interval too. The
result is the median over replays of (graph time / calls), in microseconds.

Back to back, a kernel that launches its successor early (programmatic launches) overlaps a replay
of itself. In a model a GEMM follows an elementwise kernel that does not release it early; the
"between" harness times that case: every call after the activations' producer, the producer's own
time taken off.

The problem side of the harness is shared too: `gen tune` and `gen bench` draw their random weights
with random_weights, rotate through weight_copies of each kernel's format, and time the FP16 baseline
(torch.matmul on the same dequantized weights, Fp16Baseline) beside the INT4 kernels in the same run.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from schedules.quant import dequantize, torch_dtype


def copies_for(bytes_per_copy: int, device=None, min_copies: int = 2, max_copies: int = 256) -> int:
    """How many weight copies make the rotation at least 4x larger than the GPU's L2 cache."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    need = -(-4 * l2 // max(1, bytes_per_copy))
    return int(max(min_copies, min(max_copies, need)))


def weight_copies(tensors: tuple) -> list[tuple]:
    """`tensors` (one kernel's weights in its own format) and clones of them, copies_for their bytes
    in all: a call per copy, captured in turn, reads every copy from HBM, as a model's layers do.
    The first copy is `tensors` itself (the one a caller checks against the reference)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies_for(nbytes) - 1)]


def random_weights(problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Random INT4 weights of `problem` (a schedules.problem.Problem) on the GPU: codes uint8 [K, N]
    and scales [K / group, N] in the activation dtype, drawn from torch's generator as it stands
    (the caller seeds it)."""
    codes = torch.randint(0, 1 << problem.bits, (problem.k, problem.n), dtype=torch.uint8, device="cuda")
    # Positive scales of ~1/100 keep the outputs of K-long sums of O(1) activations well inside fp16 and bf16.
    scales = (torch.rand(problem.num_groups, problem.n, device="cuda") * 0.01 + 0.005).to(torch_dtype(problem.dtype))
    return codes, scales


def random_zero_points(problem) -> torch.Tensor | None:
    """Zero points over the whole code range for a problem that has them ([K / group, N] on the GPU,
    from torch's generator as it stands), else None."""
    if not problem.zero_points:
        return None
    return torch.randint(0, 1 << problem.bits, (problem.num_groups, problem.n), device="cuda")


class Fp16Baseline:
    """torch.matmul on the dequantized weights (the values the INT4 kernels compute with) in the
    activation dtype, in weight_copies: the time every INT4 kernel is compared with, timed in the
    same run because FP16's own time moves a few per cent between runs."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bits: int = 4, dtype=torch.float16):
        weight = dequantize(codes, scales, bits).to(dtype)
        self.copies = [w for (w,) in weight_copies((weight,))]

    def calls(self, x: torch.Tensor, out: torch.Tensor | None = None) -> list[Callable[[], object]]:
        """One torch.matmul of activations `x` [M, K] per weight copy: into `out` when given (as the
        INT4 candidates of `gen tune` write theirs), else into a fresh output per call (as the
        kernels of `gen bench` return theirs)."""
        return [functools.partial(torch.matmul, x, w, out=out) for w in self.copies]


LAUNCH_COVER_CYCLES = 200_000   # ~0.1 ms at H200 clocks: far more than a graph launch takes


def capture_graph(calls: list[Callable[[], object]], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """`calls` captured in order into one CUDA graph, after a first run of each and `warmup` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:          # first calls outside the graph: lazy init, allocations
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Capture on the warm-up stream: per-stream state made there (split-K workspaces, zeroed once)
    # is what the graph then uses, as in serving, instead of set-up work captured into every replay.
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    return graph


def _timed_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds that `replays` back-to-back replays of `graph` take on the GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # The GPU spins while the CPU enqueues the timed replays, so the interval holds the replays'
    # kernels only, not the launch latency or a CPU that is busy elsewhere (compiles run beside).
    torch.cuda._sleep(LAUNCH_COVER_CYCLES)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_calls(calls: list[Callable[[], object]], replays: int = 30, warmup: int = 3) -> float:
    """Median microseconds per call of `calls`, captured in order into one CUDA graph."""
    graph = capture_graph(calls, warmup)
    samples = [_timed_replays(graph, 1) * 1000.0 / len(calls) for _ in range(replays)]
    del graph
    return statistics.median(samples)


SUSTAIN_CHUNK_S = 0.05   # replays enqueued between two reads of the clock


def time_sustained(calls: list[Callable[[], object]], seconds: float, nvml=None) -> dict:
    """`calls` replayed back to back for `seconds`, as a long prefill keeps the GPU busy, so that the
    board's power controller settles on the clock this load holds: {"us": microseconds per call over
    the whole run, "mj_per_call": the board's millijoules per call (NVML's energy counter, read
    around the run, which also holds the short spins between chunks, ~0.2 % of it), "sm_mhz": the
    median SM clock read between chunks}. Without `nvml` (a gen.bench.energy.Nvml) the last two are None."""
    graph = capture_graph(calls)
    chunk = max(1, int(SUSTAIN_CHUNK_S * 1000.0 / _timed_replays(graph, 1)))
    busy_ms, replays, clocks = 0.0, 0, []
    energy_before = nvml.energy_mj() if nvml else None
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        busy_ms += _timed_replays(graph, chunk)
        replays += chunk
        if nvml:
            clocks.append(nvml.sm_mhz())
    per_call = replays * len(calls)
    mj = (nvml.energy_mj() - energy_before) / per_call if nvml else None
    del graph
    return {"us": busy_ms * 1000.0 / per_call, "mj_per_call": mj,
            "sm_mhz": statistics.median(clocks) if clocks else None}


PRODUCER_CALLS = 64   # the producer timed alone: enough back-to-back calls for a steady per-call time


def activation_producer(x: torch.Tensor) -> Callable[[], object]:
    """The kernel that writes a GEMM's activations in a model, as a call: x rewritten in place with
    the same values (x * 1 is exact), so that the GEMM reads what a kernel has just written."""
    return functools.partial(x.mul_, 1)


def after(produce: Callable[[], object], call: Callable[[], object]) -> Callable[[], object]:
    """`call` preceded by `produce`."""
    def produced_then_called():
        produce()
        return call()
    return produced_then_called


def time_producer(produce: Callable[[], object], replays: int = 30) -> float:
    """Median microseconds of the producer alone, back to back."""
    return time_calls([produce] * PRODUCER_CALLS, replays=replays)


def time_calls_between(calls: list[Callable[[], object]], x: torch.Tensor, replays: int = 30) -> float:
    """time_calls of each call after the producer of its activations `x`, less the producer's time."""
    produce = activation_producer(x)
    return time_calls([after(produce, call) for call in calls], replays=replays) - time_producer(produce, replays)


def hbm_read_bandwidth(gib: float = 2.0) -> float:
    """Measured HBM read bandwidth in bytes/s: a sum over `gib` GiB of fp32."""
    x = torch.ones(int(gib * (1 << 30)) // 4, device="cuda", dtype=torch.float32)
    out = torch.empty((), device="cuda", dtype=torch.float32)
    us = time_calls([lambda: torch.sum(x, dim=0, out=out)], replays=10)
    return x.numel() * 4 / (us * 1e-6)


def fp16_tensor_flops(n: int = 8192) -> float:
    """Measured FP16 tensor-core rate in flop/s: torch.matmul at n^3."""
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    us = time_calls([lambda: torch.matmul(a, b, out=c)], replays=10)
    return 2 * n ** 3 / (us * 1e-6)
