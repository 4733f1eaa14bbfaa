"""The search for the fastest correct kernel of each (problem, M bucket).

1. Plan: the cost model ranks every valid schedule at the bucket's upper edge; the top ones are kept.
2. Compile: M is dynamic, so one kernel serves every bucket; the jobs are deduplicated across buckets
   and compiled in parallel on the CPU cores (gen.compile.compile_many fills the disk cache).
3. Measure, on the GPU: each candidate is checked against the fp32 reference first (fresh random
   inputs at both ends of the bucket, output poisoned with NaN, two calls so that a split-K workspace
   left dirty is caught), then timed with gen.measure.time_calls over weight copies that L2 cannot
   hold, next to FP16 torch.matmul in the same process.
4. Refine: a second, smaller round measures what lies one knob step away from each bucket's fastest
   candidates and the winners of the buckets beside it (add_refinements), where the model misranks.
A candidate that fails to compile, crashes, hangs or is wrong is a result with its reason, never the
end of the run.

Measuring runs in a child process. A kernel that faults (illegal address) leaves the CUDA context
unusable for the rest of the process, so the child reports the culprit, exits, and a fresh child
carries on with the remaining candidates; a child that dies or stops reporting is handled the same way.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import itertools
import math
import multiprocessing
import os
from dataclasses import dataclass, field

from schedules.arch import Arch, get_arch
from schedules import cost
from schedules.cost import GpuSpec, estimate_us, rank
from schedules.knob_space import axis_values
from schedules.problem import Problem
from schedules.registry import FAMILIES, Schedule
from runtime.table import bucket_range

DEFAULT_TOP = 12
# A family whose fastest estimate is this many times the fastest of all is not measured at that bucket
# (with the default families): on the H200 the winning family's fastest estimate was within 1.15x of
# the fastest in all 52 layer-buckets of session 6, and the worst cross-family misrank ever measured
# was 1.5x (perf-notes v5). At M >= 64 this skips stream_mma (3-4.6x) and mostly marlin_mma (2.1-2.9x),
# the slowest candidates to time.
FAMILY_CUTOFF = 2.5
DEFAULT_REFINE = 6     # candidates per bucket in each local round (add_refinements)
# Local rounds after the first: round two refines every bucket, each later one only the buckets whose
# winner the round before changed (a hill climb from the new winner, which ends where nothing moves).
REFINE_ROUNDS = 3
PEERS_PER_BUCKET = 2   # other layers' winners at the same M that a local round measures (add_refinements)
# fp16 outputs carry ~5e-4 of rounding error; bf16 has an 8-bit mantissa, so its rounding alone is ~2e-3.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
STALL_TIMEOUT_S = 300.0   # no word from the measuring child for this long: the kernel is presumed hung


@dataclass
class Result:
    """One candidate at one bucket: its estimate and then its time, or why it has none."""

    schedule: Schedule
    estimate_us: float
    us: float | None = None
    rel_err: float | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        # JSON has no infinity: an output with NaN or Inf (relative error inf) is told by its error.
        rel_err = self.rel_err if self.rel_err is not None and math.isfinite(self.rel_err) else None
        return {"schedule": self.schedule.to_dict(), "name": self.schedule.name, "estimate_us": self.estimate_us,
                "us": self.us, "rel_err": rel_err, "error": self.error}


@dataclass
class BucketSearch:
    """The candidates of one (problem, bucket) and FP16's time at the bucket's upper edge."""

    problem: Problem
    bucket: int
    results: list[Result] = field(default_factory=list)
    fp16_us: float | None = None

    def winner(self) -> Result | None:
        timed = [r for r in self.results if r.us is not None and r.error is None]
        return min(timed, key=lambda r: r.us) if timed else None

    def timings(self) -> list[dict]:
        return [r.to_dict() for r in self.results]


def achieved_gbps(problem: Problem, m: int, us: float) -> float:
    """Bytes one call must move (weights, scales, activations, output) per second, in GB/s."""
    elem = 2
    moved = problem.weight_bytes() + m * problem.k * elem + m * problem.n * elem
    return moved / (us * 1e-6) / 1e9


def plan(pairs: list[tuple[Problem, int]], arch: Arch, gpu: GpuSpec, top: int = DEFAULT_TOP,
         families=None, workers: int | None = None) -> list[BucketSearch]:
    """The top `top` candidates of each (problem, bucket) by estimated time at the bucket's edge,
    from `families` (registry.SEARCHED by default). Ranking a bucket estimates every point of the
    space (~1.5 s for a Llama shape on one core, a minute for llama-2-7b's 52 buckets), so the buckets
    are ranked in `workers` processes (default: one per CPU core) when there are several."""
    if top < 1:
        raise ValueError(f"--top must be at least 1, got {top}")
    # The families' AXES travel with the jobs: `gen tune --axes` changes them in this process only.
    axes = {name: dict(fam.AXES) for name, fam in FAMILIES.items()}
    jobs = [(p, b, arch.name, gpu, top, families, axes) for p, b in pairs]
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers > 1:
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            # Consecutive buckets of a shape go to one worker, which builds the shape's space once.
            picks = list(pool.map(_first_round_pick, jobs, chunksize=-(-len(jobs) // workers)))
    else:
        picks = [_first_round_pick(job) for job in jobs]
    return [BucketSearch(p, b, [Result(s, estimate_us(p, s, b, gpu)) for s in chosen])
            for (p, b), chosen in zip(pairs, picks)]


def _first_round_pick(job: tuple) -> list[Schedule]:
    """One bucket's first-round candidates (a process-pool task of plan)."""
    problem, bucket, arch_name, gpu, top, families, axes = job
    use_axes(axes)
    return top_of_each_family(first_round_ranking(problem, bucket, get_arch(arch_name), gpu, families), top)


def use_axes(axes: dict[str, dict[str, tuple]]) -> None:
    """Put `axes` (family name -> knob -> values) in place of those families' AXES in this process,
    and drop the cost model's candidate lists built from the old ones (only when something changed)."""
    changed = [name for name, values in axes.items() if FAMILIES[name].AXES != values]
    for name in changed:
        FAMILIES[name].AXES.update(axes[name])     # same keys, same order: from_axes stays positional
    if changed:
        cost._candidates.cache_clear()


def first_round_ranking(problem: Problem, m: int, arch: Arch, gpu: GpuSpec, families=None) -> list[Schedule]:
    """What the first round chooses from, fastest estimate first: the families in reach, one schedule
    per point of their non-variant axes."""
    ranked = rank(problem, m, arch, gpu, families)
    if families is None:
        ranked = within_reach(ranked, problem, m, gpu)
    return one_per_variant(ranked)


def within_reach(ranked: list[Schedule], problem: Problem, m: int, gpu: GpuSpec) -> list[Schedule]:
    """`ranked` without the families whose fastest estimate is over FAMILY_CUTOFF times the fastest."""
    if not ranked:
        return ranked
    fastest = {}
    for s in ranked:                        # fastest first: a family's first schedule is its fastest
        if s.family not in fastest:
            fastest[s.family] = estimate_us(problem, s, m, gpu)
    limit = FAMILY_CUTOFF * min(fastest.values())
    return [s for s in ranked if fastest[s.family] <= limit]


def one_per_variant(ranked: list[Schedule]) -> list[Schedule]:
    """`ranked` with one schedule per point of its family's other axes than VARIANT_AXES (the best
    ranked): a variant axis (a launch mode, an end-of-kernel detail) shifts a kernel's time by a few
    per cent and the model only by its measured factor, so the first round would otherwise spend its
    places on near-copies of one kernel. The second round's neighbours move those axes too."""
    seen, kept = set(), []
    for s in ranked:
        key = without_variants(s)
        if key not in seen:
            seen.add(key)
            kept.append(s)
    return kept


@functools.lru_cache(maxsize=1 << 19)     # the same schedules come back in every bucket of a problem
def without_variants(schedule: Schedule) -> tuple:
    """The schedule's family and its values on the family's AXES other than VARIANT_AXES."""
    variant = getattr(schedule.module, "VARIANT_AXES", ())
    return (schedule.family,) + tuple(v for name, v in zip(schedule.module.AXES,
                                                           axis_values(schedule.module.AXES, schedule.knobs))
                                      if name not in variant)


def top_of_each_family(ranked: list[Schedule], top: int) -> list[Schedule]:
    """Each family's top // 2 best by the model, then the best of the rest up to `top` in all (with
    three families in reach that is 1.5 x top): the model orders candidates within a family much
    better than across families, so each family's best few are measured rather than trusted
    (measured on the H200: the model ranked hopper_wgmma first at large M, where marlin_mma ran 1.5x
    faster). Half rather than a third (session 8, perf-notes v29): on the timings of sessions 5-8 the
    best of a 12-candidate selection came to 1.066x / 1.127x / 1.038x of the measured best at M = 1-8
    / 16-64 / 128-4096, against 1.110x / 1.137x / 1.095x, for 774 candidates instead of 624 on
    llama-2-7b's 52 buckets."""
    per_family = top // 2
    keep: list[Schedule] = []
    for fam in dict.fromkeys(s.family for s in ranked):
        keep += [s for s in ranked if s.family == fam][:per_family]
    keep += [s for s in ranked if s not in keep][:max(0, top - len(keep))]
    return sorted(keep, key=ranked.index)


def _add_candidate(search: BucketSearch, schedule: Schedule, arch: Arch, gpu: GpuSpec) -> bool:
    """Append `schedule` to the bucket's candidates if it is valid there and not among them yet."""
    if schedule.module.check(search.problem, schedule.knobs, arch) is not None or \
            any(r.schedule == schedule for r in search.results):
        return False
    search.results.append(Result(schedule, estimate_us(search.problem, schedule, search.bucket, gpu)))
    return True


def add_incumbents(searches: list[BucketSearch], table, arch: Arch, gpu: GpuSpec, families=None) -> int:
    """Put each bucket's current table winner among its candidates (when still valid and of a searched
    family), so that a re-tune measures it in the same run and never replaces it with something
    slower that the cost model preferred. Returns how many were added."""
    added = 0
    for search in searches:
        entry = table.entry(search.problem, search.bucket)
        if entry is not None and (families is None or entry.schedule.family in families):
            added += _add_candidate(search, entry.schedule, arch, gpu)
    return added


def add_variants(searches: list[BucketSearch], table, variants: dict[str, list[dict]], arch: Arch, gpu: GpuSpec,
                 families=None) -> int:
    """Per bucket, the current table winner with each of `variants[its family]` (knob name -> value)
    applied, where valid and not among the candidates yet: an A/B of a prepared knob against every
    winner in one run (`gen tune --force --variants ...`), each variant checked and timed like any
    candidate, the winner itself measured beside it (add_incumbents). Returns how many were added."""
    added = 0
    for search in searches:
        entry = table.entry(search.problem, search.bucket)
        if entry is None or (families is not None and entry.schedule.family not in families):
            continue
        for change in variants.get(entry.schedule.family, ()):
            variant = Schedule(entry.schedule.family, dataclasses.replace(entry.schedule.knobs, **change))
            added += _add_candidate(search, variant, arch, gpu)
    return added


def add_seeds(searches: list[BucketSearch], sweep_records: list[dict], arch: Arch, gpu: GpuSpec,
              per_bucket: int = 3, families=None) -> int:
    """Add the `per_bucket` fastest correct candidates of a `gen sweep --json` file at the same
    problem and M as a bucket's edge to that bucket's candidates (if valid and not there yet): what
    a sweep found is measured by the tune even where the cost model ranks it low. Returns how many
    were added; a record that is not a sweep's is an error that names it."""
    from schedules.problem import Problem

    by_key: dict[tuple, list[tuple[float, Schedule]]] = {}
    for i, rec in enumerate(sweep_records):
        try:
            key = (Problem(**rec["problem"]), int(rec["m"]))
            timed = [(r["us"], Schedule.from_dict(r["schedule"])) for r in rec["results"]
                     if r.get("us") is not None and not r.get("error")]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"sweep record {i} is not a `gen sweep --json` record ({exc!r})") from None
        by_key.setdefault(key, []).extend(timed)
    added = 0
    for search in searches:
        seeds = [s for _, s in sorted(by_key.get((search.problem, search.bucket), []), key=lambda pair: pair[0])]
        for schedule in [s for s in seeds if families is None or s.family in families][:per_bucket]:
            added += _add_candidate(search, schedule, arch, gpu)
    return added


