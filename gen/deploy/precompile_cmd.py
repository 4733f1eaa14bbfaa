"""`gen precompile`: build ahead of time every kernel a model's linear layers will run.

    gen precompile --model llama-2-7b                      # this GPU: all 13 M buckets
    gen precompile --model llama-3-70b --tp 4 --buckets 1,2,4,8,16
    gen precompile --shapes 4096x4096 --arch sm_90a        # no GPU needed: nvcc builds for the arch
    gen precompile --model llama-2-7b --arch sm_90a --dry-run
    gen precompile --model llama-2-7b --act fp8             # W4A8: its GEMMs and activation kernels

The kernels are the op's own choices (runtime/precompile.py `plan`: the tuned table's winner of each
(problem, bucket), else the fallback's pick), and the activation kernels beside them (W4A8's FP8
quantizer and rounding, act-order's gather and gathering norm, per K), built into the compiled-kernel
store in parallel worker processes; kernels already there are skipped. Serving then loads them without compiling, and
`gen export` packs them for other machines.
"""
from __future__ import annotations

import sys
import time

from gen.deploy.targets import add_arguments, deployment_from_args
from gen.tune.options import positive_workers


def register(subparsers) -> None:
    p = subparsers.add_parser("precompile", help="build every kernel a model's layers will run, ahead of serving",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--workers", type=positive_workers, help="parallel compile processes (default: one per CPU core)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the kernels and whether the store has them; build nothing")
    p.set_defaults(func=run)


def run(args) -> int:
    from runtime.kernels import ActivationJob, job_stored, kernel_dir
    from runtime.precompile import build_missing

    try:
        deployment = deployment_from_args(args)
        planned = deployment.plan()
    except ValueError as exc:
        print(f"gen precompile: {exc}", file=sys.stderr)
        return 2
    arch = deployment.dispatch.arch
    labels = deployment.labels()
    jobs = [*planned, *(ActivationJob(*kernel) for kernel in deployment.activation_kernels())]
    stored = {job for job in jobs if job_stored(job, arch)}

    def label(job) -> str:
        if isinstance(job, ActivationJob):
            return activation_label((job.kind, job.k, job.dtype))
        problem, schedule = job
        return f"{labels[problem]}  {schedule.name}"

    print(summary_line(deployment, planned))
    if args.dry_run:
        for job in jobs:
            status = "in store" if job in stored else "to build"
            served = f"  {served_text(planned[job])}" if job in planned else ""
            print(f"  {status}  {label(job)}{served}")
        print(f"would build {len(jobs) - len(stored)}, {len(stored)} already in the store ({kernel_dir()})")
        return 0

    started, done = time.monotonic(), [0]
    to_build = len(jobs) - len(stored)

    def progress(job, error) -> None:
        done[0] += 1
        status = "built" if error is None else f"FAILED: {error}"
        print(f"[{done[0]}/{to_build}] {time.monotonic() - started:6.1f}s  {label(job)}  {status}", flush=True)

    results = build_missing(jobs, arch, args.workers, progress)
    failed = {job: error for job, error in results.items() if error}
    print(f"{to_build - len(failed)} built, {len(stored)} already in the store, {len(failed)} failed ({kernel_dir()})")
    for job, error in failed.items():
        print(f"  failed: {label(job)}: {error}", file=sys.stderr)
    return 1 if failed else 0


def activation_label(kernel: tuple[str, int, str]) -> str:
    """How a (kind, K, dtype) activation kernel is named in the listings."""
    from runtime.kernels import ACTIVATION_KERNELS

    kind, k, dtype = kernel
    return f"{ACTIVATION_KERNELS[kind][1]}, K = {k}, {dtype} input"


def summary_line(deployment, planned: dict) -> str:
    """'4 problems x 13 buckets on <GPU>: 17 kernels (48 pairs tuned, 4 chosen by the fallback)'."""
    pairs = [how for served in planned.values() for _, how in served]
    untuned = sum(how is not None for how in pairs)
    problems = len(deployment.targets)
    activations = len(deployment.activation_kernels())
    return (f"{problems} problem{'s' * (problems != 1)} x {len(deployment.buckets)} buckets on "
            f"{deployment.describe()}: {len(planned)} kernels ({len(pairs) - untuned} pairs tuned, "
            f"{untuned} chosen by the fallback)" + (f" and {activations} activation kernels" if activations else ""))


def served_text(served: list) -> str:
    """'buckets 1,2,4 (tuned)' or '... (fallback)', per how each bucket was chosen."""
    parts = []
    for kind in ("tuned", "fallback"):
        buckets = [str(b) for b, how in served if (how is None) == (kind == "tuned")]
        if buckets:
            parts.append(f"buckets {','.join(buckets)} ({kind})")
    return "; ".join(parts)
