"""Measuring the candidates of a search: compile them, check each against the fp32 reference, time it.

Compiling runs on the CPU cores (runtime.kernels.compile_many fills the disk cache); M is dynamic, so
one kernel serves every bucket of a problem and the jobs are deduplicated across buckets. A problem
is measured as soon as all its kernels are built, while the next one compiles (compile_and_measure).

Measuring a candidate, on the GPU (Bench.check_and_time): first checked against the fp32 reference
(fresh random inputs at both ends of the bucket, the output poisoned with NaN, two calls so that a
split-K workspace left dirty is caught), then timed in gen.timing's harness over weight copies that
L2 cannot hold, next to the FP16 baseline of the same problem (gen.timing.Fp16Baseline) in the same
process. A fast wrong kernel never gets a time.

Measuring runs in a child process. A kernel that faults (illegal address) leaves the CUDA context
unusable for the rest of the process, so the child reports the culprit, exits, and a fresh child
carries on with the remaining candidates; a child that dies or stops reporting is handled the same
way. A candidate that fails to compile, crashes, hangs or is wrong is a result with its reason,
never the end of the run.
"""
from __future__ import annotations

import functools
import multiprocessing

import torch

from runtime.table import bucket_range
from schedules.arch import Arch, get_arch
from schedules.problem import Problem
from schedules.quant import kernel_activations, mismatch, problem_reference, relative_error, torch_dtype
from schedules.registry import Schedule

from gen.timing import Fp16Baseline, random_weights, random_zero_points, time_calls, time_calls_between, weight_copies
from gen.tune.search import BucketSearch

OPEN_BUCKET_CHECK_M = 16384   # where a candidate for the open last bucket (M > 2048) is also checked
STALL_TIMEOUT_S = 300.0   # no word from the measuring child for this long: the kernel is presumed hung


# --- compiling, and measuring each problem once its kernels are built ------------------------------

def compile_jobs(searches: list[BucketSearch]) -> list[tuple[Problem, Schedule]]:
    """Distinct (problem, schedule) pairs of the candidates not measured or failed yet, in first-seen
    order: one kernel serves every bucket."""
    return list(dict.fromkeys((s.problem, r.schedule) for s in searches for r in s.results
                              if r.us is None and r.error is None))


def compile_candidates(searches: list[BucketSearch], arch: Arch, workers: int | None = None, progress=None) -> int:
    """Compile every planned candidate once; failures become `compile:` errors. Returns the job count."""
    from runtime.kernels import compile_many

    jobs = compile_jobs(searches)
    _note_compile_errors(searches, compile_many(jobs, arch, workers=workers, progress=progress) if jobs else {})
    return len(jobs)


def _note_compile_errors(searches: list[BucketSearch], errors: dict) -> None:
    """A candidate whose kernel did not compile is a result: `compile: <why>`."""
    for search in searches:
        for r in search.results:
            if errors.get((search.problem, r.schedule)):
                r.error = f"compile: {errors[(search.problem, r.schedule)]}"


def compile_and_measure(searches: list[BucketSearch], arch: Arch, workers: int | None = None, compiled=None,
                        progress=None, on_bucket=None, measure=None, between: bool = False) -> None:
    """Compile the candidates not measured yet and check + time them, a problem as soon as all its
    kernels are built: the GPU measures one problem while the CPU cores compile the next (a cold tune
    spends about as long in nvcc as on the GPU). Compile failures become `compile:` errors.

    compiled(job, error) follows every compile job; progress, on_bucket and between are
    measure_problem's, and the first two are called from the measuring thread. A MeasureError is
    raised once the compiles are done.
    `measure` replaces measure_problem (tests).
    """
    from concurrent.futures import ThreadPoolExecutor

    from runtime.kernels import compile_many

    measure = measure or measure_problem
    problems = list(dict.fromkeys(s.problem for s in searches))
    jobs = sorted(compile_jobs(searches), key=lambda job: problems.index(job[0]))  # first problem first
    left = {p: sum(job[0] == p for job in jobs) for p in problems}
    errors: dict = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="measure") as gpu:
        measuring = []

        def start(problem):
            mine = [s for s in searches if s.problem == problem]
            _note_compile_errors(mine, errors)
            measuring.append(gpu.submit(measure, problem, arch, mine, progress=progress, on_bucket=on_bucket,
                                        between=between))

        def built(job, error):
            errors[job] = error
            if compiled:
                compiled(job, error)
            left[job[0]] -= 1
            if not left[job[0]]:
                start(job[0])

        try:
            for problem in [p for p in problems if not left[p]]:   # nothing to compile: measure at once
                start(problem)
            if jobs:
                compile_many(jobs, arch, workers=workers, progress=built)
            for future in measuring:
                future.result()
        except BaseException:      # Ctrl-C or a failure: measure nothing more than what is under way
            gpu.shutdown(wait=False, cancel_futures=True)
            raise


