"""runtime/dispatch.py on the CPU: what the op's choice reads (the tuned table per GPU, the arch's
winners, read once and forgotten on request), the choice itself (the table's entry, else a twin's
winner through the table, else the fallback) and the warning that says how to tune an untuned shape."""
import warnings

import pytest
import torch

import runtime.dispatch as dispatching
import schedules.arch
import schedules.cost
from runtime.table import GpuKey
from schedules import marlin_mma
from schedules.problem import Problem
from schedules.registry import Schedule

SM90 = schedules.arch.get_arch("sm_90a")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
FP16 = Problem(n=4096, k=4096, group=128)
BF16 = Problem(n=4096, k=4096, group=128, dtype="bfloat16")
WINNER = Schedule("marlin_mma", marlin_mma.Knobs(block_n=128, warps_n=2, split_k=1))


class Table:
    """A tuned table of (problem, bucket) -> schedule that records its lookups."""

    def __init__(self, entries):
        self.entries, self.lookups = entries, []

    def lookup(self, problem, bucket):
        self.lookups.append((problem, bucket))
        return self.entries.get((problem, bucket))


@pytest.fixture
def fresh(monkeypatch):
    """Empty caches, a stub GPU of sm_90a."""
    monkeypatch.setattr(dispatching, "_TABLES", {})
    monkeypatch.setattr(dispatching, "_WINNERS", {})
    monkeypatch.setattr(dispatching, "_WARNED", set())
    monkeypatch.setattr(schedules.arch, "current_arch", lambda device=None: SM90)
    monkeypatch.setattr(schedules.cost.GpuSpec, "current", classmethod(lambda cls, device=None: None))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stub GPU")


def test_a_twins_winner_serves_through_the_gpus_table():
    """choose hands the table to the fallback: bf16 runs the tuned fp16 winner of its bucket."""
    assert WINNER.module.check(BF16, WINNER.knobs, SM90) is None
    table = Table({(FP16, 16): WINNER})
    schedule, how = dispatching.Dispatch(SM90, None, table, ()).choose(BF16, 16, marlin_mma.LAYOUT)
    assert schedule == WINNER and FP16.name in how
    assert (BF16, 16) in table.lookups and (FP16, 16) in table.lookups


def test_schedule_for_asks_for_the_bucket_of_m(fresh, monkeypatch):
    table = Table({(FP16, 16): WINNER})
    monkeypatch.setattr(dispatching, "_tuned_table", lambda device: table)
    monkeypatch.setattr(dispatching, "_winners", lambda arch: ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a tuned bucket warns nothing
        assert dispatching.schedule_for(FP16, 9, CUDA0) == WINNER
    assert table.lookups == [(FP16, 16)]


@pytest.mark.parametrize("problem, command", [
    (Problem.make(n=4096, k=4096, group=-1), "gen tune --shapes 4096x4096 --group -1"),
    (Problem(n=4096, k=4096, group=128, act="fp8"), "gen tune --shapes 4096x4096 --group 128 --act fp8"),
    (Problem(n=4096, k=4096, group=128, dtype="bfloat16", zero_points=True),
     "gen tune --shapes 4096x4096 --group 128 --dtype bfloat16 --zero-points"),
])
def test_the_warning_names_the_tune_of_the_same_problem(fresh, problem, command):
    with pytest.warns(dispatching.UntunedShapeWarning) as record:
        dispatching._warn_untuned(problem, CUDA0, WINNER, "a stub")
        dispatching._warn_untuned(problem, CUDA0, WINNER, "a stub")      # once per problem
    assert len(record) == 1 and str(record[0].message).endswith(f"Tune this shape with: {command}")


def test_the_tables_are_read_once_per_gpu_and_again_after_forget(fresh, monkeypatch):
    import runtime.table

    reads = []
    monkeypatch.setattr(GpuKey, "current", classmethod(lambda cls, device=None: f"gpu {device.index}"))
    monkeypatch.setattr(runtime.table, "load_tuned_table", lambda gpu: reads.append(gpu) or f"table of {gpu}")
    monkeypatch.setattr(runtime.table, "winners_for_arch", lambda arch: reads.append(arch) or (arch,))
    tables = [dispatching._tuned_table(device) for device in (CUDA0, CUDA1, CUDA0)]
    assert tables == ["table of gpu 0", "table of gpu 1", "table of gpu 0"]
    assert dispatching._winners("sm_90a") == dispatching._winners("sm_90a") == ("sm_90a",)
    assert reads == ["gpu 0", "gpu 1", "sm_90a"]
    dispatching.forget_tables()
    dispatching._tuned_table(CUDA0)
    dispatching._winners("sm_90a")
    assert reads[3:] == ["gpu 0", "sm_90a"]
