"""A forced re-tune that resumes counts a bucket as done only where the table still holds it, timed in
this run's harness: after `gen cache clear --tables`, a table replaced as stale (another TileLang), or
an interrupted run in the other harness, those buckets are tuned again."""
import itertools
import pytest

import runtime.table as table_module
import runtime.kernels as kernels
from gen.cli import main as gen_main
from gen.tune import measuring
from runtime.table import TunedTable, table_path
from schedules.problem import Problem
from tests.fake_gpu import H200, pretend_h200

GPU = H200
P = Problem.make(n=4096, k=4096)
ARGS = ["tune", "--shapes", "4096x4096", "--buckets", "1,2", "--families", "marlin_mma", "--top", "2", "--refine", "2",
        "--force"]


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(table_module, "shipped_tables_dir", lambda: tmp_path / "shipped")
    pretend_h200(monkeypatch)
    return tmp_path


def interrupted_forced_run(monkeypatch, args=ARGS):
    """Round 1 measures both buckets; round 2 leaves bucket 1's winner alone (done) and moves bucket
    2's; round 3 fails: the forced run stops with bucket 1 noted as done."""
    calls = itertools.count(1)

    def measure(problem, arch, mine, progress=None, on_bucket=None, **_):
        n = next(calls)
        if n == 3:
            raise measuring.MeasureError("interrupted")
        for x in mine:
            x.fp16_us = 50.0
            for r in x.results:
                if r.us is None and r.error is None:
                    r.us, r.rel_err = (10.0 if n == 1 else (100.0 if x.bucket == 1 else 1.0)), 1e-4
                    progress and progress(r)
            on_bucket(x)
    monkeypatch.setattr(measuring, "measure_problem", measure)
    assert gen_main(args) == 1


def simple_measure(monkeypatch):
    def measure(problem, arch, mine, progress=None, on_bucket=None, **_):
        for x in mine:
            x.fp16_us = 50.0
            for r in x.results:
                if r.us is None and r.error is None:
                    r.us, r.rel_err = 10.0, 1e-4
            on_bucket(x)
    monkeypatch.setattr(measuring, "measure_problem", measure)


def both_buckets_tuned(harness="replay"):
    table = TunedTable.load(table_path(GPU), GPU)
    return all(table.entry(P, b) is not None and table.entry(P, b).harness == harness for b in (1, 2))


def test_a_resumed_forced_run_tunes_buckets_the_cleared_table_lost(fake_gpu, monkeypatch):
    interrupted_forced_run(monkeypatch)
    assert gen_main(["cache", "clear", "--tables"]) == 0
    simple_measure(monkeypatch)
    assert gen_main(ARGS) == 0
    assert both_buckets_tuned()


def test_a_resumed_forced_run_tunes_buckets_of_a_stale_table(fake_gpu, monkeypatch):
    interrupted_forced_run(monkeypatch)
    monkeypatch.setattr(kernels, "tilelang_version", lambda: "99.0-upgraded")
    simple_measure(monkeypatch)
    assert gen_main(ARGS) == 0
    assert both_buckets_tuned()


def test_a_forced_run_resumed_in_the_other_harness_times_every_bucket_again(fake_gpu, monkeypatch):
    interrupted_forced_run(monkeypatch, ARGS + ["--between"])
    simple_measure(monkeypatch)
    assert gen_main(ARGS) == 0
    assert both_buckets_tuned("replay")
