"""The search for the fastest correct kernel of each (problem, M bucket): which candidates to measure.

1. Plan: the cost model ranks every valid schedule at the bucket's upper edge; the top ones of each
   family are kept (plan, top_of_each_family).
2. Compile and measure: gen/tune/measuring.py compiles the candidates, checks each against the fp32
   reference and times it next to FP16 torch.matmul; the results land on this module's Result.
3. Refine: smaller rounds measure what lies one knob step away from each bucket's fastest candidates
   and the winners of the buckets beside it and of the other layers (add_refinements), where the
   model misranks. A re-tune also measures the table's current winners (add_incumbents), and a run
   can add a sweep's or another table's picks (add_seeds) or variants of the winners (add_variants).
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

from schedules import cost
from schedules.arch import Arch, get_arch
from schedules.cost import GpuSpec, estimate_us, rank
from schedules.knob_space import axis_values
from schedules.problem import Problem
from schedules.registry import FAMILIES, Schedule

DEFAULT_TOP = 12
# A family whose fastest estimate is this many times the fastest of all is not measured at that bucket
# (with the default families): on the H200 the winning family's fastest estimate was within 1.15x of
# the fastest in all 52 layer-buckets of llama-2-7b, and the worst cross-family misrank measured was
# 1.5x (docs/performance.md, "The first round"). At M >= 64 this skips stream_mma (3-4.6x) and mostly
# marlin_mma (2.1-2.9x), the slowest candidates to time.
FAMILY_CUTOFF = 2.5
DEFAULT_REFINE = 6     # candidates per bucket in each local round (add_refinements)
# Local rounds after the first: round two refines every bucket, each later one only the buckets whose
# winner the round before changed (a hill climb from the new winner, which ends where nothing moves).
REFINE_ROUNDS = 3
PEERS_PER_BUCKET = 2   # other layers' winners at the same M that a local round measures (add_refinements)
# A bucket keeps the kernel of a neighbouring bucket (add_siblings) when it is this close to the fastest
# candidate: within the replays' run-to-run spread, and every kernel shared is one compile fewer when a
# served model starts with an empty kernel store (Llama-2-7B's 52 pairs: 43 distinct kernels before, 39
# after a re-tune with it, H200 2026-12-04).
SHARE_TOLERANCE = 0.01


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
    siblings: set = field(default_factory=set)   # the schedules the problem's neighbouring buckets run

    def winner(self) -> Result | None:
        """The fastest correct candidate, or a sibling's kernel within SHARE_TOLERANCE of it."""
        timed = [r for r in self.results if r.us is not None and r.error is None]
        if not timed:
            return None
        fastest = min(timed, key=lambda r: r.us)
        shared = [r for r in timed if r.schedule in self.siblings and r.us <= fastest.us * (1 + SHARE_TOLERANCE)]
        return min(shared, key=lambda r: r.us) if shared else fastest

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
    variant = schedule.module.VARIANT_AXES
    return (schedule.family,) + tuple(v for name, v in zip(schedule.module.AXES,
                                                           axis_values(schedule.module.AXES, schedule.knobs))
                                      if name not in variant)


def top_of_each_family(ranked: list[Schedule], top: int) -> list[Schedule]:
    """Each family's top // 2 best by the model, then the best of the rest up to `top` in all (with
    three families in reach that is 1.5 x top): the model orders candidates within a family much
    better than across families, so each family's best few are measured rather than trusted (a
    cross-family misrank of 1.5x has been measured on the H200). Half rather than a third: over
    recorded H200 timings the best of a 12-candidate selection came to 1.066x / 1.127x / 1.038x of the
    measured best at M = 1-8 / 16-64 / 128-4096 with half, against 1.110x / 1.137x / 1.095x with a
    third, for 774 candidates instead of 624 on llama-2-7b's 52 buckets (docs/performance.md,
    "The first round")."""
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


def add_siblings(searches: list[BucketSearch], table, arch: Arch, gpu: GpuSpec, families=None) -> int:
    """Put the table's winners of each bucket's neighbouring buckets (the same problem, one bucket edge
    below and above) among its candidates and mark them its siblings: a kernel that serves M = 2 often
    serves M = 1 as fast or faster, and BucketSearch.winner keeps a sibling that times within
    SHARE_TOLERANCE of the fastest, so that neighbouring buckets share kernels. Returns how many were
    added."""
    from runtime.table import BUCKETS

    added = 0
    for search in searches:
        i = BUCKETS.index(search.bucket)
        for j in (i - 1, i + 1):
            entry = table.entry(search.problem, BUCKETS[j]) if 0 <= j < len(BUCKETS) else None
            if entry is None or (families is not None and entry.schedule.family not in families):
                continue
            added += _add_candidate(search, entry.schedule, arch, gpu)
            if any(r.schedule == entry.schedule for r in search.results):
                search.siblings.add(entry.schedule)
    return added


def add_transfers(searches: list[BucketSearch], table, winners, arch: Arch, gpu: GpuSpec, per_bucket: int = 2,
                  families=None, twins_only: bool = False) -> int:
    """Start each bucket from what the runtime would run there: `table`'s winner of the problem itself
    (another table's, e.g. the shipped one, for a tune into a cache of its own), the tuned winners of
    the problem's twins at the same bucket (the same shape in the other dtype or zero-point setting,
    runtime.fallback.twins), the winners of the nearest tuned layers and buckets (what the fallback
    chooses between, so that a tune records how good its choice was) and the `per_bucket`
    best-estimated of `winners` (every tuned winner for the arch, runtime.fallback.TunedWinner) that
    fit the problem. Proven kernels cost a compile each, mostly shared across buckets,
    so a short tune (a low --top) starts from them instead of from the cost model's guesses alone,
    and a tune never ends slower than what it replaces (beyond SHARE_TOLERANCE, where a neighbouring
    bucket's kernel is kept). `twins_only`: the problem's own and its
    twins' winners alone. Returns how many were added."""
    from runtime.fallback import nearest_transfers, ranked_transfers, twin_winners

    added = 0
    for search in searches:
        problem, bucket = search.problem, search.bucket
        own = table.lookup(problem, bucket)
        proven = [own] if own is not None else []
        proven += [s for s, _ in twin_winners(problem, bucket, arch, table)]
        if not twins_only:
            proven += nearest_transfers(problem, bucket, arch, winners)
            proven += ranked_transfers(problem, bucket, arch, gpu, winners)[:per_bucket]
        for schedule in proven:
            if families is None or schedule.family in families:
                added += _add_candidate(search, schedule, arch, gpu)
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
    winners by 5-20 %): a local search around what was measured fixes what it misranks
    (docs/performance.md, "Refinement rounds"). Returns how many were added."""
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
        # (11 of the 52 shipped H200 winners are another layer's, knob for knob), and a cold
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
        # are where a misranked knob is found (gate_up M = 64's shipped winner is one warpgroup count
        # away from the one a cold tune's first round finds).
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
    by estimate alone the variants come first and fill the places (in a cold tune of gate_up at
    M = 64 all three went to variants within 1 % of the kernel, and the winner one warpgroup count
    away was never measured)."""
    own = without_variants(schedule)
    structural = [s for s in near if without_variants(s) != own]
    variants = [s for s in near if without_variants(s) == own]
    return [s for pair in itertools.zip_longest(structural, variants) for s in pair if s is not None]


def _peer_key(search: BucketSearch) -> tuple:
    """Buckets whose winners may serve each other: the same M, quantization and activation dtype."""
    p = search.problem
    return search.bucket, "channelwise" if p.channelwise else p.group, p.bits, p.dtype


