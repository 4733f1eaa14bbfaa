"""Deployment artifacts without a GPU: `gen export` packs the tuned entries and store entries of a
model's kernels, `load_artifact` unpacks them on a matching machine so that the op loads without
building, and refuses, naming each field, any machine that differs, and any member that could write
outside the cache."""
import hashlib
import io
import json
import multiprocessing
import shutil
import tarfile

import pytest
import torch

import runtime.dispatch as dispatching
import runtime.kernels as store
import runtime.op as op
import runtime.table as tables
from gen.cli import main as gen_main
from runtime import ArtifactError, load_artifact
from runtime.artifact import FIELDS, differences
from runtime.table import BUCKETS, GpuKey, TunedTable, table_path
from schedules.arch import get_arch
from schedules.cost import GpuSpec
from schedules.problem import Problem
from tests.test_precompile import COMMITTED, fake_entry

SM90 = get_arch("sm_90a")
H200 = GpuKey("NVIDIA H200", "sm_90a", 132)
TOOLKIT = "cuda_13.0.r13.0/compiler.36424714_0"
PROBLEM = Problem(4096, 4096)
THIS_GPU = GpuKey.__dict__["current"]


@pytest.fixture
def artifact(tmp_path, monkeypatch):
    """An artifact of 4096x4096 exported for sm_90a from a store of fake entries (no GPU, a CPU torch),
    then a fresh cache on a machine like the one the table was tuned on (its torch and CUDA): (path,
    {bucket: schedule}, export cache)."""
    source = tmp_path / "build"
    (source / "tuned").mkdir(parents=True)
    shutil.copy(COMMITTED, source / "tuned")
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(source))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(store, "cuda_toolkit", lambda: TOOLKIT)
    monkeypatch.setattr(torch.version, "cuda", None)
    chosen = {b: TunedTable.read(COMMITTED).lookup(PROBLEM, b) for b in BUCKETS}
    for schedule in set(chosen.values()):
        fake_entry(PROBLEM, schedule, toolkit=TOOLKIT)
    out = tmp_path / "llama.tar.gz"
    assert gen_main(["export", "--arch", "sm_90a", "--shapes", "4096x4096", "--out", str(out)]) == 0
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "serve"))
    monkeypatch.setattr(GpuKey, "current", classmethod(lambda cls, device=None: H200))
    tuned_with = json.loads(COMMITTED.read_text())["versions"]
    monkeypatch.setattr(torch.version, "cuda", tuned_with["cuda"])
    monkeypatch.setattr(torch, "__version__", tuned_with["torch"])
    return out, chosen, source


def test_the_artifact_holds_the_entries_the_kernels_and_what_they_were_built_with(artifact):
    out, chosen, _ = artifact
    with tarfile.open(out) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())
        table = json.loads(tar.extractfile(manifest["table"]).read())
    root = store.cache_root()
    kernels = {store.kernel_folder(PROBLEM, s, SM90).relative_to(root).as_posix() for s in chosen.values()}
    assert manifest["kernels"] == sorted(kernels)
    assert sorted(names) == sorted(["manifest.json", manifest["table"]]
                                   + [f"{k}/{f}" for k in kernels for f in ("kernel.so", "kernel.cu", "meta.json")])
    assert not any(n.startswith("/") or ".." in n for n in names)
    built = manifest["built_with"]
    assert set(built) == set(FIELDS)
    assert (built["gpu"], built["arch"], built["sm_count"], built["cuda_toolkit"], built["cuda"], built["torch"]) == \
        ("NVIDIA H200", "sm_90a", 132, TOOLKIT, "13.0", "2.11.0+cu130")      # the tune's, not the CPU host's
    assert built["tilelang"] == store.tilelang_version() and built["kernel_code"] == store._code_fingerprint()
    assert {e["bucket"] for e in table["entries"]} == set(BUCKETS)
    assert all("all_timings" not in e for e in table["entries"])