def neighbours(schedule: Schedule, problem: Problem, arch: Arch) -> list[Schedule]:
    """The valid schedules one step away from `schedule` in its family's space: one axis moved to the
    next value up or down (in AXES order). A move that breaks a rule between knobs (producer_warp
    needs release_barriers, a split needs k-tiles for its stages) is retried together with one step
    along another axis, so that coupled knobs move as a pair. Deterministic, without `schedule`."""
    module = schedule.module
    axes = list(module.AXES.values())
    here = axis_values(module.AXES, schedule.knobs)

    def moved(point: tuple, axis: int, step: int) -> list[tuple]:
        values = axes[axis]
        if point[axis] not in values:              # off the searched grid (a seed): onto its first value
            return [point[:axis] + (values[0],) + point[axis + 1:]]
        i = values.index(point[axis]) + step
        return [point[:axis] + (values[i],) + point[axis + 1:]] if 0 <= i < len(values) else []

    def valid(point: tuple):
        knobs = module.from_axes(point)
        return knobs if module.check(problem, knobs, arch) is None else None

    found: list[Schedule] = []
    for axis in range(len(axes)):
        for step in (-1, 1):
            for single in moved(here, axis, step):
                points = [single] if valid(single) else [
                    pair for other in range(len(axes)) if other != axis
                    for s2 in (-1, 1) for pair in moved(single, other, s2)]
                for point in points:
                    knobs = valid(point)
                    candidate = Schedule(schedule.family, knobs) if knobs else None
                    if candidate and point != here and candidate not in found:
                        found.append(candidate)
    return found


