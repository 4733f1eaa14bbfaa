"""`gen modelcheck` without a GPU: recorded timings from a tuned table and a sweep, ranked by the cost
model, against timings made to agree or disagree with it."""
import json

import pytest

from gen.cli import main
from gen.dev.modelcheck import load_timings, ranking_quality
from runtime.table import GpuKey, TunedTable
from schedules.arch import get_arch
from schedules.cost import GpuSpec, estimate_us, rank
from schedules.problem import Problem

H200 = get_arch("sm_90a")
SPEC = GpuSpec.for_arch(H200)
O_PROJ = Problem.make(n=4096, k=4096)


def _timings(m, agree: bool, count=6):
    """`count` stream_mma candidates with times that follow the model's order (agree) or reverse it."""
    ranked = [s for s in rank(O_PROJ, m, H200, SPEC) if s.family == "stream_mma"][:count]
    estimates = [estimate_us(O_PROJ, s, m, SPEC) for s in ranked]
    times = estimates if agree else [10.0 * (count - i) for i in range(count)]    # the first pick slowest
    return [{"schedule": s.to_dict(), "name": s.name, "us": us, "error": None} for s, us in zip(ranked, times)]


def _files(tmp_path, agree):
    table = TunedTable(GpuKey("NVIDIA H200", "sm_90a", 132))
    timings = _timings(1, agree)
    table.record(O_PROJ, 1, rank(O_PROJ, 1, H200, SPEC)[0], 1.0, all_timings=timings + [
        {"schedule": timings[0]["schedule"], "us": None, "error": "wrong: relative error 0.5"}])
    table_path = tmp_path / "table.json"
    table.save(table_path)
    sweep_path = tmp_path / "sweep.json"
    sweep_path.write_text(json.dumps([{"problem": {"n": 4096, "k": 4096, "group": 128, "dtype": "float16", "bits": 4},
                                       "m": 16, "results": _timings(16, agree)}]))
    return str(table_path), str(sweep_path)


def test_a_model_that_agrees_with_the_timings_scores_one(tmp_path):
    table, sweep = _files(tmp_path, agree=True)
    groups = load_timings([table], [sweep])
    assert sorted(m for _, m in groups) == [1, 16] and all(len(t) == 6 for t in groups.values())
    q = ranking_quality(groups, H200, SPEC, top=2)
    assert q.groups == 2 and q.first_mean == pytest.approx(1.0) and q.top_mean == pytest.approx(1.0)
    assert q.log_bias == pytest.approx(0.0, abs=1e-9)
    assert ranking_quality(groups, H200, SPEC, top=2, family="marlin_mma") is None     # none of those timed


def test_a_model_that_disagrees_scores_worse(tmp_path):
    table, sweep = _files(tmp_path, agree=False)
    q = ranking_quality(load_timings([table], [sweep]), H200, SPEC, top=2)
    assert q.first_mean > 5 and q.first_worst >= q.first_mean > q.top_mean >= 1.0