# --- measuring (parent side) ---------------------------------------------------------------------

class MeasureError(RuntimeError):
    """The measuring child could not start (no GPU, broken install): nothing can be measured."""


def measure_problem(problem: Problem, arch: Arch, searches: list[BucketSearch], progress=None, on_bucket=None,
                    stall_timeout_s: float = STALL_TIMEOUT_S, child_main=None, between: bool = False) -> None:
    """Check and time the compiled candidates of `searches` (all of `problem`) that have no time yet,
    in child processes; with `between`, candidates and FP16 alike are timed after the activations'
    producer (gen.timing.time_calls_between) instead of back to back.

    Fills each Result's us / rel_err / error and each search's fp16_us; calls progress(result) after
    every candidate and on_bucket(search) when a bucket is complete. `child_main` replaces the
    measuring child (tests drive the crash and hang handling with fake children).
    """
    child_main = child_main or _measure_child
    by_bucket = {s.bucket: s for s in searches}
    todo = {s.bucket: [i for i, r in enumerate(s.results) if r.error is None and r.us is None] for s in searches}
    for bucket in [b for b, idx in todo.items() if not idx]:        # nothing compiled: done already
        del todo[bucket]
        if on_bucket:
            on_bucket(by_bucket[bucket])
    ctx = multiprocessing.get_context("spawn")   # a fresh CUDA context for every child
    while todo:
        tasks = [(b, [(i, by_bucket[b].results[i].schedule) for i in idx]) for b, idx in todo.items()]
        parent_end, child_end = ctx.Pipe(duplex=False)
        child = ctx.Process(target=child_main, args=(child_end, problem, arch.name, tasks, between))
        child.start()
        child_end.close()
        started, progressed = None, False
        try:
            while True:
                if not parent_end.poll(stall_timeout_s):
                    lost = f"hung: no progress for {stall_timeout_s:.0f} s, the measuring process was killed"
                    break
                try:
                    msg = parent_end.recv()
                except EOFError:
                    child.join(5)
                    lost = f"crashed the measuring process (exit code {child.exitcode})"
                    break
                kind = msg[0]
                if kind == "start":
                    started = msg[1:]
                elif kind == "fp16":
                    by_bucket[msg[1]].fp16_us = msg[2]
                elif kind == "result":
                    _, bucket, i, fields = msg
                    _finish(by_bucket[bucket], i, fields, todo, progress, on_bucket)
                    started, progressed = None, True
                elif kind == "restart":          # the CUDA context is gone; the culprit was reported
                    lost = None
                    break
                elif kind == "fatal":
                    raise MeasureError(f"measuring {problem.name} failed: {msg[1]}")
                elif kind == "done":
                    lost = None
                    break
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            parent_end.close()
        if lost and started:
            bucket, i = started
            _finish(by_bucket[bucket], i, {"error": lost}, todo, progress, on_bucket)
        elif not progressed:   # a child that finishes nothing would be restarted forever
            raise MeasureError(f"measuring {problem.name} failed before any candidate finished: "
                               f"{lost or 'the measuring process stopped'}")


def _finish(search: BucketSearch, i: int, fields: dict, todo: dict, progress, on_bucket) -> None:
    result = search.results[i]
    for name, value in fields.items():
        setattr(result, name, value)
    todo[search.bucket].remove(i)
    if progress:
        progress(result)
    if not todo[search.bucket]:
        del todo[search.bucket]
        if on_bucket:
            on_bucket(search)


# --- measuring (child side) ----------------------------------------------------------------------

def _measure_child(conn, problem: Problem, arch_name: str, tasks: list, between: bool) -> None:
    """Entry point of the measuring process; reports over `conn` (see measure_problem)."""
    import logging

    logging.disable(logging.WARNING)
    try:
        bench = Bench(problem, between)
    except Exception as exc:
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    arch = get_arch(arch_name)
    for bucket, candidates in tasks:
        try:
            conn.send(("fp16", bucket, bench.time_fp16(bucket)))
        except Exception as exc:
            conn.send(("fatal", f"FP16 baseline at M={bucket}: {type(exc).__name__}: {exc}"))
            return
        for i, schedule in candidates:
            conn.send(("start", bucket, i))
            try:
                fields = bench.check_and_time(schedule, arch, bucket)
            except Exception as exc:
                fields = {"error": f"failed: {type(exc).__name__}: {str(exc).strip()[:300]}"}
                if not _cuda_usable():
                    fields["error"] = "crash (CUDA context lost): " + fields["error"][len("failed: "):]
                    conn.send(("result", bucket, i, fields))
                    conn.send(("restart",))
                    return
            conn.send(("result", bucket, i, fields))
    conn.send(("done",))


