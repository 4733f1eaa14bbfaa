"""Split-K workspaces: a zeroed fp32 buffer and zeroed int32 tile counters per (device, stream).

A split-K kernel adds its fp32 partial sums into the buffer, counts arriving blocks per output tile
and, as the last block of a tile, writes the output and zeroes what it used. So the buffers only
need zeroing once, when they are allocated, and any number of kernels on one stream can share them:
kernels on a stream run one after another. Two streams get two workspaces, so concurrent kernels
never mix their partial sums.

Workspaces only grow. An outgrown buffer is kept alive, never freed: a CUDA graph captured earlier
still writes to it on every replay, and freed memory would be handed to someone else.

Growing during a CUDA-graph capture (the capture stream's first use is usually inside the capture)
allocates from the graph's memory pool, and the zero-fill becomes a node of that graph, which has
not run when the capture ends. Until such a workspace has been zeroed outside a capture, every
capture that uses it also captures a zero-fill of the part it uses, so that any graph is right on
its first replay, in any order; the first use outside a capture zeroes it for good.
"""
from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()


class _Workspace:
    def __init__(self, partials: torch.Tensor, counters: torch.Tensor, zeroed: bool):
        self.partials = partials        # fp32 partial sums, [elements]
        self.counters = counters        # int32 arrival counters, one per output tile
        self.zeroed = zeroed            # True once known zero outside any graph


_WORKSPACES: dict[tuple[int, int], _Workspace] = {}
_OUTGROWN: list[torch.Tensor] = []      # kept alive for the graphs that may use them


def _capacity(needed: int, current: int) -> int:
    """Doubling growth keeps the outgrown buffers below the size of the live one."""
    return max(needed, 2 * current, 1024)


def split_k_workspace(device: torch.device, fp32_elems: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 buffer, int32 counters) on `device` for the current stream, at least the sizes asked,
    zero wherever a kernel will read them. No host synchronization; allocates only to grow."""
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.partials.numel() < fp32_elems or ws.counters.numel() < counters:
        ws = _grow(key, device, fp32_elems, counters)
    if not ws.zeroed:
        if torch.cuda.is_current_stream_capturing():
            ws.partials[:fp32_elems].zero_()
            ws.counters[:counters].zero_()
        else:
            ws.partials.zero_()
            ws.counters.zero_()
            ws.zeroed = True
    return ws.partials, ws.counters


def _grow(key: tuple[int, int], device: torch.device, fp32_elems: int, counters: int) -> _Workspace:
    with _LOCK:
        old = _WORKSPACES.get(key)
        if old is not None and old.partials.numel() >= fp32_elems and old.counters.numel() >= counters:
            return old  # another thread grew it meanwhile
        have_elems, have_counters = (old.partials.numel(), old.counters.numel()) if old else (0, 0)
        new = _Workspace(
            torch.zeros(_capacity(fp32_elems, have_elems), dtype=torch.float32, device=device),
            torch.zeros(_capacity(counters, have_counters), dtype=torch.int32, device=device),
            zeroed=not torch.cuda.is_current_stream_capturing(),
        )
        if old is not None:
            _OUTGROWN.extend((old.partials, old.counters))
        _WORKSPACES[key] = new
        return new
