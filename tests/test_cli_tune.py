"""`gen tune` and `gen cache` without a GPU: argument handling, resume, the dry run (one real
compile), and listing, showing and clearing the cache."""
import argparse
import json
import itertools

import pytest

from gen.tune import cache_cmd
from gen.tune import command as tune
from gen.tune import options
from gen.tune.search import DEFAULT_TOP
import runtime.table as table_module
from runtime.table import BUCKETS, GpuKey, TunedTable, table_path
from schedules.arch import get_arch
from schedules.cost import GpuSpec
from schedules.marlin_mma import Knobs
from schedules.problem import Problem
from schedules.registry import FAMILIES, Schedule

GPU = GpuKey("NVIDIA H200", "sm_90a", 132)
SCHEDULE = Schedule("marlin_mma", Knobs())


def parse(*argv):
    parser = argparse.ArgumentParser(prog="gen")
    subparsers = parser.add_subparsers(dest="command", required=True)
    tune.register(subparsers)
    cache_cmd.register(subparsers)
    return parser.parse_args(list(argv))


def call(capsys, *argv):
    args = parse(*argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty cache, with no shipped tables beneath it."""
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(table_module, "shipped_tables_dir", lambda: tmp_path / "shipped")
    return tmp_path


def test_tune_defaults():
    args = parse("tune", "--model", "llama-2-7b")
    assert (args.tp, args.group, args.dtype, args.top, args.force, args.dry_run) == (1, 128, "float16", DEFAULT_TOP, False, False)
    assert options.parse_buckets(args.buckets) == list(BUCKETS)


def test_targets_merge_layers_that_share_a_problem():
    targets = options.targets_from_args(parse("tune", "--model", "llama-2-7b", "--shapes", "4096x4096,1024x256"))
    assert [t.label for t in targets] == ["qkv_proj", "o_proj,4096x4096", "gate_up_proj", "down_proj", "1024x256"]
    assert targets[0].problem == Problem.make(n=12288, k=4096, group=128)
    cw = options.targets_from_args(parse("tune", "--shapes", "1024x256", "--group", "-1", "--dtype", "bfloat16"))
    assert cw[0].problem == Problem(n=256, k=1024, group=1024, dtype="bfloat16")


def test_several_models_share_one_run_and_their_common_shapes():
    targets = options.targets_from_args(parse("tune", "--model", "llama-2-7b,llama-3-8b"))
    labels = {t.problem: t.label for t in targets}
    # o_proj (4096x4096) is the same problem in both; each name says its model
    assert labels[Problem.make(n=4096, k=4096)] == "llama-2-7b:o_proj,llama-3-8b:o_proj"
    assert labels[Problem.make(n=6144, k=4096)] == "llama-3-8b:qkv_proj"
    assert len(targets) == 7
    with pytest.raises(ValueError, match="no-such-model"):
        options.targets_from_args(parse("tune", "--model", "llama-2-7b,no-such-model"))


def test_target_errors_name_the_layer():
    with pytest.raises(ValueError, match="down_proj .*2752x4096.* group size 128"):
        options.targets_from_args(parse("tune", "--model", "llama-2-7b", "--tp", "4"))
    with pytest.raises(ValueError, match="--model"):
        options.targets_from_args(parse("tune"))


def test_a_checkpoint_names_the_layers_its_model_runs(tmp_path):
    """gen tune --checkpoint: the problems of the checkpoint's INT4 layers as load_quantized serves them
    (AWQ: zero points everywhere), q/k/v and gate/up fused, in --dtype; no layer gathers without act-order."""
    pytest.importorskip("transformers")
    import torch

    from tests.checkpoint_writers import write_checkpoint

    write_checkpoint(tmp_path, "awq", torch.float16, 128, symmetric=False)
    targets = options.targets_from_args(parse("tune", "--checkpoint", str(tmp_path), "--dtype", "bfloat16"))
    assert {(t.problem, t.label) for t in targets} == {
        (Problem.make(n=n, k=k, dtype="bfloat16", zero_points=True), label) for n, k, label in (
            (512, 256, "self_attn.q_k_v_proj"), (256, 256, "self_attn.o_proj"), (1024, 256, "mlp.gate_up_proj"),
            (256, 512, "mlp.down_proj"))}
    assert not any(t.gathered for t in targets)


def test_a_checkpoint_loads_on_the_gpu_where_it_fits_easily(tmp_path, monkeypatch):
    import torch

    from gen.checkpoints import loading_device

    (tmp_path / "model.safetensors").write_bytes(bytes(1000))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2000, 4000))
    assert loading_device(str(tmp_path)) == "cuda"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1999, 4000))
    assert loading_device(str(tmp_path)) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading_device(str(tmp_path)) == "cpu"


def test_parse_buckets():
    assert options.parse_buckets("16,1,16") == [1, 16]
    for bad in ("3", "1,x", ",", "8192"):
        with pytest.raises(ValueError, match="--buckets"):
            options.parse_buckets(bad)


def test_bad_arguments_exit_2(capsys):
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--buckets", "3")
    assert rc == 2 and "bucket edges" in err
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--top", "0")
    assert rc == 2 and "--top" in err
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--time-budget", "0")
    assert rc == 2 and "--time-budget" in err
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--dry-run", "--between")
    assert rc == 2 and "--between" in err and "times nothing" in err


def test_resume_skips_tuned_buckets():
    targets = options.targets_from_args(parse("tune", "--shapes", "1024x256,4096x4096"))
    table = TunedTable(GPU)
    table.record(targets[0].problem, 16, SCHEDULE, 3.0)
    pending = tune.pending_pairs(targets, [1, 16], table, force=False)
    assert pending == [(targets[0].problem, 1), (targets[1].problem, 1), (targets[1].problem, 16)]
    assert len(tune.pending_pairs(targets, [1, 16], table, force=True)) == 4
    # An entry timed in the other harness answers another question: it is tuned again.
    assert (targets[0].problem, 16) in tune.pending_pairs(targets, [1, 16], table, force=False, harness="between")


def test_a_forced_run_resumes_only_the_same_buckets(tmp_path):
    targets = options.targets_from_args(parse("tune", "--shapes", "1024x256,4096x4096"))
    table_path = tmp_path / "gpu.json"
    pairs = [(t.problem, b) for t in targets for b in (1, 16)]
    run = tune.ForcedRun.resume(table_path, pairs)
    assert not run.done and not run.path.exists()
    run.finished(*pairs[0])
    run.finished(*pairs[2])
    assert run.path.name == "gpu.force-progress"
    again = tune.ForcedRun.resume(table_path, pairs)                       # the same forced run, interrupted
    assert again.is_done(*pairs[0]) and again.is_done(*pairs[2]) and not again.is_done(*pairs[1])
    assert not tune.ForcedRun.resume(table_path, pairs[:3]).done            # other buckets: start afresh
    assert not tune.ForcedRun.restart(table_path, pairs).done and not run.path.exists()   # --restart
    run.path.write_text("{not json")
    assert not tune.ForcedRun.resume(table_path, pairs).done                 # unreadable: start afresh
    again.complete()
    assert not run.path.exists()
    again.complete()                                                          # twice is fine


def _forced_tuner(table_path, pairs, steps, barrier):
    """A `gen tune --force` of `pairs` in a process of its own: resumed, then noting each step's
    bucket as finished once the step's event is set."""
    run = tune.ForcedRun.resume(table_path, pairs)
    barrier.wait(60)
    for go, index, noted in steps:
        go.wait(60)
        run.finished(*pairs[index])
        noted.set()


def _spawned(ctx, target, *args):
    process = ctx.Process(target=target, args=args)
    process.start()
    return process


def test_two_forced_tuners_of_the_same_buckets_keep_each_others_progress(tmp_path):
    import multiprocessing

    targets = options.targets_from_args(parse("tune", "--shapes", "1024x256"))
    pairs = [(targets[0].problem, b) for b in (1, 2, 4)]
    table_path = tmp_path / "gpu.json"
    ctx = multiprocessing.get_context("spawn")
    barrier, events = ctx.Barrier(3), [ctx.Event() for _ in range(6)]
    tuners = [_spawned(ctx, _forced_tuner, table_path, pairs, [(events[0], 0, events[1]), (events[4], 2, events[5])],
                       barrier),
              _spawned(ctx, _forced_tuner, table_path, pairs, [(events[2], 1, events[3])], barrier)]
    barrier.wait(60)                     # both resumed with nothing done
    for go, noted in ((0, 1), (2, 3), (4, 5)):  # A notes bucket 1, B bucket 2, A bucket 4
        events[go].set()
        assert events[noted].wait(60)
    for process in tuners:
        process.join(60)
        assert process.exitcode == 0
    assert tune.ForcedRun.resume(table_path, pairs).done == {f"{p.name}@{b}" for p, b in pairs}


def _hold_the_table_lock(table_path, held, release):
    from runtime.cache_files import table_lock

    with table_lock(table_path):
        held.set()
        release.wait(60)


def test_the_progress_file_is_written_under_the_tables_lock(tmp_path):
    import multiprocessing
    import threading

    targets = options.targets_from_args(parse("tune", "--shapes", "1024x256"))
    table_path = tmp_path / "gpu.json"
    run = tune.ForcedRun.resume(table_path, [(targets[0].problem, 1)])
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = _spawned(ctx, _hold_the_table_lock, table_path, held, release)
    assert held.wait(60)
    note = threading.Thread(target=run.finished, args=(targets[0].problem, 1))
    note.start()
    note.join(1.0)
    assert note.is_alive() and not run.path.exists()       # waits while a tuner saves the table
    release.set()
    note.join(60)
    holder.join(60)
    assert run.path.exists() and tune.ForcedRun.resume(table_path, [(targets[0].problem, 1)]).done


def test_axes_override_the_searched_values_for_one_run():
    from schedules import stream_wgmma
    from schedules.cost import rank

    spec = GpuSpec.for_arch(get_arch("sm_90a"))
    o_proj = Problem.make(n=4096, k=4096)
    before = dict(stream_wgmma.AXES)
    axes = options.parse_axes("stream_wgmma.rotate=0,1 stream_wgmma.block_k=64")
    assert axes == {"stream_wgmma": {"rotate": (False, True), "block_k": (64,)}}
    def unrotated(ranked):
        return [s for s in ranked if s.family == "stream_wgmma" and not s.knobs.rotate]

    def deep(ranked):
        return [s for s in ranked if s.family == "stream_wgmma" and s.knobs.block_k == 128]

    assert not unrotated(rank(o_proj, 128, get_arch("sm_90a"), spec))
    assert deep(rank(o_proj, 128, get_arch("sm_90a"), spec))
    with options.searched_axes(axes):
        ranked = rank(o_proj, 128, get_arch("sm_90a"), spec)
        assert unrotated(ranked) and not deep(ranked)
        assert list(stream_wgmma.AXES) == list(before)           # same axes, same order
    assert stream_wgmma.AXES == before
    assert not unrotated(rank(o_proj, 128, get_arch("sm_90a"), spec))
    for text, fragment in (("stream_wgmma.setmaxnreg", "expected family.knob"), ("nope.x=1", "nope"),
                           ("stream_wgmma.colour=1", "no searched axis 'colour'"),
                           ("stream_wgmma.block_k=big", "integers"),
                           ("stream_mma.warps=4 stream_mma.warps=8", "twice")):
        with pytest.raises(ValueError, match=fragment):
            options.parse_axes(text)


def test_variants_name_any_knob_of_a_family():
    changes = options.parse_variants("stream_mma.sum_slices=1 stream_mma.pdl=0,1 stream_wgmma.split_wait=1")
    assert changes == {"stream_mma": [{"sum_slices": True, "pdl": False}, {"sum_slices": True, "pdl": True}],
                       "stream_wgmma": [{"split_wait": True}]}
    assert options.parse_variants(None) == {}
    for text, fragment in (("stream_mma.pdl", "expected family.knob"), ("nope.x=1", "nope"),
                           ("stream_wgmma.colour=1", "no knob 'colour'"), ("stream_mma.pdl=maybe", "flag"),
                           ("stream_mma.pdl=0 stream_mma.pdl=1", "twice")):
        with pytest.raises(ValueError, match=fragment):
            options.parse_variants(text)


def test_variants_need_force(capsys):
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--variants", "stream_mma.pdl=1")
    assert rc == 2 and "--force" in err


def test_restart_needs_force(capsys):
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--restart")
    assert rc == 2 and "--force" in err


def test_without_gpu_suggests_dry_run(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = call(capsys, "tune", "--model", "llama-2-7b")
    assert rc == 2
    assert "no CUDA GPU" in err and "--dry-run --arch sm_90a" in err


def test_dry_run_compiles_and_ranks_without_measuring(capsys, cache_dir):
    rc, out, err = call(capsys, "tune", "--shapes", "1024x256", "--buckets", "1,16", "--top", "1",
                        "--dry-run", "--arch", "sm_90a", "--workers", "1")
    assert rc == 0, err
    assert "DRY RUN for sm_90a" in out and "nothing is measured" in out and "cost model only" in out
    picks = sum(out.count(f"{name}:") for name in FAMILIES)
    assert picks == 2 and "1/1" in out                          # one candidate per bucket, compiled
    assert not (cache_dir / "tuned").exists()                  # nothing measured, so no table
    assert any((cache_dir / "kernels").rglob("*"))              # the compile filled the kernel cache


def test_a_dry_run_without_candidates_says_why(capsys, cache_dir):
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--buckets", "1", "--families", "stream_wgmma",
                      "--dry-run", "--arch", "sm_80", "--workers", "1")
    assert rc == 1 and "1024x256 bucket 1: no schedule of stream_wgmma fits n256_k1024_g128_float16_w4 on sm_80" in err


def test_dry_run_rejects_unknown_arch(capsys):
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--dry-run", "--arch", "sm_70")
    assert rc == 2 and "unknown arch" in err


def _table(problem=Problem.make(n=256, k=1024)):
    table = TunedTable(GPU)
    table.record(problem, 16, SCHEDULE, 3.0, fp16_us=6.0, gbps=150.0,
                 all_timings=[{"us": 3.0, "error": None}, {"us": None, "error": "compile: x"}])
    table.save(table_path(GPU))
    return table_path(GPU)


def test_cache_list_and_show(capsys, cache_dir):
    rc, out, _ = call(capsys, "cache", "list")
    assert rc == 0 and "(none)" in out and "compiled kernels" in out
    path = _table()
    rc, out, _ = call(capsys, "cache", "list")
    assert rc == 0 and GPU.slug in out and "NVIDIA H200" in out and " ok" in out
    rc, out, _ = call(capsys, "cache", "show", "--gpu", GPU.slug)
    assert rc == 0 and str(path) in out and "1024x256" in out and "2.00x" in out and "1/2" in out
    rc, _, err = call(capsys, "cache", "show", "--gpu", "nope")
    assert rc == 2 and GPU.slug in err


def test_cache_list_reports_broken_tables(capsys, cache_dir):
    path = _table()
    path.write_text("{")
    rc, out, _ = call(capsys, "cache", "list")
    assert rc == 0 and "ignored: " in out and "is not valid JSON" in out


def test_cache_show_reports_malformed_entries_and_keeps_the_rest(capsys, cache_dir):
    import json

    path = _table()
    table = TunedTable.load(path, GPU, history=True)
    for bucket in (1, 2, 4):
        table.record(Problem.make(n=256, k=1024), bucket, SCHEDULE, 4.0, fp16_us=8.0, all_timings=[{"us": 4.0}])
    table.save(path)
    data = json.loads(path.read_text())
    data["entries"][0]["fp16_us"] = "abc"                      # bucket 1
    data["entries"][1]["gbps"] = "fast"                        # bucket 2
    path.write_text(json.dumps(data))
    history = cache_dir / "history" / path.name
    data = json.loads(history.read_text())
    data["entries"][2]["all_timings"] = [1, "x"]               # bucket 4: loses its timings only
    history.write_text(json.dumps(data))
    rc, out, err = call(capsys, "cache", "show")
    assert rc == 0 and "Traceback" not in err, err
    assert "skipped entry 0 (n256_k1024_g128_float16_w4, bucket 1): times must be finite and positive" in out
    assert "skipped entry 1 (n256_k1024_g128_float16_w4, bucket 2): GB/s must be finite and positive" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("1024x256")]
    assert [(row[3], row[-2]) for row in rows] == [("4", "0/0"), ("16", "1/2")]
    rc, out, _ = call(capsys, "cache", "list")
    assert rc == 0 and "ok, 2 entries skipped" in out