def _cuda_usable() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:
        return False


class Bench:
    """Random weights of one problem on the GPU, packed per family in weight copies past L2, and the
    FP16 baseline on the same weights; timed back to back or, with `between`, after the activations'
    producer."""

    def __init__(self, problem: Problem, between: bool = False):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible")
        torch.manual_seed(0)
        self.problem = problem
        self.between = between
        self.dtype = torch_dtype(problem.dtype)
        self.codes, self.scales = random_weights(problem)
        self.zeros = random_zero_points(problem)
        self._packed: dict[str, list] = {}
        self._fp16 = None

    def packed(self, family_module) -> list:
        """Copies of the packed weights: the first is checked, all are rotated through when timing.
        Families that read the same layout share them."""
        layout = family_module.LAYOUT
        if layout not in self._packed:
            self._packed[layout] = weight_copies(family_module.pack(self.codes, self.scales, self.zeros))
        return self._packed[layout]

    def _time(self, calls: list, a) -> float:
        """Median us per call of `calls`, whose activations are `a`, in this bench's harness."""
        return time_calls_between(calls, a) if self.between else time_calls(calls)

    def time_fp16(self, m: int) -> float:
        """The FP16 baseline's median us per call at M = m, in this bench's harness."""
        if self._fp16 is None:
            self._fp16 = Fp16Baseline(self.codes, self.scales, self.problem.bits, self.dtype)
        a = torch.randn(m, self.problem.k, dtype=self.dtype, device="cuda")
        out = torch.empty(m, self.problem.n, dtype=self.dtype, device="cuda")
        return self._time(self._fp16.calls(a, out), a)

    def rotated_calls(self, kernel, fam, knobs, a, out, ws, counters) -> list:
        """One call of `kernel` per weight copy, all on the same activations, output and workspace."""
        a = kernel_activations(self.problem, a)      # (FP8: quantized once, outside the timed calls)
        return [functools.partial(kernel, *fam.kernel_args(self.problem, knobs, a, qw, qs, out, ws, counters))
                for qw, qs in self.packed(fam)]

    def check_and_time(self, schedule: Schedule, arch: Arch, bucket: int) -> dict:
        """{"us", "rel_err"} of a correct candidate, or {"error", "rel_err"} of a wrong one."""
        from runtime.kernels import compile_schedule

        p, fam, knobs = self.problem, schedule.module, schedule.knobs
        kernel = compile_schedule(p, schedule, arch)    # a disk-cache hit after compile_many
        copies = self.packed(fam)
        low, high = bucket_range(bucket)
        # The bucket's edges; the open last bucket serves any M above its lower edge, so one far past it too.
        check_ms = sorted({low, bucket} | ({OPEN_BUCKET_CHECK_M} if high is None else set()))
        ws_elems, counter_elems = fam.workspace_elems(p, knobs, max(check_ms))
        ws = torch.zeros(ws_elems, dtype=torch.float32, device="cuda")
        counters = torch.zeros(counter_elems, dtype=torch.int32, device="cuda")

        def run(m: int, qw, qs):
            a = torch.randn(m, p.k, dtype=self.dtype, device="cuda")
            out = torch.full((m, p.n), float("nan"), dtype=self.dtype, device="cuda")
            args = fam.kernel_args(p, knobs, kernel_activations(p, a), qw, qs, out, ws, counters)
            return a, out, args

        worst = 0.0
        for m in check_ms:
            for call in (1, 2):   # the second call runs on the workspace the first one left behind
                a, out, args = run(m, *copies[0])
                kernel(*args)
                torch.cuda.synchronize()
                ref = problem_reference(p, a, self.codes, self.scales, self.zeros)
                err = relative_error(out, ref)
                worst = max(worst, err)
                why = mismatch(out, ref, p.dtype)    # the norm and every element
                if why:
                    return {"error": f"wrong: {why} at M={m} (call {call})", "rel_err": err}
        if ws.any() or counters.any():
            return {"error": "wrong: the split-K workspace was not left zero", "rel_err": worst}

        a, out, _ = run(bucket, *copies[0])
        us = self._time(self.rotated_calls(kernel, fam, knobs, a, out, ws, counters), a)
        # The replays must still compute the right thing (e.g. split-K state across graph replays).
        ref = problem_reference(p, a, self.codes, self.scales, self.zeros)
        err = relative_error(out, ref)
        why = mismatch(out, ref, p.dtype)
        if why:
            return {"error": f"wrong after timing: {why} at M={bucket}", "rel_err": err}
        return {"us": us, "rel_err": max(worst, err)}