def add_refinements(searches: list[BucketSearch], arch: Arch, gpu: GpuSpec, per_bucket: int = 6,
                    from_best: int = 2, only: list[BucketSearch] | None = None) -> int:
    """A local round of a search, after the one before is measured: per bucket (of `only`, default
    all), the winners of the buckets beside on the same problem (already compiled; one kernel serves
    any M), the winners of the same bucket on the other problems, and the unmeasured neighbours of its
    `from_best` fastest correct candidates (the fastest one's first, each one's by estimate), up to
    `per_bucket` new candidates, at most half of them other buckets' winners. The cost model orders a
    family's knobs well but not exactly (stages, the producer warp and split-K moved the H200's
    winners by 5-20 %, perf-notes v16): a local search around what was measured fixes what it
    misranks. Returns how many were added."""
    added = 0
    by_problem: dict[Problem, dict[int, BucketSearch]] = {}
    peers: dict[tuple, list[BucketSearch]] = {}
    for search in searches:
        by_problem.setdefault(search.problem, {})[search.bucket] = search
        peers.setdefault(_peer_key(search), []).append(search)
    for search in searches if only is None else only:
        timed = sorted((r for r in search.results if r.us is not None and r.error is None), key=lambda r: r.us)
        if not timed:
            continue
        buckets = sorted(by_problem[search.problem])
        i = buckets.index(search.bucket)

        def beside(d):
            return [by_problem[search.problem][buckets[j]].winner() for j in (i - d, i + d) if 0 <= j < len(buckets)]

        # Another layer's winner at the same M: the layers of a model share M and often a kernel shape
        # (11 of the 52 H200 winners of session 12 are another layer's, knob for knob), and a cold
        # tune's first round may not have ranked it high enough for this layer.
        others = [o.winner() for o in peers[_peer_key(search)] if o is not search]
        others = sorted({w.schedule for w in others if w is not None},
                        key=lambda s: (estimate_us(search.problem, s, search.bucket, gpu), s.name))[:PEERS_PER_BUCKET]
        # Nearest buckets first; two on each side: a shape that wins at M = 4 can win at M = 1 too.
        pool = [w.schedule for w in beside(1) if w is not None] + others + \
            [w.schedule for w in beside(2) if w is not None]
        near = []
        for r in timed[:from_best]:      # the best one's neighbours first, each list best estimate first
            near += _structure_first(r.schedule, sorted(
                neighbours(r.schedule, search.problem, arch),
                key=lambda s: (estimate_us(search.problem, s, search.bucket, gpu), s.name)))
        # At most half the places go to other buckets' winners: the rest to the neighbours, which
        # are where a misranked knob is found (gate_up M = 64's winner is one warpgroup count away
        # from the cold tune's, perf-notes v37).
        count = 0
        for schedule in pool:
            if count >= per_bucket // 2:
                break
            count += _add_candidate(search, schedule, arch, gpu)
        for schedule in near:
            if count >= per_bucket:
                break
            count += _add_candidate(search, schedule, arch, gpu)
        added += count
    return added


