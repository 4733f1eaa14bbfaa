"""The compiled-kernel store: where compiled kernels live, how they are built, and how they load.

A kernel is identified by what changes its binary: the code that builds kernels (a hash of
schedules/ and templates/), TileLang's version, the CUDA toolkit, the arch, the problem and the
schedule. Each lives in a readable folder, `kernels/<arch>/<problem>/<schedule>-<hash>/`, holding

- `kernel.so`: TileLang's exported library (its `tvm_ffi` backend: host launcher + embedded cubin),
- `kernel.cu`: the device source, for reading and for the code-generation tests,
- `meta.json`: the identity above, including the CUDA toolkit that built it.

Loading imports none of TileLang's Python and compiles nothing. TileLang 0.1.15 exports a kernel as
a shared library whose host code calls TVM-FFI and TVM's runtime (`TVMBackendGetFuncFromEnv`, the CUDA
module loader `ffi.Module.load_from_bytes.cuda`) and, for TMA loads, `__tvm_tensormap_create_tiled`,
which TileLang's `lib/libtilelang.so` registers. The store loads those native libraries
(NATIVE_LIBRARIES) into the process and opens the kernel with `tvm_ffi.load_module`, then calls it
with torch tensors as TileLang's own adapter does (the stream comes from torch through DLPack).
Building a kernel imports TileLang, lowers the schedule and runs nvcc (5-10 s); that happens only on
a miss, and `compile_many` does it for many kernels in worker processes.

The CUDA toolkit sits in `meta.json` rather than in the folder's hash, so that a serving machine
without nvcc can still load what a machine with the same toolkit built; where a toolkit is found and
differs from the one recorded, the kernel counts as missing and is rebuilt.

A read-only store serves as it is: only a build needs to write. `TILEMARLIN_CACHE_DIR` moves the
whole cache (tuned tables and kernels), e.g. for an installed, non-editable package.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from schedules.arch import Arch, get_arch
from schedules.problem import Problem
from schedules.registry import Schedule

from .cache_files import swap_in

_LOCK = threading.Lock()            # guards the dicts below; held for lookups and inserts only
_LOADED: dict[tuple, "CompiledKernel"] = {}
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
# In-process builds one at a time (TileLang's compiler is not known to be thread-safe); loading a
# stored kernel never waits for them.
_BUILD_LOCK = threading.Lock()


def cache_root() -> Path:
    """tilemarlin's cache folder: $TILEMARLIN_CACHE_DIR (`~` expanded, as a shell would not inside
    quotes), else the project's cache/ folder."""
    env = os.environ.get("TILEMARLIN_CACHE_DIR")
    return Path(env).expanduser() if env else Path(__file__).resolve().parent.parent / "cache"


def kernel_dir() -> Path:
    """Where compiled kernels live (not created: reading needs no folder)."""
    return cache_root() / "kernels"


def writable_kernel_dir() -> Path:
    """kernel_dir(), created, for a build: an unwritable one is a clear error, not a failure deep
    inside TileLang (an installed package's folder is often read-only)."""
    from .cache_files import writable_folder

    return writable_folder(kernel_dir())