def test_a_loaded_artifact_serves_without_building(artifact, monkeypatch):
    import schedules.arch

    out, chosen, source = artifact
    monkeypatch.setattr(dispatching, "_TABLES", {0: "read before the artifact came"})
    manifest = load_artifact(out)
    assert dispatching._TABLES == {}                 # the next choice reads the new table
    root = store.cache_root()
    for relative in manifest["kernels"]:
        for name in ("kernel.so", "kernel.cu", "meta.json"):
            assert (root / relative / name).read_bytes() == (source / relative / name).read_bytes()
    monkeypatch.setattr(schedules.arch, "current_arch", lambda device=None: SM90)
    monkeypatch.setattr(GpuSpec, "current", classmethod(lambda cls, device=None: GpuSpec.for_arch(SM90)))
    monkeypatch.setattr(dispatching, "_WINNERS", {})
    monkeypatch.setattr(store, "_LOADED", {})
    monkeypatch.setattr(store, "build_kernel", lambda *a: pytest.fail("built although the artifact holds it"))
    monkeypatch.setattr(store, "_load_library", lambda path: lambda *args: f"library {path}")
    for bucket, schedule in chosen.items():
        assert dispatching.schedule_for(PROBLEM, bucket, torch.device("cuda", 0)) == schedule      # the tuned entry
        kernel = store.compile_schedule(PROBLEM, schedule, SM90)
        assert kernel.folder.is_relative_to(root) and kernel("x") == f"library {kernel.folder / 'kernel.so'}"
    load_artifact(out)                      # loading it again changes nothing


def test_its_entries_replace_the_same_keys_and_keep_the_others(artifact):
    out, chosen, _ = artifact
    other = Problem(2048, 4096)
    local = TunedTable(H200)
    newer_but_different = chosen[4096]
    local.record(PROBLEM, 1, newer_but_different, 1.0, measured_at="2999-01-01T00:00:00+00:00")
    local.record(other, 1, newer_but_different, 2.0)
    local.save(table_path(H200))
    load_artifact(out)
    installed = TunedTable.read(table_path(H200))
    assert installed.lookup(PROBLEM, 1) == chosen[1] != newer_but_different
    assert installed.lookup(other, 1) == newer_but_different


def test_without_nvcc_any_toolkit_loads(artifact, monkeypatch):
    monkeypatch.setattr(store, "cuda_toolkit", lambda: None)
    assert load_artifact(artifact[0])["built_with"]["cuda_toolkit"] == TOOLKIT


def _gpu(name, arch, sm_count):
    return classmethod(lambda cls, device=None: GpuKey(name, arch, sm_count))


@pytest.mark.parametrize("change, message", [
    (lambda mp: mp.setattr(store, "cuda_toolkit", lambda: "cuda_12.8.r12.8/compiler.35404655_0"),
     f"artifact built with CUDA toolkit {TOOLKIT}, this machine has cuda_12.8.r12.8/compiler.35404655_0"),
    (lambda mp: mp.setattr(torch.version, "cuda", "12.8"), "artifact built with CUDA 13.0, this machine has 12.8"),
    (lambda mp: mp.setattr(store, "tilelang_version", lambda: "0.1.16"),
     "artifact built with TileLang 0.1.15, this machine has 0.1.16"),
    (lambda mp: mp.setattr(tables, "_tilemarlin_version", lambda: "0.2.0"),
     "artifact built with tilemarlin 0.1.0, this machine has 0.2.0"),
    (lambda mp: mp.setattr(torch, "__version__", "2.99.0"), "artifact built with torch"),
    (lambda mp: mp.setattr(store, "_code_fingerprint", lambda: "edited"),
     "artifact built with kernel code (schedules/, templates/) "),
    (lambda mp: mp.setattr(GpuKey, "current", _gpu("NVIDIA H100 80GB HBM3", "sm_90a", 132)),
     "artifact built for GPU NVIDIA H200, this machine has NVIDIA H100 80GB HBM3"),
    (lambda mp: mp.setattr(GpuKey, "current", _gpu("NVIDIA H200", "sm_90a", 60)),
     "artifact built for SM count 132, this machine has 60"),
], ids=["toolkit", "cuda", "tilelang", "tilemarlin", "torch", "kernel-code", "gpu-model", "sm-count"])
def test_a_machine_that_differs_is_refused_naming_the_field(artifact, monkeypatch, change, message):
    change(monkeypatch)
    with pytest.raises(ArtifactError, match="does not fit this machine") as refused:
        load_artifact(artifact[0])
    assert message in str(refused.value)
    assert not store.cache_root().exists()        # nothing unpacked


def test_every_field_that_differs_is_named():
    here = {field: "here" for field in FIELDS}
    built = dict(here, tilelang="0.1.15", gpu="NVIDIA H200", cuda_toolkit="cuda_13.0")
    assert differences(built, here) == ["artifact built with TileLang 0.1.15, this machine has here",
                                        "artifact built with CUDA toolkit cuda_13.0, this machine has here",
                                        "artifact built for GPU NVIDIA H200, this machine has here"]
    assert differences(built, dict(here, cuda_toolkit=None))[1].startswith("artifact built for GPU")


