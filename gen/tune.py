"""`gen tune`: find and cache the fastest correct kernel of every linear layer and M bucket.

    gen tune --model llama-2-7b                 # 4 layers x 13 buckets on this GPU
    gen tune --model path/to/config.json --tp 2
    gen tune --shapes 4096x12288 --buckets 1,16 --top 4
    gen tune --model llama-2-7b --dry-run --arch sm_90a --top 2   # no GPU: compile + cost model only

Results go to this GPU's tuned table (runtime/table.py) after every bucket, so an interrupted run
resumes where it stopped; --force re-tunes what is already there. After the cost model's picks are
measured, local rounds (--refine candidates per bucket) measure their neighbours in knob space and the
winners of nearby buckets and of the other layers, until the winners stop moving (REFINE_ROUNDS).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.table import BETWEEN, BUCKETS, FORMAT as TABLE_FORMAT, REPLAY, TableError, TunedTable
from schedules.problem import SUPPORTED_DTYPES, Problem

from .search import DEFAULT_REFINE, DEFAULT_TOP, REFINE_ROUNDS

# Issue 3 asks a cold `gen tune --model llama-2-7b` to finish within 10 minutes on the H200: planning
# and rounds one and two took ~430 s there (perf-notes v37), so later rounds get what is left of 520 s.
DEFAULT_TIME_BUDGET_S = 520.0
# A local round costs about this much besides its candidates' compiles and timings (the H200's cold
# tune in session 16: rounds of 312, 216 and 72 candidates took 121, 99 and 56 s, ~36 s + 0.27 s per
# candidate; scaling the last round's seconds per candidate sent round four past the budget).
ROUND_FIXED_S = 30.0


@dataclass
class Target:
    """One problem to tune and the layers that share it."""

    problem: Problem
    layers: list[str]

    @property
    def label(self) -> str:
        return ",".join(self.layers)


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="tune kernels for a model's linear layers on this GPU",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a registered model (see gen/models.py) or a path to a Hugging Face config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the --model layers are split over (--shapes are taken as given)")
    p.add_argument("--shapes", help="extra KxN shapes, comma separated, e.g. 4096x12288,11008x4096")
    p.add_argument("--group", type=int, default=128, help="rows per quantization group; -1 = channelwise")
    p.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float16", help="activation dtype")
    p.add_argument("--buckets", help=f"M buckets to tune, comma separated (default: all of {','.join(map(str, BUCKETS))})")
    p.add_argument("--top", type=int, default=DEFAULT_TOP, help="candidates per bucket to compile and measure")
    p.add_argument("--refine", type=int, default=DEFAULT_REFINE,
                   help="candidates per bucket in each local round around the fastest so far (one knob a step "
                        "away, the winners of the buckets beside and of the other layers at the same M); up to "
                        f"{REFINE_ROUNDS} rounds after the first, each after round two only where the winner "
                        "moved; 0 = one round only")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="SECONDS",
                   help="a local round after the second starts only if it is expected to end within this many "
                        f"seconds of the tune's start (default {DEFAULT_TIME_BUDGET_S:.0f})")
    p.add_argument("--force", action="store_true", help="re-tune buckets that are already in the table (an "
                   "interrupted forced run of the same buckets resumes where it stopped)")
    p.add_argument("--restart", action="store_true", help="with --force: start over, ignoring an interrupted run")
    p.add_argument("--seed", metavar="SWEEP.json", help="also measure, per bucket, the 3 fastest correct candidates "
                   "that `gen sweep --json` recorded at the bucket's edge M for the same shape, or that another "
                   "tuned table (e.g. a cold run's) recorded for the same shape and bucket")
    p.add_argument("--axes", metavar='"FAMILY.KNOB=V1,V2 ..."',
                   help="search these values of a family's axes in this run instead of its AXES (knob "
                        "development: e.g. stream_wgmma.setmaxnreg=0,1)")
    p.add_argument("--variants", metavar='"FAMILY.KNOB=V1,V2 ..."',
                   help="also measure, per bucket, the current winner with these knobs changed (any knob of "
                        "its family, searched or not; several values: one variant each, several knobs: every "
                        "combination): an A/B of a prepared knob in one run, e.g. with --force --top 1 --refine 0")
    p.add_argument("--between", action="store_true",
                   help="time every candidate (and FP16) after the activations' producer, as a model runs its GEMMs, "
                        "instead of back to back (gen bench --between); buckets tuned the other way are re-tuned, "
                        "and the table records the harness per entry")
    p.add_argument("--families", help="schedule families to search, comma separated (default: marlin_mma, stream_mma and stream_wgmma where the arch offers them)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: compile the candidates for --arch and rank them by the cost model only")
    p.add_argument("--arch", help="target arch for --dry-run (default sm_90a); with a GPU it must match the GPU")
    p.add_argument("--workers", type=int, help="parallel ranking and compile processes (default: one per CPU core)")
    p.set_defaults(func=run)


def targets_from_args(args) -> list[Target]:
    """The distinct problems of --model and --shapes, each with the names of its layers."""
    from .models import model_layers, parse_shapes

    if not args.model and not args.shapes:
        raise ValueError("say what to tune: --model NAME|PATH/config.json and/or --shapes KxN,...")
    layers = (model_layers(args.model, tp=args.tp) if args.model else []) + \
        (parse_shapes(args.shapes) if args.shapes else [])
    targets: dict[Problem, Target] = {}
    for layer in layers:
        try:
            problem = Problem.make(n=layer.n, k=layer.k, group=args.group, dtype=args.dtype)
        except ValueError as exc:
            raise ValueError(f"layer {layer.name} ({layer.shape}): {exc}") from None
        targets.setdefault(problem, Target(problem, [])).layers.append(layer.name)
    return list(targets.values())


def parse_families(text: str | None) -> list[str] | None:
    """The --families list (None: registry.SEARCHED); an unknown name is an error that lists the known ones."""
    from schedules.registry import family

    if not text:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        family(name)
    return names


def parse_knob_values(text: str | None, flag: str, searched_only: bool) -> dict[str, dict[str, tuple]]:
    """"family.knob=v1,v2 ..." (--axes, --variants) -> {family: {knob: values}}. With `searched_only`
    the knob must be one of the family's AXES. An unknown family, knob or value is an error naming it."""
    from schedules.knob_space import knob_value
    from schedules.registry import family

    values: dict[str, dict[str, tuple]] = {}
    for item in (text or "").split():
        key, sep, listed = item.partition("=")
        family_name, dot, knob = key.partition(".")
        if not (sep and dot and listed):
            raise ValueError(f"bad {flag} item {item!r}: expected family.knob=value[,value...]")
        module = family(family_name)
        if searched_only and knob not in module.AXES:
            raise ValueError(f"{family_name} has no searched axis {knob!r}; its axes: {', '.join(module.AXES)}")
        if knob in values.get(family_name, {}):
            raise ValueError(f"{flag} names {key} twice")
        values.setdefault(family_name, {})[knob] = tuple(knob_value(module.Knobs, knob, v) for v in listed.split(","))
    return values


