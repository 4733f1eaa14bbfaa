"""The tuned-table format: buckets, round trip, untrusted files, atomic merged saves."""
import json
import multiprocessing
import os

import pytest

import runtime.table as table_module
from runtime.table import (BUCKETS, GpuKey, TableWarning, TunedTable, bucket_of, bucket_range, current_versions,
                           load_tuned_table, shipped_tables_dir, table_folders, table_path, tables_dir)
from schedules.marlin_mma import Knobs
from schedules.problem import Problem
from schedules.registry import Schedule

GPU = GpuKey("NVIDIA H200", "sm_90a", 132)
PROBLEM = Problem.make(n=12288, k=4096)
SCHEDULE = Schedule("marlin_mma", Knobs(block_m=16, block_n=256, split_k=2))


def test_bucket_of_edges():
    assert bucket_of(1) == 1
    assert bucket_of(3) == 4
    assert bucket_of(16) == 16
    assert bucket_of(17) == 32
    assert bucket_of(4096) == 4096
    assert bucket_of(100_000) == 4096        # the last bucket serves everything above it
    for edge in BUCKETS:
        assert bucket_of(edge) == edge
    with pytest.raises(ValueError):
        bucket_of(0)


def test_bucket_range():
    assert bucket_range(1) == (1, 1)
    assert bucket_range(16) == (9, 16)
    assert bucket_range(4096) == (2049, None)


def test_slug_is_filename_safe():
    assert GPU.slug == "nvidia-h200_sm_90a_132sm"
    assert GpuKey("NVIDIA A100-SXM4-80GB", "sm_80", 108).slug == "nvidia-a100-sxm4-80gb_sm_80_108sm"
    assert table_path(GPU, root="/x").name == "nvidia-h200_sm_90a_132sm.json"


def test_a_moved_cache_keeps_the_shipped_entries_beneath_its_own(tmp_path, monkeypatch):
    """TILEMARLIN_CACHE_DIR moves where tune writes; the shipped tables are still read, and an entry
    tuned into the moved cache replaces the shipped entry of the same key."""
    shipped = TunedTable(GPU)
    shipped.record(PROBLEM, 1, SCHEDULE, 9.0)
    shipped.record(PROBLEM, 16, SCHEDULE, 12.0)
    shipped.save(tmp_path / "shipped" / f"{GPU.slug}.json")
    monkeypatch.setattr(table_module, "shipped_tables_dir", lambda: tmp_path / "shipped")
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "cache"))
    assert table_path(GPU) == tmp_path / "cache" / "tuned" / f"{GPU.slug}.json"
    assert table_folders() == [tmp_path / "shipped", tmp_path / "cache" / "tuned"]
    assert [(k[1], e.us) for k, e in load_tuned_table(GPU).items()] == [(1, 9.0), (16, 12.0)]

    own = TunedTable(GPU)
    own.record(PROBLEM, 16, SCHEDULE, 7.0)
    own.save(table_path(GPU))
    assert [(k[1], e.us) for k, e in load_tuned_table(GPU).items()] == [(1, 9.0), (16, 7.0)]


def test_the_default_cache_is_the_shipped_folder(monkeypatch):
    monkeypatch.delenv("TILEMARLIN_CACHE_DIR", raising=False)
    assert table_folders() == [shipped_tables_dir()] and tables_dir() == shipped_tables_dir()


