"""The tuned table: which schedule won for each (problem, M bucket) on one GPU, and how fast it ran.

One JSON file per GPU (named by GpuKey.slug) under cache_root()/tuned/. It records the schema
version, the GPU, the versions of tilemarlin, TileLang, CUDA and torch it was tuned with, and per
entry the problem, the bucket, the winning schedule, its time and every candidate's timing or
failure, and the harness that timed them when it is not the default (gen/measure.py: "between",
each call after the activations' producer; absent means back-to-back replays). A file that cannot
be parsed, has another schema, was tuned for another GPU or with another TileLang (the kernels it
names would compile differently) is reported with a warning and ignored: the runtime then falls
back to the cost model, which is slower but never wrong.

Tuners save under a file lock and merge with what is on disk, so two tuners running at once (say,
one per model) keep each other's entries; the file is replaced atomically, so a reader never sees
half of it.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from schedules.problem import Problem
from schedules.registry import Schedule

SCHEMA_VERSION = 1
FORMAT = "tilemarlin-tuned-table"

# Decode (1..16) needs fine buckets: the kernel's block_m and split-K change there. Prefill only
# needs powers of two. The last bucket also serves every M above it.
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# How a bucket's candidates were timed (gen/measure.py): replayed back to back, or each call after the
# activations' producer.
REPLAY, BETWEEN = "replay", "between"
HARNESSES = (REPLAY, BETWEEN)


def bucket_of(m: int) -> int:
    """The smallest bucket edge >= m; M above the last edge falls in the last bucket."""
    if m < 1:
        raise ValueError(f"M must be at least 1, got {m}")
    for edge in BUCKETS:
        if m <= edge:
            return edge
    return BUCKETS[-1]


def bucket_range(bucket: int) -> tuple[int, int | None]:
    """(smallest M, largest M) served by `bucket`; the largest is None for the open last bucket."""
    i = BUCKETS.index(bucket)
    low = BUCKETS[i - 1] + 1 if i else 1
    return low, (None if bucket == BUCKETS[-1] else bucket)


class TableError(ValueError):
    """A tuned-table file that cannot be trusted; the message says why."""


class TableWarning(UserWarning):
    """A tuned-table file was ignored or replaced."""


@dataclass(frozen=True)
class GpuKey:
    """What a tuned table is valid for: same GPU model, arch and SM count (MIG slices differ)."""

    name: str
    arch: str
    sm_count: int

    @classmethod
    def current(cls, device=None) -> "GpuKey":
        import torch

        from schedules.arch import current_arch

        arch = current_arch(device)  # raises a clear error without CUDA
        props = torch.cuda.get_device_properties(device)
        return cls(name=props.name, arch=arch.name, sm_count=props.multi_processor_count)

    @property
    def slug(self) -> str:
        """A filename-safe name, e.g. 'nvidia-h200_sm_90a_132sm'."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "gpu"
        return f"{name}_{self.arch}_{self.sm_count}sm"

    def to_dict(self) -> dict:
        return {"name": self.name, "arch": self.arch, "sm_count": self.sm_count}


def _tilemarlin_version() -> str:
    try:
        return importlib.metadata.version("tilemarlin")
    except importlib.metadata.PackageNotFoundError:  # a source checkout: read pyproject.toml
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def current_versions() -> dict[str, str]:
    """The versions a table tuned now would be tuned with."""
    import torch

    try:
        tilelang = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        tilelang = "unknown"
    return {"tilemarlin": _tilemarlin_version(), "tilelang": tilelang,
            "cuda": str(torch.version.cuda), "torch": torch.__version__}