def test_cache_list_names_a_table_without_entries(capsys, cache_dir):
    TunedTable(GPU).save(table_path(GPU))
    rc, out, _ = call(capsys, "cache", "list")
    row = next(line for line in out.splitlines() if line.startswith(GPU.slug))
    assert rc == 0 and "NVIDIA H200  0" in row and row.endswith(" ok")


def test_cache_clear(capsys, cache_dir):
    path = _table()
    kernels = cache_dir / "kernels" / "x.so"
    kernels.parent.mkdir()
    kernels.write_bytes(b"0" * 10)
    rc, out, _ = call(capsys, "cache", "clear", "--gpu", GPU.slug)      # that table only
    assert rc == 0 and not path.exists() and kernels.exists()
    _table()
    rc, out, _ = call(capsys, "cache", "clear", "--kernels")
    assert rc == 0 and path.exists() and not kernels.exists()
    rc, out, _ = call(capsys, "cache", "clear")
    assert rc == 0 and not path.exists()


def test_cache_clear_with_a_relative_cache_dir_that_holds_the_shipped_tables(capsys, cache_dir, monkeypatch):
    """A checkout's own cache folder, named relative to the working directory: tune writes there."""
    path = _table()
    monkeypatch.setattr(table_module, "shipped_tables_dir", lambda: path.parent.resolve())
    monkeypatch.chdir(cache_dir.parent)
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", cache_dir.name)
    rc, out, _ = call(capsys, "cache", "clear", "--tables")
    assert rc == 0 and not path.exists(), out