def parse_axes(text: str | None) -> dict[str, dict[str, tuple]]:
    """--axes "family.knob=v1,v2 ...": the values that replace those axes of the families' AXES for
    this run, so that a prepared knob can be searched (checked against the reference and timed like
    any candidate) without editing the code."""
    return parse_knob_values(text, "--axes", searched_only=True)


def parse_variants(text: str | None) -> dict[str, list[dict]]:
    """--variants "family.knob=v1,v2 ...": per family, the knob changes to apply to its winners (every
    combination of the values named); any knob of the family, searched or not."""
    values = parse_knob_values(text, "--variants", searched_only=False)
    return {name: [dict(zip(knobs, combo)) for combo in itertools.product(*knobs.values())]
            for name, knobs in values.items()}


@contextlib.contextmanager
def searched_axes(overrides: dict[str, dict[str, tuple]]):
    """The families' AXES with `overrides` (parse_axes) in place for the duration of a tune: the plan,
    the cost model's candidate lists and the second round's neighbours all read them there."""
    from schedules.registry import family

    from .search import use_axes

    saved = {name: dict(family(name).AXES) for name in overrides}
    try:
        use_axes({name: {**saved[name], **axes} for name, axes in overrides.items()})
        yield
    finally:
        use_axes(saved)


def parse_buckets(text: str | None, flag: str = "--buckets") -> list[int]:
    if not text:
        return list(BUCKETS)
    try:
        buckets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"bad {flag} {text!r}: expected comma-separated integers") from None
    bad = [b for b in buckets if b not in BUCKETS]
    if bad or not buckets:
        raise ValueError(f"{flag} must be bucket edges, one or more of {','.join(map(str, BUCKETS))}; got {text!r}")
    return buckets


