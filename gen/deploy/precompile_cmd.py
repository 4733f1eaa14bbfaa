"""`gen precompile`: build ahead of time every kernel a model's linear layers will run.

    gen precompile --model llama-2-7b                      # this GPU: all 13 M buckets
    gen precompile --model llama-3-70b --tp 4 --buckets 1,2,4,8,16
    gen precompile --shapes 4096x4096 --arch sm_90a        # no GPU needed: nvcc builds for the arch
    gen precompile --model llama-2-7b --arch sm_90a --dry-run
    gen precompile --model llama-2-7b --act fp8             # W4A8: its GEMMs and activation kernels

The kernels are the op's own choices (runtime/precompile.py `plan`: the tuned table's winner of each
(problem, bucket), else the fallback's pick), built into the compiled-kernel store in parallel worker
processes, and for W4A8 layers the per-token FP8 activation kernel of each K; kernels already there
are skipped. Serving then loads them without compiling, and
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
    from runtime.kernels import is_activation_kernel_stored, is_stored, kernel_dir
    from runtime.precompile import build_missing

    try:
        deployment = deployment_from_args(args)
    except ValueError as exc:
        print(f"gen precompile: {exc}", file=sys.stderr)
        return 2
    planned = deployment.plan()
    arch = deployment.dispatch.arch
    labels = deployment.labels()
    stored = {job for job in planned if is_stored(*job, arch)}
    activations = deployment.activation_kernels()
    missing_activations = [kernel for kernel in activations if not is_activation_kernel_stored(*kernel, arch)]
    print(summary_line(deployment, planned))
    if args.dry_run:
        for (problem, schedule), served in planned.items():
            status = "in store" if (problem, schedule) in stored else "to build"
            print(f"  {status}  {labels[problem]}  {schedule.name}  {served_text(served)}")
        for kernel in activations:
            status = "to build" if kernel in missing_activations else "in store"
            print(f"  {status}  {activation_label(kernel)}")
        print(f"would build {len(planned) - len(stored) + len(missing_activations)}, "
              f"{len(stored) + len(activations) - len(missing_activations)} already in the store ({kernel_dir()})")
        return 0

    started, done = time.monotonic(), [0]
    to_build = len(planned) - len(stored)

    def progress(job, error) -> None:
        done[0] += 1
        status = "built" if error is None else f"FAILED: {error}"
        print(f"[{done[0]}/{to_build}] {time.monotonic() - started:6.1f}s  {labels[job[0]]}  {job[1].name}  {status}",
              flush=True)

    results = build_missing(list(planned), arch, args.workers, progress)
    failed = {job: error for job, error in results.items() if error}
    if missing_activations:
        print(f"building {len(missing_activations)} activation kernels", flush=True)
        activation_failures = build_activation_kernels(missing_activations, arch)
    else:
        activation_failures = {}
    built = len(planned) - len(stored) - len(failed) + len(missing_activations) - len(activation_failures)
    print(f"{built} built, {len(stored) + len(activations) - len(missing_activations)} already in the store, "
          f"{len(failed) + len(activation_failures)} failed ({kernel_dir()})")
    for (problem, schedule), error in failed.items():
        print(f"  failed: {labels[problem]} {schedule.name}: {error}", file=sys.stderr)
    for kernel, error in activation_failures.items():
        print(f"  failed: {activation_label(kernel)}: {error}", file=sys.stderr)
    return 1 if failed or activation_failures else 0


def activation_label(kernel: tuple[str, int, str]) -> str:
    """How a (kind, K, dtype) activation kernel is named in the listings."""
    from runtime.kernels import ACTIVATION_KERNELS

    kind, k, dtype = kernel
    return f"{ACTIVATION_KERNELS[kind][1]}, K = {k}, {dtype} input"


def build_activation_kernels(wanted: list[tuple[str, int, str]], arch) -> dict:
    """Build activation kernels (kind, K, dtype) into the store, one after another (a few, one per
    kind and K); {(kind, K, dtype): error} for those that failed."""
    from runtime.kernels import compile_activation_kernel

    failed = {}
    for kernel in wanted:
        try:
            compile_activation_kernel(*kernel, arch)
        except Exception as exc:    # a compiler failure of any kind is reported, the rest still built
            failed[kernel] = f"{type(exc).__name__}: {exc}"
    return failed


def summary_line(deployment, planned: dict) -> str:
    """'4 problems x 13 buckets on <GPU>: 17 kernels (48 pairs tuned, 4 chosen by the fallback)'."""
    pairs = [how for served in planned.values() for _, how in served]
    untuned = sum(how is not None for how in pairs)
    problems = len(deployment.targets)
    return (f"{problems} problem{'s' * (problems != 1)} x {len(deployment.buckets)} buckets on "
            f"{deployment.describe()}: {len(planned)} kernels ({len(pairs) - untuned} pairs tuned, "
            f"{untuned} chosen by the fallback)")


def served_text(served: list) -> str:
    """'buckets 1,2,4 (tuned)' or '... (fallback)', per how each bucket was chosen."""
    parts = []
    for kind in ("tuned", "fallback"):
        buckets = [str(b) for b, how in served if (how is None) == (kind == "tuned")]
        if buckets:
            parts.append(f"buckets {','.join(buckets)} ({kind})")
    return "; ".join(parts)
