"""The compiled-kernel store: where kernels go, what identifies them, and loading without TileLang's
compiler (no GPU needed: nvcc builds for sm_90a here, and a stored kernel loads on any machine)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import runtime.kernels as store
from runtime.kernels import cache_root, kernel_dir, writable_kernel_dir


def test_env_var_moves_the_whole_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "tm"))
    assert cache_root() == tmp_path / "tm"
    assert kernel_dir() == tmp_path / "tm" / "kernels" and not kernel_dir().exists()   # reading creates nothing
    assert writable_kernel_dir().is_dir()



def test_a_cache_dir_under_home_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", "~/.cache/tilemarlin")
    assert store.cache_root() == tmp_path / ".cache" / "tilemarlin"

def test_read_only_cache_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "access", lambda p, mode: False)      # as a read-only volume answers
    with pytest.raises(PermissionError, match="not writable.*TILEMARLIN_CACHE_DIR"):
        writable_kernel_dir()


def test_a_file_in_the_way_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "kernels").write_text("not a folder")
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    with pytest.raises(PermissionError, match="TILEMARLIN_CACHE_DIR"):
        writable_kernel_dir()


def _small_kernel():
    from schedules.arch import get_arch
    from schedules.problem import Problem
    from schedules.registry import Schedule
    from schedules.stream_mma import Knobs

    return Problem(512, 1024, 128), Schedule("stream_mma", Knobs(warps=4, unroll=4, ahead=2)), get_arch("sm_90a")


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """One kernel built into a fresh store (one nvcc run for the whole module)."""
    root = tmp_path_factory.mktemp("store")
    old = os.environ.get("TILEMARLIN_CACHE_DIR")
    os.environ["TILEMARLIN_CACHE_DIR"] = str(root)
    saved = dict(store._LOADED)
    store._LOADED.clear()
    try:
        problem, schedule, arch = _small_kernel()
        kernel = store.compile_schedule(problem, schedule, arch)
        yield root, kernel
    finally:
        store._LOADED.clear()
        store._LOADED.update(saved)
        if old is None:
            os.environ.pop("TILEMARLIN_CACHE_DIR")
        else:
            os.environ["TILEMARLIN_CACHE_DIR"] = old


def test_a_built_kernel_is_stored_under_readable_names(stored):
    root, kernel = stored
    problem, schedule, arch = _small_kernel()
    folder = kernel.folder
    assert folder == store.kernel_folder(problem, schedule, arch)
    assert folder.relative_to(root / "kernels").parts[:2] == ("sm_90a", problem.name)
    assert folder.name.startswith(schedule.name.replace(":", "-"))
    assert sorted(p.name for p in folder.iterdir()) == ["kernel.cu", "kernel.so", "meta.json"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["cuda"] == store.cuda_toolkit() and meta["cuda"]          # the toolkit that built it
    assert meta["schedule"] == schedule.to_dict() and meta["tilelang"] == store.tilelang_version()
    assert "__global__" in kernel.get_kernel_source()


def test_a_stored_kernel_loads_without_building(stored, monkeypatch):
    problem, schedule, arch = _small_kernel()
    monkeypatch.setattr(store, "_LOADED", {})
    monkeypatch.setattr(store, "build_kernel", lambda *a: pytest.fail("built although the store has it"))
    again = store.compile_schedule(problem, schedule, arch)
    assert again.folder == stored[1].folder and again.get_kernel_source() == stored[1].get_kernel_source()


def test_a_read_only_pre_filled_store_serves(stored, monkeypatch):
    problem, schedule, arch = _small_kernel()
    monkeypatch.setattr(store, "_LOADED", {})
    monkeypatch.setattr(os, "access", lambda p, mode: False)      # as a read-only volume answers
    assert store.compile_schedule(problem, schedule, arch).folder == stored[1].folder


def test_another_cuda_toolkit_or_a_damaged_entry_is_not_current(stored, monkeypatch):
    folder = stored[1].folder
    assert store._is_current(folder)
    monkeypatch.setattr(store, "cuda_toolkit", lambda: "cuda_99.9.r99.9/compiler.0_0")
    assert not store._is_current(folder)
    monkeypatch.setattr(store, "cuda_toolkit", lambda: None)       # no nvcc here: any toolkit serves
    assert store._is_current(folder)
    monkeypatch.undo()
    meta = folder / "meta.json"
    text = meta.read_text()
    try:
        meta.write_text("{not json")
        assert not store._is_current(folder)
    finally:
        meta.write_text(text)
    library = folder / "kernel.so"
    library.rename(folder / "kernel.so.aside")
    try:
        assert not store._is_current(folder)          # a meta.json without its library
    finally:
        (folder / "kernel.so.aside").rename(library)
    assert store._is_current(folder)


def test_the_identity_covers_the_code_and_the_schedule(monkeypatch):
    """A kernel's folder changes with any byte of schedules/ or templates/, and with its schedule."""
    from pathlib import Path

    problem, schedule, arch = _small_kernel()
    before = store.kernel_folder(problem, schedule, arch)
    read_bytes = Path.read_bytes
    for edited in ("templates/dequant.cuh.j2", "schedules/stream_mma/kernel.py"):
        monkeypatch.setattr(Path, "read_bytes",
                            lambda path, edited=edited: read_bytes(path) + (b"//" if path.as_posix().endswith(edited) else b""))
        store._code_fingerprint.cache_clear()
        try:
            assert store.kernel_folder(problem, schedule, arch) != before, f"{edited} is not in the identity"
        finally:
            monkeypatch.undo()
            store._code_fingerprint.cache_clear()
    assert store.kernel_folder(problem, schedule, arch) == before
    other = type(schedule)("stream_mma", type(schedule.knobs)(warps=4, unroll=4, ahead=3))
    assert store.kernel_folder(problem, other, arch) != before


