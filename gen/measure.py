"""The one way tilemarlin times a kernel: CUDA-graph replays over weight copies that L2 cannot hold.

Each call site gets its own copy of the weights; the copies are captured round-robin into one CUDA
graph, so a replay streams every copy from HBM once and Python's launch overhead is not timed; a
spinning kernel ahead of each timed replay keeps the graph's own launch out of the interval too. The
result is the median over replays of (graph time / calls), in microseconds.

Back to back, a kernel that launches its successor early (programmatic launches) overlaps a replay
of itself. In a model a GEMM follows an elementwise kernel that does not release it early; the
"between" harness times that case: every call after the activations' producer, the producer's own
time taken off.
"""
from __future__ import annotations

import functools
import statistics
from typing import Callable

import torch


def copies_for(bytes_per_copy: int, device=None, min_copies: int = 2, max_copies: int = 256) -> int:
    """How many weight copies make the rotation at least 4x larger than the GPU's L2 cache."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    need = -(-4 * l2 // max(1, bytes_per_copy))
    return int(max(min_copies, min(max_copies, need)))


LAUNCH_COVER_CYCLES = 200_000   # ~0.1 ms at H200 clocks: far more than a graph launch takes


def time_calls(calls: list[Callable[[], object]], replays: int = 30, warmup: int = 3) -> float:
    """Median microseconds per call of `calls`, captured in order into one CUDA graph."""
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        # The GPU spins while the CPU enqueues the timed replay, so the interval holds the replay's
        # kernels only, not the launch latency or a CPU that is busy elsewhere (compiles run beside).
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return statistics.median(samples)


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
