"""End to end on a GPU: `gen tune` one small shape, then check what it cached.

Run on the GPU machine: python -m pytest tests/test_tune_gpu.py -q   (about a minute; skipped without CUDA)
"""
import argparse

import pytest
import torch

from gen.tune import command as tune
from gen.tune.search import REFINE_ROUNDS
from runtime.table import GpuKey, TunedTable, table_path
from schedules.problem import Problem

pytestmark = pytest.mark.gpu

SHAPE_ARGS = ["tune", "--shapes", "1024x256", "--buckets", "1,16", "--refine", "2", "--top", "3"]
PROBLEM = Problem.make(n=256, k=1024)


def call(capsys, argv):
    parser = argparse.ArgumentParser(prog="gen")
    tune.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def run_kernel(problem, schedule, m):
    """The relative error of `schedule`'s kernel at M = m against the fp32 reference."""
    from runtime.kernels import compile_schedule
    from schedules.arch import current_arch
    from schedules.quant import reference_matmul, relative_error, torch_dtype

    fam, knobs, dtype = schedule.module, schedule.knobs, torch_dtype(problem.dtype)
    codes = torch.randint(0, 16, (problem.k, problem.n), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(problem.num_groups, problem.n, device="cuda") * 0.01 + 0.005).to(dtype)
    qw, qs = fam.pack(codes, scales)
    ws_elems, counter_elems = fam.workspace_elems(problem, knobs, m)
    ws = torch.zeros(ws_elems, dtype=torch.float32, device="cuda")
    counters = torch.zeros(counter_elems, dtype=torch.int32, device="cuda")
    a = torch.randn(m, problem.k, dtype=dtype, device="cuda")
    out = torch.full((m, problem.n), float("nan"), dtype=dtype, device="cuda")
    kernel = compile_schedule(problem, schedule, current_arch())
    kernel(*fam.kernel_args(problem, knobs, a, qw, qs, out, ws, counters))
    torch.cuda.synchronize()
    return relative_error(out, reference_matmul(a, codes, scales))


def test_tune_one_shape_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    rc, out, err = call(capsys, SHAPE_ARGS)
    assert rc == 0, err
    assert "2 to tune" in out and "1024x256" in out
    assert "candidates added around the measured winners (--refine 2)" in out

    gpu = GpuKey.current()
    path = table_path(gpu)
    assert path == tmp_path / "tuned" / f"{gpu.slug}.json"
    table = TunedTable.load(path, gpu, history=True)
    assert len(table) == 2
    for bucket in (1, 16):
        entry = table.entry(PROBLEM, bucket)
        assert entry.us > 0 and entry.fp16_us > 0 and entry.gbps > 0
        # every round's candidates kept, win or lose: 3 of the cost model's, up to 4 tuned winners of other
        # shapes (the fallback's two nearest, the two best-estimated: add_transfers), then 2 per local round
        assert 3 <= len(entry.all_timings) <= 3 + 4 + 2 * REFINE_ROUNDS
        correct = [t for t in entry.all_timings if t["us"] is not None and t["error"] is None]
        assert correct and all(t["rel_err"] < 2e-3 for t in correct)
        assert entry.us == min(t["us"] for t in correct)
        assert entry.schedule.to_dict() == min(correct, key=lambda t: t["us"])["schedule"]

    # Each winner serves its whole bucket (dynamic M), not only the edge it was timed at.
    for m in (1, 9, 13, 16):
        assert run_kernel(PROBLEM, table.lookup(PROBLEM, m), m) < 2e-3

    # Resume: everything is in the table, so nothing is compiled or measured again.
    rc, out, err = call(capsys, SHAPE_ARGS)
    assert rc == 0, err
    assert "0 to tune, 2 already in" in out

    # --force measures again and replaces the entries.
    # With --top 1 it measures the model's first pick and the standing winner (the incumbent, which a
    # second round may have found), one timing if they are the same kernel.
    before = len(table.entry(PROBLEM, 1).all_timings)
    incumbent = table.entry(PROBLEM, 16).schedule.to_dict()
    rc, out, err = call(capsys, SHAPE_ARGS[:-2] + ["--top", "1", "--buckets", "16", "--force", "--refine", "0"])
    assert rc == 0, err
    retuned = TunedTable.load(path, gpu, history=True)
    timings = retuned.entry(PROBLEM, 16).all_timings
    fresh = [t for t in timings if not t.get("earlier_run")]
    assert 1 <= len(fresh) <= 2 and incumbent in [t["schedule"] for t in fresh]
    # the first run's timings of the kernels not timed again stay, marked as an earlier run's
    not_again = [t for t in table.entry(PROBLEM, 16).all_timings if t["schedule"] not in [f["schedule"] for f in fresh]]
    assert len(timings) == len(fresh) + len(not_again)
    assert len(retuned.entry(PROBLEM, 1).all_timings) == before      # untouched bucket kept
    assert not list(path.parent.glob("*.force-progress"))            # a completed forced run leaves no note


def test_gpu_key_and_table_for_this_gpu(tmp_path, monkeypatch):
    import runtime.table as table_module
    from runtime.table import load_tuned_table

    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    gpu = GpuKey.current()
    props = torch.cuda.get_device_properties(0)
    assert gpu.sm_count == props.multi_processor_count and gpu.name == props.name
    assert gpu.slug.endswith(f"_{gpu.arch}_{gpu.sm_count}sm") and " " not in gpu.slug
    monkeypatch.setattr(table_module, "shipped_tables_dir", lambda: tmp_path / "shipped")
    assert len(load_tuned_table()) == 0
