"""Compiling schedules, and the compiled-kernel cache they load from.

Compiled kernels live in TileLang's own kernel cache, pointed at tilemarlin's cache folder. Its key is
a hash of the lowered program (which carries our decode source as a prelude), the target, the pass
configs and TileLang's version: everything that changes the binary. A cached kernel loads in a
fraction of a second instead of a 5-10 s nvcc run. `TILEMARLIN_CACHE_DIR` moves the whole cache
(tuned tables and kernels) for installed, non-editable use.

TileLang's key needs the prim_func, and building it from our schedule code takes ~0.3 s on the CPU,
longer than checking and timing a small-M candidate: the tune's measuring process spent most of its
time rebuilding kernels that the compile workers had built already. So each compiled kernel also gets
an index entry (`index/`): its prim_func serialized by TVM, filed under a hash of (problem, schedule,
arch, TileLang version, the contents of schedules/ and templates/). A later load deserializes it
(~15 ms) and takes only TileLang's disk-cache path with it; the deserialized function is never
compiled (TVM's JSON round trip keeps the printed program, which is TileLang's key, but drops parts
that lowering needs), so a missing or unreadable kernel falls back to building as before.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import gzip
import hashlib
import json
import multiprocessing
import os
import threading
from pathlib import Path

from schedules.arch import Arch, get_arch
from schedules.problem import Problem
from schedules.registry import Schedule

_LOCK = threading.Lock()
_LOADED: dict[tuple, object] = {}


def cache_root() -> Path:
    """tilemarlin's cache folder: $TILEMARLIN_CACHE_DIR, else the project's cache/ folder."""
    env = os.environ.get("TILEMARLIN_CACHE_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "cache"


def kernel_dir() -> Path:
    """Where compiled kernels live (created if missing); an unwritable one is a clear error, not a
    failure deep inside TileLang (an installed package's folder is often read-only)."""
    path = cache_root() / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PermissionError(f"cannot create the compiled-kernel cache {path} ({exc.strerror}); "
                              "point TILEMARLIN_CACHE_DIR at a writable folder") from None
    if not os.access(path, os.W_OK):
        raise PermissionError(f"the compiled-kernel cache {path} is not writable; point "
                              "TILEMARLIN_CACHE_DIR at a writable folder")
    return path


def compile_schedule(problem: Problem, schedule: Schedule, arch: Arch):
    """The compiled kernel: from this process's memory, else the disk cache, else nvcc. Thread-safe;
    each (problem, schedule, arch) is built at most once per process."""
    key = (problem, schedule, arch.name)
    with _LOCK:
        kernel = _LOADED.get(key)
        if kernel is None:
            os.environ["TILELANG_CACHE_DIR"] = str(kernel_dir())
            import tilelang

            fam = schedule.module
            reason = fam.check(problem, schedule.knobs, arch)
            if reason:
                raise ValueError(f"{schedule.name} is not valid for {problem.name} on {arch.name}: {reason}")
            entry = index_path(problem, schedule, arch)
            kernel = _load_indexed(entry, arch, fam.PASS_CONFIGS)
            if kernel is None:
                func = fam.build(problem, schedule.knobs)
                kernel = tilelang.compile(func, target=arch.target, pass_configs=fam.PASS_CONFIGS)
                _write_index(entry, func)
            _LOADED[key] = kernel
        return kernel


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A hash of every file that builds a kernel (schedules/, templates/): an index entry written by
    other code is never found."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("schedules", "templates"):
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def index_path(problem: Problem, schedule: Schedule, arch: Arch) -> Path:
    """The index entry of a kernel (see the module's docstring)."""
    import tilelang

    ident = json.dumps({"code": _code_fingerprint(), "tilelang": tilelang.__version__, "arch": arch.name,
                        "problem": problem.name, "schedule": schedule.to_dict()}, sort_keys=True)
    return kernel_dir() / "index" / f"{hashlib.sha256(ident.encode()).hexdigest()}.json.gz"


def _write_index(entry: Path, func) -> None:
    import tvm

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(gzip.compress(tvm.ir.save_json(func).encode(), compresslevel=6))   # ~235 KB of JSON
    os.replace(tmp, entry)       # atomic: parallel compile workers may write the same entry


def _load_indexed(entry: Path, arch: Arch, pass_configs: dict):
    """The kernel of an index entry from TileLang's disk cache, or None (no entry, or its kernel is
    gone or unreadable). Goes through TileLang's own key and loader, never its compiler."""
    if not entry.is_file():
        return None
    try:
        import tvm
        from tilelang.cache import _resolve_cache_dispatch
        from tilelang.transform.pass_config import normalize_pass_configs

        func = tvm.ir.load_json(gzip.decompress(entry.read_bytes()).decode())
        cache, context, _ = _resolve_cache_dispatch(arch.target, None, None, False)
        configs = normalize_pass_configs(pass_configs)
        tl_key = cache._generate_key(func=func, out_idx=None, execution_backend=context.execution_backend.name,
                                     args=(), target=context.target, target_host=context.target_host,
                                     pass_configs=configs, compile_flags=None)
        return cache._load_kernel_from_disk(tl_key, context, None, configs, None, func, False)
    except Exception:   # a stale or damaged entry: build the kernel again, which rewrites it
        entry.unlink(missing_ok=True)
        return None


def _compile_job(problem: Problem, schedule_dict: dict, arch_name: str) -> str | None:
    """Worker side of compile_many: fills the disk cache; returns an error message or None."""
    import logging

    logging.disable(logging.CRITICAL)  # failed candidates would otherwise print whole kernel sources
    try:
        compile_schedule(problem, Schedule.from_dict(schedule_dict), get_arch(arch_name))
        return None
    except Exception as exc:  # a candidate that fails is a result, not a crash
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:500]


def _yield_to_the_gpu_driver() -> None:
    """Compile workers run below normal priority: a tune measures one problem on the GPU while the
    next one compiles, and the measuring process must get a core the moment it wants one."""
    try:
        os.nice(10)
    except OSError:   # not permitted here: compile at normal priority
        pass


def compile_many(jobs: list[tuple[Problem, Schedule]], arch: Arch, workers: int | None = None,
                 progress=None) -> dict[tuple[Problem, Schedule], str | None]:
    """Compile `jobs` in a process pool (each nvcc run takes seconds); returns job -> error or None.

    Results land in the disk cache, so the caller's compile_schedule afterwards is a cache hit.
    """
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2)))
    results: dict = {}
    ctx = multiprocessing.get_context("spawn")  # no CUDA context or TVM state inherited by forks
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_yield_to_the_gpu_driver) as pool:
        futures = {pool.submit(_compile_job, p, s.to_dict(), arch.name): (p, s) for p, s in jobs}
        for fut in cf.as_completed(futures):
            try:
                results[futures[fut]] = fut.result()
            except Exception as exc:  # the worker itself died (e.g. killed by the OOM killer)
                results[futures[fut]] = f"compile worker died: {exc}"
            if progress is not None:
                progress(futures[fut], results[futures[fut]])
    return results
