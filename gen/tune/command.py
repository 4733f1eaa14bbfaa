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

import json
import sys
import time
from pathlib import Path

from runtime.table import BETWEEN, BUCKETS, REPLAY
from schedules.problem import Problem

from gen.models import add_layer_arguments
from gen.tune.measuring import MeasureError
from gen.tune.options import (Target, load_seeds, parse_axes, parse_buckets, parse_families, parse_variants,
                              positive_workers, searched_axes, targets_from_args)
from gen.tune.rounds import compile_and_measure_with_progress, compile_with_progress, local_rounds
from gen.tune.search import (DEFAULT_REFINE, DEFAULT_TOP, REFINE_ROUNDS, achieved_gbps, add_incumbents, add_seeds,
                             add_siblings, add_transfers, add_variants, plan)

# A cold `gen tune --model llama-2-7b` must finish within 10 minutes on the H200 (docs/performance.md,
# "The cold tune's time"): planning and rounds one and two take ~430 s there, so later rounds get what
# is left of 520 s. A shorter budget skips round two too where it would end past it.
DEFAULT_TIME_BUDGET_S = 520.0


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="tune kernels for a model's linear layers on this GPU",
                              description=__doc__.split("\n\n")[0])
    add_layer_arguments(p)
    p.add_argument("--buckets", help=f"M buckets to tune, comma separated (default: all of {','.join(map(str, BUCKETS))})")
    p.add_argument("--top", type=int, default=DEFAULT_TOP, help="candidates per bucket to compile and measure: each family's top//2 best, then the best "
                        "of the rest")
    p.add_argument("--refine", type=int, default=DEFAULT_REFINE,
                   help="candidates per bucket in each local round around the fastest so far (one knob a step "
                        "away, the winners of the buckets beside and of the other layers at the same M); up to "
                        f"{REFINE_ROUNDS} rounds after the first, each after round two only where the winner "
                        "moved; 0 = one round only")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="SECONDS",
                   help="a local round (after round one) starts only if it is expected to end within this many "
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
                        "combination): an A/B of a prepared knob in one run; needs --force, e.g. --force --top 1 "
                        "--refine 0")
    p.add_argument("--between", action="store_true",
                   help="time every candidate (and FP16) after the activations' producer, as a model runs its GEMMs, "
                        "instead of back to back (gen bench --between); buckets tuned the other way are re-tuned, "
                        "and the table records the harness per entry")
    p.add_argument("--families", help="schedule families to search, comma separated (default: marlin_mma, stream_mma and stream_wgmma where the arch offers them)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: compile the candidates for --arch and rank them by the cost model only")
    p.add_argument("--arch", help="target arch for --dry-run (default sm_90a); with a GPU it must match the GPU")
    p.add_argument("--workers", type=positive_workers,
                   help="parallel ranking and compile processes (default: one per CPU core)")
    p.set_defaults(func=run)


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
        if args.dry_run and args.arch and any(t.problem.fp8 for t in targets):
            from schedules.arch import get_arch

            if not get_arch(args.arch).hopper:
                raise ValueError(f"--act fp8 (W4A8) runs on FP8 wgmma, sm_90a; {args.arch} has none")
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
    afresh; the file goes when the run completes. It is written under the table's lock and merged
    with what is on disk, so that two tuners forcing the same pairs each keep the other's buckets."""

    def __init__(self, table_path, pairs: list[tuple[Problem, int]]):
        self.table_path = Path(table_path)
        self.path = self.table_path.with_suffix(".force-progress")
        self.pairs = sorted(f"{p.name}@{b}" for p, b in pairs)
        self.done: set[str] = set()

    @classmethod
    def resume(cls, table_path, pairs: list[tuple[Problem, int]]) -> "ForcedRun":
        run = cls(table_path, pairs)
        run.done = run._saved()
        return run

    @classmethod
    def restart(cls, table_path, pairs: list[tuple[Problem, int]]) -> "ForcedRun":
        run = cls(table_path, pairs)
        run.complete()        # an interrupted run's buckets no longer count
        return run

    def _saved(self) -> set[str]:
        """The buckets the file on disk notes for the same pairs (none: missing, unreadable or another run's)."""
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("pairs") == self.pairs:
                return set(saved.get("done", [])) & set(self.pairs)
        except (OSError, ValueError, AttributeError, TypeError):
            pass      # it is only a shortcut: start afresh
        return set()

    def is_done(self, problem: Problem, bucket: int) -> bool:
        return f"{problem.name}@{bucket}" in self.done

    def finished(self, problem: Problem, bucket: int) -> None:
        from runtime.cache_files import atomic_write, table_lock

        self.done.add(f"{problem.name}@{bucket}")
        with table_lock(self.table_path):
            self.done |= self._saved()
            atomic_write(self.path, json.dumps({"pairs": self.pairs, "done": sorted(self.done)}))

    def complete(self) -> None:
        from runtime.cache_files import table_lock

        with table_lock(self.table_path):
            self.path.unlink(missing_ok=True)