def with_earlier_timings(timings: list[dict], earlier) -> list[dict]:
    """This run's timings of a bucket, then the timings that the bucket's table entry (`earlier`, an
    Entry or None) holds for kernels this run did not time, marked "earlier_run": a forced re-tune
    adds to a bucket's record instead of erasing it. The winner is chosen from this run's alone (times
    from another run are not comparable to a few per cent)."""
    if earlier is None:
        return timings
    timed = {json.dumps(t.get("schedule"), sort_keys=True) for t in timings}
    return timings + [dict(t, earlier_run=True) for t in earlier.all_timings
                      if json.dumps(t.get("schedule"), sort_keys=True) not in timed]


def run(args) -> int:
    try:
        targets = targets_from_args(args)
        buckets = parse_buckets(args.buckets)
        args.families = parse_families(args.families)
        if args.top < 1:
            raise ValueError(f"--top must be at least 1, got {args.top}")
        if args.restart and not args.force:
            raise ValueError("--restart starts a forced re-tune over: it goes with --force")
        if args.between and args.dry_run:
            raise ValueError("--between chooses how candidates are timed on the GPU; a --dry-run times nothing")
        if args.refine < 0:
            raise ValueError(f"--refine must be 0 (no second round) or more, got {args.refine}")
        if args.time_budget <= 0:
            raise ValueError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
        args.seed_records = load_seeds(args.seed) if args.seed else []
        axes = parse_axes(args.axes)
        args.variant_changes = parse_variants(args.variants)
        if args.variant_changes and not args.force:
            raise ValueError("--variants changes the current winners of the buckets it re-tunes: it goes with --force")
    except ValueError as exc:
        print(f"gen tune: {exc}", file=sys.stderr)
        return 2
    with searched_axes(axes):
        return _run(args, targets, buckets)


def _run(args, targets: list[Target], buckets: list[int]) -> int:
    if args.dry_run:
        return dry_run(args, targets, buckets)
    import torch

    if not torch.cuda.is_available():
        print("gen tune: no CUDA GPU is visible, so no kernel can be checked or timed.\n"
              "To compile the candidates and rank them by the cost model only, add --dry-run --arch sm_90a "
              "(or sm_80).", file=sys.stderr)
        return 2
    return tune_on_gpu(args, targets, buckets)


def load_seeds(path: str) -> list[dict]:
    """The records of a `gen sweep --json` file, or of a tuned table (another run's or machine's: each
    entry's recorded timings as a sweep record at the bucket's edge), for --seed; a missing or
    unreadable file, or one that is neither, is a ValueError that says so."""
    try:
        with open(path) as f:
            records = json.load(f)
    except OSError as exc:
        raise ValueError(f"--seed {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--seed {path} is not JSON ({exc})") from None
    if isinstance(records, dict) and records.get("format") == TABLE_FORMAT:
        try:
            table = TunedTable.from_json(records)
        except TableError as exc:
            raise ValueError(f"--seed {path}: {exc}") from None
        return [{"problem": e["problem"], "m": e["bucket"],
                 "results": e["all_timings"] or [{"schedule": e["schedule"], "us": e["us"]}]}
                for e in table.to_json()["entries"]]
    if not isinstance(records, list):
        raise ValueError(f"--seed {path} is neither a `gen sweep --json` file (a list of records) nor a tuned table")
    return records


def entry_in_harness(table, problem: Problem, bucket: int, harness: str):
    """The table's entry for (problem, bucket) if it was timed in `harness`, else None: times and a
    winner from the other harness answer another question, so they are neither resumed nor kept."""
    entry = table.entry(problem, bucket)
    return entry if entry is not None and entry.harness == harness else None


def pending_pairs(targets: list[Target], buckets: list[int], table, force: bool,
                  harness: str = REPLAY) -> list[tuple[Problem, int]]:
    """The (problem, bucket) pairs to tune: those without an entry timed in `harness`, or all of
    them with --force."""
    return [(t.problem, b) for t in targets for b in buckets
            if force or entry_in_harness(table, t.problem, b, harness) is None]