def _fresh_python(code: str, cache: str) -> dict:
    env = {**os.environ, "TILEMARLIN_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


COMPILER_MODULES = ("gen", "tilelang", "tvm")     # tvm_ffi (the call interface) is not the compiler


def _compiler_modules(names):
    return sorted(n for n in names if n.split(".")[0] in COMPILER_MODULES)


def test_importing_the_runtime_imports_neither_the_generator_nor_the_compiler(tmp_path):
    names = _fresh_python("""
        import json, sys
        import runtime
        print(json.dumps(sorted(sys.modules)))
    """, str(tmp_path))
    assert _compiler_modules(names) == []


def test_loading_a_stored_kernel_imports_no_compiler(stored):
    root, _ = stored
    result = _fresh_python("""
        import json, sys
        from runtime.kernels import compile_schedule
        from schedules.arch import get_arch
        from schedules.problem import Problem
        from schedules.registry import Schedule
        from schedules.stream_mma import Knobs
        kernel = compile_schedule(Problem(512, 1024, 128), Schedule("stream_mma", Knobs(warps=4, unroll=4, ahead=2)),
                                  get_arch("sm_90a"))
        print(json.dumps({"modules": sorted(sys.modules), "folder": str(kernel.folder)}))
    """, str(root))
    assert _compiler_modules(result["modules"]) == []
    assert result["folder"].startswith(str(root))


def test_a_script_that_builds_at_import_time_needs_no_main_guard(tmp_path):
    """The compile workers are plain child processes, not multiprocessing ones, which import the main
    script first: a script that builds kernels at import time, with no `if __name__ == "__main__":`
    guard, builds them once, in the workers, and is not run again there."""
    from pathlib import Path

    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent("""
        from runtime.kernels import compile_many, is_stored
        from schedules.arch import get_arch
        from schedules.problem import Problem
        from schedules.registry import Schedule
        from schedules.marlin_mma import Knobs
        print("SCRIPT RAN", flush=True)
        job = (Problem(256, 1024), Schedule("marlin_mma", Knobs()))
        errors = compile_many([job], get_arch("sm_90a"), workers=1)
        print("ERRORS", list(errors.values()), is_stored(*job, get_arch("sm_90a")))
    """))
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "TILEMARLIN_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.stdout.count("SCRIPT RAN") == 1, out.stdout + out.stderr[-2000:]
    assert "ERRORS [None] True" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_worker_that_dies_fails_its_job_and_the_next_job_gets_another(monkeypatch, tmp_path):
    """Each job is answered: a worker that dies (here one that exits at once, as one killed for memory
    would) fails its job with its exit code and last words, and the next job starts a new worker; a
    worker that cannot start at all fails its job with the reason."""
    import runtime.kernels as kernels
    from schedules.arch import get_arch
    from schedules.marlin_mma import Knobs
    from schedules.problem import Problem
    from schedules.registry import Schedule

    dying = tmp_path / "python"
    dying.write_text("#!/bin/sh\necho 'Killed: out of memory' >&2\nexit 137\n")
    dying.chmod(0o755)
    monkeypatch.setattr(kernels.sys, "executable", str(dying))
    jobs = [(Problem(256, 1024), Schedule("marlin_mma", Knobs())), (Problem(512, 1024), Schedule("marlin_mma", Knobs()))]
    seen = []
    errors = kernels.compile_many(jobs, get_arch("sm_90a"), workers=1, progress=lambda job, error: seen.append(job))
    assert sorted(errors, key=str) == sorted(jobs, key=str) and sorted(seen, key=str) == sorted(jobs, key=str)
    assert all(e == "compile worker died (exit code 137): Killed: out of memory" for e in errors.values())
    monkeypatch.setattr(kernels.sys, "executable", str(tmp_path / "no-such-python"))
    (error,) = kernels.compile_many(jobs[:1], get_arch("sm_90a")).values()
    assert error.startswith("cannot start a compile worker: ") and "no-such-python" in error