def unwritable_cache(folders) -> str | None:
    """Why a run cannot write into `folders` (created where missing), naming the folder and
    TILEMARLIN_CACHE_DIR, or None: checked before anything is compiled or measured."""
    from runtime.cache_files import writable_folder

    try:
        for folder in folders:
            writable_folder(folder)
    except PermissionError as exc:
        return str(exc)
    return None


def tune_on_gpu(args, targets: list[Target], buckets: list[int]) -> int:
    from runtime.kernels import kernel_dir
    from runtime.table import (GpuKey, TunedTable, history_path_of, load_tuned_table, table_path,
                               winners_for_arch)
    from schedules.arch import current_arch, get_arch
    from schedules.cost import GpuSpec

    arch = current_arch()
    if args.arch and get_arch(args.arch) != arch:
        print(f"gen tune: --arch {args.arch} does not match this GPU ({arch.name}); kernels are tuned for the "
              "GPU they run on (use --dry-run to compile for another arch)", file=sys.stderr)
        return 2
    started = time.monotonic()
    gpu = GpuKey.current()
    path = table_path(gpu)
    why = unwritable_cache((path.parent, history_path_of(path).parent, kernel_dir()))
    if why:
        print(f"gen tune: the tuned table, its history and the compiled kernels are written as the tune goes, "
              f"but {why}", file=sys.stderr)
        return 2
    table = TunedTable.load(path, gpu, history=True)   # a re-tune keeps the earlier candidates' timings
    harness = BETWEEN if args.between else REPLAY
    pending = pending_pairs(targets, buckets, table, args.force, harness)
    forced = None
    if args.force:
        forced = ForcedRun.restart(path, pending) if args.restart else ForcedRun.resume(path, pending)
        if forced.done:
            print(f"resuming the forced re-tune of these buckets: {len(forced.done)} of {len(pending)} done "
                  "(--restart to start over)")
            # done only where the table still holds the bucket in this harness: a cleared or stale
            # table, or a run in the other harness, leaves nothing to resume from
            pending = [(p, b) for p, b in pending
                       if not (forced.is_done(p, b) and entry_in_harness(table, p, b, harness) is not None)]
    print(f"tuning on {gpu.name} ({gpu.arch}, {gpu.sm_count} SMs): {len(targets)} shapes x {len(buckets)} buckets, "
          f"{len(pending)} to tune, {len(targets) * len(buckets) - len(pending)} already in {path}"
          + (", timing every call after the activations' producer (--between)" if args.between else ""))

    spec = GpuSpec.current()
    searches = plan(pending, arch, spec, top=args.top, families=args.families, workers=args.workers)
    add_incumbents(searches, table, arch, spec, args.families)   # with --force: re-measure the winners
    if not args.axes:   # knob development (--axes) measures its own grid alone
        add_siblings(searches, table, arch, spec, args.families)  # and the neighbouring buckets' kernels
        # buckets tuned before have their winner measured again instead (add_incumbents), and their
        # twins' winners (the same shape symmetric, or in the other dtype): after a kernel change those
        # are the likeliest to have become the fastest, and the cost model may not rank them first
        fresh = [s for s in searches if table.entry(s.problem, s.bucket) is None]
        retuned = [s for s in searches if table.entry(s.problem, s.bucket) is not None]
        shipped, winners = load_tuned_table(gpu), winners_for_arch(arch.name)
        transfers = add_transfers(fresh, shipped, winners, arch, spec, families=args.families)
        transfers += add_transfers(retuned, shipped, winners, arch, spec, families=args.families, twins_only=True)
        print(f"{transfers} candidates added from the tuned winners of twins and of other shapes")
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
        round_started = time.monotonic()
        compile_and_measure_with_progress(searches, arch, args.workers, labels, on_bucket=record,
                                          between=args.between)
        first_round = (sum(len(s.results) for s in searches), time.monotonic() - round_started)
        local_rounds(searches, args, arch, spec, labels, started, record, finished, first_round)
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

    from runtime.kernels import kernel_dir

    try:
        arch = get_arch(args.arch or "sm_90a")
        spec = GpuSpec.for_arch(arch)
    except ValueError as exc:
        print(f"gen tune: {exc}", file=sys.stderr)
        return 2
    why = unwritable_cache((kernel_dir(),))
    if why:
        print(f"gen tune: a dry run compiles its candidates into the kernel store, but {why}", file=sys.stderr)
        return 2
    print(f"DRY RUN for {arch.name}: candidates are compiled but nothing is measured; they are ranked by the "
          f"cost model only (estimates for {spec.name}), and no tuned table is written"
          + (" (no second round: --refine works from measured times)." if args.refine else "."))
    searches = plan([(t.problem, b) for t in targets for b in buckets], arch, spec, top=args.top,
                    families=args.families, workers=args.workers)
    compile_with_progress(searches, arch, args.workers)

    from schedules.registry import SEARCHED

    labels = {t.problem: t.label for t in targets}
    families = args.families or SEARCHED
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
        if not s.results:
            print(f"  {labels[s.problem]} bucket {s.bucket}: no schedule of {', '.join(families)} fits "
                  f"{s.problem.name} on {arch.name}", file=sys.stderr)
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