class ForcedRun:
    """The buckets that a `gen tune --force` run has finished, in a file beside the table: the table
    alone cannot tell a re-tuned bucket from an old one, so without it an interrupted forced re-tune
    could only start over. The same pairs forced again resume; other pairs (or --restart) start
    afresh; the file goes when the run completes."""

    def __init__(self, table_path, pairs: list[tuple[Problem, int]]):
        self.path = Path(table_path).with_suffix(".force-progress")
        self.pairs = sorted(f"{p.name}@{b}" for p, b in pairs)
        self.done: set[str] = set()

    @classmethod
    def resume(cls, table_path, pairs: list[tuple[Problem, int]]) -> "ForcedRun":
        run = cls(table_path, pairs)
        try:
            saved = json.loads(run.path.read_text())
            if saved.get("pairs") == run.pairs:
                run.done = set(saved.get("done", [])) & set(run.pairs)
        except (OSError, ValueError, AttributeError):
            pass      # none, unreadable or not ours: start afresh (it is only a shortcut)
        return run

    def is_done(self, problem: Problem, bucket: int) -> bool:
        return f"{problem.name}@{bucket}" in self.done

    def finished(self, problem: Problem, bucket: int) -> None:
        from runtime.table import atomic_write

        self.done.add(f"{problem.name}@{bucket}")
        atomic_write(self.path, json.dumps({"pairs": self.pairs, "done": sorted(self.done)}))

    def complete(self) -> None:
        self.path.unlink(missing_ok=True)


def compile_with_progress(searches, arch, workers) -> None:
    """Compile the searches' candidates in parallel behind a progress bar (the dry run)."""
    from tqdm import tqdm

    from .search import compile_candidates, compile_jobs

    with tqdm(total=len(compile_jobs(searches)), desc=f"compile ({arch.name})", unit="kernel") as bar:
        compile_candidates(searches, arch, workers=workers, progress=_CompileBar(bar))


class _CompileBar:
    """compile_many's progress callback: a bar step per job, and the failures counted beside it."""

    def __init__(self, bar, on_failure=None):
        self.bar, self.failed, self.on_failure = bar, 0, on_failure

    def __call__(self, job, error) -> None:
        if error is not None:
            self.failed += 1
            if self.on_failure:
                self.on_failure(job)
        self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)


def compile_and_measure_with_progress(searches, arch, workers, labels: dict, label="check + time",
                                      on_bucket=None, between: bool = False) -> None:
    """Compile and measure the searches' new candidates (the GPU measures a problem while the CPU
    compiles the next, search.compile_and_measure), behind two progress bars (shared with gen sweep).
    `labels` names each problem on the measuring bar; `between` picks the harness (measure_problem)."""
    from collections import Counter

    from tqdm import tqdm

    from .search import compile_and_measure, compile_jobs, measure_problem

    per_job = Counter((s.problem, r.schedule) for s in searches for r in s.results if r.error is None and r.us is None)
    with tqdm(total=len(compile_jobs(searches)), desc=f"compile ({arch.name})", unit="kernel", position=0) as built, \
            tqdm(total=sum(per_job.values()), desc=label, unit="cand", position=1) as measured:
        def not_measured(job):   # a kernel that did not compile is never measured
            measured.total -= per_job[job]
            measured.refresh()

        def measure(problem, *args, **kwargs):
            measured.set_postfix_str(labels.get(problem, problem.name), refresh=True)
            return measure_problem(problem, *args, **kwargs)

        compile_and_measure(searches, arch, workers, compiled=_CompileBar(built, not_measured),
                            progress=lambda _: measured.update(1), on_bucket=on_bucket, measure=measure,
                            between=between)


def expected_round_s(past: list[tuple[int, float]], added: int) -> float:
    """Seconds a local round of `added` candidates should take, from the (candidates, seconds) of the
    rounds before it: a straight line through them when two or more differ in size (never below
    their slowest second per candidate at zero fixed cost), else ROUND_FIXED_S (at most half the last
    round) plus the last round's seconds per candidate on the rest."""
    if len({n for n, _ in past}) >= 2:
        slope, fixed = statistics.linear_regression([n for n, _ in past], [t for _, t in past])
        if slope >= 0 and fixed >= 0:
            return fixed + slope * added
        return added * max(t / n for n, t in past)
    n, took = past[-1]
    fixed = min(ROUND_FIXED_S, took / 2)
    return fixed + (took - fixed) * added / n