def test_round_trip(tmp_path):
    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    timings = [{"schedule": SCHEDULE.to_dict(), "us": 7.5}, {"schedule": None, "error": "compile: boom"}]
    table.record(PROBLEM, 16, SCHEDULE, 7.5, fp16_us=15.0, gbps=3300.0, all_timings=timings)
    table.save(path)

    data = json.loads(path.read_text())
    assert data["gpu"] == {"name": "NVIDIA H200", "arch": "sm_90a", "sm_count": 132}
    assert set(data["versions"]) == {"tilemarlin", "tilelang", "cuda", "torch"}
    assert data["entries"][0]["problem"] == {"n": 12288, "k": 4096, "group": 128, "dtype": "float16", "bits": 4}

    assert "all_timings" not in data["entries"][0]          # the history lives in its own file
    history = json.loads((tmp_path.parent / "history" / "t.json").read_text())
    assert history["entries"][0]["all_timings"] == timings

    loaded = TunedTable.load(path, GPU)
    entry = loaded.entry(PROBLEM, 16)
    assert entry.schedule == SCHEDULE and entry.us == 7.5 and entry.speedup == 2.0
    assert entry.all_timings == [] and TunedTable.load(path, GPU, history=True).entry(PROBLEM, 16).all_timings == timings
    assert loaded.lookup(PROBLEM, 9) == SCHEDULE     # 9..16 share the bucket
    assert loaded.lookup(PROBLEM, 8) is None
    assert loaded.lookup(Problem.make(n=4096, k=4096), 16) is None
    assert entry.harness == "replay" and "harness" not in data["entries"][0]   # the default is not written


def test_harness_round_trips_and_an_unknown_one_is_malformed(tmp_path):
    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    table.record(PROBLEM, 16, SCHEDULE, 7.5, harness="between")
    table.save(path)
    assert json.loads(path.read_text())["entries"][0]["harness"] == "between"
    assert TunedTable.load(path, GPU).entry(PROBLEM, 16).harness == "between"
    with pytest.raises(ValueError, match="harness 'graph'"):
        table.record(PROBLEM, 16, SCHEDULE, 7.5, harness="graph")
    data = json.loads(path.read_text())
    data["entries"][0]["harness"] = "graph"
    path.write_text(json.dumps(data))
    _assert_ignored(path, "entry 0 .*harness 'graph'")


def test_record_rejects_non_bucket():
    with pytest.raises(ValueError, match="bucket"):
        TunedTable(GPU).record(PROBLEM, 3, SCHEDULE, 1.0)


def _saved(tmp_path):
    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    table.record(PROBLEM, 1, SCHEDULE, 5.0)
    table.save(path)
    return path


def _assert_ignored(path, match):
    with pytest.warns(TableWarning, match=match) as record:
        table = TunedTable.load(path, GPU)
    assert str(path) in str(record[0].message)
    assert len(table) == 0 and table.lookup(PROBLEM, 1) is None
    return table


def test_missing_file_is_empty(tmp_path):
    assert len(TunedTable.load(tmp_path / "none.json")) == 0


def test_corrupt_file_is_ignored(tmp_path):
    path = _saved(tmp_path)
    path.write_bytes(b"\x00\xffgarbage{")
    _assert_ignored(path, "corrupt|cannot be read")


