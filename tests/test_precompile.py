"""Compiling ahead without a GPU: the plan is the op's own choice per (problem, bucket), the
constructors, replace_linear and load_quantized build it in one parallel call (or not at all when
turned off), and `gen precompile` lists, builds and sums up."""
import json
import random
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime.dispatch as dispatching
import runtime.kernels as store
import runtime.op as op
import runtime.precompile as precompile
from gen.cli import main as gen_main
import runtime.linear as linear_module
from runtime import QuantLinear, replace_linear
from runtime.dispatch import Dispatch
from runtime.precompile import PRECOMPILE_ENV, buckets_up_to, plan
from runtime.table import BUCKETS, TunedTable, winners_for_arch
from schedules import marlin_mma
from schedules.arch import get_arch
from schedules.cost import GpuSpec
from schedules.problem import Problem
from schedules.quant import quantize_rtn
from schedules.registry import Schedule

SM90 = get_arch("sm_90a")
H200 = GpuSpec.for_arch(SM90)
COMMITTED = Path(__file__).resolve().parent.parent / "cache" / "tuned" / "nvidia-h200_sm_90a_132sm.json"
UNTUNED = [Problem(15360, 6144), Problem(6144, 13824)]          # in no committed table, in either dtype
CUDA0 = torch.device("cuda", 0)
PROBLEM = Problem(n=128, k=256, group=128)
SMALL_M = Schedule("marlin_mma", marlin_mma.Knobs(block_m=16, split_k=2))
LARGE_M = Schedule("marlin_mma", marlin_mma.Knobs(block_m=64, split_k=1))


class StubTable:
    """Every problem tuned: one schedule up to M = 16, another above."""

    def lookup(self, problem, m):
        return SMALL_M if m <= 16 else LARGE_M


@pytest.fixture(scope="module")
def h200():
    """The op's inputs on an H200, from the committed table: tuned problems and untuned ones."""
    table = TunedTable.read(COMMITTED)
    tuned = sorted({problem for (problem, _), _ in table.items()}, key=lambda p: p.name)
    assert tuned, "the committed H200 table should hold tuned problems"
    return Dispatch(SM90, H200, table, winners_for_arch("sm_90a")), tuned


# --- the plan ------------------------------------------------------------------------------------

def test_the_plan_is_the_ops_choice_for_every_problem_and_bucket(h200, monkeypatch):
    import schedules.arch

    dispatch, tuned = h200
    monkeypatch.setattr(dispatching, "_tuned_table", lambda device: dispatch.table)
    monkeypatch.setattr(dispatching, "_winners", lambda arch: dispatch.winners)
    monkeypatch.setattr(dispatching, "_WARNED", set())
    monkeypatch.setattr(schedules.arch, "current_arch", lambda device=None: SM90)
    monkeypatch.setattr(GpuSpec, "current", classmethod(lambda cls, device=None: H200))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stub GPU")
    problems = tuned[:2] + UNTUNED
    planned = plan(problems, BUCKETS, dispatch, op.DEFAULT_LAYOUT)
    served = {(p, b): s for (p, s), buckets in planned.items() for b, _ in buckets}
    assert sorted(served, key=lambda k: (k[0].name, k[1])) == sorted(
        ((p, b) for p in problems for b in BUCKETS), key=lambda k: (k[0].name, k[1]))   # each pair once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatching.UntunedShapeWarning)
        for (problem, bucket), schedule in served.items():
            assert dispatching.schedule_for(problem, bucket, CUDA0) == schedule, (problem.name, bucket)


