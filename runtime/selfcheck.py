"""A kernel's first run on a GPU is a check against the fp32 reference.

The tuner checks every candidate before timing it, but a served kernel may have been built elsewhere
(a shipped table's choice, rebuilt by another CUDA toolkit) or chosen without a tune (the fallback).
So the first time a kernel runs on a GPU model with this torch and CUDA, the op runs it once on seeded
random weights and activations at its bucket's M and compares with schedules.quant.problem_reference,
before it serves any request. The check costs one kernel call, one dequantization, one fp32 matmul,
and the drawing and packing of its inputs, all on the GPU. A passing kernel gets a stamp in its
store folder (`verified/<gpu and versions>`), so later processes skip the check; in a read-only store
the check simply runs again in each process.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from schedules.problem import Problem
from schedules.quant import kernel_activations, mismatch, problem_reference, torch_dtype
from schedules.registry import Schedule

from .op import launch_schedule

SEED = 20261202
LARGEST_CHECKED_M = 4096       # the open last bucket is checked at its lower edge's neighbour


class KernelCheckError(RuntimeError):
    """A kernel disagreed with the reference on its first run."""


def stamp_path(folder: Path, device: torch.device) -> Path:
    name = torch.cuda.get_device_name(device).replace(" ", "-").replace("/", "-")
    return folder / "verified" / f"{name}_torch-{torch.__version__}_cuda-{torch.version.cuda}.json"


def check_once(kernel, problem: Problem, schedule: Schedule, bucket: int, device: torch.device) -> None:
    """Raise KernelCheckError unless the kernel matches the reference (or was checked here before)."""
    stamp = stamp_path(kernel.folder, device)
    if stamp.is_file():
        return
    why = run_check(kernel, problem, schedule, min(bucket, LARGEST_CHECKED_M), device)
    if why:
        raise KernelCheckError(f"{schedule.name} for {problem.name} at M={bucket} on "
                               f"{torch.cuda.get_device_name(device)}: {why}")
    try:
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(json.dumps({"problem": problem.name, "schedule": schedule.to_dict(), "m": bucket}))
    except OSError:       # a read-only store: check again in the next process
        pass


def run_check(kernel, problem: Problem, schedule: Schedule, m: int, device: torch.device) -> str | None:
    """Why the kernel's output at M = m differs from the reference, or None."""
    # drawn and packed on the device: on the host, packing a Llama-size layer takes most of a second
    gen = torch.Generator(device=device).manual_seed(SEED)
    dtype = torch_dtype(problem.dtype)
    codes = torch.randint(0, 16, (problem.k, problem.n), generator=gen, dtype=torch.uint8, device=device)
    scales = (torch.rand((problem.num_groups, problem.n), generator=gen, device=device) * 0.02 + 0.001).to(dtype)
    a = torch.randn((m, problem.k), generator=gen, device=device).to(dtype)
    zeros = torch.randint(0, 16, scales.shape, generator=gen, device=device) if problem.zero_points else None
    qweight, packed_scales = schedule.module.pack(codes, scales, zeros)
    out = torch.full((m, problem.n), float("nan"), dtype=dtype, device=device)
    launch_schedule(kernel, schedule, problem, kernel_activations(problem, a), qweight, packed_scales, out)
    return mismatch(out, problem_reference(problem, a, codes, scales, zeros), problem.dtype)