class CompiledKernel:
    """A kernel loaded from the store: call it with the family's kernel_args()."""

    def __init__(self, folder: Path, function):
        self.folder = folder
        self._function = function

    def __call__(self, *args):
        return self._function(*args)

    def get_kernel_source(self) -> str:
        """The CUDA device source nvcc compiled."""
        return (self.folder / "kernel.cu").read_text()

    def ptx(self) -> str:
        """The kernel's PTX, compiled from its stored source by TileLang's nvcc helper (as TileLang's
        JITKernel.export_ptx does) the first time and kept beside it as kernel.ptx (developer tools and
        code-generation tests only: it imports TileLang)."""
        kept = self.folder / "kernel.ptx"
        if kept.is_file():
            return kept.read_text()
        from tilelang.contrib import nvcc
        from tvm.target import Target

        arch = get_arch(json.loads((self.folder / "meta.json").read_text())["arch"])
        with Target(arch.target):
            ptx = nvcc.get_ptx_from_source(self.get_kernel_source())
        staging = kept.with_name(f"kernel.ptx.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            staging.write_text(ptx)
            staging.replace(kept)
        except OSError:         # a read-only store: compiled again next time
            staging.unlink(missing_ok=True)
        return ptx

    def export_ptx(self, path) -> None:
        Path(path).write_text(self.ptx())


def compile_schedule(problem: Problem, schedule: Schedule, arch: Arch) -> CompiledKernel:
    """The compiled kernel: from this process's memory, else the store, else built (and stored).
    Thread-safe; each (problem, schedule, arch) is loaded at most once per process, and a thread
    loading one kernel never waits for another kernel's build."""
    return _loaded((problem, schedule, arch.name), lambda: _stored(problem, schedule, arch))


def _loaded(key: tuple, stored_folder) -> CompiledKernel:
    """The kernel of `key` from this process's memory, else loaded from stored_folder() (which builds
    it first where it is missing), under a lock of this key alone."""
    kernel = _LOADED.get(key)
    if kernel is None:
        with _LOCK:
            key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
        with key_lock:
            kernel = _LOADED.get(key)
            if kernel is None:
                folder = stored_folder()
                kernel = CompiledKernel(folder, _load_library(folder / "kernel.so"))
                with _LOCK:
                    _LOADED[key] = kernel
    return kernel


def _stored(problem: Problem, schedule: Schedule, arch: Arch) -> Path:
    """The kernel's folder in the store, built first if it is missing or stale."""
    reason = schedule.module.check(problem, schedule.knobs, arch)
    if reason:
        raise ValueError(f"{schedule.name} is not valid for {problem.name} on {arch.name}: {reason}")
    folder = kernel_folder(problem, schedule, arch)
    if not _is_current(folder):
        with _BUILD_LOCK:
            _build_into(folder, problem, schedule, arch)
    return folder


def build_kernel(problem: Problem, schedule: Schedule, arch: Arch):
    """TileLang's JITKernel of a schedule, built now (for developer tools that want its PTX): with the
    kernels' own prelude in place of TileLang's headers where it covers the code
    (templates.with_own_prelude: nvcc ~3x faster), and again with TileLang's headers should nvcc
    refuse it (a name the prelude's checks did not see)."""
    fam, tilelang = schedule.module, _compiler()

    def compile_once():
        return tilelang.compile(fam.build(problem, schedule.knobs), target=arch.target, pass_configs=fam.PASS_CONFIGS)

    try:
        with cuda_postproc(tilelang, own_prelude):
            return compile_once()
    except RuntimeError as exc:
        if "Compilation error" not in str(exc):
            raise
    return compile_once()


def _compiler():
    """TileLang, with its own kernel cache off in this process: the store is the cache, and TileLang's
    would export each library a second time into a folder of its own (13 % of a build's time over 9
    Llama-2-7B kernels built on a CPU, 2026-12-03)."""
    import tilelang

    tilelang.disable_cache()
    return tilelang


@contextlib.contextmanager
def cuda_postproc(tilelang, transform):
    """TileLang's CUDA post-processing hook (one per process) set to `transform` while the block runs,
    applied after the hook already set, if any, which is put back afterwards."""
    import tvm_ffi

    name = "tilelang_callback_cuda_postproc"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    tilelang.engine.register_cuda_postproc(
        lambda code, target: transform(previous(code, target) if previous is not None else code, target))
    try:
        yield
    finally:
        tilelang.engine.register_cuda_postproc(previous if previous is not None else (lambda code, target: code))


def own_prelude(code: str, target) -> str:
    """templates.with_own_prelude as a post-processing hook (imported here, with jinja2, by builds
    alone)."""
    from templates import with_own_prelude

    return with_own_prelude(code)


# --- identity ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A hash of every file that builds a kernel (schedules/, templates/)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("schedules", "templates"):
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def tilelang_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("tilelang")


@functools.lru_cache(maxsize=1)
def cuda_toolkit() -> str | None:
    """The nvcc that TileLang would build with (CUDA_HOME, CUDA_PATH, else PATH), as its release
    and build line, e.g. 'cuda_13.0.r13.0/compiler.36424714_0'; None where no nvcc is installed."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    build = re.search(r"Build (\S+)", text)
    return build.group(1) if build else text.strip().splitlines()[-1]


def identity(problem: Problem, schedule: Schedule, arch: Arch) -> dict:
    """Everything but the CUDA toolkit that makes a kernel's binary (see the module's docstring)."""
    return {"code": _code_fingerprint(), "tilelang": tilelang_version(), "arch": arch.name,
            "problem": problem.name, "schedule": schedule.to_dict()}


def kernel_folder(problem: Problem, schedule: Schedule, arch: Arch) -> Path:
    """The store's folder for a kernel: readable names, then a hash of its identity."""
    digest = hashlib.sha256(json.dumps(identity(problem, schedule, arch), sort_keys=True).encode()).hexdigest()
    readable = schedule.name.replace(":", "-")
    return kernel_dir() / arch.name / problem.name / f"{readable}-{digest[:16]}"