def local_rounds(searches, args, arch, spec, labels: dict, started: float, record, finished) -> None:
    """Rounds two and on (--refine places per bucket): the neighbours of what measured fastest, the
    winners of the buckets beside and of the other layers at the same M (search.add_refinements);
    round two for every bucket, each later one only where the round before moved the winner, and only
    if it is expected to end within --time-budget of `started` (expected_round_s, from the rounds
    before it). record(search) saves a measured bucket; finished(searches) marks buckets done."""
    from .search import add_refinements

    active = list(searches) if args.refine else []
    past = []       # (candidates, seconds) of the rounds run
    for round_no in range(2, 2 + REFINE_ROUNDS):
        if not active:
            return
        round_started = time.monotonic()
        had = {id(s): len(s.results) for s in active}
        before = {id(s): s.winner() for s in active}
        added = add_refinements(searches, arch, spec, per_bucket=args.refine, only=active)
        if round_no > 2 and added:
            expected = expected_round_s(past, added)
            if round_started - started + expected > args.time_budget:
                for s in active:
                    del s.results[had[id(s)]:]
                print(f"round {round_no} ({added} candidates, about {expected:.0f} s) skipped: it would end "
                      f"past --time-budget {args.time_budget:.0f} s")
                return
        print(f"round {round_no}: {added} candidates added around the measured winners (--refine {args.refine})")
        if not added:
            return
        compile_and_measure_with_progress(searches, arch, args.workers, labels, f"check + time, round {round_no}",
                                          on_bucket=record, between=args.between)
        past.append((added, time.monotonic() - round_started))
        moved = [s for s in active if s.winner() is not before[id(s)]]
        print(f"round {round_no} took {past[-1][1]:.0f} s and moved {len(moved)} of {len(active)} winners "
              f"({time.monotonic() - started:.0f} s in all)")
        finished([s for s in active if s.winner() is before[id(s)]])
        active = moved


def tune_on_gpu(args, targets: list[Target], buckets: list[int]) -> int:
    from runtime.table import GpuKey, TunedTable, table_path
    from schedules.arch import current_arch, get_arch
    from schedules.cost import GpuSpec

    from .search import MeasureError, achieved_gbps, add_incumbents, add_seeds, add_variants, plan

    arch = current_arch()
    if args.arch and get_arch(args.arch) != arch:
        print(f"gen tune: --arch {args.arch} does not match this GPU ({arch.name}); kernels are tuned for the "
              "GPU they run on (use --dry-run to compile for another arch)", file=sys.stderr)
        return 2
    started = time.monotonic()
    gpu = GpuKey.current()
    path = table_path(gpu)
    table = TunedTable.load(path, gpu)
    harness = BETWEEN if args.between else REPLAY
    pending = pending_pairs(targets, buckets, table, args.force, harness)
    forced = None
    if args.force:
        forced = ForcedRun(path, pending) if args.restart else ForcedRun.resume(path, pending)
        if forced.done:
            print(f"resuming the forced re-tune of these buckets: {len(forced.done)} of {len(pending)} done "
                  "(--restart to start over)")
            pending = [(p, b) for p, b in pending if not forced.is_done(p, b)]
    print(f"tuning on {gpu.name} ({gpu.arch}, {gpu.sm_count} SMs): {len(targets)} shapes x {len(buckets)} buckets, "
          f"{len(pending)} to tune, {len(targets) * len(buckets) - len(pending)} already in {path}"
          + (", timing every call after the activations' producer (--between)" if args.between else ""))

    spec = GpuSpec.current()
    searches = plan(pending, arch, spec, top=args.top, families=args.families, workers=args.workers)
    add_incumbents(searches, table, arch, spec, args.families)   # with --force: re-measure the winners
    if args.variant_changes:
        varied = add_variants(searches, table, args.variant_changes, arch, spec, families=args.families)
        print(f"{varied} variants of the current winners added (--variants {args.variants})")
    if args.seed_records:
        seeded = add_seeds(searches, args.seed_records, arch, spec, families=args.families)
        print(f"{seeded} candidates added from the sweep {args.seed}")

    def record(search):
        best = search.winner()
        if best is not None:
            earlier = entry_in_harness(table, search.problem, search.bucket, harness)
            timings = with_earlier_timings(search.timings(), earlier)
            table.record(search.problem, search.bucket, best.schedule, best.us, fp16_us=search.fp16_us,
                         gbps=achieved_gbps(search.problem, search.bucket, best.us), all_timings=timings,
                         harness=harness)
            table.save(path)   # after every bucket: an interrupted run resumes from here

    def finished(done):
        if forced:
            for search in done:
                forced.finished(search.problem, search.bucket)

    labels = {t.problem: t.label for t in targets}
    try:
        compile_and_measure_with_progress(searches, arch, args.workers, labels, on_bucket=record,
                                          between=args.between)
        local_rounds(searches, args, arch, spec, labels, started, record, finished)
        finished(searches)
    except MeasureError as exc:
        print(f"gen tune: {exc}", file=sys.stderr)
        return 1
    if forced:
        forced.complete()

    unsolved = [s for s in searches if s.winner() is None]
    print_results(targets, buckets, table)
    for s in unsolved:
        reasons = sorted({(r.error or "").split(":")[0] for r in s.results}) or ["no valid schedule"]
        print(f"no correct candidate for {s.problem.name} at bucket {s.bucket} ({', '.join(reasons)}); "
              "the runtime will use the cost model's pick there", file=sys.stderr)
    print(f"tuned table: {path}")
    return 1 if unsolved else 0