def test_a_machine_without_a_gpu_is_refused(artifact, monkeypatch):
    monkeypatch.setattr(GpuKey, "current", THIS_GPU)      # and torch sees no CUDA
    with pytest.raises(ArtifactError, match="no CUDA GPU is visible"):
        load_artifact(artifact[0])



def test_a_gpu_of_an_arch_without_kernels_is_refused_as_an_artifact_error(artifact, monkeypatch):
    def unknown_arch(device=None):
        raise ValueError("unknown arch 'sm_120'; known: ['sm_80', 'sm_86', 'sm_89', 'sm_90a']")

    monkeypatch.setattr(GpuKey, "current", unknown_arch)
    with pytest.raises(ArtifactError, match="this machine's GPU cannot load an artifact: unknown arch 'sm_120'"):
        load_artifact(artifact[0])

def _repacked(src, dst, member: tarfile.TarInfo, data: bytes = b""):
    """The artifact at `src` with one more member."""
    with tarfile.open(src) as old, tarfile.open(dst, "w:gz") as new:
        for m in old.getmembers():
            new.addfile(m, old.extractfile(m))
        member.size = len(data) if member.isfile() else 0
        new.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return dst


def _symlink(name, target):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


@pytest.mark.parametrize("member, match", [
    (tarfile.TarInfo("../escaped.txt"), "unsafe member '../escaped.txt'"),
    (tarfile.TarInfo("kernels/sm_90a/../../../escaped.txt"), "unsafe member"),
    (tarfile.TarInfo("/tmp/absolute.txt"), "unsafe member '/tmp/absolute.txt'"),
    (_symlink("kernels/sm_90a/link", "/etc/passwd"), "a link or special file"),
    (tarfile.TarInfo("kernels/sm_90a/n1_k1/extra-0/kernel.so"), "unexpected member"),
    (tarfile.TarInfo("run.sh"), "unexpected member 'run.sh'"),
], ids=["dotdot", "nested-dotdot", "absolute", "symlink", "unlisted-kernel", "unlisted-file"])
def test_members_that_could_write_elsewhere_are_refused(artifact, tmp_path, member, match):
    bad = _repacked(artifact[0], tmp_path / "bad.tar.gz", member, b"#!/bin/sh\n")
    with pytest.raises(ArtifactError, match=match):
        load_artifact(bad)
    assert not store.cache_root().exists() and not (tmp_path / "escaped.txt").exists()


def test_a_file_that_is_not_an_artifact_is_refused(tmp_path):
    (tmp_path / "x.tar.gz").write_bytes(b"not a tar at all")
    with pytest.raises(ArtifactError, match="is not a tilemarlin artifact"):
        load_artifact(tmp_path / "x.tar.gz")
    with tarfile.open(tmp_path / "y.tar.gz", "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("README"), io.BytesIO(b""))
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        load_artifact(tmp_path / "y.tar.gz")


def _with_member_changed(src, dst, name, change):
    """The artifact at `src` with member `name`'s bytes changed by change(bytes) -> bytes."""
    with tarfile.open(src) as old, tarfile.open(dst, "w:gz") as new:
        for m in old.getmembers():
            data = old.extractfile(m).read() if m.isfile() else None
            if m.name == name:
                data = change(data)
                m.size = len(data)
            new.addfile(m, io.BytesIO(data) if data is not None else None)
    return dst


def test_a_damaged_file_is_refused_before_anything_is_written(artifact, tmp_path):
    out, _, _ = artifact
    with tarfile.open(out) as tar:
        kernel = next(n for n in tar.getnames() if n.endswith("kernel.so"))
    flipped = _with_member_changed(out, tmp_path / "flipped.tar.gz", kernel,
                                   lambda data: data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match=f"is damaged: 1 files differ from their sha256 .* {kernel}"):
        load_artifact(flipped)
    assert not store.cache_root().exists()


def test_a_truncated_archive_is_an_artifact_error(artifact, tmp_path):
    data = artifact[0].read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ArtifactError, match="truncated or damaged"):
        load_artifact(tmp_path / "cut.tar.gz")