def test_stray_output_of_a_worker_is_skipped_and_a_progress_error_reaches_the_caller(monkeypatch, tmp_path):
    """Answers are marked lines: a worker whose start-up prints to stdout (a sitecustomize, an import)
    still answers. An exception of the caller's progress callback stops the build and is raised by
    compile_many, not lost in a worker thread."""
    import runtime.kernels as kernels
    from schedules.arch import get_arch
    from schedules.marlin_mma import Knobs
    from schedules.problem import Problem
    from schedules.registry import Schedule

    chatty = tmp_path / "python"
    chatty.write_text(f"#!/bin/sh\necho 'hello from site'\nexec {sys.executable} \"$@\"\n")
    chatty.chmod(0o755)
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels.sys, "executable", str(chatty))
    job = (Problem(256, 1024), Schedule("marlin_mma", Knobs()))
    assert kernels.compile_many([job], get_arch("sm_90a"), workers=1) == {job: None}

    def refuse(job, error):
        raise KeyboardInterrupt

    monkeypatch.setattr(kernels.sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(KeyboardInterrupt):
        kernels.compile_many([job, (Problem(512, 1024), job[1])], get_arch("sm_90a"), workers=1, progress=refuse)


def test_a_pool_takes_jobs_as_they_come_stops_when_cancelled_and_refuses_jobs_once_closed(monkeypatch, tmp_path):
    """CompilePool: jobs submitted after the workers started are answered too, whatever arch each is
    for; cancel() lets the current job finish and no other start; a closed pool refuses new jobs
    instead of dropping them."""
    import threading

    import runtime.kernels as kernels
    from schedules.arch import get_arch
    from schedules.marlin_mma import Knobs
    from schedules.problem import Problem
    from schedules.registry import Schedule

    dying = tmp_path / "python"          # every job fails at once: no compile needed to see the pool work
    dying.write_text("#!/bin/sh\nexit 1\n")
    dying.chmod(0o755)
    monkeypatch.setattr(kernels.sys, "executable", str(dying))
    jobs = [(Problem(256 * (i + 1), 1024), Schedule("marlin_mma", Knobs())) for i in range(3)]
    sm90 = get_arch("sm_90a")
    pool = kernels.CompilePool(workers=2)
    pool.submit(jobs[:1], sm90)
    pool.submit(jobs[1:], get_arch("sm_80"))
    assert set(pool.close()) == {(jobs[0], sm90), *((job, get_arch("sm_80")) for job in jobs[1:])}
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(jobs[:1], sm90)

    first_done, resume = threading.Event(), threading.Event()

    def hold_after_the_first(job, error):
        first_done.set()
        assert resume.wait(timeout=30)

    pool = kernels.CompilePool(workers=1, progress=hold_after_the_first)
    pool.submit(jobs, sm90)
    assert first_done.wait(timeout=30)
    pool.cancel()
    resume.set()
    assert list(pool.close()) == [(jobs[0], sm90)]


def test_loading_a_stored_kernel_never_waits_for_another_kernels_build(monkeypatch, tmp_path):
    """compile_schedule locks per kernel: a build (seconds of nvcc) holds up only callers of that kernel."""
    import threading

    from schedules.arch import get_arch
    from schedules.marlin_mma import Knobs
    from schedules.problem import Problem
    from schedules.registry import Schedule

    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_LOADED", {})
    building, release = threading.Event(), threading.Event()
    slow, stored = Problem(n=128, k=256), Problem(n=256, k=256)
    schedule, arch = Schedule("marlin_mma", Knobs()), get_arch("sm_90a")

    def folder_of(problem, schedule, arch):
        if problem == slow:            # missing from the store: its build takes a while
            building.set()
            assert release.wait(30)
        return store.kernel_folder(problem, schedule, arch)

    monkeypatch.setattr(store, "_stored", folder_of)
    monkeypatch.setattr(store, "_load_library", lambda path: (lambda *args: None))
    builder = threading.Thread(target=store.compile_schedule, args=(slow, schedule, arch))
    builder.start()
    loaded = []
    try:
        assert building.wait(30)
        loader = threading.Thread(target=lambda: loaded.append(store.compile_schedule(stored, schedule, arch)))
        loader.start()
        loader.join(10)
        assert not loader.is_alive(), "loading a stored kernel waited for another kernel's build"
    finally:
        release.set()
        builder.join(30)
    assert loaded[0].folder.parent.name == stored.name
    assert store.compile_schedule(slow, schedule, arch) is store.compile_schedule(slow, schedule, arch)
