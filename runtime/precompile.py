"""Compiling ahead: the kernels a set of layers will run, planned as the op chooses them, built in
parallel before the first call.

The op (runtime/op.py) runs one kernel per (problem, M bucket), chosen by runtime/dispatch.py: the
tuned table's entry for this GPU, else the fallback's pick, for the problem that serves the bucket.
`Dispatch` makes those choices as functions of their inputs alone, and the op makes them through the
same functions, so `plan` (problems x buckets -> the (served problem, schedule) pairs to build) names
exactly the kernels the op will load. Only a kernel that fails its first-run check is replaced by
one the plan could not foresee (runtime/selfcheck.py).

Converting a model (`replace_linear`), loading a checkpoint and constructing a `QuantLinear` on a GPU
build every kernel of every bucket up to `max_m`, each distinct problem once, kernels already in the
store skipped, the rest by one pool of worker processes, so that serving only loads. The
workers build while the model is being made (`PendingBuild`, on `kernels.CompilePool`):
`replace_linear` plans from the layers' shapes before it quantizes any (`start_precompile`), and the
checkpoint loader queues each layer's kernels as it reads the layer. `precompile=False` or
TILEMARLIN_PRECOMPILE=0 turns it off; weights that are not on a CUDA device skip it (the arch to
build for is the GPU's).
"""
from __future__ import annotations

import os
from typing import Iterable

from schedules.arch import Arch
from schedules.problem import Problem
from schedules.registry import Schedule

from .dispatch import DEFAULT_LAYOUT, Dispatch, dispatch_for
from .table import BUCKETS, bucket_of

PRECOMPILE_ENV = "TILEMARLIN_PRECOMPILE"
FP8_ACTIVATION_KERNELS = ("fp8_activations", "fp8_activations_sums")
_OFF = ("0", "false", "no", "off")


def activation_kernels(problems: Iterable[Problem], gathered: Iterable[Problem] = (),
                       normed: Iterable[Problem] = ()) -> list[tuple[str, int, str]]:
    """(kind, K, dtype) of each activation kernel (runtime.kernels.ACTIVATION_KERNELS) that layers of
    `problems` need, W4A8's quantizer with and without the k-tile sums for every FP8 one (two small
    kernels per K: whether a bucket uses one, and which, follows the tuned table,
    Dispatch.serving_problem, and the kernel's offset_decode, on the serving machine too), that
    act-order layers of `gathered` need, the column gather, and that act-order layers fed
    by an RMSNorm in their order (`normed`, runtime/checkpoint/norm_fold.py) need, that norm; one per
    kind, K and input dtype, sorted."""
    wanted = {(kind, p.k, p.dtype) for p in problems if p.fp8 for kind in FP8_ACTIVATION_KERNELS}
    wanted |= {("gather_columns", p.k, p.dtype) for p in gathered}
    wanted |= {("rms_norm_gather", p.k, p.dtype) for p in normed}
    return sorted(wanted)


def plan(problems: Iterable[Problem], buckets: Iterable[int], dispatch: Dispatch,
         layout: str) -> dict[tuple[Problem, Schedule], list[tuple[int, str | None]]]:
    """The kernels the op will load for `problems` at `buckets`: (problem, schedule) -> the buckets
    it serves, each with how it was chosen (Dispatch.choose), the problem being the one whose kernel
    serves the bucket (Dispatch.serving_problem: a W4A8 problem's W4A16 twin at some). Each distinct
    problem and bucket is planned once; the order is by problem, then schedule name, whatever the
    order of the inputs."""
    kernels: dict[tuple[Problem, Schedule], list[tuple[int, str | None]]] = {}
    for problem in sorted(set(problems), key=lambda p: p.name):
        for bucket in sorted({bucket_of(b) for b in buckets}):
            served = dispatch.serving_problem(problem, bucket)
            schedule, how = dispatch.choose(served, bucket, layout)
            buckets_served = kernels.setdefault((served, schedule), [])
            if (bucket, how) not in buckets_served:
                buckets_served.append((bucket, how))
    return dict(sorted(kernels.items(), key=lambda kv: (kv[0][0].name, kv[0][1].name)))


def buckets_up_to(max_m: int | None) -> tuple[int, ...]:
    """The buckets that serve M = 1..max_m (all of them for None)."""
    if max_m is None:
        return BUCKETS
    return BUCKETS[:BUCKETS.index(bucket_of(max_m)) + 1]


def build_missing(jobs: list, arch: Arch, workers: int | None = None, progress=None) -> dict:
    """Build the jobs ((problem, schedule) pairs or kernels.ActivationJob) the store lacks, in one
    compile_many call (none when the store has them all); returns job -> error or None for every job.
    `progress(job, error)` follows each build."""
    from . import kernels

    missing = [job for job in jobs if not kernels.job_stored(job, arch)]
    results = dict.fromkeys(jobs)
    if missing:
        results.update(kernels.compile_many(missing, arch, workers, progress))
    return results


def job_name(job) -> str:
    """How messages name a compile job: '<problem> <schedule>', or the activation kernel's kind, K and
    dtype."""
    if isinstance(job, tuple):
        problem, schedule = job
        return f"{problem.name} {schedule.name}"
    return f"{job.kind} K={job.k} {job.dtype}"


def enabled() -> bool:
    """False when TILEMARLIN_PRECOMPILE turns the constructors' precompile off (0, false, no, off)."""
    return os.environ.get(PRECOMPILE_ENV, "1").strip().lower() not in _OFF


def _on_cuda(device) -> bool:
    return device.type == "cuda"