def _structure_first(schedule: Schedule, near: list[Schedule]) -> list[Schedule]:
    """`near` (neighbours of `schedule`) taking turns, a move along a structural axis first, then one
    along a VARIANT_AXES axis: a variant's estimate is within a few per cent of the kernel's own, so
    by estimate alone the variants come first and fill the places (cold tune, gate_up M = 64: all
    three went to variants within 1 % of the kernel, and the winner one warpgroup count away was
    never measured; perf-notes v37)."""
    own = without_variants(schedule)
    structural = [s for s in near if without_variants(s) != own]
    variants = [s for s in near if without_variants(s) == own]
    return [s for pair in itertools.zip_longest(structural, variants) for s in pair if s is not None]


def _peer_key(search: BucketSearch) -> tuple:
    """Buckets whose winners may serve each other: the same M, quantization and activation dtype."""
    p = search.problem
    return search.bucket, "channelwise" if p.channelwise else p.group, p.bits, p.dtype


def compile_jobs(searches: list[BucketSearch]) -> list[tuple[Problem, Schedule]]:
    """Distinct (problem, schedule) pairs of the candidates not measured or failed yet, in first-seen
    order: one kernel serves every bucket."""
    return list(dict.fromkeys((s.problem, r.schedule) for s in searches for r in s.results
                              if r.us is None and r.error is None))