def test_the_plan_of_a_w4a8_problem_is_what_the_ops_launcher_loads(h200, monkeypatch):
    """For W4A8 the op's _launcher first picks the problem that serves the bucket (its W4A16 twin at
    small M on the committed table, compiled to round the activations itself); the plan lists the same
    (problem, schedule) for every bucket."""
    import runtime.kernels
    import runtime.selfcheck
    import schedules.arch

    dispatch, _ = h200
    monkeypatch.setattr(dispatching, "_tuned_table", lambda device: dispatch.table)
    monkeypatch.setattr(dispatching, "_winners", lambda arch: dispatch.winners)
    monkeypatch.setattr(op, "_LAUNCHERS", {})
    monkeypatch.setattr(schedules.arch, "current_arch", lambda device=None: SM90)
    monkeypatch.setattr(GpuSpec, "current", classmethod(lambda cls, device=None: H200))
    monkeypatch.setattr(runtime.kernels, "compile_schedule", lambda problem, schedule, arch: "kernel")
    monkeypatch.setattr(runtime.selfcheck, "check_once", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fp8 = Problem(12288, 4096, act="fp8")
    planned = plan([fp8], BUCKETS, dispatch, op.DEFAULT_LAYOUT)
    served = {b: (p, s) for (p, s), buckets in planned.items() for b, _ in buckets}
    assert sorted(served) == list(BUCKETS) and {p.act for p, _ in served.values()} == {"fp8_rounded", "fp8"}
    for bucket, (problem, schedule) in served.items():
        launcher = op._launcher(CUDA0, fp8, op.DEFAULT_LAYOUT, bucket)
        assert (launcher.problem, launcher.schedule) == (problem, schedule), bucket


def test_tuned_pairs_are_the_tables_and_the_rest_the_fallbacks(h200):
    dispatch, tuned = h200
    planned = plan([tuned[0], UNTUNED[0]], BUCKETS, dispatch, op.DEFAULT_LAYOUT)
    for (problem, schedule), served in planned.items():
        for bucket, how in served:
            if problem == tuned[0] and dispatch.table.lookup(problem, bucket) is not None:
                assert how is None and dispatch.table.lookup(problem, bucket) == schedule
            else:
                assert "tuned winners" in how and schedule in {w.schedule for w in dispatch.winners}


def test_the_plan_does_not_depend_on_the_order_of_its_inputs(h200):
    dispatch, tuned = h200
    problems, buckets, winners = tuned + UNTUNED, list(BUCKETS), list(dispatch.winners)
    first = list(plan(problems, buckets, dispatch, op.DEFAULT_LAYOUT).items())
    rng = random.Random(0)
    for _ in range(2):
        for items in (problems, buckets, winners):
            rng.shuffle(items)
        shuffled = Dispatch(SM90, H200, dispatch.table, tuple(winners))
        assert list(plan(problems + problems[:1], buckets, shuffled, op.DEFAULT_LAYOUT).items()) == first


def test_m_values_plan_their_buckets_and_max_m_limits_them():
    assert buckets_up_to(None) == BUCKETS
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert buckets_up_to(10**6) == BUCKETS
    dispatch = Dispatch(SM90, None, StubTable(), ())
    planned = plan([PROBLEM], [3, 4, 100], dispatch, op.DEFAULT_LAYOUT)
    assert [b for served in planned.values() for b, _ in served] == [4, 128]


def test_a_schedule_for_another_layout_is_refused():
    with pytest.raises(ValueError, match="layout"):
        plan([PROBLEM], [1], Dispatch(SM90, None, StubTable(), ()), "other.v9")


# --- building: once, only what the store lacks -------------------------------------------------

class Builds(list):
    """(jobs, arch) of each compile pool a build closed, in order; `outcome(job)` is each job's error
    (None: built), `started` is set when a pool first gets jobs, `cancelled` counts cancel() calls."""

    def __init__(self):
        super().__init__()
        self.outcome = lambda job: None
        self.started = threading.Event()
        self.cancelled = 0
        self.submitted = []      # how many jobs each submit() queued


@pytest.fixture
def compiler(monkeypatch):
    """GPU weights as the precompile sees them, the stub table's choices, and recording compile pools
    whose store holds nothing."""
    calls = Builds()

    class RecordingPool:
        def __init__(self, workers=None, progress=None):
            self.arch, self.progress, self.jobs, self.results = None, progress, [], None

        def submit(self, jobs, arch):
            assert self.arch in (None, arch), "these tests build for one arch"
            self.arch = arch
            self.jobs += jobs
            calls.submitted.append(len(jobs))
            calls.started.set()

        def cancel(self):
            calls.cancelled += 1

        def end_jobs(self):
            pass

        def close(self):
            if self.results is None:      # closing again (a cancel after a wait) builds nothing more
                calls.append((list(self.jobs), self.arch))
                self.results = {job: calls.outcome(job) for job in self.jobs}
                for job, error in self.results.items():
                    self.progress(job, error)
            return self.results

    monkeypatch.delenv(PRECOMPILE_ENV, raising=False)
    monkeypatch.setattr(precompile, "_on_cuda", lambda device: True)
    monkeypatch.setattr(precompile, "dispatch_for", lambda device=None: Dispatch(SM90, None, StubTable(), ()))
    monkeypatch.setattr(store, "is_stored", lambda problem, schedule, arch: False)
    monkeypatch.setattr(store, "is_activation_kernel_stored", lambda kind, k, dtype, arch: False)
    monkeypatch.setattr(store, "CompilePool", RecordingPool)
    monkeypatch.setattr(store, "compile_activation_kernel",
                        lambda kind, k, dtype, arch: calls.append(((kind, k, dtype), arch)))
    return calls


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(128, 128, bias=False)
        self.up_proj = nn.Linear(128, 256, bias=False)
        self.down_proj = nn.Linear(256, 128, bias=True)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    return model.half()


def test_a_failed_build_leaves_the_model_as_it_was(compiler):
    model = _model()
    compiler.outcome = lambda job: "nvcc said no"
    with pytest.raises(RuntimeError, match="kernels failed to build"):
        replace_linear(model, group_size=64)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    replace_linear(model, group_size=64, precompile=False)       # the retry the message suggests
    assert any(isinstance(m, QuantLinear) for m in model.modules())


def test_replace_linear_builds_every_layers_kernels_in_one_call(compiler):
    replace_linear(_model(), group_size=64)
    assert len(compiler) == 1
    jobs, arch = compiler[0]
    problems = {Problem(128, 128, 64), Problem(256, 128, 64), Problem(128, 256, 64)}
    assert arch == SM90 and len(jobs) == len(set(jobs))
    assert set(jobs) == {(p, s) for p in problems for s in (SMALL_M, LARGE_M)}



def test_layers_on_two_gpus_of_one_arch_build_each_kernel_once(compiler):
    """Every device's kernels are planned, and a kernel two devices share is queued once."""
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    shared, own = Problem(128, 128, 64), Problem(256, 128, 64)
    build = precompile.start_precompile([(shared, gpu0)])
    build.add([(shared, gpu1), (own, gpu1)])
    build.wait()
    (jobs, _), = compiler
    assert len(jobs) == len(set(jobs)) and {p for p, _ in jobs} == {shared, own}


def test_the_layout_asked_for_is_the_one_planned(compiler):
    with pytest.raises(ValueError, match="these are packed in other.v9"):
        precompile.precompile_layers([(Problem(128, 128, 64), torch.device("cuda", 0))], layout="other.v9")


def test_ctrl_c_while_waiting_stops_the_workers(compiler, monkeypatch):
    build = precompile.start_precompile([(Problem(128, 128, 64), torch.device("cuda", 0))])

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(build._pool, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build.wait()
    assert compiler.cancelled == 1

def test_replace_linear_builds_while_it_quantizes(compiler, monkeypatch):
    """The kernels' build starts before the first layer is quantized: quantizing waits (here) until
    the build has begun, which it could not if the build followed the conversion."""
    def quantize(*args, **kwargs):
        assert compiler.started.wait(timeout=30), "the build had not started when the first layer was quantized"
        return quantize_rtn(*args, **kwargs)

    monkeypatch.setattr(linear_module, "quantize_rtn", quantize)
    replace_linear(_model(), group_size=64)
    assert len(compiler) == 1 and compiler.cancelled == 0


def test_a_layer_refused_while_quantizing_stops_the_build(compiler):
    model = _model()
    with torch.no_grad():
        model[2].down_proj.weight[1, 2] = float("nan")
    with pytest.raises(ValueError, match="weight nan at row 1, column 2"):
        replace_linear(model, group_size=64)
    assert compiler.cancelled == 1 and len(compiler) == 1          # stopped, then waited for
    assert all(isinstance(m, nn.Linear) for m in model[2].children())


def test_a_failed_build_is_raised_by_wait(compiler):
    compiler.outcome = lambda job: "nvcc said no"
    with pytest.raises(RuntimeError, match="6 kernels failed to build .*nvcc said no"):
        replace_linear(_model(), group_size=64)


def test_max_m_limits_the_buckets(compiler):
    replace_linear(_model(), group_size=64, max_m=16)
    (jobs, _), = compiler
    assert {s for _, s in jobs} == {SMALL_M}


def test_kernels_in_the_store_are_not_built(compiler, monkeypatch):
    monkeypatch.setattr(store, "is_stored", lambda problem, schedule, arch: schedule == SMALL_M)
    replace_linear(_model(), group_size=64)
    (jobs, _), = compiler
    assert {s for _, s in jobs} == {LARGE_M}
    monkeypatch.setattr(store, "is_stored", lambda problem, schedule, arch: True)
    replace_linear(_model(), group_size=64)
    assert len(compiler) == 1          # all stored: no compile, no worker pool


def test_each_constructor_builds_its_own_kernels(compiler):
    linear = nn.Linear(256, 128, bias=False).half()
    QuantLinear.from_linear(linear, group_size=64, max_m=4)
    QuantLinear(256, 128, group_size=64, dtype=torch.float16, max_m=64)
    from tests.checkpoint_writers import gptq_tensors, layer_of

    layer = QuantLinear.from_linear(linear, group_size=64, precompile=False)
    QuantLinear.from_gptq(**gptq_tensors(layer_of(*layer.unpack()), "gptq"), group_size=64, max_m=1)
    assert [{s for _, s in jobs} for jobs, _ in compiler] == [{SMALL_M}, {SMALL_M, LARGE_M}, {SMALL_M}]
    assert all({p for p, _ in jobs} == {Problem(128, 256, 64)} for jobs, _ in compiler)


def test_load_quantized_builds_every_layers_kernels_in_one_call(compiler, tmp_path):
    from runtime import load_quantized
    from tests.checkpoint_writers import write_checkpoint

    drawn = write_checkpoint(tmp_path / "ckpt", "gptq", symmetric=False, act_order=True)
    load_quantized(tmp_path / "ckpt", device="cpu")
    ((jobs, arch),) = compiler        # one call: nothing built serially, nothing in this process
    shape = lambda *names: (sum(drawn[f"model.layers.0.{name}"].codes.shape[1] for name in names),  # noqa: E731
                            drawn[f"model.layers.0.{names[0]}"].codes.shape[0])
    fused = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
             ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]   # as runtime/fuse.py serves them
    problems = {Problem(*shape(*names), 128, zero_points=True) for names in fused}
    assert len(problems) == 4 and arch == SM90 and len(jobs) == len(set(jobs))
    gemms = [job for job in jobs if isinstance(job, tuple)]
    assert set(gemms) == {(p, s) for p in problems for s in (SMALL_M, LARGE_M)}
    # act-order's column gather (o_proj's) and the norm that writes q/k/v's and gate/up's input in their
    # order, once per input width and dtype: the hidden size alone, since down_proj's permutation went
    # into gate_proj's and up_proj's output columns
    assert jobs[len(gemms):] == [store.ActivationJob("gather_columns", 256, "float16"),
                                 store.ActivationJob("rms_norm_gather", 256, "float16")]


@pytest.mark.parametrize("fuse", [False, True])
def test_load_quantized_queues_each_new_layers_kernels_as_it_reads_them(compiler, tmp_path, monkeypatch, fuse):
    """The first layer's kernels are queued before the next layer is read; the gathers and norms, known
    once every layer is in, join the same pool last. Fusing, the layers that may be fused (those with a
    sibling of the same K) wait for the fusion: down_proj's are queued as they are read."""
    from runtime import load_quantized
    from runtime.checkpoint import loader
    from tests.checkpoint_writers import write_checkpoint

    write_checkpoint(tmp_path / "ckpt", "gptq", symmetric=False, act_order=True)
    made = []
    from_layer = QuantLinear.from_layer

    def counted(*args, **kwargs):
        made.append(len(compiler.submitted))     # submissions queued before this layer was made
        return from_layer(*args, **kwargs)

    monkeypatch.setattr(loader.QuantLinear, "from_layer", counted)
    load_quantized(tmp_path / "ckpt", device="cpu", fuse=fuse)
    assert len(compiler) == 1                                  # one pool
    if fuse:   # down_proj's two kernels as it is read; then qkv's, o's and gate_up's, the gather and the norm
        assert made[-1] == 1 and compiler.submitted == [2, 3 * 2 + 2]
    else:
        assert made[0] == 0 and made[1] == 1                   # the first layer's kernels before the second
        assert compiler.submitted[-1] == 2                     # the gather and the norm last


def test_a_checkpoint_that_fails_to_load_stops_its_build(compiler, tmp_path, monkeypatch):
    from runtime import CheckpointError, load_quantized
    from runtime.checkpoint import loader
    from tests.checkpoint_writers import write_checkpoint

    write_checkpoint(tmp_path / "ckpt", "gptq", symmetric=True, act_order=False)

    def refuse(*args, **kwargs):
        raise CheckpointError("model.safetensors: lm_head.weight", "missing")

    monkeypatch.setattr(loader, "load_dense_parameters", refuse)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_quantized(tmp_path / "ckpt", device="cpu")
    assert compiler.cancelled == 1 and compiler.submitted


def test_an_act_order_layer_alone_builds_its_gather(compiler):
    """QuantLinear(act_order=True) and from_layer with a permutation build the gather in the GEMMs'
    compile_many call."""
    from runtime.checkpoint.layer import build_layer
    from tests.checkpoint_writers import draw_layer

    QuantLinear(256, 128, group_size=64, act_order=True, max_m=1)
    drawn = draw_layer(256, 128, 64, True, True, torch.float16, torch.Generator().manual_seed(0))
    QuantLinear.from_layer(build_layer(drawn.codes, drawn.scales, None, drawn.g_idx, 64, None, torch.float16), max_m=1)
    assert len(compiler) == 2
    for jobs, arch in compiler:
        assert {job[0] for job in jobs[:-1]} == {Problem(128, 256, 64)}
        assert jobs[-1] == store.ActivationJob("gather_columns", 256, "float16")


def test_precompile_off_by_option_or_environment(compiler, monkeypatch):
    replace_linear(_model(), group_size=64, precompile=False)
    QuantLinear.from_linear(nn.Linear(256, 128).half(), group_size=64, precompile=False)
    monkeypatch.setenv(PRECOMPILE_ENV, "0")
    replace_linear(_model(), group_size=64)
    QuantLinear(256, 128, group_size=64)
    assert compiler == []


def test_weights_off_the_gpu_are_not_precompiled(monkeypatch):
    monkeypatch.setattr(precompile, "dispatch_for", lambda device=None: pytest.fail("planned for CPU weights"))
    monkeypatch.setattr(store, "CompilePool", lambda *a, **k: pytest.fail("compiled for CPU weights"))
    monkeypatch.delenv(PRECOMPILE_ENV, raising=False)
    replace_linear(_model(), group_size=64)
    QuantLinear(256, 128, group_size=64)


def test_a_kernel_that_fails_to_build_is_an_error_naming_it(compiler):
    compiler.outcome = lambda job: "nvcc: out of memory" if job[1] == LARGE_M else None
    with pytest.raises(RuntimeError, match=r"3 kernels failed.*marlin_mma:m64.*nvcc: out of memory.*max_m"):
        replace_linear(_model(), group_size=64)


# --- gen precompile ----------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache holding the committed H200 table and an empty store; no GPU; a fixed toolkit."""
    (tmp_path / "tuned").mkdir()
    shutil.copy(COMMITTED, tmp_path / "tuned")
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(store, "cuda_toolkit", lambda: "cuda_test")
    return tmp_path


def fake_entry(problem, schedule, arch=SM90, toolkit="cuda_test"):
    """A store entry as a build leaves it (the library's bytes are not a real library)."""
    return _fake_store_entry(store.kernel_folder(problem, schedule, arch), store.identity(problem, schedule, arch),
                             toolkit)


def _fake_store_entry(folder, identity: dict, toolkit: str):
    folder.mkdir(parents=True)
    (folder / "kernel.so").write_bytes(b"\x7fELF not really")
    (folder / "kernel.cu").write_text("// device source\n")
    (folder / "meta.json").write_text(json.dumps({**identity, "cuda": toolkit}))
    return folder


def _expected_4096(cache):
    table = TunedTable.read(cache / "tuned" / COMMITTED.name)
    problem = Problem(4096, 4096)
    return problem, {table.lookup(problem, b) for b in BUCKETS}


def test_dry_run_lists_the_tables_kernels_for_an_arch_without_a_gpu(cache, capsys):
    problem, expected = _expected_4096(cache)
    stored = sorted(expected, key=lambda s: s.name)[0]
    fake_entry(problem, stored)
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = {line.strip().split("  ")[2] for line in out.splitlines() if line.startswith("  ")}
    assert listed == {s.name for s in expected}
    assert f"{len(expected)} kernels (13 pairs tuned, 0 chosen by the fallback)" in out
    assert f"in store  {problem.name} (4096x4096)  {stored.name}" in out
    assert f"would build {len(expected) - 1}, 1 already in the store" in out
    assert not list(store.kernel_dir().glob("*/*/*.tmp"))


def test_precompile_builds_what_is_missing_and_sums_up(cache, capsys, monkeypatch):
    problem, expected = _expected_4096(cache)
    stored = sorted(expected, key=lambda s: s.name)[0]
    fake_entry(problem, stored)
    broken = sorted(expected, key=lambda s: s.name)[1]
    calls = []

    def compile_many(jobs, arch, workers=None, progress=None):
        calls.append(jobs)
        results = {job: ("ptxas: too many registers" if job[1] == broken else None) for job in jobs}
        for job, error in results.items():
            progress(job, error)
        return results

    monkeypatch.setattr(store, "compile_many", compile_many)
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096"]) == 1
    captured = capsys.readouterr()
    (jobs,) = calls
    assert {s for _, s in jobs} == expected - {stored}
    assert f"[{len(jobs)}/{len(jobs)}]" in captured.out and "FAILED: ptxas: too many registers" in captured.out
    assert f"{len(jobs) - 1} built, 1 already in the store, 1 failed" in captured.out
    assert f"failed: {problem.name} (4096x4096)  {broken.name}: ptxas" in captured.err


def test_without_a_gpu_or_an_arch_the_command_says_what_to_name(cache, capsys):
    assert gen_main(["precompile", "--shapes", "4096x4096"]) == 2
    assert "no CUDA GPU is visible: name the target with --arch" in capsys.readouterr().err
    assert gen_main(["precompile", "--gpu", "nvidia-b200_sm_100a_148sm", "--shapes", "4096x4096"]) == 2
    assert "no tuned table 'nvidia-b200_sm_100a_148sm'" in capsys.readouterr().err


def fake_activation_entry(kind, k, dtype, arch=SM90, toolkit="cuda_test"):
    """The store entry of an activation kernel as a build leaves it."""
    return _fake_store_entry(store.activation_kernel_folder(kind, k, dtype, arch),
                             store._activation_identity(kind, k, dtype, arch), toolkit)


def test_act_order_layers_precompile_their_gather_when_asked(cache, capsys):
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096,11008x4096", "--act-order",
                     "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "to build  act-order gather, K = 4096, float16 input" in out
    assert "to build  act-order gather, K = 11008, float16 input" in out
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096", "--dry-run"]) == 0
    assert "gather" not in capsys.readouterr().out


def test_a_checkpoint_plans_its_own_layers_and_gathers(cache, capsys, tmp_path):
    """--checkpoint: the problems of the INT4 layers load_quantized makes (q/k/v and gate/up fused, zero
    points), named by their layers, and the act-order kernels the model runs: o_proj's gather and the norm that writes
    q/k/v's and gate/up's input in their order, both of the hidden size; down_proj's permutation went
    into gate/up's columns."""
    pytest.importorskip("transformers")
    from tests.checkpoint_writers import write_checkpoint

    folder = tmp_path / "llama-gptq"
    write_checkpoint(folder, "gptq", torch.bfloat16, 128, symmetric=False, act_order=True)
    assert gen_main(["precompile", "--arch", "sm_90a", "--checkpoint", str(folder), "--dtype", "bfloat16",
                     "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("4 problems x 13 buckets on sm_90a") and "note:" not in captured.err
    labels = {line.split("  ")[2] for line in captured.out.splitlines() if line.startswith("  to build  n")}
    assert labels == {f"{Problem(n, k, dtype='bfloat16', zero_points=True).name} ({layers})" for n, k, layers in (
        (512, 256, "self_attn.q_k_v_proj"), (256, 256, "self_attn.o_proj"), (1024, 256, "mlp.gate_up_proj"),
        (256, 512, "mlp.down_proj"))}
    gathers = [line.strip() for line in captured.out.splitlines() if "act-order" in line]
    assert gathers == ["to build  act-order gather, K = 256, bfloat16 input",
                       "to build  act-order RMSNorm, K = 256, bfloat16 input"]
    assert gen_main(["precompile", "--arch", "sm_90a", "--checkpoint", str(folder), "--dry-run"]) == 0
    assert "config.json says bfloat16; its layers are planned in --dtype float16" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--zero-points"], ["--group", "64"], ["--shapes", "4096x4096"], ["--tp", "2"]])
def test_a_checkpoint_decides_its_layers_itself(cache, capsys, flags):
    assert gen_main(["precompile", "--arch", "sm_90a", "--checkpoint", "ckpt", *flags, "--dry-run"]) == 2
    assert f"{flags[0]}: --checkpoint's layers come with their shapes" in capsys.readouterr().err


def test_a_checkpoint_that_cannot_be_loaded_is_named(cache, capsys, tmp_path):
    assert gen_main(["precompile", "--arch", "sm_90a", "--checkpoint", str(tmp_path), "--dry-run"]) == 2
    assert f"{tmp_path}/config.json: cannot be read" in capsys.readouterr().err


def test_w4a8_layers_precompile_their_activation_kernel_too(cache, capsys, monkeypatch):
    """--act fp8: the FP8 problems' GEMMs (the committed table's fp8 entries), the W4A16 twins' schedules
    built to round the activations themselves at the buckets the table times them faster, and two
    activation kernels per K and input dtype (the FP8 quantizer, with and without the k-tile sums),
    listed by --dry-run and built in the GEMMs' worker processes."""
    problem = Problem(4096, 4096, act="fp8")
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096,4096x12288", "--act", "fp8",
                     "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "to build  FP8 activations, K = 4096, float16 input" in out and out.count(" FP8 activations,") == 1
    assert "to build  FP8 activations with k-tile sums, K = 4096, float16 input" in out
    assert f"{problem.name} (4096x4096)" in out
    assert f"{problem.rounded_twin.name} (4096x4096, W4A8 on W4A16 kernels)" in out   # small M, by the table
    built = []

    def compile_many(jobs, arch, workers=None, progress=None):
        built.extend((job.kind, job.k, job.dtype, arch.name) for job in jobs if isinstance(job, store.ActivationJob))
        return {job: None for job in jobs}

    monkeypatch.setattr(store, "compile_many", compile_many)
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096", "--act", "fp8"]) == 0
    assert built == [("fp8_activations", 4096, "float16", "sm_90a"),
                     ("fp8_activations_sums", 4096, "float16", "sm_90a")]
    assert "already in the store, 0 failed" in capsys.readouterr().out   # in the GEMMs' compile_many call
    for kind in ("fp8_activations", "fp8_activations_sums"):
        fake_activation_entry(kind, 4096, "float16")
    built.clear()
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096", "--act", "fp8"]) == 0
    assert built == []                                                   # in the store: not built again
    assert gen_main(["precompile", "--arch", "sm_90a", "--shapes", "4096x4096"]) == 0
    assert built == []                                                   # W4A16 layers need none


def test_the_ops_precompile_builds_w4a8s_activation_kernels_with_the_gemms(h200, monkeypatch):
    dispatch, _ = h200
    calls = []
    monkeypatch.setattr(op, "dispatch_for", lambda device=None: dispatch)
    monkeypatch.setattr(store, "is_stored", lambda problem, schedule, arch: False)
    monkeypatch.setattr(store, "is_activation_kernel_stored", lambda kind, k, dtype, arch: False)
    monkeypatch.setattr(store, "compile_many",
                        lambda jobs, arch, workers=None, progress=None: calls.append(jobs) or dict.fromkeys(jobs))
    results = op.precompile([Problem(4096, 4096, act="fp8")], [1, 4096])
    (jobs,) = calls
    assert set(results) == set(jobs) and all(isinstance(job, tuple) for job in jobs[:-2])
    assert jobs[-2:] == [store.ActivationJob("fp8_activations", 4096, "float16"),
                         store.ActivationJob("fp8_activations_sums", 4096, "float16")]


def test_w4a8_runs_on_its_w4a16_twin_where_the_table_times_the_twin_faster():
    """Dispatch.serving_problem compares the two tuned entries of a bucket; without both, the FP8 kernel.
    The twin's schedule serves as fp8_rounded where its family rounds the activations (not marlin_mma)."""
    from types import SimpleNamespace

    from schedules import marlin_mma, stream_mma, stream_wgmma
    from schedules.registry import Schedule

    fp8, twin = Problem(4096, 4096, act="fp8"), Problem(4096, 4096)
    timings = {(fp8, 1): 6.2, (twin, 1): 4.7, (fp8, 2): 6.3, (twin, 2): 4.6, (fp8, 4): 6.3, (twin, 4): 4.6,
               (fp8, 256): 12.7, (twin, 256): 14.7, (fp8, 16): 6.6, (twin, 32): 5.0, (fp8, 128): 9.0,
               (twin, 128): 9.0}
    schedules = {1: Schedule("marlin_mma", marlin_mma.Knobs()), 2: Schedule("stream_mma", stream_mma.Knobs(split_k=2)),
                 4: Schedule("stream_wgmma", stream_wgmma.Knobs(block_m=8, groups=1, block_k=128, stages=6,
                                                                release_barriers=True, producer_warp=True))}

    class TimedTable:
        def entry(self, problem, bucket):
            us = timings.get((problem, bucket))
            return None if us is None else SimpleNamespace(us=us, schedule=schedules.get(bucket, schedules[4]))

    dispatch = Dispatch(SM90, None, TimedTable(), ())
    assert dispatch.serving_problem(fp8, 1) == fp8            # marlin_mma cannot round: the FP8 kernel
    assert dispatch.serving_problem(fp8, 2) == fp8.rounded_twin == dispatch.serving_problem(fp8, 4)
    assert dispatch.serving_problem(fp8, 256) == fp8
    assert dispatch.serving_problem(fp8, 16) == fp8 and dispatch.serving_problem(fp8, 64) == fp8
    assert dispatch.serving_problem(fp8, 32) == fp8         # the twin alone was tuned: nothing to compare
    assert dispatch.serving_problem(fp8, 128) == fp8        # a tie keeps the FP8 kernel
    assert dispatch.serving_problem(twin, 1) == twin


def test_the_plan_of_a_w4a8_layer_names_the_twins_kernels_at_its_small_buckets(h200):
    """On the committed H200 table Llama-2-7B's W4A8 layers run W4A16's kernels at M = 1 (stream_mma,
    rounding the activations in its registers) and FP8's at M = 4096; the plan lists each kernel under
    the problem it is compiled for."""
    dispatch, _ = h200
    fp8 = Problem(4096, 11008, act="fp8")
    planned = plan([fp8], [1, 4096], dispatch, marlin_mma.LAYOUT)
    assert {(problem.act, tuple(b for b, _ in served)) for (problem, _), served in planned.items()} == \
        {("fp8_rounded", (1,)), ("fp8", (4096,))}



@pytest.mark.parametrize("value, on", [("0", False), ("false", False), (" No ", False), ("OFF", False),
                                       ("1", True), ("yes", True), ("", True)])
def test_the_environment_switch_reads_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv(PRECOMPILE_ENV, value)
    assert precompile.enabled() is on