def precompile_layers(layers: Iterable[tuple[Problem, object]], max_m: int | None = None,
                      layout: str | None = None, gathered: Iterable[tuple[Problem, object]] = (),
                      normed: Iterable[tuple[Problem, object]] = ()) -> None:
    """Build every kernel that layers of these (problem, torch device) pairs will run at M up to
    `max_m` (all buckets for None), as the constructors and replace_linear do, the column gather of the
    act-order layers among them (`gathered`, the same pairs) and the RMSNorm that writes the input of
    those in `normed` in their order: nothing when TILEMARLIN_PRECOMPILE is off, nothing for devices
    other than CUDA GPUs, one pool of worker processes for all of them (this process imports no
    compiler). Raises RuntimeError naming the kernels that failed to build (their first calls would
    fail)."""
    start_precompile(layers, max_m, layout, gathered, normed).wait()


def start_precompile(layers: Iterable[tuple[Problem, object]], max_m: int | None = None,
                     layout: str | None = None, gathered: Iterable[tuple[Problem, object]] = (),
                     normed: Iterable[tuple[Problem, object]] = ()) -> "PendingBuild":
    """precompile_layers' build, planned now and running in worker processes while the caller goes on
    (replace_linear quantizes meanwhile); wait() before the kernels are needed."""
    build = PendingBuild(max_m, layout)
    try:
        build.add(layers, gathered, normed)
    except BaseException:
        build.cancel()
        raise
    return build


class PendingBuild:
    """A model's kernels, built in worker processes (one kernels.CompilePool, whatever GPUs they are
    for) while its layers are still being made: add() plans the kernels of layers not seen before and queues those
    the store lacks, wait() returns once all are built. Nothing is planned or built when
    TILEMARLIN_PRECOMPILE is off or for layers not on a CUDA GPU."""

    def __init__(self, max_m: int | None = None, layout: str | None = None):
        self._max_m, self._layout = max_m, layout
        self._seen: set = set()          # (kind, problem, device) already planned
        self._queued: set = set()        # (arch, job)
        self._pool = None                # kernels.CompilePool, once a job needs it
        self._failed: dict = {}

    def add(self, layers: Iterable[tuple[Problem, object]] = (), gathered: Iterable[tuple[Problem, object]] = (),
            normed: Iterable[tuple[Problem, object]] = ()) -> None:
        """Plan and queue the kernels of these layers (precompile_layers' arguments) not planned before."""
        from . import kernels

        if not enabled():
            return
        fresh = [[pair for pair in pairs if _on_cuda(pair[1]) and (kind, *pair) not in self._seen]
                 for kind, pairs in (("gemm", layers), ("gather", gathered), ("norm", normed))]
        self._seen.update((kind, *pair) for kind, pairs in zip(("gemm", "gather", "norm"), fresh) for pair in pairs)
        for arch, jobs in _planned_jobs(*fresh, self._max_m, self._layout).items():
            missing = [job for job in jobs if (arch, job) not in self._queued and not kernels.job_stored(job, arch)]
            self._queued.update((arch, job) for job in missing)
            if missing:
                self._pool = self._pool or kernels.CompilePool(progress=self._note)
                self._pool.submit(missing, arch)

    def _note(self, job, error) -> None:
        if error:
            self._failed[job] = error

    def cancel(self) -> None:
        """Stop the workers after their current jobs (the caller's conversion failed) and wait for them.
        Harmless after wait()."""
        if self._pool is not None:
            self._pool.cancel()
            self._pool.close()

    def wait(self) -> None:
        """Return once every queued kernel is built (no add() after it). Raises RuntimeError naming the
        kernels that failed to build (their first calls would fail)."""
        try:
            if self._pool is not None:
                self._pool.close()
        except BaseException:       # Ctrl-C: the workers stop after their current jobs
            self.cancel()
            raise
        if self._failed:
            listed = "; ".join(f"{job_name(job)}: {error}" for job, error in list(self._failed.items())[:5])
            advice = ("their buckets' first calls would fail too. Serve smaller M with max_m=..., or build later "
                      "with precompile=False" if any(isinstance(job, tuple) for job in self._failed) else
                      "the layers' calls would fail too")
            raise RuntimeError(f"{len(self._failed)} kernels failed to build ({listed}); {advice}")


def _planned_jobs(layers, gathered, normed, max_m, layout) -> dict[Arch, list]:
    """arch -> the jobs (compile_many's) that the layers' kernels need, in plan's order, the activation
    kernels last."""
    from . import kernels

    by_device: dict = {}
    gathers_by_device: dict = {}
    norms_by_device: dict = {}
    for pairs, into in ((layers, by_device), (gathered, gathers_by_device), (normed, norms_by_device)):
        for problem, device in pairs:
            into.setdefault(device, set()).add(problem)
    jobs_by_arch: dict[Arch, dict] = {}
    activations_by_arch: dict[Arch, set] = {}
    for device in {**by_device, **gathers_by_device, **norms_by_device}:
        dispatch = dispatch_for(device)
        problems = by_device.get(device, set())
        planned = plan(problems, buckets_up_to(max_m), dispatch, layout or DEFAULT_LAYOUT)
        jobs_by_arch.setdefault(dispatch.arch, {}).update(dict.fromkeys(planned))
        activations_by_arch.setdefault(dispatch.arch, set()).update(
            activation_kernels(problems, gathers_by_device.get(device, ()), norms_by_device.get(device, ())))
    return {arch: [*jobs, *(kernels.ActivationJob(*kernel) for kernel in sorted(activations_by_arch[arch]))]
            for arch, jobs in jobs_by_arch.items()}