def print_results(targets: list[Target], buckets: list[int], table) -> None:
    rows = []
    for t in targets:
        for b in buckets:
            e = table.entry(t.problem, b)
            if e is None:
                rows.append([t.label, f"{t.problem.k}x{t.problem.n}", b, "-", "-", "-", "-"])
                continue
            rows.append([t.label, f"{t.problem.k}x{t.problem.n}", b, e.schedule.name, f"{e.us:.1f}",
                         f"{e.speedup:.2f}x" if e.speedup else "-", f"{e.gbps:.0f}" if e.gbps else "-"])
    print(format_table(["layer", "KxN", "bucket", "winner", "us", "vs FP16", "GB/s"], rows))


def dry_run(args, targets: list[Target], buckets: list[int]) -> int:
    from schedules.arch import get_arch
    from schedules.cost import GpuSpec

    from .search import plan

    try:
        arch = get_arch(args.arch or "sm_90a")
        spec = GpuSpec.for_arch(arch)
    except ValueError as exc:
        print(f"gen tune: {exc}", file=sys.stderr)
        return 2
    print(f"DRY RUN for {arch.name}: candidates are compiled but nothing is measured; they are ranked by the "
          f"cost model only (estimates for {spec.name}), and no tuned table is written"
          + (" (no second round: --refine works from measured times)." if args.refine else "."))
    searches = plan([(t.problem, b) for t in targets for b in buckets], arch, spec, top=args.top,
                    families=args.families, workers=args.workers)
    compile_with_progress(searches, arch, args.workers)

    labels = {t.problem: t.label for t in targets}
    rows = []
    for s in searches:
        ok = [r for r in s.results if r.error is None]
        best = ok[0] if ok else None   # results are in estimate order
        rows.append([labels[s.problem], f"{s.problem.k}x{s.problem.n}", s.bucket,
                     best.schedule.name if best else "(none compiled)",
                     f"{best.estimate_us:.1f}" if best else "-", f"{len(ok)}/{len(s.results)}"])
        for r in s.results:
            if r.error:
                print(f"  {labels[s.problem]} bucket {s.bucket}: {r.schedule.name}: {r.error}", file=sys.stderr)
    print(format_table(["layer", "KxN", "bucket", "best by cost model", "estimate us", "compiled"], rows))
    print("DRY RUN: these are cost-model estimates, not measurements; run without --dry-run on the GPU to tune.")
    return 0 if all(any(r.error is None for r in s.results) for s in searches) else 1


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain, aligned text table."""
    cells = [[str(c) for c in row] for row in [headers] + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