def test_loading_again_writes_nothing_and_repairs_a_damaged_kernel(artifact, monkeypatch):
    """Every server start loads the artifact: once in place, into a read-only cache too. A kernel file
    damaged on disk since is put back."""
    import runtime.cache_files

    out, _, _ = artifact
    manifest = load_artifact(out)
    installed = store.cache_root() / manifest["kernels"][0] / "kernel.so"
    good = installed.read_bytes()

    def read_only(folder):
        raise PermissionError(f"{folder} is not writable")

    with monkeypatch.context() as mp:
        mp.setattr(runtime.cache_files, "writable_folder", read_only)
        mp.setattr(TunedTable, "save", lambda *args, **kwargs: pytest.fail("the table was written again"))
        load_artifact(out)
    installed.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    load_artifact(out)
    assert installed.read_bytes() == good


def test_a_table_for_another_gpu_than_the_kernels_is_refused(artifact, tmp_path):
    out, _, _ = artifact
    with tarfile.open(out) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())

    def other_gpu(data):
        table = json.loads(data)
        table["gpu"]["sm_count"] = 114
        return json.dumps(table).encode()

    changed = _with_member_changed(out, tmp_path / "t.tar.gz", manifest["table"], other_gpu)

    def rehash(data):
        fixed = json.loads(data)
        with tarfile.open(changed) as tar:
            fixed["sha256"][manifest["table"]] = hashlib.sha256(tar.extractfile(manifest["table"]).read()).hexdigest()
        return json.dumps(fixed).encode()

    crafted = _with_member_changed(changed, tmp_path / "crafted.tar.gz", "manifest.json", rehash)
    with pytest.raises(ArtifactError, match="its tuned table is for .*114.* its kernels for NVIDIA H200"):
        load_artifact(crafted)


def test_an_export_with_cuda_torch_names_its_own_versions(artifact, monkeypatch, tmp_path):
    """Exported on a GPU machine (a CUDA torch), the artifact is for machines like it: its torch and
    CUDA, not the tune's (a fleet upgraded since its tune exports again)."""
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(artifact[2]))
    monkeypatch.setattr(torch.version, "cuda", "13.1")
    monkeypatch.setattr(torch, "__version__", "2.12.0+cu131")
    out = tmp_path / "upgraded.tar.gz"
    assert gen_main(["export", "--arch", "sm_90a", "--shapes", "4096x4096", "--out", str(out)]) == 0
    with tarfile.open(out) as tar:
        built = json.loads(tar.extractfile("manifest.json").read())["built_with"]
    assert (built["torch"], built["cuda"]) == ("2.12.0+cu131", "13.1")


def test_export_into_a_missing_folder_says_so(artifact, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(artifact[2]))
    assert gen_main(["export", "--arch", "sm_90a", "--shapes", "4096x4096", "--out",
                     str(tmp_path / "nowhere" / "a.tar.gz")]) != 0
    assert f"no folder {tmp_path / 'nowhere'}" in capsys.readouterr().err



def test_the_commands_export_suggests_quote_paths_with_spaces():
    import argparse
    import shlex

    from gen.deploy.export_cmd import _same_layers

    args = argparse.Namespace(model="/models/my llama/config.json", tp=1, shapes=None, group=128, dtype="float16",
                              act="dtype", checkpoint=None, buckets=None, arch="sm_90a", gpu=None, unfused=False,
                              zero_points=False, act_order=False)
    flags = shlex.split(_same_layers(args))
    assert flags == ["--model", "/models/my llama/config.json", "--arch", "sm_90a"]

def test_export_refuses_while_kernels_are_missing(artifact, monkeypatch, capsys):
    out, chosen, source = artifact
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(source))
    shutil.rmtree(store.kernel_folder(PROBLEM, chosen[1], SM90))
    again = out.with_name("b.tar.gz")
    assert gen_main(["export", "--arch", "sm_90a", "--shapes", "4096x4096", "--out", str(again)]) == 1
    err = capsys.readouterr().err
    assert "1 of the" in err and "gen precompile --shapes 4096x4096 --arch sm_90a" in err
    assert not again.exists()


def test_export_without_a_table_for_the_arch_names_the_fix(artifact, monkeypatch, capsys):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(artifact[2].parent / "empty"))
    assert gen_main(["export", "--arch", "sm_80", "--shapes", "4096x4096", "--out", "x.tar.gz"]) == 2
    assert "no tuned table of sm_80 to export" in capsys.readouterr().err