def test_families_limits_the_search(capsys, cache_dir):
    rc, out, err = call(capsys, "tune", "--shapes", "1024x256", "--buckets", "16", "--top", "3",
                        "--families", "stream_mma", "--dry-run", "--arch", "sm_90a", "--workers", "1")
    assert rc == 0, err
    assert "stream_mma:" in out
    assert not any(f"{name}:" in out for name in FAMILIES if name != "stream_mma")


def test_unknown_family_is_an_error_that_lists_the_known(capsys):
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--families", "stream_mma,nope",
                      "--dry-run", "--arch", "sm_90a")
    assert rc == 2 and "unknown schedule family 'nope'" in err and "marlin_mma" in err


def test_a_bad_seed_file_is_an_error_that_names_it(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    rc, _, err = call(capsys, "tune", "--shapes", "4096x4096", "--seed", str(missing))
    assert rc == 2 and "--seed" in err and "missing.json" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    rc, _, err = call(capsys, "tune", "--shapes", "4096x4096", "--seed", str(broken))
    assert rc == 2 and "not JSON" in err
    broken.write_text('{"problem": {}}')
    rc, _, err = call(capsys, "tune", "--shapes", "4096x4096", "--seed", str(broken))
    assert rc == 2 and "gen sweep --json" in err


def test_another_tuned_table_seeds_its_recorded_candidates(tmp_path):
    from gen.tune.search import add_seeds, plan
    from schedules import stream_mma

    qkv = Problem.make(n=12288, k=4096)
    fast = Schedule("stream_mma", stream_mma.Knobs(1, 8, 4, 8, ahead=3))
    slow = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 16, ahead=2))
    other = TunedTable(GpuKey("NVIDIA H200", "sm_90a", 132), versions={"tilelang": "0.1.15"})
    other.record(qkv, 1, fast, 9.0, all_timings=[{"schedule": slow.to_dict(), "us": 20.0, "error": None},
                                                  {"schedule": fast.to_dict(), "us": 9.0, "error": None}])
    other.record(qkv, 16, slow, 30.0)           # an entry without recorded timings seeds its winner
    path = tmp_path / "cold.json"
    other.save(path)
    records = options.load_seeds(str(path))
    assert [(r["m"], len(r["results"])) for r in records] == [(1, 2), (16, 1)]
    searches = plan([(qkv, 1), (qkv, 16)], get_arch("sm_90a"), GpuSpec.for_arch(get_arch("sm_90a")), top=1)
    assert add_seeds(searches, records, get_arch("sm_90a"), GpuSpec.for_arch(get_arch("sm_90a")), per_bucket=1) == 2
    assert searches[0].results[-1].schedule == fast and searches[1].results[-1].schedule == slow
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "tilemarlin-tuned-table", "schema": 0}')
    with pytest.raises(ValueError, match="broken.json: table schema 0"):
        options.load_seeds(str(broken))