def test_cli_prints_per_family_and_rejects_bad_input(tmp_path, capsys):
    table, sweep = _files(tmp_path, agree=True)
    assert main(["modelcheck", "--table", table, "--sweep", sweep]) == 0
    out = capsys.readouterr().out
    assert "all families" in out and "stream_mma" in out and "1.000" in out
    assert main(["modelcheck"]) == 2
    assert "--table" in capsys.readouterr().err
    assert main(["modelcheck", "--sweep", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["modelcheck", "--sweep", table]) == 2          # a table is not a sweep
    assert "not a `gen sweep --json` file" in capsys.readouterr().err


def test_reach_tells_which_winners_a_cold_tune_would_measure(tmp_path, capsys):
    from gen.dev.modelcheck import first_round_reach
    from gen.tune.search import first_round_ranking
    from schedules import stream_wgmma
    from schedules.registry import Schedule

    ranked = first_round_ranking(O_PROJ, 1, H200, SPEC)
    first_pick = ranked[0]
    stream_picks = [s for s in ranked if s.family == "stream_wgmma"]
    far = stream_picks[200]                      # deep in its family's ranking: not in a top-2 round
    outside = Schedule("stream_wgmma", stream_wgmma.Knobs(88, 1, 1, 64, 4))     # block_m 88 is not on the axis
    assert stream_wgmma.check(O_PROJ, outside.knobs, H200) is None
    table = TunedTable(GpuKey("NVIDIA H200", "sm_90a", 132))
    for bucket, winner in ((1, first_pick), (2, far), (4, outside)):
        table.record(O_PROJ, bucket, winner, 1.0)
    path = tmp_path / "table.json"
    table.save(path)

    reach = {r.bucket: r for r in first_round_reach(str(path), H200, SPEC, top=2)}
    assert reach[1].in_first_round
    assert not reach[2].in_first_round and reach[2].family_rank == 200
    assert not reach[4].in_first_round and reach[4].family_rank is None
    assert main(["modelcheck", "--reach", str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "measures 1 of 3 winners" in out and "outside the space" in out and far.name in out
    assert main(["modelcheck", "--reach", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_timings_after_the_producer_are_left_out(tmp_path):
    """Records and entries timed in the between harness include a kernel boundary the cost model does
    not estimate: load_timings skips them; an unknown harness is an error that names the file."""
    table, sweep = _files(tmp_path, agree=True)
    records = json.loads(open(sweep).read())
    between = tmp_path / "between.json"
    between.write_text(json.dumps([{**r, "m": 32, "harness": "between"} for r in records]))
    groups = load_timings([table], [sweep, str(between)])
    assert sorted(m for _, m in groups) == [1, 16]
    data = json.loads(open(table).read())
    for e in data["entries"]:
        e["harness"] = "between"
    between_table = tmp_path / "between_table.json"
    between_table.write_text(json.dumps(data))
    assert sorted(m for _, m in load_timings([str(between_table)], [sweep])) == [16]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{**r, "harness": "sideways"} for r in records]))
    with pytest.raises(ValueError, match="bad.json.*sideways"):
        load_timings([], [str(bad)])


def test_the_fallback_check_leaves_each_problem_out_and_times_its_choice(tmp_path, capsys):
    """Two problems of one shape in fp16 and bf16: left out in turn, each runs the other's winner (its
    twin), whose recorded time over the fastest is the ratio; a choice nobody timed has none."""
    from gen.dev.fallback_check import fallback_against_tune, summary

    fast, slow = rank(O_PROJ, 16, H200, SPEC)[:2]
    bf16 = Problem.make(n=4096, k=4096, dtype="bfloat16")
    table = TunedTable(GpuKey("NVIDIA H200", "sm_90a", 132))

    def timed(schedule, us):
        return {"schedule": schedule.to_dict(), "name": schedule.name, "us": us, "error": None}

    table.record(O_PROJ, 16, fast, 5.0, all_timings=[timed(fast, 5.0), timed(slow, 6.0)])
    table.record(bf16, 16, slow, 4.0, all_timings=[timed(slow, 4.0)])
    path = tmp_path / "table.json"
    table.save(path)
    results = {r.problem: r for r in fallback_against_tune(TunedTable.read(path), load_timings([str(path)], []),
                                                           H200, SPEC)}
    assert results[O_PROJ].choice == slow.name and results[O_PROJ].ratio == pytest.approx(6.0 / 5.0)
    assert "bfloat16" in results[O_PROJ].how
    assert results[bf16].choice == fast.name and results[bf16].ratio is None     # not timed for bf16
    assert summary(list(results.values())) == "1 of 2 choices measured: median 1.200x the fastest, worst 1.20x, 0 within 10 %"
    assert main(["modelcheck", "--fallback", str(path)]) == 0
    assert "16: 1.20" in capsys.readouterr().out