def is_stored(problem: Problem, schedule: Schedule, arch: Arch) -> bool:
    """Whether the store holds the kernel, built by the CUDA toolkit found here (compile_schedule
    would only load it)."""
    return _is_current(kernel_folder(problem, schedule, arch))


def _is_current(folder: Path) -> bool:
    """A complete entry built by the CUDA toolkit found here (any, where none is installed)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    toolkit = cuda_toolkit()
    return (folder / "kernel.so").is_file() and (toolkit is None or meta.get("cuda") == toolkit)


# --- building and loading ------------------------------------------------------------------------

def _build_into(folder: Path, problem: Problem, schedule: Schedule, arch: Arch) -> None:
    """Build the kernel and put its entry in place (_store_entry)."""
    writable_kernel_dir()
    _store_entry(folder, build_kernel(problem, schedule, arch), identity(problem, schedule, arch))


def _store_entry(folder: Path, jit, ident: dict) -> None:
    """Put a built kernel's entry in place atomically: a reader sees all of it or none. Parallel
    builders of one kernel each write their own staging folder; the first in place stays."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    os.chmod(staging, 0o755)       # mkdtemp's 0700 would hide a shared store's kernel from other users
    try:
        jit.export_library(str(staging / "kernel.so"))
        (staging / "kernel.cu").write_text(jit.get_kernel_source())
        meta = {**ident, "cuda": cuda_toolkit()}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    except BaseException:          # a failed export leaves nothing behind in the store
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # another builder's current entry stays; a stale one (another toolkit) is replaced
    swap_in(staging, folder, keep=_is_current)


# The kernels beside the GEMMs, each built per (K, dtype) by a function(k, dtype, arch), "module:function", and
# how listings name them: W4A8's FP8 quantizer (and with the k-tile sums that offset_decode's GEMMs read),
# act-order's column gather, and the RMSNorm that writes its output in act-order's order.
ACTIVATION_KERNELS = {"fp8_activations": ("schedules.fp8_activations:build", "FP8 activations"),
                      "fp8_activations_sums": ("schedules.fp8_activations:build_with_sums",
                                               "FP8 activations with k-tile sums"),
                      "gather_columns": ("schedules.gather:build", "act-order gather"),
                      "rms_norm_gather": ("schedules.norm_gather:build", "act-order RMSNorm")}


def _activation_identity(kind: str, k: int, dtype: str, arch: Arch) -> dict:
    return {"code": _code_fingerprint(), "tilelang": tilelang_version(), "arch": arch.name,
            "kernel": f"{kind}_k{k}_{dtype}"}


def activation_kernel_folder(kind: str, k: int, dtype: str, arch: Arch) -> Path:
    """The store's folder of activation kernel `kind` (one of ACTIVATION_KERNELS) for K = k and `dtype`."""
    ident = _activation_identity(kind, k, dtype, arch)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return kernel_dir() / arch.name / kind / f"k{k}_{dtype}-{digest[:16]}"


def is_activation_kernel_stored(kind: str, k: int, dtype: str, arch: Arch) -> bool:
    """Whether the store holds that activation kernel, built by the CUDA toolkit found here."""
    return _is_current(activation_kernel_folder(kind, k, dtype, arch))


def compile_activation_kernel(kind: str, k: int, dtype: str, arch: Arch) -> CompiledKernel:
    """Activation kernel `kind` for K = k and `dtype` input: "fp8_activations" (schedules/fp8_activations.py;
    call it with x [M, K], fp8 out [M, K], token scales [M, 1] fp32), "fp8_activations_sums" (the same
    and k-tile sums [M, K / 128] fp32), "gather_columns" (schedules/gather.py; x [M, K], perm [K] int32, out
    [M, K]) or "rms_norm_gather" (schedules/norm_gather.py; x [M, K], weight [K] in x's dtype, perm [K]
    int32, eps [1] fp32, out [M, K]). From this process's memory, else the store
    (`kernels/<arch>/<kind>/`), else built and stored."""
    return _loaded((kind, k, dtype, arch.name), lambda: _stored_activation(ActivationJob(kind, k, dtype), arch))


@dataclasses.dataclass(frozen=True)
class ActivationJob:
    """An activation kernel (ACTIVATION_KERNELS) as a job of compile_many, beside (problem, schedule)
    jobs."""

    kind: str
    k: int
    dtype: str


