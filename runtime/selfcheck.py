"""A kernel's first run on a GPU is a check against the fp32 reference.

The tuner checks every candidate before timing it, but a served kernel may have been built elsewhere
(a shipped table's choice, rebuilt by another CUDA toolkit) or chosen without a tune (the fallback).
So the first time a kernel serves a bucket on a GPU model with this torch and CUDA, the op runs it once
on seeded random weights and activations and compares with schedules.quant.problem_reference, before
it serves any request of that bucket. The M checked is a ragged one of the bucket (`checked_m`: the
last tile part full), so that the kernel's bounds on M are checked as well as its full tiles. The
check costs one kernel call, one dequantization, one float64 matmul (which no TF32 or autocast
setting of the caller rounds), and the drawing and packing of its inputs, all on the GPU. A passing kernel gets a stamp
per M checked in its store folder (`verified/<gpu and versions>_m<M>.json`), so later processes skip
the check; in a read-only store the check simply runs again in each process.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from schedules.problem import Problem
from schedules.quant import kernel_activations, mismatch, problem_reference, torch_dtype
from schedules.registry import Schedule

from .launch import launch_schedule
from .table import bucket_range

SEED = 20261202


class KernelCheckError(RuntimeError):
    """A kernel disagreed with the reference on its first run."""


def checked_m(bucket: int) -> int:
    """The M a bucket's kernel is checked at: one below the bucket's edge where the bucket holds it (a
    partial last tile for any tile height that divides the edge), the edge itself for buckets 1 and
    2, and one past the edge for the open last bucket, which serves every larger M."""
    low, high = bucket_range(bucket)
    if high is None:
        return bucket + 1
    return high - 1 if high - 1 >= low else high


def stamp_path(folder: Path, device: torch.device, m: int) -> Path:
    name = torch.cuda.get_device_name(device).replace(" ", "-").replace("/", "-")
    return folder / "verified" / f"{name}_torch-{torch.__version__}_cuda-{torch.version.cuda}_m{m}.json"


def is_verified(kernel, bucket: int, device: torch.device) -> bool:
    """Whether the kernel passed its check for this bucket on this GPU model (here or before)."""
    return stamp_path(kernel.folder, device, checked_m(bucket)).is_file()


def check_once(kernel, problem: Problem, schedule: Schedule, bucket: int, device: torch.device) -> None:
    """Raise KernelCheckError unless the kernel matches the reference at the bucket's checked_m (or was
    checked so here before)."""
    m = checked_m(bucket)
    stamp = stamp_path(kernel.folder, device, m)
    if stamp.is_file():
        return
    why = run_check(kernel, problem, schedule, m, device)
    if why:
        raise KernelCheckError(f"{schedule.name} for {problem.name} at M={m} (bucket {bucket}) on "
                               f"{torch.cuda.get_device_name(device)}: {why}")
    try:
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(json.dumps({"problem": problem.name, "schedule": schedule.to_dict(), "m": m}))
    except OSError:       # a read-only store: check again in the next process
        pass


def run_check(kernel, problem: Problem, schedule: Schedule, m: int, device: torch.device) -> str | None:
    """Why the kernel's output at M = m differs from the reference, or None. Runs with the caller's
    autocast off (it is thread-local and would reach the packing and the reference), and computes the
    reference in float64, which no TF32 setting rounds."""
    with torch.autocast(device.type, enabled=False):
        return _compare(kernel, problem, schedule, m, device)


def _compare(kernel, problem: Problem, schedule: Schedule, m: int, device: torch.device) -> str | None:
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
    reference = problem_reference(problem, a, codes, scales, zeros, precision=torch.float64)
    return mismatch(out, reference, problem.dtype)