def test_untuned_pairs_ship_the_fallbacks_kernels_and_no_entries(artifact, monkeypatch, capsys, tmp_path):
    from runtime.op import DEFAULT_LAYOUT
    from runtime.dispatch import Dispatch
    from runtime.precompile import plan
    from runtime.table import winners_for_arch

    out, _, source = artifact
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(source))
    untuned = Problem(5120, 5120)                 # in no committed table
    dispatch = Dispatch(SM90, GpuSpec.for_arch(SM90), TunedTable.read(COMMITTED), winners_for_arch("sm_90a"))
    planned = plan([untuned], BUCKETS, dispatch, DEFAULT_LAYOUT)
    for problem, schedule in planned:
        fake_entry(problem, schedule, toolkit=TOOLKIT)
    both = tmp_path / "both.tar.gz"
    assert gen_main(["export", "--arch", "sm_90a", "--shapes", "4096x4096,5120x5120", "--out", str(both)]) == 0
    assert "note: 13 (problem, bucket) pairs are not tuned" in capsys.readouterr().out
    with tarfile.open(both) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        entries = json.loads(tar.extractfile(manifest["table"]).read())["entries"]
    assert len(manifest["kernels"]) == len(planned) + len(set(artifact[1].values()))
    assert {(e["problem"]["n"], e["problem"]["k"]) for e in entries} == {(4096, 4096)} and len(entries) == 13


def test_a_w4a8_artifact_carries_the_activation_kernel(artifact, monkeypatch, capsys, tmp_path):
    """--act fp8: refused while the per-token activation kernels are not in the store (the command to
    build them named), packed beside the GEMMs once they are: the FP8 kernels, the W4A16 twin's at
    the buckets it serves (compiled to round the activations itself), and the FP8 entries that decide
    those buckets."""
    from runtime.dispatch import Dispatch
    from tests.test_precompile import fake_activation_entry

    _, _, source = artifact
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(source))
    fp8 = Problem(4096, 4096, act="fp8")
    committed = Dispatch(get_arch("sm_90a"), None, TunedTable.read(COMMITTED), ())
    served = {b: committed.serving_problem(fp8, b) for b in BUCKETS}
    assert {p.act for p in served.values()} == {"fp8", "fp8_rounded"}
    chosen = {(p, committed.choose(p, b, op.DEFAULT_LAYOUT)[0]) for b, p in served.items()}
    for problem, schedule in chosen:
        if not store.kernel_folder(problem, schedule, committed.arch).exists():   # (the fixture built W4A16's)
            fake_entry(problem, schedule, toolkit=TOOLKIT)
    out = tmp_path / "w4a8.tar.gz"
    args = ["export", "--arch", "sm_90a", "--shapes", "4096x4096", "--act", "fp8", "--out", str(out)]
    assert gen_main(args) == 1
    err = capsys.readouterr().err
    assert "FP8 activations, K = 4096, float16 input" in err and "gen precompile --shapes 4096x4096 --act fp8" in err
    folders = [fake_activation_entry(kind, 4096, "float16", toolkit=TOOLKIT)
               for kind in ("fp8_activations", "fp8_activations_sums")]
    assert gen_main(args) == 0
    with tarfile.open(out) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        shipped = {(entry["problem"].get("act", "dtype"), entry["bucket"])
                   for entry in json.loads(tar.extractfile(manifest["table"]).read())["entries"]}
    assert len(manifest["kernels"]) == len(chosen) + 2 and manifest["about"]["act"] == "fp8"
    assert all(folder.relative_to(source).as_posix() in manifest["kernels"] for folder in folders)
    assert {("fp8", b) for b in BUCKETS} <= shipped       # every FP8 entry: they decide the W4A16 buckets
    assert {("dtype", b) for b, p in served.items() if not p.fp8} <= shipped


def _serve(path, barrier, errors):
    barrier.wait()
    try:
        load_artifact(path)
    except BaseException as exc:                     # noqa: BLE001: the parent names it
        errors.put(f"{type(exc).__name__}: {exc}")


def test_servers_loading_one_artifact_into_one_cache_at_once_all_succeed(artifact):
    """One server per GPU of a node, each loading the artifact at its start into a shared cache."""
    out, _, _ = artifact
    ctx = multiprocessing.get_context("fork")       # the children keep the fixture's stubs
    failures = []
    for _ in range(12):
        shutil.rmtree(store.cache_root(), ignore_errors=True)
        barrier, errors = ctx.Barrier(8), ctx.Queue()
        servers = [ctx.Process(target=_serve, args=(str(out), barrier, errors)) for _ in range(8)]
        for server in servers:
            server.start()
        for server in servers:
            server.join(120)
        while not errors.empty():
            failures.append(errors.get())
    assert not failures, f"{len(failures)} of 96 loads failed, e.g. {failures[0]}"