def test_the_tune_loop_end_to_end_with_a_fake_gpu(capsys, cache_dir, monkeypatch):
    """tune_on_gpu's wiring without a GPU: both rounds compile and measure (a problem measured while
    the next compiles), every bucket lands in the table with all its timings, a forced run leaves no
    progress note, and a second run has nothing to do."""
    import zlib

    import torch

    from gen.tune import measuring, search

    h200 = get_arch("sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("schedules.arch.current_arch", lambda device=None: h200)
    monkeypatch.setattr(GpuKey, "current", classmethod(lambda cls, device=None: GPU))
    monkeypatch.setattr(GpuSpec, "current", classmethod(lambda cls, device=None: GpuSpec.for_arch(h200)))
    compiled = []

    def fake_compile_many(jobs, arch, workers=None, progress=None):
        compiled.append(list(jobs))
        for job in jobs:
            progress(job, None)
        return {}

    def fake_measure(problem, arch, mine, progress=None, on_bucket=None, **_):
        for x in mine:
            x.fp16_us = 50.0
            for r in x.results:
                if r.us is None and r.error is None:
                    # a made-up time that the estimate does not predict, so that round two matters
                    r.us, r.rel_err = 10.0 + zlib.crc32(r.schedule.name.encode()) % 97 / 10, 1e-4
                    progress(r)
            on_bucket(x)

    monkeypatch.setattr("runtime.kernels.compile_many", fake_compile_many)
    monkeypatch.setattr(measuring, "measure_problem", fake_measure)
    rc, out, err = call(capsys, "tune", "--shapes", "4096x4096,4096x1024", "--buckets", "1,128", "--top", "4",
                        "--refine", "2", "--force")
    assert rc == 0, err
    assert "candidates added around the measured winners" in out
    table = TunedTable.load(table_path(GPU), GPU, history=True)
    for n in (4096, 1024):
        for bucket in (1, 128):
            entry = table.entry(Problem.make(n=n, k=4096), bucket)
            assert entry is not None and entry.us == min(t["us"] for t in entry.all_timings)
            assert len(entry.all_timings) > 4        # round two measured more than the plan's top 4
    # round two refines every bucket, later rounds (at most REFINE_ROUNDS local ones) those whose winner moved
    assert 2 <= len(compiled) <= 1 + search.REFINE_ROUNDS and all(len(jobs) == len(set(jobs)) for jobs in compiled)
    assert "round 2: " in out
    assert not list(cache_dir.rglob("*.force-progress"))
    # A forced re-tune of the winners alone keeps the first run's other timings, marked as earlier.
    first = {(n, b): TunedTable.load(table_path(GPU), GPU, history=True).entry(Problem.make(n=n, k=4096), b).all_timings
             for n in (4096, 1024) for b in (1, 128)}
    rc, out, err = call(capsys, "tune", "--shapes", "4096x4096,4096x1024", "--buckets", "1,128", "--top", "1",
                        "--refine", "0", "--force", "--restart")
    assert rc == 0, err
    table = TunedTable.load(table_path(GPU), GPU, history=True)
    for (n, bucket), before in first.items():
        entry = table.entry(Problem.make(n=n, k=4096), bucket)
        now = [t for t in entry.all_timings if not t.get("earlier_run")]
        kept = [t for t in entry.all_timings if t.get("earlier_run")]
        assert 1 <= len(now) <= 2 and entry.us == min(t["us"] for t in now)
        assert sorted(t["name"] for t in entry.all_timings) == sorted(t["name"] for t in before)
        assert kept and not {t["name"] for t in kept} & {t["name"] for t in now}
    compiled.clear()
    rc, out, _ = call(capsys, "tune", "--shapes", "4096x4096,4096x1024", "--buckets", "1,128")
    assert rc == 0 and "0 to tune" in out and not compiled
    # --between times in the other harness: every bucket timed back to back is tuned again, each
    # measurement told so, and the entries record it; then it is a resumed run like any other.
    harnesses = []

    def measure_between(problem, arch, mine, progress=None, on_bucket=None, between=False):
        harnesses.append(between)
        fake_measure(problem, arch, mine, progress, on_bucket)

    monkeypatch.setattr(measuring, "measure_problem", measure_between)
    rc, out, err = call(capsys, "tune", "--shapes", "4096x4096,4096x1024", "--buckets", "1,128", "--top", "2",
                        "--refine", "0", "--between")
    assert rc == 0 and "4 to tune" in out and "--between" in out, err
    assert harnesses and all(harnesses)
    table = TunedTable.load(table_path(GPU), GPU, history=True)
    assert {table.entry(Problem.make(n=n, k=4096), b).harness for n in (4096, 1024) for b in (1, 128)} == {"between"}
    # the replay-timed entries' timings are not carried over as earlier ones: they answer another question
    assert not any(t.get("earlier_run") for n in (4096, 1024) for b in (1, 128)
                   for t in table.entry(Problem.make(n=n, k=4096), b).all_timings)
    rc, out, _ = call(capsys, "tune", "--shapes", "4096x4096,4096x1024", "--buckets", "1,128", "--between")
    assert rc == 0 and "0 to tune" in out
    rc, out, _ = call(capsys, "tune", "--shapes", "4096x4096", "--buckets", "1", "--top", "1", "--refine", "0")
    assert rc == 0 and "1 to tune" in out and not harnesses[-1]
    assert TunedTable.load(table_path(GPU), GPU).entry(Problem.make(n=4096, k=4096), 1).harness == "replay"
    monkeypatch.setattr(measuring, "measure_problem", fake_measure)
    # Every new candidate faster than all before: each round moves every winner, so the rounds go on
    # to the last one that the time budget allows.
    ticks = itertools.count()

    def faster_each_time(problem, arch, mine, progress=None, on_bucket=None, **_):
        for x in mine:
            x.fp16_us = 50.0
            for r in x.results:
                if r.us is None and r.error is None:
                    r.us, r.rel_err = 40.0 - next(ticks) / 100, 1e-4
                    progress(r)
            on_bucket(x)

    monkeypatch.setattr(measuring, "measure_problem", faster_each_time)
    for budget, rounds in (("1e6", 1 + search.REFINE_ROUNDS), ("1e-6", 1)):
        compiled.clear()
        rc, out, err = call(capsys, "tune", "--shapes", "4096x4096,4096x1024", "--buckets", "1,128", "--top", "4",
                            "--refine", "2", "--force", "--restart", "--time-budget", budget)
        assert rc == 0, err
        assert len(compiled) == rounds and f"round {rounds + 1}: " not in out
        assert rounds == 1 or f"round {rounds}: " in out        # (round one's own line names no number)
    assert "round 2 (" in out and "skipped: it would end past --time-budget" in out


def test_a_round_is_expected_to_cost_a_fixed_part_and_a_part_per_candidate():
    from gen.tune.rounds import ROUND_FIXED_S, expected_round_s

    # A cold tune on the H200: 312 then 216 candidates took 121 and 99 s; the line through
    # them says 72 candidates take ~66 s (they took 56), where the last round's seconds per candidate
    # said 33 and let the round start 37 s before a budget it then overran by 19.
    assert expected_round_s([(312, 121.0), (216, 99.0)], 72) == pytest.approx(49.5 + 72 * 22 / 96)
    # One round so far: the fixed part plus the last round's rate on the rest.
    assert expected_round_s([(312, 121.0)], 216) == pytest.approx(ROUND_FIXED_S + (121 - ROUND_FIXED_S) * 216 / 312)
    assert expected_round_s([(10, 4.0)], 20) == pytest.approx(2 + 2 * 2)     # the fixed part at most half
    # Rounds that got cheaper with more candidates (noise): never below the slowest rate seen.
    assert expected_round_s([(100, 50.0), (200, 40.0)], 50) == pytest.approx(25.0)
    # Equal sizes cannot fit a line: the last round's rule.
    assert expected_round_s([(100, 50.0), (100, 60.0)], 100) == pytest.approx(60.0)


# --- a read-only cache ---------------------------------------------------------------------------

def _fake_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("schedules.arch.current_arch", lambda device=None: get_arch("sm_90a"))
    monkeypatch.setattr(GpuKey, "current", classmethod(lambda cls, device=None: GPU))
    monkeypatch.setattr(GpuSpec, "current", classmethod(lambda cls, device=None: GpuSpec.for_arch(get_arch("sm_90a"))))


@pytest.fixture
def read_only_cache(cache_dir, monkeypatch):
    """cache_dir holding a tuned table, then read-only: its folders chmod a-w, and os.access answering
    as a read-only volume does, since chmod binds no one running as root. Yields a function that
    lists what changed in the folder since (so that a write is caught as root too)."""
    import os

    _table()

    def files():
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(cache_dir.rglob("*"))}

    before = files()
    folders = [cache_dir, *(p for p in cache_dir.rglob("*") if p.is_dir())]
    for folder in folders:
        folder.chmod(0o555)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if mode & os.W_OK else access(path, mode, **kw))

    def changed():
        now = files()
        return {k: v for k, v in now.items() if before.get(k) != v} | {k: "gone" for k in before if k not in now}

    yield changed
    for folder in folders:
        folder.chmod(0o755)


