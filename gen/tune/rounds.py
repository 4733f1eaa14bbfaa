"""The rounds of a tune on the GPU, behind progress bars: compile and measure a round's candidates
(shared with `gen sweep`), then the local rounds around the measured winners, each only if it is
expected to end within the time budget.
"""
from __future__ import annotations

import statistics
import time

from gen.tune.search import REFINE_ROUNDS, add_refinements

# A local round costs about this much besides its candidates' compiles and timings (a cold tune of
# llama-2-7b on the H200: rounds of 312, 216 and 72 candidates took 121, 99 and 56 s, ~36 s + 0.27 s
# per candidate; scaling the last round's seconds per candidate alone sent round four past the budget).
ROUND_FIXED_S = 30.0


def compile_with_progress(searches, arch, workers) -> None:
    """Compile the searches' candidates in parallel behind a progress bar (the dry run)."""
    from tqdm import tqdm

    from gen.tune.measuring import compile_candidates, compile_jobs

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
    compiles the next, measuring.compile_and_measure), behind two progress bars (shared with gen sweep).
    `labels` names each problem on the measuring bar; `between` picks the harness (measure_problem)."""
    from collections import Counter

    from tqdm import tqdm

    from gen.tune.measuring import compile_and_measure, compile_jobs, measure_problem

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


def local_rounds(searches, args, arch, spec, labels: dict, started: float, record, finished,
                 first_round: tuple[int, float]) -> None:
    """Rounds two and on (--refine places per bucket): the neighbours of what measured fastest, the
    winners of the buckets beside and of the other layers at the same M (add_refinements);
    round two for every bucket, each later one only where the round before moved the winner, each
    only if it is expected to end within --time-budget of `started` (expected_round_s, from the
    rounds before it, round one's (candidates, seconds) `first_round` among them), so that a tune
    fits the time it is given. record(search) saves a measured bucket; finished(searches) marks
    buckets done."""
    active = list(searches) if args.refine else []
    past = [first_round]       # (candidates, seconds) of the rounds run
    for round_no in range(2, 2 + REFINE_ROUNDS):
        if not active:
            return
        round_started = time.monotonic()
        had = {id(s): len(s.results) for s in active}
        before = {id(s): s.winner() for s in active}
        added = add_refinements(searches, arch, spec, per_bucket=args.refine, only=active)
        if added:
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
