"""Compiling schedules, and the compiled-kernel cache they load from.

Compiled kernels live in TileLang's own kernel cache, pointed at tilemarlin's cache folder. Its key is
a hash of the lowered program (which carries our decode source as a prelude), the target, the pass
configs and TileLang's version: everything that changes the binary. A cached kernel loads in a
fraction of a second instead of a 5-10 s nvcc run. `TILEMARLIN_CACHE_DIR` moves the whole cache
(tuned tables and kernels) for installed, non-editable use.
"""
from __future__ import annotations

import concurrent.futures as cf
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
            kernel = tilelang.compile(fam.build(problem, schedule.knobs), target=arch.target,
                                      pass_configs=fam.PASS_CONFIGS)
            _LOADED[key] = kernel
        return kernel


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
