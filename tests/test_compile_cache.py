"""Where compiled kernels go, and the error when they cannot go there."""
import os

import pytest

from gen.compile import cache_root, kernel_dir


def test_env_var_moves_the_whole_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "tm"))
    assert cache_root() == tmp_path / "tm"
    assert kernel_dir() == tmp_path / "tm" / "kernels" and kernel_dir().is_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_cache_names_the_fix(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(ro))
    with pytest.raises(PermissionError, match="TILEMARLIN_CACHE_DIR"):
        kernel_dir()


def test_a_file_in_the_way_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "kernels").write_text("not a folder")
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    with pytest.raises(PermissionError, match="TILEMARLIN_CACHE_DIR"):
        kernel_dir()


def _small_kernel():
    from schedules.arch import get_arch
    from schedules.problem import Problem
    from schedules.registry import Schedule
    from schedules.stream_mma import Knobs

    return Problem(512, 1024, 128), Schedule("stream_mma", Knobs(warps=4, unroll=4, ahead=2)), get_arch("sm_90a")


def test_a_compiled_kernel_loads_through_its_index_without_being_built(monkeypatch):
    import gen.compile as gc

    problem, schedule, arch = _small_kernel()
    assert schedule.module.check(problem, schedule.knobs, arch) is None
    monkeypatch.setattr(gc, "_LOADED", {})
    first = gc.compile_schedule(problem, schedule, arch)
    entry = gc.index_path(problem, schedule, arch)
    assert entry.is_file()

    def no_build(*args):
        raise AssertionError("built although the index has the kernel")

    import tilelang      # TileLang's own way to the same kernel: build, key, disk-cache hit
    fam = schedule.module
    built = tilelang.compile(fam.build(problem, schedule.knobs), target=arch.target, pass_configs=fam.PASS_CONFIGS)
    monkeypatch.setattr(gc, "_LOADED", {})
    monkeypatch.setattr(fam, "build", no_build)
    again = gc.compile_schedule(problem, schedule, arch)
    assert again is not first and again.get_kernel_source() == built.get_kernel_source()
    assert repr(again.params) == repr(built.params)
    assert repr(again.adapter.dynamic_symbolic_map) == repr(built.adapter.dynamic_symbolic_map)   # M, dynamic


def test_a_damaged_index_entry_is_rebuilt(monkeypatch):
    import gen.compile as gc

    problem, schedule, arch = _small_kernel()
    monkeypatch.setattr(gc, "_LOADED", {})
    source = gc.compile_schedule(problem, schedule, arch).get_kernel_source()
    entry = gc.index_path(problem, schedule, arch)
    entry.write_bytes(b"not gzip")
    monkeypatch.setattr(gc, "_LOADED", {})
    assert gc.compile_schedule(problem, schedule, arch).get_kernel_source() == source
    import gzip
    import json
    json.loads(gzip.decompress(entry.read_bytes()))          # rewritten by the build


def test_the_index_is_keyed_by_the_code_that_builds_kernels(monkeypatch):
    import gen.compile as gc

    problem, schedule, arch = _small_kernel()
    before = gc.index_path(problem, schedule, arch)
    monkeypatch.setattr(gc, "_code_fingerprint", lambda: "schedules changed")
    assert gc.index_path(problem, schedule, arch) != before
    monkeypatch.undo()
    other = type(schedule)("stream_mma", type(schedule.knobs)(warps=4, unroll=4, ahead=3))
    assert gc.index_path(problem, other, arch) != before
