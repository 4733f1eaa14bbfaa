"""`gen sweep`: the knob grid, argument errors, the report, and (on a GPU) one small sweep end to end."""
import argparse
import json

import pytest

from gen.dev import sweep
from gen.tune.command import format_table
from gen.tune.options import Target
from gen.tune.search import BucketSearch, Result
from schedules import marlin_mma, stream_mma
from schedules.problem import Problem
from schedules.registry import Schedule


def call(capsys, *argv):
    parser = argparse.ArgumentParser(prog="gen")
    sweep.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sweep", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_grid_is_the_product_and_keeps_defaults():
    grid = sweep.parse_grid(stream_mma, "warps=4,8 fold_zero_point=0,true split_k=2")
    assert len(grid) == 4
    assert {(k.warps, k.fold_zero_point) for k in grid} == {(4, False), (4, True), (8, False), (8, True)}
    default = stream_mma.Knobs()
    assert all(k.split_k == 2 and k.unroll == default.unroll and k.m_tiles == default.m_tiles for k in grid)
    assert sweep.parse_grid(marlin_mma, "") == [marlin_mma.Knobs()]


@pytest.mark.parametrize("text,message", [
    ("wraps=4", "has no knob 'wraps'"),
    ("warps=4 warps=8", "given twice"),
    ("warps=four", "takes integers"),
    ("fold_zero_point=2", "is a flag"),
    ("warps", "expected name=value"),
])
def test_grid_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        sweep.parse_grid(stream_mma, text)


def test_cli_errors_without_measuring(capsys, monkeypatch):
    rc, _, err = call(capsys, "--family", "nope", "--shapes", "1024x256")
    assert rc == 2 and "unknown schedule family" in err
    rc, _, err = call(capsys, "--family", "stream_mma", "--shapes", "1024x256", "--ms", "3")
    assert rc == 2 and "--ms must be bucket edges" in err
    rc, _, err = call(capsys, "--family", "stream_mma")
    assert rc == 2 and "--model" in err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = call(capsys, "--family", "stream_mma", "--shapes", "1024x256", "--knobs", "warps=4")
    assert rc == 2 and "needs one" in err


def test_report_sorts_each_layer_and_sums_the_best():
    a, b = Problem(256, 1024), Problem(512, 1024)
    k1, k2 = stream_mma.Knobs(warps=4), stream_mma.Knobs(warps=8)
    s = lambda k: Schedule("stream_mma", k)
    searches = [
        BucketSearch(a, 1, [Result(s(k1), 1.0, us=6.0), Result(s(k2), 1.0, us=4.0)], fp16_us=12.0),
        BucketSearch(b, 1, [Result(s(k1), 1.0, us=5.0), Result(s(k2), 1.0, error="wrong: 0.5")], fp16_us=10.0),
        BucketSearch(a, 16, [Result(s(k1), 1.0, error="compile: nvcc")], fp16_us=12.0),
        BucketSearch(b, 16, [Result(s(k1), 1.0, us=7.0)], fp16_us=10.0),
    ]
    text = sweep.report([Target(a, ["a"]), Target(b, ["b"])], [1, 16], searches, 5, format_table)
    row_a1 = next(line for line in text.splitlines() if line.startswith("a ") and " 1 " in line)
    assert "3.00x" in row_a1 and row_a1.index(k2.name) < row_a1.index(k1.name)
    assert "(none correct)" in text
    summed = text.split("\n\n")[1]
    assert "22.0" in summed and "9.0" in summed and "2.44x" in summed   # M=1: (12 + 10) / (4 + 5)
    assert not any(line.startswith("16 ") for line in summed.splitlines())  # M=16 has a layer without a time


@pytest.mark.gpu
def test_sweep_times_a_small_grid_end_to_end(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "cache"))
    out_json = tmp_path / "sweep.json"
    rc, out, err = call(capsys, "--family", "stream_mma", "--knobs", "warps=2,4 unroll=4", "--shapes", "1024x256",
                        "--ms", "1,16", "--json", str(out_json), "--workers", "2")
    assert rc == 0, err
    records = json.loads(out_json.read_text())
    assert len(records) == 2 and all(len(r["results"]) == 2 for r in records)
    for r in records:
        assert r["fp16_us"] > 0
        for res in r["results"]:
            assert res["error"] is None and res["us"] > 0 and res["rel_err"] < 2e-3
    assert "speedup" in out


def test_gen_compile_parses_knobs_the_same_way():
    from gen.dev.compile_cmd import parse_knobs

    assert parse_knobs(stream_mma, "warps=8,fold_zero_point=yes") == stream_mma.Knobs(warps=8, fold_zero_point=True)
    for bad in ("warps=eight", "fold_zero_point=maybe", "wraps=4", "warps"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad knob"):
            parse_knobs(stream_mma, bad)


def test_a_sweep_cut_short_keeps_what_it_measured(capsys, tmp_path, monkeypatch):
    """Without a GPU (faked): the --json file holds every finished bucket before the sweep ends, so a
    sweep stopped by a time limit or a broken GPU still leaves its measurements."""
    from gen.tune import measuring
    from tests.fake_gpu import pretend_h200

    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "cache"))
    pretend_h200(monkeypatch)
    out_json = tmp_path / "sweep.json"

    def measure(problem, arch, mine, progress=None, on_bucket=None, between=False):
        assert between                   # --between is passed on to the measuring
        if problem.n == 1024:
            assert len(json.loads(out_json.read_text())) == 2     # the first layer's buckets are on disk already
            raise measuring.MeasureError("the GPU fell off the bus")
        for x in mine:
            x.fp16_us = 9.0
            for r in x.results:
                r.us, r.rel_err = 3.0, 1e-4
                progress(r)
            on_bucket(x)

    monkeypatch.setattr(measuring, "measure_problem", measure)
    rc, _, err = call(capsys, "--family", "stream_mma", "--knobs", "warps=4,8 unroll=4", "--shapes", "4096x4096,4096x1024",
                      "--ms", "1,16", "--json", str(out_json), "--between")
    assert rc == 1 and "fell off the bus" in err
    records = json.loads(out_json.read_text())
    assert [(r["problem"]["n"], r["m"]) for r in records] == [(4096, 1), (4096, 16)]
    assert all(res["us"] == 3.0 for r in records for res in r["results"])
    assert all(r["harness"] == "between" for r in records)      # what gen modelcheck leaves out