@dataclass
class Entry:
    """The winner of one (problem, bucket): its schedule, median us per call at the bucket's upper
    edge, FP16 torch.matmul's time in the same run, achieved GB/s, every candidate's result, and the
    harness that timed them (one of HARNESSES)."""

    schedule: Schedule
    us: float
    fp16_us: float | None = None
    gbps: float | None = None
    all_timings: list[dict] = field(default_factory=list)
    harness: str = REPLAY

    def __post_init__(self):
        if self.harness not in HARNESSES:
            raise ValueError(f"harness {self.harness!r} is not one of {HARNESSES}")

    @property
    def speedup(self) -> float | None:
        return self.fp16_us / self.us if self.fp16_us else None


def _problem_dict(p: Problem) -> dict:
    return {"n": p.n, "k": p.k, "group": p.group, "dtype": p.dtype, "bits": p.bits}


class TunedTable:
    """Entries keyed by (problem, bucket) for one GPU."""

    def __init__(self, gpu: GpuKey | None = None, versions: dict | None = None):
        self.gpu = gpu
        self.versions = dict(versions) if versions else {}
        self._entries: dict[tuple[Problem, int], Entry] = {}
        self._recorded: set[tuple[Problem, int]] = set()   # what this process adds on save

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[tuple[Problem, int], Entry]]:
        """Entries sorted by problem and bucket."""
        return sorted(self._entries.items(), key=lambda kv: (tuple(_problem_dict(kv[0][0]).values()), kv[0][1]))

    def entry(self, problem: Problem, bucket: int) -> Entry | None:
        return self._entries.get((problem, bucket))

    def lookup(self, problem: Problem, m: int) -> Schedule | None:
        """The tuned schedule for `problem` at M = m, or None when its bucket was not tuned."""
        found = self._entries.get((problem, bucket_of(m)))
        return found.schedule if found else None

    def record(self, problem: Problem, bucket: int, schedule: Schedule, us: float, **extra) -> None:
        """Set the winner of (problem, bucket); `extra` are Entry's other fields."""
        if bucket not in BUCKETS:
            raise ValueError(f"{bucket} is not a bucket edge; buckets are {BUCKETS}")
        self._entries[(problem, bucket)] = Entry(schedule=schedule, us=float(us), **extra)
        self._recorded.add((problem, bucket))

    # --- files -------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "schema": SCHEMA_VERSION,
            "gpu": self.gpu.to_dict() if self.gpu else None,
            "versions": self.versions,
            "entries": [
                {"problem": _problem_dict(p), "bucket": b, "schedule": e.schedule.to_dict(), "us": e.us,
                 "fp16_us": e.fp16_us, "gbps": e.gbps, "all_timings": e.all_timings,
                 **({"harness": e.harness} if e.harness != REPLAY else {})}
                for (p, b), e in self.items()
            ],
        }

    @classmethod
    def read(cls, path) -> "TunedTable":
        """Parse a table file as it is, stale or not; raises TableError when it cannot be parsed."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise TableError(f"not valid JSON ({exc}); the file is corrupt or truncated") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise TableError(f"cannot be read ({exc})") from None
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data) -> "TunedTable":
        """A table from a parsed table file, stale or not; raises TableError when it is not one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TableError(f"not a tilemarlin tuned table (format field {_field(data, 'format')!r})")
        if data.get("schema") != SCHEMA_VERSION:
            raise TableError(f"table schema {data.get('schema')!r}, this tilemarlin reads schema {SCHEMA_VERSION}")
        try:
            if not isinstance(data["versions"], dict):
                raise TypeError("'versions' is not an object")
            table = cls(GpuKey(**data["gpu"]), versions=data["versions"])
            entries = data["entries"]
        except (KeyError, TypeError) as exc:
            raise TableError(f"missing or malformed header field ({type(exc).__name__}: {exc})") from None
        for i, e in enumerate(entries if isinstance(entries, list) else [None]):
            try:
                bucket = int(e["bucket"])
                if bucket not in BUCKETS:
                    raise ValueError(f"bucket {bucket} is not one of {BUCKETS}")
                table._entries[(Problem(**e["problem"]), bucket)] = Entry(
                    schedule=Schedule.from_dict(e["schedule"]), us=float(e["us"]), fp16_us=e.get("fp16_us"),
                    gbps=e.get("gbps"), all_timings=list(e.get("all_timings", [])),
                    harness=e.get("harness", REPLAY))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise TableError(f"entry {i} is malformed ({type(exc).__name__}: {exc})") from None
        return table

    def stale_reason(self, gpu: GpuKey | None = None) -> str | None:
        """Why this table's kernels cannot be trusted now (other TileLang, other GPU), or None."""
        tilelang_now = current_versions()["tilelang"]
        if self.versions.get("tilelang") != tilelang_now:
            return f"stale: tuned with TileLang {self.versions.get('tilelang')}, this is TileLang {tilelang_now}"
        if gpu is not None and self.gpu != gpu:
            return f"tuned for {self.gpu}, not for {gpu}"
        return None

    @classmethod
    def load(cls, path, gpu: GpuKey | None = None) -> "TunedTable":
        """The table at `path`, or an empty one (for `gpu`) when it is missing or untrusted.

        An untrusted file (corrupt, truncated, other schema, stale, other GPU) is reported with a
        TableWarning naming the file and the problem.
        """
        path = Path(path)
        try:
            table = _read_trusted(path, gpu)
        except TableError as exc:
            warnings.warn(f"ignoring tuned table {path}: {exc}", TableWarning, stacklevel=2)
            table = None
        return table if table is not None else cls(gpu)

    def save(self, path) -> None:
        """Write atomically, merged under a file lock with what other tuners saved meanwhile.

        Entries recorded by this object win; every other entry comes from the file as it is now,
        so a concurrent tuner's newer results are kept and a cleared table stays cleared.
        """
        from filelock import FileLock

        if self.gpu is None:
            raise ValueError("a tuned table needs its GpuKey before it can be saved")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            try:
                on_disk = _read_trusted(path, self.gpu)
            except TableError as exc:
                warnings.warn(f"replacing tuned table {path}: {exc}", TableWarning, stacklevel=2)
                on_disk = None
            merged = dict(on_disk._entries) if on_disk is not None else {}
            merged.update({key: self._entries[key] for key in self._recorded})
            self._entries = merged
            self.versions = current_versions()
            atomic_write(path, json.dumps(self.to_json(), indent=1) + "\n")