def _stored_activation(job: ActivationJob, arch: Arch) -> Path:
    """The activation kernel's folder in the store, built first if it is missing or stale."""
    if job.kind not in ACTIVATION_KERNELS:
        raise ValueError(f"unknown activation kernel {job.kind!r}; known: {sorted(ACTIVATION_KERNELS)}")
    folder = activation_kernel_folder(job.kind, job.k, job.dtype, arch)
    if not _is_current(folder):
        with _BUILD_LOCK:
            _store_entry(folder, _build_activation_kernel(job.kind, job.k, job.dtype, arch),
                         _activation_identity(job.kind, job.k, job.dtype, arch))
    return folder


def job_stored(job, arch: Arch) -> bool:
    """Whether the store holds a compile_many job's kernel: a (problem, schedule) pair or an ActivationJob."""
    if isinstance(job, ActivationJob):
        return is_activation_kernel_stored(job.kind, job.k, job.dtype, arch)
    return is_stored(*job, arch)


def _build_activation_kernel(kind: str, k: int, dtype: str, arch: Arch):
    module, function = ACTIVATION_KERNELS[kind][0].split(":")
    build = getattr(importlib.import_module(module), function)
    writable_kernel_dir()     # a read-only store is an error before the compile, not after it
    return _compiler().compile(build(k, dtype, arch), target=arch.target)


# Loaded in this order: TVM's runtime (its symbols and its CUDA module loader), then TileLang's library,
# whose static initializers register `__tvm_tensormap_create_tiled`, the function through which a TMA
# kernel's host code builds its tensor maps at every launch. Neither loads TileLang's Python.
NATIVE_LIBRARIES = ("libtvm_runtime.so", "libtilelang.so")


@functools.lru_cache(maxsize=1)
def _tvm_runtime() -> None:
    """Load the native libraries exported kernels call into (NATIVE_LIBRARIES) from TileLang's package."""
    spec = importlib.util.find_spec("tilelang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tilemarlin's kernels need the tilelang package (pip install tilelang==0.1.15)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "lib"
    for name in NATIVE_LIBRARIES:
        ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)


def _load_library(path: Path):
    """The entry function of an exported kernel library (TileLang's adapter calls the same one)."""
    import tvm_ffi

    _tvm_runtime()
    return tvm_ffi.load_module(str(path)).main


# --- many kernels at once ------------------------------------------------------------------------

def _compile_job(message: dict) -> str | None:
    """Worker side of compile_many: fills the store with one job's kernel (_job_message's form);
    returns an error message or None."""
    import logging

    logging.disable(logging.CRITICAL)  # failed candidates would otherwise print whole kernel sources
    try:
        arch = get_arch(message["arch"])
        if "activation" in message:
            _stored_activation(ActivationJob(*message["activation"]), arch)
        else:
            _stored(Problem(**message["problem"]), Schedule.from_dict(message["schedule"]), arch)
        return None
    except Exception as exc:  # a candidate that fails is a result, not a crash
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:500]


def _job_message(job, arch: Arch) -> dict:
    """A compile_many job as the worker reads it (JSON)."""
    if isinstance(job, ActivationJob):
        return {"activation": [job.kind, job.k, job.dtype], "arch": arch.name}
    problem, schedule = job
    return {"problem": dataclasses.asdict(problem), "schedule": schedule.to_dict(), "arch": arch.name}


def compile_many(jobs: list, arch: Arch, workers: int | None = None, progress=None) -> dict:
    """Build `jobs` ((problem, schedule) pairs, or ActivationJob) into the store in worker processes
    (runtime/compile_worker.py; each nvcc run takes seconds); returns job -> error or None, and calls
    progress(job, error) as each ends, one call at a time. A caller's compile_schedule (or
    compile_activation_kernel) afterwards only loads. An exception of `progress` (or Ctrl-C) stops the
    workers after their current jobs and is raised here."""
    if not jobs:
        return {}
    pool = CompilePool(workers or min(len(jobs), os.cpu_count() or 2), progress)
    pool.submit(jobs, arch)
    return {job: error for (job, _), error in pool.close().items()}