def test_reading_commands_work_on_a_read_only_cache(capsys, cache_dir, read_only_cache):
    from gen.cli import main
    from runtime.table import winners_for_arch

    rc, out, _ = call(capsys, "cache", "list")
    assert rc == 0 and GPU.slug in out and " ok" in out
    rc, out, _ = call(capsys, "cache", "show")
    assert rc == 0 and "1024x256" in out and "2.00x" in out
    rc = main(["precompile", "--shapes", "1024x256", "--arch", "sm_90a", "--gpu", GPU.slug, "--buckets", "16",
               "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "1 pairs tuned" in out and "marlin_mma:" in out
    assert TunedTable.load(table_path(GPU), GPU).entry(Problem.make(n=256, k=1024), 16).us == 3.0
    assert [w.schedule for w in winners_for_arch("sm_90a")] == [SCHEDULE]   # what serving (and gen bench) choose from
    assert read_only_cache() == {}


def test_tune_refuses_a_read_only_cache_before_measuring(capsys, cache_dir, read_only_cache, monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(tune, "plan", lambda *a, **kw: pytest.fail("planned before refusing"))
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--buckets", "1")
    assert rc == 2 and f"{cache_dir / 'tuned'} is not writable" in err and "TILEMARLIN_CACHE_DIR" in err
    assert "Traceback" not in err
    rc, _, err = call(capsys, "tune", "--shapes", "1024x256", "--buckets", "1", "--dry-run")
    assert rc == 2 and f"cannot create {cache_dir / 'kernels'}: {cache_dir} is not writable" in err
    assert "TILEMARLIN_CACHE_DIR" in err and read_only_cache() == {}


def test_clearing_a_read_only_cache_is_an_error_that_names_it(capsys, cache_dir, read_only_cache):
    rc, _, err = call(capsys, "cache", "clear", "--tables")
    assert rc == 2 and f"{cache_dir / 'tuned'} is not writable" in err and "TILEMARLIN_CACHE_DIR" in err
    assert read_only_cache() == {}


@pytest.mark.parametrize("models", [",", " , "])
def test_a_model_list_that_names_no_model_is_an_error(capsys, models):
    rc, _, err = call(capsys, "tune", "--model", models, "--dry-run", "--arch", "sm_90a")
    assert rc == 2 and "name the layers" in err


def test_a_config_of_the_other_dtype_is_noted(capsys, tmp_path):
    from gen.models import MODELS

    (tmp_path / "config.json").write_text(json.dumps(dict(MODELS["llama-2-7b"], torch_dtype="bfloat16")))
    args = parse("tune", "--model", str(tmp_path / "config.json"), "--dry-run", "--arch", "sm_90a")
    targets = options.targets_from_args(args)
    assert {t.problem.dtype for t in targets} == {"float16"}
    assert "says bfloat16; its layers are planned in --dtype float16" in capsys.readouterr().err
    args = parse("tune", "--model", str(tmp_path), "--dtype", "bfloat16", "--dry-run", "--arch", "sm_90a")
    options.targets_from_args(args)
    assert "note:" not in capsys.readouterr().err
