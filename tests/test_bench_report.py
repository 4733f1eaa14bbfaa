"""`gen bench` without a GPU: the report from a recorded sample, the command line, the no-GPU exit.

tests/data/bench_sample.json is a hand-made fixture in the recorded format (two layers, M = 1, 16,
4096; one failed torch_int4 point; humming skipped). Its numbers are chosen so the sums are easy to
check by hand: FP16 40 / 41 / 940 us, tilemarlin 20 / 22 / 1000 us.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from gen.bench import command as bench
from gen.bench import common as bench_common
from gen.bench import contenders, report

SAMPLE = Path(__file__).parent / "data" / "bench_sample.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gen")
    bench.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


@pytest.fixture
def sample() -> dict:
    return report.load(SAMPLE)


# --- the report from the recorded sample ---------------------------------------------------------------

def test_sample_is_marked_as_a_fixture(sample):
    assert "not a measurement" in sample["meta"]["fixture"].lower()


def test_summed_times_cover_only_kernels_measured_on_every_layer(sample):
    summed = report.summed_times(sample)
    assert summed[1] == pytest.approx({"fp16": 40.0, "tilemarlin": 20.0, "torch_int4": 22.0})
    assert summed[16] == pytest.approx({"fp16": 41.0, "tilemarlin": 22.0, "torch_int4": 80.0})
    # torch_int4 failed on qkv at M=4096: summing o alone would flatter it, so there is no sum
    assert summed[4096] == pytest.approx({"fp16": 940.0, "tilemarlin": 1000.0})


def test_summed_speedups(sample):
    gains = report.speedups(report.summed_times(sample))
    assert gains[1]["tilemarlin"] == pytest.approx(2.0)
    assert gains[1]["torch_int4"] == pytest.approx(40.0 / 22.0)
    assert gains[16]["tilemarlin"] == pytest.approx(41.0 / 22.0)
    assert gains[16]["torch_int4"] == pytest.approx(41.0 / 80.0)
    assert gains[4096] == pytest.approx({"tilemarlin": 0.94})


def test_layer_times_leave_out_failed_points(sample):
    qkv = report.layer_times(sample, "qkv")
    assert qkv[4096] == {"fp16": 700.0, "tilemarlin": 750.0}
    assert report.layer_times(sample, "o")[4096]["torch_int4"] == 4000.0


def test_kernels_put_the_baseline_first_and_drop_skipped_ones(sample):
    assert report.kernels(sample) == ["fp16", "tilemarlin", "torch_int4"]


def test_ideal_int4_speedup_from_the_ceilings(sample):
    ceilings = sample["meta"]["ceilings"]
    # o at M=1 is memory bound both ways: FP16 moves 2*4096*4096 + 2*4096 + 2*4096 bytes; INT4 moves
    # 4096*4096/2 codes + 2*32*4096 scale bytes + the same activations and output.
    fp16_bytes = 33_554_432 + 8192 + 8192
    int4_bytes = 8_388_608 + 262_144 + 8192 + 8192
    assert report.ideal_int4_speedup([(4096, 4096)], 1, 128, ceilings) == pytest.approx(fp16_bytes / int4_bytes)
    # at M=4096 both are bound by the FP16 tensor-core rate
    assert report.ideal_int4_speedup([(4096, 4096), (4096, 12288)], 4096, 128, ceilings) == pytest.approx(1.0)


def test_bytes_moved_per_format():
    assert report.bytes_moved("fp16", 128, 64, 2, 128) == 2 * 128 * 64 + 2 * 2 * 128 + 2 * 2 * 64
    assert report.bytes_moved("tilemarlin", 256, 64, 1, 128) == 256 * 64 // 2 + 2 * 2 * 64 + 2 * 256 + 2 * 64
    assert report.bytes_moved("torch_int4", 256, 64, 1, 128) == 256 * 64 // 2 + 4 * 2 * 64 + 2 * 256 + 2 * 64
    assert report.weight_bytes("tilemarlin", 256, 64, -1) == 256 * 64 // 2 + 2 * 64   # channelwise: one group


def test_markdown_summary_table(sample):
    text = report.markdown(sample)
    assert ("| M | FP16 sum (us) | tilemarlin sum (us) | tilemarlin speedup | torch_int4 speedup "
            "| ideal INT4 speedup |") in text
    assert "| 1 | 40.0 | 20.0 | 2.00 | 1.82 | 3.87 |" in text
    assert "| 16 | 41.0 | 22.0 | 1.86 | 0.51 | 3.81 |" in text
    assert "| 4096 | 940.0 | 1000.0 | 0.94 | - | 1.00 |" in text
    assert "qkv 4096x12288, o 4096x4096" in text
    assert "humming not measured" in text
    assert "failed: qkv torch_int4 at M=4096: RuntimeError" in text
    assert "rounds" not in text                       # a run of one round says nothing about rounds
    assert "the median of 3 rounds in which the kernels took turns" in report.markdown(
        {**sample, "meta": {**sample["meta"], "rounds": 3}})
    assert "producer" not in text and "the producer's own time, timed alone in each round, is subtracted" in \
        report.markdown({**sample, "meta": {**sample["meta"], "between": True}})
    assert "FP16 activations" in text and "over FP16 `torch.matmul`" in text
    bf16 = report.markdown({**sample, "meta": {**sample["meta"], "dtype": "bfloat16"}})
    assert "BF16 activations" in bf16 and "over BF16 `torch.matmul`" in bf16 and "FP16 activations" not in bf16


def test_speedup_per_round_spans_the_rounds_of_a_rounds_run(sample):
    # FP16 the same in both rounds, tilemarlin 1.25x slower in the second: M = 1 is 40 / 20 = 2.00,
    # then 40 / 25 = 1.60. A point where one layer kept no rounds gets no range.
    rows = []
    for row in sample["rows"]:
        row = dict(row)
        if row["us"] is not None and row["kernel"] in ("fp16", "tilemarlin") and row["m"] != 16:
            row["us_rounds"] = [row["us"], row["us"] * (1.25 if row["kernel"] == "tilemarlin" else 1.0)]
        rows.append(row)
    data = {**sample, "rows": rows, "meta": {**sample["meta"], "rounds": 2}}
    assert report.round_speedups(data)[1] == pytest.approx([2.0, 1.6])
    assert 16 not in report.round_speedups(data)
    text = report.markdown(data)
    assert "| tilemarlin speedup per round | ideal INT4 speedup |" in text
    assert "| 1 | 40.0 | 20.0 | 2.00 | 1.82 | 1.60-2.00 | 3.87 |" in text
    assert "| 16 | 41.0 | 22.0 | 1.86 | 0.51 | - | 3.81 |" in text
    assert "| 4096 | 940.0 | 1000.0 | 0.94 | - | 0.75-0.94 | 1.00 |" in text
    assert "per round" not in report.markdown(sample)     # a run without rounds has no such column


def test_terminal_report_has_a_table_per_layer_and_the_sum(sample):
    text = report.terminal_report(sample)
    assert "qkv (K=4096, N=12288)" in text and "o (K=4096, N=4096)" in text
    assert "all layers summed" in text
    # tilemarlin at qkv M=1: (12288*4096/2 + 2*32*12288 + 2*4096 + 2*12288) bytes in 15 us
    assert f"{(25_165_824 + 786_432 + 8192 + 24_576) / 15.0 / 1e3:.0f}" in text


def test_load_rejects_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a gen bench file"):
        report.load(path)
    path.write_text(json.dumps({"meta": {}, "rows": [{"layer": "x", "m": 1}]}))
    with pytest.raises(ValueError, match="lacks"):
        report.load(path)


def test_from_json_writes_png_plots_and_markdown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = parse(["--from-json", str(SAMPLE), "--out", str(tmp_path), "--markdown"])
    assert args.func(args) == 0
    for suffix in ("-speedup.png", "-roofline.png"):
        png = tmp_path / f"bench_sample{suffix}"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size > 10_000   # a drawn figure, not an empty canvas
    assert "| 1 | 40.0 | 20.0 | 2.00 |" in (tmp_path / "bench_sample.md").read_text()
    assert not (tmp_path / "bench_sample.json").exists()   # the recorded file is read, never rewritten
    assert "all layers summed" in capsys.readouterr().out


def test_without_matplotlib_the_plots_are_skipped_with_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # makes the import fail
    args = parse(["--from-json", str(SAMPLE), "--out", str(tmp_path), "--markdown"])
    assert args.func(args) == 0
    assert not list(tmp_path.glob("*.png"))
    assert (tmp_path / "bench_sample.md").exists()
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "--from-json" in err


def test_from_json_with_a_missing_file_is_a_clear_error(tmp_path, capsys):
    args = parse(["--from-json", str(tmp_path / "nope.json")])
    assert args.func(args) == 2
    assert "cannot read" in capsys.readouterr().err



def test_an_interrupted_run_says_its_sums_cover_the_layers_measured(sample):
    assert report.incomplete_note(sample) is None
    sample["meta"]["complete"] = False
    sample["rows"] = [row for row in sample["rows"] if row["layer"] == "qkv"]
    note = "Incomplete run: 1 of 2 layers measured (qkv); the sums cover those layers only"
    assert report.incomplete_note(sample) == note
    assert note in report.terminal_report(sample) and note in report.markdown(sample)


def test_an_out_folder_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    args = parse(["--from-json", str(SAMPLE), "--out", str(tmp_path / "file" / "sub")])
    assert args.func(args) == 2
    assert f"{tmp_path / 'file'} is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "file" / "sub").exists()

# --- the command line -----------------------------------------------------------------------------------

def test_defaults():
    args = parse([])
    assert args.model == "llama-2-7b" and args.shapes is None and args.from_json is None
    assert args.ms == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert args.kernels == ["tilemarlin", "fp16", "torch_int4", "humming"]
    assert args.group == 128 and args.out == "docs/bench" and args.markdown is False and args.rounds == 3
    assert args.func is bench.run


def test_ms_are_parsed_sorted_and_deduplicated():
    assert parse(["--ms", "16, 1,4,16"]).ms == [1, 4, 16]


@pytest.mark.parametrize("argv, message", [
    (["--ms=0"], "'0' is not a positive integer"),
    (["--ms=-4"], "'-4' is not a positive integer"),
    (["--ms=1,,2"], "'' is not a positive integer"),
    (["--ms=two"], "'two' is not a positive integer"),
    (["--kernels=tilemarlin,cutlass,fp16"], "unknown kernel(s) cutlass"),
    (["--kernels=tilemarlin"], "must include fp16"),
    (["--group=0"], "'0' is not a group size"),
    (["--group=abc"], "'abc' is not a group size"),
    (["--rounds=0"], "--rounds must be a positive whole number, got '0'"),
    (["--rounds=two"], "--rounds must be a positive whole number, got 'two'"),
    (["--sustain=0"], "--sustain takes seconds per point and kernel, more than 0 and at most 60, got '0'"),
    (["--sustain=long"], "got 'long'"),
    (["--sustain=120"], "at most 60"),
    (["--model", "x", "--shapes", "4096x4096"], "not allowed with argument"),
    (["--model", "x", "--from-json", "f.json"], "not allowed with argument"),
])
def test_bad_arguments_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_channelwise_group_is_accepted():
    assert parse(["--group", "-1"]).group == -1


def test_kernels_keep_the_order_given():
    assert parse(["--kernels", "fp16,tilemarlin"]).kernels == ["fp16", "tilemarlin"]


# --- measuring, without a GPU ---------------------------------------------------------------------------

def test_no_gpu_exits_2_and_points_to_from_json(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse(["--model", "llama-2-7b"])
    assert args.func(args) == bench.NO_GPU_EXIT == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--from-json" in err


def _cpu_layer():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (256, 64), dtype=torch.uint8)
    scales = (0.005 + 0.01 * torch.rand(2, 64)).to(torch.float16)
    return contenders.LayerWeights("t", 256, 64, 128, codes, scales)


def _measure(contender, w, x, monkeypatch, timed: list):
    from gen import timing as measure
    from schedules.quant import reference_matmul

    monkeypatch.setattr(measure, "time_calls", lambda calls, replays: timed.append(len(calls)) or 12.5)
    reference = lambda: reference_matmul(x, w.codes, w.scales)   # noqa: E731
    return bench._measure_points({"fp16": contender}, x, reference, w, x.shape[0], rounds=1)["fp16"]


def test_a_correct_kernel_is_checked_then_timed(monkeypatch):
    w, timed = _cpu_layer(), []
    x = torch.randn(4, 256, dtype=torch.float16)
    right = contenders.Contender(lambda x: [lambda: (x.float() @ bench_dequant(w)).half()] * 3, exact=True)
    row = _measure(right, w, x, monkeypatch, timed)
    assert timed == [3]
    assert row["us"] == 12.5 and row["rel_err"] < 1e-3
    assert row["bytes"] == report.bytes_moved("fp16", 256, 64, 4, 128)
    assert row["gbps"] == pytest.approx(row["bytes"] / 12.5 / 1e3)
    assert row["tflops"] == pytest.approx(2 * 4 * 256 * 64 / 12.5 / 1e6)


def test_a_wrong_kernel_is_never_timed(monkeypatch):
    w, timed = _cpu_layer(), []
    x = torch.randn(4, 256, dtype=torch.float16)
    wrong = contenders.Contender(lambda x: [lambda: -(x.float() @ bench_dequant(w)).half()], exact=True)
    row = _measure(wrong, w, x, monkeypatch, timed)
    assert timed == [] and row["us"] is None and "wrong result" in row["error"]
    assert row["rel_err"] == pytest.approx(2.0, rel=1e-3)   # -out is off by twice the reference


def test_a_kernel_that_raises_is_a_result_not_a_crash(monkeypatch):
    w, timed = _cpu_layer(), []

    def broken(x):
        raise RuntimeError("no kernel for this shape\nCUDA error: invalid argument")

    row = _measure(contenders.Contender(broken, exact=True), w, torch.randn(1, 256, dtype=torch.float16), monkeypatch, timed)
    assert row == {"us": None, "error": "RuntimeError: no kernel for this shape"}


def test_fp16_is_the_shared_baseline_over_weight_copies(monkeypatch):
    """gen bench's FP16 contender is gen.timing.Fp16Baseline, the baseline `gen tune` times too: one
    torch.matmul per weight copy (as many as copies_for the weight's bytes, each its own tensor) on
    the dequantized weights, into a fresh output or into the one given."""
    from gen import timing
    from schedules.quant import reference_matmul, relative_error

    sizes = []
    monkeypatch.setattr(timing, "copies_for", lambda nbytes: sizes.append(nbytes) or 3)
    w = _cpu_layer()
    x = torch.randn(4, 256, dtype=torch.float16)
    calls = contenders.fp16_contender(w).calls(x)
    assert sizes == [256 * 64 * 2] and len(calls) == 3
    assert len({call.args[1].data_ptr() for call in calls}) == 3
    for call in calls:
        assert relative_error(call(), reference_matmul(x, w.codes, w.scales)) < 1e-3
    out = torch.empty(4, 64, dtype=torch.float16)
    baseline = timing.Fp16Baseline(w.codes, w.scales)
    assert baseline.calls(x, out)[2]() is out and torch.equal(out, calls[0]())


def test_rounds_take_turns_and_the_median_counts(monkeypatch):
    from gen import timing as measure
    from schedules.quant import reference_matmul

    w, x = _cpu_layer(), torch.randn(4, 256, dtype=torch.float16)

    class Tagged:          # a kernel call that says whose it is
        def __init__(self, kernel, x):
            self.kernel, self.x = kernel, x

        def __call__(self):
            return (self.x.float() @ bench_dequant(w)).half()

    kernels = {k: contenders.Contender(lambda x, k=k: [Tagged(k, x)], exact=True)
               for k in ("tilemarlin", "fp16", "humming")}
    script = {"tilemarlin": iter([10.0, 30.0, 20.0]), "fp16": iter([5.0, 4.0, 6.0]),
              "humming": iter([7.0, RuntimeError("lost the context\nmore")])}
    turns = []

    def fake_time_calls(calls, replays):
        turns.append(calls[0].kernel)
        value = next(script[calls[0].kernel])
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(measure, "time_calls", fake_time_calls)
    rows = bench._measure_points(kernels, x, lambda: reference_matmul(x, w.codes, w.scales), w, 4, rounds=3)
    # each round starts one kernel later; a kernel that fails to time drops out with its error
    assert turns == ["tilemarlin", "fp16", "humming", "fp16", "humming", "tilemarlin", "tilemarlin", "fp16"]
    assert rows["tilemarlin"]["us"] == 20.0 and rows["tilemarlin"]["us_rounds"] == [10.0, 30.0, 20.0]
    assert rows["fp16"]["us"] == 5.0 and rows["fp16"]["us_rounds"] == [5.0, 4.0, 6.0]
    assert rows["humming"]["us"] is None and rows["humming"]["error"] == "RuntimeError: lost the context"
    assert all(r["rel_err"] < 1e-3 for r in rows.values())


def test_errors_keep_the_line_that_says_what_went_wrong():
    traceback = ValueError("Traceback (most recent call last):\n  File x\nTVMError: bad")
    assert bench_common.error_text(traceback) == "ValueError: TVMError: bad"
    assert bench_common.error_text(RuntimeError("")) == "RuntimeError: "


def bench_dequant(w):
    from schedules.quant import dequantize

    return dequantize(w.codes, w.scales)


def test_prefill_sizes_replay_fewer_times():
    assert bench.replays_for(256) == 30 and bench.replays_for(512) == 10


@pytest.mark.gpu
def test_a_small_bench_on_the_gpu(tmp_path):
    """One layer, two batch sizes, end to end: every kernel checked against the reference, then timed
    (tilemarlin_untuned: the fallback's kernels for the tuned o_proj shape as if it had no entry)."""
    kernels = ("tilemarlin", "fp16", "torch_int4", "tilemarlin_untuned")
    args = parse(["--shapes", "4096x4096", "--ms", "1,16", "--kernels", ",".join(kernels),
                  "--out", str(tmp_path), "--markdown"])
    assert args.func(args) == 0
    (path,) = tmp_path.glob("*-shapes-4096x4096.json")
    data = report.load(path)
    assert data["meta"]["complete"] and data["meta"]["ceilings"]["hbm_read_gbps"] > 100
    rows = {(r["kernel"], r["m"]): r for r in data["rows"]}
    assert set(rows) == {(k, m) for k in kernels for m in (1, 16)}
    for row in rows.values():
        assert row["us"] is not None, row
        assert row["rel_err"] <= bench.REL_ERR_LIMIT and row["gbps"] > 0
        assert len(row["us_rounds"]) == 3 and row["us"] == sorted(row["us_rounds"])[1]


def test_between_times_each_call_after_the_producer_and_takes_the_producers_time_off(monkeypatch):
    from gen import timing as measure
    from schedules.quant import reference_matmul

    w, x = _cpu_layer(), torch.randn(4, 256, dtype=torch.float16)
    before = x.clone()
    seen = []
    kernel_call = lambda: seen.append("gemm") or (x.float() @ bench_dequant(w)).half()   # noqa: E731
    contender = contenders.Contender(lambda x: [kernel_call] * 2, exact=True)
    producer_times, kernel_times, timed = iter([2.0, 3.0]), iter([12.0, 14.0]), []

    def fake_time_calls(calls, replays):
        seen.clear()
        calls[0]()
        if seen:                         # a GEMM call, wrapped: the producer first, then the kernel
            timed.append(("gemm", len(calls)))
            return next(kernel_times)
        timed.append(("producer", len(calls)))
        return next(producer_times)

    monkeypatch.setattr(measure, "time_calls", fake_time_calls)
    row = bench._measure_points({"fp16": contender}, x, lambda: reference_matmul(x, w.codes, w.scales), w, 4,
                                rounds=2, between=True)["fp16"]
    assert timed == [("producer", measure.PRODUCER_CALLS), ("gemm", 2)] * 2
    assert row["us_rounds"] == [10.0, 11.0] and row["us"] == 10.5 and row["producer_us"] == 2.5
    assert torch.equal(x, before)        # the producer rewrites the activations with the same values
    assert parse(["--between"]).between and not parse([]).between


# --- --sustain: a steady load at the power cap, with the board's energy ---------------------------------

def test_sustain_and_between_are_refused_together(capsys):
    args = parse(["--sustain", "1.5", "--between"])
    assert args.sustain == 1.5 and args.func(args) == 2
    assert "run them separately" in capsys.readouterr().err


def test_sustain_times_each_round_for_that_long_and_keeps_energy_and_clock(monkeypatch):
    from gen import timing as measure
    from schedules.quant import reference_matmul

    w, x = _cpu_layer(), torch.randn(4, 256, dtype=torch.float16)
    contender = contenders.Contender(lambda x: [lambda: (x.float() @ bench_dequant(w)).half()] * 2, exact=True)
    runs = iter([{"us": 10.0, "mj_per_call": 7.0, "sm_mhz": 1410.0}, {"us": 12.0, "mj_per_call": 9.0, "sm_mhz": 1500.0},
                 {"us": 11.0, "mj_per_call": 8.0, "sm_mhz": 1440.0}])
    asked = []

    def fake_sustained(calls, seconds, nvml):
        asked.append((len(calls), seconds, nvml))
        return next(runs)

    monkeypatch.setattr(measure, "time_sustained", fake_sustained)
    monkeypatch.setattr(measure, "time_calls", lambda *a, **k: pytest.fail("a sustained run times nothing else"))
    row = bench._measure_points({"fp16": contender}, x, lambda: reference_matmul(x, w.codes, w.scales), w, 4,
                                rounds=3, sustain=2.0, nvml="counter")["fp16"]
    assert asked == [(2, 2.0, "counter")] * 3
    assert row["us_rounds"] == [10.0, 12.0, 11.0] and row["us"] == 11.0
    assert row["mj_per_call"] == 8.0 and row["sm_mhz"] == 1440.0


def _sustained_sample(sample: dict) -> dict:
    """The sample as a --sustain run with energy on every layer at M = 1 and 16, none at 4096."""
    rows = []
    for r in sample["rows"]:
        if r["us"] is not None and r["kernel"] in ("fp16", "tilemarlin") and r["m"] != 4096:
            r = {**r, "mj_per_call": r["us"] * (0.7 if r["kernel"] == "fp16" else 0.6),
                 "sm_mhz": 1410.0 if r["kernel"] == "fp16" else 1575.0}
        rows.append(r)
    return {"meta": {**sample["meta"], "sustain": 1.5}, "rows": rows}


def test_a_sustained_run_reports_energy_and_the_held_clocks(sample):
    data = _sustained_sample(sample)
    energy = report.summed_times(data, "mj_per_call")
    assert energy[1] == pytest.approx({"fp16": 28.0, "tilemarlin": 12.0}) and 4096 not in energy
    header, rows = report.summary_table(data)
    assert header[-3:] == ["fp16 mJ per call (sum)", "tilemarlin mJ per call (sum)",
                           "SM clock held, fp16 / tilemarlin (MHz)"]
    assert rows[0][-3:] == ["28.00", "12.00", "1410 / 1575"] and rows[-1][-3:] == ["-", "-", "- / -"]
    text = report.markdown(data)
    assert "ran back to back for 1.5 s" in text and "NVML's energy counter" in text
    unavailable = {**data, "meta": {**data["meta"], "energy": {"unavailable": "NVML cannot be loaded"}}}
    assert "No energy was read: NVML cannot be loaded" in report.markdown(unavailable)
    assert "mJ" not in report.markdown(sample)       # a plain run has no energy columns


class FakeNvmlLibrary:
    """libnvidia-ml as gen.energy calls it: each function fills its out-argument and returns a status."""

    def __init__(self, energies=(1000, 1600)):
        self.energies, self.opened = iter(energies), None

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        self.opened = uuid
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        self.opened = index.value
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, out):
        out._obj.value = next(self.energies)
        return 0

    def nvmlDeviceGetClockInfo(self, handle, clock, out):
        assert clock.value == 1      # NVML_CLOCK_SM
        out._obj.value = 1410
        return 0


def test_nvml_reads_the_energy_counter_and_the_sm_clock():
    from gen.bench.energy import Nvml

    lib = FakeNvmlLibrary(energies=(1000, 1000, 1600))
    nvml = Nvml("GPU-1234", library=lib)     # opening reads the counter once
    assert lib.opened == b"GPU-1234" and nvml.energy_mj() == 1000 and nvml.energy_mj() == 1600
    assert nvml.sm_mhz() == 1410
    assert Nvml("0", library=FakeNvmlLibrary()).sm_mhz() == 1410


def test_nvml_that_cannot_load_or_count_says_so(monkeypatch):
    import ctypes

    from gen.bench import energy

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(energy.EnergyUnavailable, match="libnvidia-ml.so.1.*cannot be loaded"):
        energy.Nvml("0")
    for failing in ("nvmlInit_v2", "nvmlDeviceGetTotalEnergyConsumption"):
        lib = FakeNvmlLibrary()
        setattr(lib, failing, lambda *args: 999)
        with pytest.raises(energy.EnergyUnavailable, match=f"{failing} failed with status 999"):
            energy.Nvml("GPU-1234", library=lib)


@pytest.mark.gpu
def test_a_sustained_timing_on_the_gpu_reads_time_energy_and_clock():
    from gen.bench import energy
    from gen import timing as measure

    a = torch.randn(256, 4096, dtype=torch.float16, device="cuda")
    b = torch.randn(4096, 4096, dtype=torch.float16, device="cuda")
    nvml = energy.Nvml(bench._smi_device())
    run = measure.time_sustained([lambda: a @ b] * 2, 0.3, nvml)
    assert 1 < run["us"] < 10_000 and run["mj_per_call"] > 0 and run["sm_mhz"] > 100
    assert measure.time_sustained([lambda: a @ b], 0.1)["mj_per_call"] is None


def test_a_bf16_run_names_its_baseline_bf16(sample):
    header, _ = report.summary_table(sample)
    assert header[1] == "FP16 sum (us)"
    bf16 = {**sample, "meta": {**sample["meta"], "dtype": "bfloat16"}}
    assert report.summary_table(bf16)[0][1] == "BF16 sum (us)" and report.baseline_label(bf16["meta"]) == "BF16"


def test_the_gemm_bench_takes_a_dtype():
    assert bench.bench_dtype(parse([])) == "float16"
    assert bench.bench_dtype(parse(["--dtype", "bfloat16"])) == "bfloat16"



def test_act_order_gathers_the_activations_by_a_permutation_in_each_timed_call(monkeypatch):
    """tilemarlin_act times what QuantLinear runs for an act-order layer: x's columns gathered by the
    layer's permutation, then the GEMM on the group-sorted weights, one call per weight copy."""
    import runtime.op
    from gen import timing
    from schedules import marlin_mma
    from schedules.quant import dequantize

    seen = []

    def gemm(x, qweight, scales, n, k, group):
        seen.append(x)
        return x.float() @ dequantize(*marlin_mma.unpack(qweight, scales)).float()

    monkeypatch.setattr(runtime.op, "w4a16_gemm", gemm)
    monkeypatch.setattr(runtime.op, "_gather_into", lambda a, perm, out: out.copy_(a[:, perm.long()]))
    monkeypatch.setattr(timing, "copies_for", lambda nbytes: 2)
    w = _cpu_layer()
    # each column names itself, each row is offset by its own multiple of 256 (exact in fp16 below 2048)
    x = (torch.arange(256) + 256 * torch.arange(3).unsqueeze(1)).to(torch.float16)
    outputs = [call() for call in contenders.tilemarlin_act_order_contender(w).calls(x)]
    assert len(outputs) == 2 and len(seen) == 2
    perm = seen[0][0].long()
    assert sorted(perm.tolist()) == list(range(256)) and not torch.equal(perm, torch.arange(256))
    assert torch.equal(seen[1], seen[0]) and torch.equal(seen[0], x[:, perm])
    assert torch.equal(outputs[0], x[:, perm].float() @ dequantize(w.codes, w.scales).float())
    assert report.weight_bytes("tilemarlin_act", 256, 64, 128) == report.weight_bytes("tilemarlin", 256, 64, 128) + 4 * 256
    assert report.bytes_moved("tilemarlin_act", 256, 64, 3, 128) == \
        report.bytes_moved("tilemarlin", 256, 64, 3, 128) + 4 * 256 + 4 * 3 * 256
    assert bench.parse_kernels("tilemarlin,tilemarlin_act,fp16") == ["tilemarlin", "tilemarlin_act", "fp16"]


def test_act_order_down_proj_runs_without_a_gather(monkeypatch):
    """A gated MLP's down_proj is served act-order with its permutation in gate_proj's and up_proj's
    output columns (runtime/checkpoint/fold.py): tilemarlin_act times its GEMM alone, checked against
    the reference, and its bytes have no permutation and no gathered copy."""
    import runtime.op
    from gen import timing

    gathered = []
    monkeypatch.setattr(runtime.op, "w4a16_gemm", lambda x, qweight, scales, n, k, group: x)
    monkeypatch.setattr(runtime.op, "_gather_into", lambda a, perm, out: gathered.append(perm))
    monkeypatch.setattr(timing, "copies_for", lambda nbytes: 2)
    t = _cpu_layer()
    w = contenders.LayerWeights("down_proj", t.k, t.n, t.group, t.codes, t.scales)
    x = torch.randn(3, 256).to(torch.float16)
    contender = contenders.tilemarlin_act_order_contender(w)
    assert contender.exact and all(call() is x for call in contender.calls(x)) and not gathered
    assert report.bytes_moved("tilemarlin_act", 256, 64, 3, 128, "down_proj") == \
        report.bytes_moved("tilemarlin", 256, 64, 3, 128)


@pytest.mark.parametrize("kernels,expected", [
    ("tilemarlin,fp16", {False}), ("tilemarlin_zp,fp16", {True}), ("tilemarlin_act,fp16", {False}),
    ("tilemarlin,tilemarlin_zp,tilemarlin_act,fp16", {False, True})])
def test_the_kernels_of_every_layer_are_built_before_timing(kernels, expected, monkeypatch):
    """Every layer's problem, with zero points where tilemarlin_zp runs, at the run's batch sizes."""
    import runtime.op
    from gen.cli import build_parser
    from gen.models import model_layers

    asked = []
    monkeypatch.setattr(runtime.op, "precompile", lambda problems, ms: asked.append((problems, ms)) or {})
    args = build_parser().parse_args(["bench", "--model", "llama-2-7b", "--kernels", kernels, "--ms", "1,64"])
    layers = model_layers("llama-2-7b")
    bench._precompile_tilemarlin(layers, args)
    (problems, ms), = asked
    assert ms == [1, 64]
    assert {(p.k, p.n, p.zero_points) for p in problems} == {(l.k, l.n, zp) for l in layers for zp in expected}


def test_tilemarlin_untuned_chooses_as_if_the_shape_had_no_entry(monkeypatch):
    """tilemarlin_untuned (timed only when named) serves a tuned shape with the fallback's kernels: the
    op's choices on this GPU with the shape left out in every form, so Llama-2-7B's tuned o_proj is
    chosen for from the other shapes' winners, and its table entry is not taken."""
    from runtime import dispatch
    from runtime.fallback import TunedWinner
    from runtime.table import TunedTable, shipped_tables_dir
    from schedules.arch import get_arch
    from schedules.cost import GpuSpec
    from schedules.problem import Problem

    table = TunedTable.read(shipped_tables_dir() / "nvidia-h200_sm_90a_132sm.json")
    winners = tuple(TunedWinner(p, b, entry.schedule) for (p, b), entry in table.items())
    sm90 = get_arch("sm_90a")
    monkeypatch.setattr(dispatch, "dispatch_for",
                        lambda device=None: dispatch.Dispatch(sm90, GpuSpec.for_arch(sm90), table, winners))
    assert bench.parse_kernels("tilemarlin,tilemarlin_untuned,fp16") == ["tilemarlin", "tilemarlin_untuned", "fp16"]
    assert "tilemarlin_untuned" not in bench.KERNELS
    o_proj = Problem.make(n=4096, k=4096, group=128, dtype="float16")
    untuned = contenders.untuned_dispatch(o_proj)
    for bucket in (1, 64, 4096):
        schedule, how = untuned.choose(o_proj, bucket, dispatch.DEFAULT_LAYOUT)
        assert how is not None and "nearest" in how
        assert dispatch.dispatch_for().choose(o_proj, bucket, dispatch.DEFAULT_LAYOUT)[1] is None    # the op's own: tuned


def test_the_report_names_the_act_order_layers_timed_without_a_gather():
    row = dict(m=1, us=1.0)
    rows = [dict(row, layer=layer, k=256, n=64, kernel=kernel)
            for layer in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            for kernel in ("fp16", "tilemarlin", "tilemarlin_act")]
    data = {"meta": {"kernels": ["tilemarlin", "tilemarlin_act", "fp16"]}, "rows": rows}
    assert report.act_order_notes(data) == [
        "tilemarlin_act gathers x's columns before each layer's GEMM except qkv_proj, gate_up_proj, which take an "
        "RMSNorm's output, written by the norm in their order (runtime/checkpoint/norm_fold.py); down_proj, "
        "which a gated MLP serves with its permutation in gate_proj's and up_proj's output columns "
        "(runtime/checkpoint/fold.py)."]
    assert report.gathers("tilemarlin_act", "o_proj") and not report.gathers("tilemarlin", "o_proj")
    without = {**data, "rows": [r for r in rows if r["kernel"] != "tilemarlin_act"]}
    assert report.act_order_notes(without) == []


def test_an_incomplete_or_whole_model_file_is_named(tmp_path):
    from gen.bench.report import load

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {}, "rows": []}))
    with pytest.raises(ValueError, match=r"not a complete gen bench file \(its meta lacks \['ceilings', 'group'\]\)"):
        load(path)
    path.write_text(json.dumps({"meta": {"kind": "e2e"}, "variants": {}}))
    with pytest.raises(ValueError, match="a whole-model file: read it with --e2e"):
        load(path)