def test_truncated_file_is_ignored(tmp_path):
    path = _saved(tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    _assert_ignored(path, "corrupt or truncated")


def test_wrong_schema_is_ignored(tmp_path):
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["schema"] = 999
    path.write_text(json.dumps(data))
    _assert_ignored(path, "schema 999")


def test_not_a_table_is_ignored(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([1, 2, 3]))
    _assert_ignored(path, "not a tilemarlin-tuned-table file")


def test_malformed_entry_is_ignored(tmp_path):
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["entries"][0]["schedule"]["knobs"]["no_such_knob"] = 1
    path.write_text(json.dumps(data))
    _assert_ignored(path, "entry 0 .*no_such_knob")


GOOD_PROBLEM = Problem.make(n=4096, k=4096)


@pytest.mark.parametrize("change, reason", [
    (lambda e: e["schedule"]["knobs"].update(split_k=7), "split_k=7 is not one of"),
    (lambda e: e["schedule"]["knobs"].update(split_k="2"), "split_k='2' is not one of"),
    (lambda e: e["schedule"]["knobs"].update(scale_on_acc=1), "scale_on_acc=1 is not one of"),
    (lambda e: e["schedule"]["knobs"].update(warps_m=float(e["schedule"]["knobs"]["warps_m"])),
     r"warps=\(1.0, .* is not one of"),
    (lambda e: e["schedule"]["knobs"].update(block_m=128, block_n=256, block_k=128, num_stages=6), "shared"),
    (lambda e: e.update(us="nan"), "finite and positive"),
    (lambda e: e.update(us=float("inf")), "finite and positive"),
    (lambda e: e.update(us=10 ** 400), "finite and positive"),
    (lambda e: e.update(us=-1.0), "finite and positive"),
    (lambda e: e.update(fp16_us="12"), "finite and positive"),
    (lambda e: e.update(gbps="fast"), "GB/s must be finite and positive"),
    (lambda e: e.update(gbps=float("nan")), "GB/s must be finite and positive"),
    (lambda e: e.update(all_timings=[1, 2]), "all_timings is not a list of objects"),
    (lambda e: e.update(bucket=3), "bucket 3 is not one of"),
    (lambda e: e.update(bucket=True), "bucket True"),
    (lambda e: e["schedule"].update(family="no_such_family"), "unknown schedule family"),
])
def test_an_untrusted_entry_is_skipped_and_named_the_rest_kept(tmp_path, change, reason):
    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    table.record(GOOD_PROBLEM, 1, SCHEDULE, 5.0)
    table.record(GOOD_PROBLEM, 2, SCHEDULE, 6.0)
    table.save(path)
    data = json.loads(path.read_text())
    change(data["entries"][1])
    path.write_text(json.dumps(data))
    with pytest.warns(TableWarning, match=f"skipped 1 entries: entry 1 .*{reason}"):
        loaded = TunedTable.load(path, GPU)
    assert len(loaded) == 1 and loaded.entry(GOOD_PROBLEM, 1).us == 5.0


def test_a_tune_that_narrows_an_axis_keeps_the_entries_outside_it(tmp_path):
    """`gen tune --axes` narrows a family's axes for its run: the table's other entries stay trusted
    when it is read and saved meanwhile."""
    from gen.tune.options import searched_axes

    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    table.record(GOOD_PROBLEM, 1, SCHEDULE, 5.0)       # split_k 2
    table.save(path)
    with searched_axes({"marlin_mma": {"split_k": (1,)}}):
        during = TunedTable.load(path, GPU)
        assert during.entry(GOOD_PROBLEM, 1) is not None
        during.record(GOOD_PROBLEM, 2, Schedule("marlin_mma", Knobs(block_m=16, block_n=256, split_k=1)), 6.0)
        during.save(path)
    assert sorted(b for (_, b), _ in TunedTable.load(path, GPU).items()) == [1, 2]


def test_a_repeated_key_keeps_the_first_entry_and_says_so(tmp_path):
    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    table.record(GOOD_PROBLEM, 1, SCHEDULE, 5.0)
    table.save(path)
    data = json.loads(path.read_text())
    data["entries"].append(dict(data["entries"][0], us=1.0))
    path.write_text(json.dumps(data))
    with pytest.warns(TableWarning, match="entry 1 .*repeats an earlier entry's key"):
        assert TunedTable.load(path, GPU).entry(GOOD_PROBLEM, 1).us == 5.0


def test_the_committed_table_is_trusted_entry_by_entry():
    from runtime.table import tables_dir

    paths = sorted(tables_dir().glob("*.json"))
    assert paths
    for path in paths:
        table = TunedTable.read(path)
        assert table.skipped == [] and len(table) > 0, (path, table.skipped)


def test_stale_tilelang_is_ignored(tmp_path):
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["versions"]["tilelang"] = "0.0.1"
    path.write_text(json.dumps(data))
    _assert_ignored(path, "stale: tuned with TileLang 0.0.1")


def test_another_tilemarlin_is_ignored(tmp_path):
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["versions"]["tilemarlin"] = "0.0.1"
    path.write_text(json.dumps(data))
    _assert_ignored(path, "stale: tuned with tilemarlin 0.0.1")


def test_another_cuda_or_torch_is_reported_and_kept(tmp_path):
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["versions"].update(cuda="11.8", torch="2.0.0")
    path.write_text(json.dumps(data))
    with pytest.warns(TableWarning, match="tuned with cuda 11.8.*tuned with torch 2.0.0.*checked against the reference"):
        assert TunedTable.load(path, GPU).entry(PROBLEM, 1).us == 5.0


def test_other_gpu_is_ignored(tmp_path):
    path = _saved(tmp_path)
    with pytest.warns(TableWarning, match="tuned for"):
        assert len(TunedTable.load(path, GpuKey("NVIDIA H100", "sm_90a", 114))) == 0


def test_save_replaces_untrusted_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{")
    table = TunedTable(GPU)
    table.record(PROBLEM, 2, SCHEDULE, 4.0)
    with pytest.warns(TableWarning, match="replacing"):
        table.save(path)
    assert TunedTable.load(path, GPU).entry(PROBLEM, 2).us == 4.0
    assert not list(tmp_path.glob("*.tmp"))


def test_save_merges_and_recorded_entries_win(tmp_path):
    path = _saved(tmp_path)                      # bucket 1 at 5.0 us
    mine = TunedTable.load(path, GPU)
    other = TunedTable.load(path, GPU)
    other.record(PROBLEM, 1, SCHEDULE, 4.0)      # another tuner re-tunes bucket 1 (--force)
    other.save(path)
    mine.record(PROBLEM, 2, SCHEDULE, 6.0)
    mine.save(path)                              # must keep the other's newer bucket 1
    final = TunedTable.load(path, GPU)
    assert final.entry(PROBLEM, 1).us == 4.0 and final.entry(PROBLEM, 2).us == 6.0
    assert mine.entry(PROBLEM, 1).us == 4.0      # the saver sees the merged table too


def test_an_older_measurement_never_replaces_a_newer_one(tmp_path):
    path = _saved(tmp_path)
    a = TunedTable.load(path, GPU)
    a.record(PROBLEM, 1, SCHEDULE, 5.0)          # A measures bucket 1 first ...
    b = TunedTable.load(path, GPU)
    b.record(PROBLEM, 1, SCHEDULE, 3.0)          # ... B measures it later and saves
    b.save(path)
    a.record(PROBLEM, 2, SCHEDULE, 6.0)
    a.save(path)                                 # A's save must not put its older 5.0 back
    final = TunedTable.load(path, GPU)
    assert final.entry(PROBLEM, 1).us == 3.0 and final.entry(PROBLEM, 2).us == 6.0


def test_a_schema_1_file_with_inline_timings_is_read(tmp_path):
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["schema"] = 1
    del data["entries"][0]["measured_at"]
    data["entries"][0]["all_timings"] = [{"schedule": SCHEDULE.to_dict(), "us": 5.0}]
    path.write_text(json.dumps(data))
    entry = TunedTable.load(path, GPU).entry(PROBLEM, 1)
    assert entry.us == 5.0 and entry.all_timings == [{"schedule": SCHEDULE.to_dict(), "us": 5.0}]


def test_a_history_record_of_another_measurement_is_not_attached(tmp_path):
    """A winner re-measured later (a table written by another tuner) keeps no timings of the old run."""
    path = tmp_path / "t.json"
    table = TunedTable(GPU)
    table.record(PROBLEM, 16, SCHEDULE, 7.5, all_timings=[{"schedule": SCHEDULE.to_dict(), "us": 7.5}],
                 measured_at="2026-12-01T00:00:00+00:00")
    table.save(path)
    data = json.loads(path.read_text())
    data["entries"][0]["measured_at"] = "2026-12-02T00:00:00+00:00"
    path.write_text(json.dumps(data))
    assert TunedTable.load(path, GPU, history=True).entry(PROBLEM, 16).all_timings == []


def test_a_corrupt_history_loses_its_timings_not_the_winners(tmp_path):
    path = tmp_path / "tuned" / "t.json"
    table = TunedTable(GPU)
    table.record(PROBLEM, 1, SCHEDULE, 5.0, all_timings=[{"us": 5.0}])
    table.save(path)
    history = tmp_path / "history" / "t.json"
    history.write_text("{")
    with pytest.warns(TableWarning, match="ignoring its history .*not valid JSON"):
        loaded = TunedTable.load(path, GPU, history=True)
    assert loaded.entry(PROBLEM, 1).us == 5.0 and loaded.entry(PROBLEM, 1).all_timings == []
    other = TunedTable(GPU)                       # another tuner saves beside it: the winners stay
    other.record(PROBLEM, 2, SCHEDULE, 6.0, all_timings=[{"us": 6.0}])
    with pytest.warns(TableWarning, match="ignoring its history"):
        other.save(path)
    final = TunedTable.load(path, GPU, history=True)
    assert final.entry(PROBLEM, 1).us == 5.0 and final.entry(PROBLEM, 2).all_timings == [{"us": 6.0}]


def test_saving_into_a_read_only_cache_names_the_path_and_the_fix(tmp_path, monkeypatch):
    (tmp_path / "tuned").mkdir()
    path = tmp_path / "tuned" / "t.json"
    monkeypatch.setattr(os, "access", lambda p, mode: False)      # as a read-only volume answers
    table = TunedTable(GPU)
    table.record(PROBLEM, 1, SCHEDULE, 5.0)
    with pytest.raises(PermissionError, match=f"{tmp_path / 'tuned'} is not writable.*TILEMARLIN_CACHE_DIR"):
        table.save(path)
    assert not path.exists()


def test_saved_versions_are_current(tmp_path):
    path = _saved(tmp_path)
    assert json.loads(path.read_text())["versions"] == current_versions()


def _save_many(path: str, n: int, buckets: list[int], barrier) -> None:
    problem = Problem.make(n=n, k=4096)
    barrier.wait()
    for b in buckets:        # one save per entry: many chances to lose another process's entries
        table = TunedTable.load(path, GPU)
        table.record(problem, b, SCHEDULE, float(b))
        table.save(path)


def test_concurrent_saves_keep_both(tmp_path):
    path = str(tmp_path / "t.json")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_save_many, args=(path, n, list(BUCKETS), barrier)) for n in (4096, 8192)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    table = TunedTable.load(path, GPU)
    assert len(table) == 2 * len(BUCKETS)
    for n in (4096, 8192):
        for b in BUCKETS:
            assert table.entry(Problem.make(n=n, k=4096), b).us == float(b)


def _tuner(path: str, steps) -> None:
    """A tuner in a process of its own: per step, once the step's event is set, it records a bucket's
    time (measured now) and saves."""
    table = TunedTable.load(path, GPU)
    for go, bucket, us, saved in steps:
        go.wait(60)
        table.record(PROBLEM, bucket, SCHEDULE, us)
        table.save(path)
        saved.set()


def test_across_processes_a_newer_measurement_survives_an_older_tuners_later_save(tmp_path):
    """A saves bucket 1 at 5.0 us, B measures it later at 3.0 and saves, then A saves bucket 2: A's
    table still holds its older bucket 1, and the save must not put it back over B's."""
    path = str(tmp_path / "t.json")
    ctx = multiprocessing.get_context("spawn")
    events = [ctx.Event() for _ in range(6)]
    a = ctx.Process(target=_tuner, args=(path, [(events[0], 1, 5.0, events[1]), (events[4], 2, 6.0, events[5])]))
    b = ctx.Process(target=_tuner, args=(path, [(events[2], 1, 3.0, events[3])]))
    for p in (a, b):
        p.start()
    for go, saved in ((0, 1), (2, 3), (4, 5)):
        events[go].set()
        assert events[saved].wait(60)
    for p in (a, b):
        p.join(60)
        assert p.exitcode == 0
    final = TunedTable.load(path, GPU)
    assert final.entry(PROBLEM, 1).us == 3.0 and final.entry(PROBLEM, 2).us == 6.0
    assert final.entry(PROBLEM, 1).measured_at < final.entry(PROBLEM, 2).measured_at