def compile_candidates(searches: list[BucketSearch], arch: Arch, workers: int | None = None, progress=None) -> int:
    """Compile every planned candidate once; failures become `compile:` errors. Returns the job count."""
    from gen.compile import compile_many

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

    from gen.compile import compile_many

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
    producer (gen.measure.time_calls_between) instead of back to back.

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
    import torch

    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:
        return False


class Bench:
    """Random weights of one problem on the GPU, packed per family, with copies for timing, timed back
    to back or, with `between`, after the activations' producer."""

    def __init__(self, problem: Problem, between: bool = False):
        import torch

        from schedules.quant import torch_dtype

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible")
        torch.manual_seed(0)
        self.problem = problem
        self.between = between
        self.dtype = torch_dtype(problem.dtype)
        p = problem
        self.codes = torch.randint(0, 1 << p.bits, (p.k, p.n), dtype=torch.uint8, device="cuda")
        # Scales of ~1/100 keep outputs of K-long sums of O(1) activations well inside fp16.
        self.scales = (torch.rand(p.num_groups, p.n, device="cuda") * 0.01 + 0.005).to(self.dtype)
        self._packed: dict[str, list] = {}
        self.fp16_weights = None

    def packed(self, family_module) -> list:
        """Copies of the packed weights: the first is checked, all are rotated through when timing.
        Families that read the same layout share them."""
        from gen.measure import copies_for

        layout = family_module.LAYOUT
        if layout not in self._packed:
            qw, qs = family_module.pack(self.codes, self.scales)
            n = copies_for(qw.numel() * qw.element_size() + qs.numel() * qs.element_size())
            self._packed[layout] = [(qw, qs)] + [(qw.clone(), qs.clone()) for _ in range(n - 1)]
        return self._packed[layout]

    def _time(self, calls: list, a) -> float:
        """Median us per call of `calls`, whose activations are `a`, in this bench's harness."""
        from gen.measure import time_calls, time_calls_between

        return time_calls_between(calls, a) if self.between else time_calls(calls)

    def time_fp16(self, m: int) -> float:
        import torch

        from gen.measure import copies_for
        from schedules.quant import dequantize

        if self.fp16_weights is None:
            w = dequantize(self.codes, self.scales, self.problem.bits).to(self.dtype)
            self.fp16_weights = [w] + [w.clone() for _ in range(copies_for(w.numel() * w.element_size()) - 1)]
        a = torch.randn(m, self.problem.k, dtype=self.dtype, device="cuda")
        out = torch.empty(m, self.problem.n, dtype=self.dtype, device="cuda")
        return self._time([functools.partial(torch.matmul, a, w, out=out) for w in self.fp16_weights], a)

    def rotated_calls(self, kernel, fam, knobs, a, out, ws, counters) -> list:
        """One call of `kernel` per weight copy, all on the same activations, output and workspace."""
        return [functools.partial(kernel, *fam.kernel_args(self.problem, knobs, a, qw, qs, out, ws, counters))
                for qw, qs in self.packed(fam)]

    def check_and_time(self, schedule: Schedule, arch: Arch, bucket: int) -> dict:
        """{"us", "rel_err"} of a correct candidate, or {"error", "rel_err"} of a wrong one."""
        import torch

        from gen.compile import compile_schedule
        from schedules.quant import reference_matmul, relative_error

        p, fam, knobs = self.problem, schedule.module, schedule.knobs
        kernel = compile_schedule(p, schedule, arch)    # a disk-cache hit after compile_many
        copies = self.packed(fam)
        ws_elems, counter_elems = fam.workspace_elems(p, knobs, bucket)
        ws = torch.zeros(ws_elems, dtype=torch.float32, device="cuda")
        counters = torch.zeros(counter_elems, dtype=torch.int32, device="cuda")
        tol = TOLERANCE[p.dtype]

        def run(m: int, qw, qs):
            a = torch.randn(m, p.k, dtype=self.dtype, device="cuda")
            out = torch.full((m, p.n), float("nan"), dtype=self.dtype, device="cuda")
            args = fam.kernel_args(p, knobs, a, qw, qs, out, ws, counters)
            return a, out, args

        worst = 0.0
        low, _ = bucket_range(bucket)
        for m in sorted({low, bucket}):
            for call in (1, 2):   # the second call runs on the workspace the first one left behind
                a, out, args = run(m, *copies[0])
                kernel(*args)
                torch.cuda.synchronize()
                err = relative_error(out, reference_matmul(a, self.codes, self.scales, p.bits))
                worst = max(worst, err)
                if not err < tol:
                    return {"error": f"wrong: relative error {err:.3g} at M={m} (call {call}), tolerance {tol}",
                            "rel_err": err}
        if ws.any() or counters.any():
            return {"error": "wrong: the split-K workspace was not left zero", "rel_err": worst}

        a, out, _ = run(bucket, *copies[0])
        us = self._time(self.rotated_calls(kernel, fam, knobs, a, out, ws, counters), a)
        # The replays must still compute the right thing (e.g. split-K state across graph replays).
        err = relative_error(out, reference_matmul(a, self.codes, self.scales, p.bits))
        if not err < tol:
            return {"error": f"wrong after timing: relative error {err:.3g} at M={bucket}", "rel_err": err}
        return {"us": us, "rel_err": max(worst, err)}