def _field(data, name):
    return data.get(name) if isinstance(data, dict) else None


def _read_trusted(path: Path, gpu: GpuKey | None) -> TunedTable | None:
    """The table at `path`, None when missing; TableError when present but untrusted."""
    if not path.exists():
        return None
    table = TunedTable.read(path)
    reason = table.stale_reason(gpu)
    if reason:
        raise TableError(reason)
    return table


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tables_dir() -> Path:
    """The folder of the tuned tables, one JSON file per GPU: cache_root()/tuned."""
    from runtime.kernels import cache_root

    return cache_root() / "tuned"


def table_path(gpu: GpuKey, root=None) -> Path:
    """Where the table of `gpu` lives: <root or tables_dir()>/<gpu.slug>.json."""
    return Path(root if root is not None else tables_dir()) / f"{gpu.slug}.json"


def winners_for_arch(arch: str) -> tuple[Schedule, ...]:
    """The winning schedules of every trusted tuned table for `arch` under tables_dir(), each once,
    in file and entry order: what an untuned shape's fallback chooses from."""
    found: dict[Schedule, None] = {}
    for path in sorted(tables_dir().glob("*.json")):
        try:
            table = _read_trusted(path, None)
        except TableError:
            continue
        if table is not None and table.gpu.arch == arch:
            found.update((entry.schedule, None) for _, entry in table.items())
    return tuple(found)


def load_tuned_table(gpu: GpuKey | None = None) -> TunedTable:
    """The tuned table of `gpu` (this process's GPU when None), empty when there is none."""
    gpu = gpu or GpuKey.current()
    return TunedTable.load(table_path(gpu), gpu)