class CompilePool:
    """compile_many's workers, fed jobs as they come: a model's build starts with its first layers
    and takes the rest as the loader reaches them (runtime/precompile.py). Up to `workers` threads
    (one per core by default), each owning a worker process, start as jobs arrive and take them in
    order, whatever arch each is for (a worker builds for any), so that one process never runs more
    compilers than cores; progress(job, error) follows each job, one call at a time. An exception of
    `progress`, or cancel(), stops the workers after their current jobs, and close() raises the
    exception."""

    def __init__(self, workers: int | None = None, progress=None):
        self._limit = max(1, workers or os.cpu_count() or 2)
        self._progress = progress
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._submitted = 0
        self._threads: list[threading.Thread] = []
        self._results: dict = {}
        self._done = threading.Lock()
        self._stop = threading.Event()
        self._raised: list[BaseException] = []
        self._ended = False

    def submit(self, jobs, arch: Arch) -> None:
        """Queue jobs for `arch` behind those submitted before; a worker starts for each up to the
        limit. Raises RuntimeError once end_jobs() (or close()) has run: no worker would take them."""
        if self._ended:
            raise RuntimeError("this compile pool is closed: it takes no more jobs")
        for job in jobs:
            self._pending.put((job, arch))
            self._submitted += 1
        while len(self._threads) < min(self._limit, self._submitted):
            thread = threading.Thread(target=_serve_jobs, args=(self._pending, self._finish, self._stop), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _finish(self, job, arch: Arch, error) -> None:
        with self._done:
            self._results[job, arch] = error
            try:
                if self._progress is not None:
                    self._progress(job, error)
            except BaseException as exc:    # the caller's: stop, and raise it in the caller's thread
                self._raised.append(exc)
                self._stop.set()

    def cancel(self) -> None:
        """No worker takes another job; close() still waits for their current ones."""
        self._stop.set()

    def end_jobs(self) -> None:
        """No more jobs: one end mark per worker thread, behind every job (once)."""
        if not self._ended:
            self._ended = True
            for _ in self._threads:
                self._pending.put(None)

    def close(self) -> dict:
        """Wait for every submitted job (or, once stopped, for the current ones); (job, arch) -> error or
        None. Raises what `progress` raised."""
        try:
            self.end_jobs()
            for thread in self._threads:
                thread.join()
        finally:
            self._stop.set()      # Ctrl-C: no worker takes another job, each exits after its current one
        if self._raised:
            raise self._raised[0]
        return self._results


REPLY = "tilemarlin-compile-worker:"   # marks the answers among anything else a worker may print


def _serve_jobs(pending: queue.SimpleQueue, finish, stop: threading.Event) -> None:
    """One worker process's share: (job, arch) pairs off the queue until its end mark (None) or `stop`.
    A worker that dies (killed for memory, say) fails its job with its exit code and last words; the
    next job starts another."""
    worker = None
    try:
        while not stop.is_set():
            item = pending.get()
            if item is None or stop.is_set():      # the pool's end mark, or stopped while waiting
                return
            job, arch = item
            try:
                worker = worker or _start_worker()
            except OSError as exc:
                finish(job, arch, f"cannot start a compile worker: {exc}")
                continue
            answer = _ask(worker, _job_message(job, arch))
            if answer is not None:
                finish(job, arch, answer["error"])
                continue
            finish(job, arch, _obituary(worker))
            worker = None
    finally:
        if worker is not None:
            _close(worker)
            worker.log.close()


def _ask(worker: subprocess.Popen, job: dict) -> dict | None:
    """Send one job; the worker's answer ({"error": message or None}), or None when it died first."""
    try:
        worker.stdin.write(json.dumps(job) + "\n")
        worker.stdin.flush()
        for line in worker.stdout:          # lines without the mark are someone else's output
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
    except OSError:                         # its stdin closed under us: it died
        pass
    return None


def _start_worker() -> subprocess.Popen:
    # A plain child, not a multiprocessing one: those import the caller's main script first.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    log = tempfile.TemporaryFile()       # its stderr: read back only if it dies
    try:
        worker = subprocess.Popen([sys.executable, "-m", "runtime.compile_worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    except BaseException:
        log.close()
        raise
    worker.log = log
    return worker


def _close(worker: subprocess.Popen) -> int:
    """Close the worker's stdin (it exits after its job) and wait for it; its exit code."""
    with contextlib.suppress(OSError):    # a dead worker's pipe is broken
        worker.stdin.close()
    code = worker.wait()
    worker.stdout.close()
    return code


def _obituary(worker: subprocess.Popen) -> str:
    code = _close(worker)
    worker.log.seek(0)
    last = worker.log.read().decode(errors="replace").strip().splitlines()[-3:]
    worker.log.close()
    return f"compile worker died (exit code {code})" + (f": {' | '.join(last)}" if last else "")