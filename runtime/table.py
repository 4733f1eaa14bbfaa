"""The tuned table: which schedule won for each (problem, M bucket) on one GPU, and how fast it ran.

Two JSON files per GPU (named by GpuKey.slug):
- `cache_root()/tuned/<slug>.json`, the winners: per (problem, bucket) the winning schedule, its time,
  FP16's time in the same run, when it was measured and with which harness (gen/timing.py: "between",
  each call after the activations' producer; absent means back-to-back replays). This is what
  serving reads and what the package ships.
- `cache_root()/history/<slug>.json`, every candidate's timing or failure per (problem, bucket), for
  the tuner (re-tunes keep earlier timings), `gen cache show` and `gen modelcheck`. It stays beside
  the winners in a source checkout and is not part of the wheel.

Trust is decided entry by entry. A file that cannot be parsed, has another schema, was tuned for
another GPU or with another tilemarlin or TileLang (the kernels it names would differ) is ignored as
a whole, with a warning. Within a trusted file an entry is skipped, with a warning that names it and
the reason, when its schedule is unknown or its knobs lie outside the family's axes or fail the
family's check on this arch, its times or GB/s are not finite and positive, or it repeats a key; the
other entries are kept. A history file that cannot be read loses its timings only. Another CUDA or
torch than the table's is reported but does not discard it: the kernels are rebuilt by the local
toolkit and checked against the reference before they serve.

Tuners save under a file lock and merge with what is on disk: per (problem, bucket) the more
recent measurement wins, so two tuners running at once keep each other's entries and a tuner never
puts back an older timing over a newer one. Files are replaced atomically: a reader never sees half.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from schedules.problem import Problem
from schedules.registry import Schedule

from .cache_files import atomic_write, table_lock, writable_folder

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)      # schema 1 kept each entry's candidates inline, in one file
FORMAT = "tilemarlin-tuned-table"
HISTORY_FORMAT = "tilemarlin-tuning-history"

# Decode (1..16) needs fine buckets: the kernel's block_m and split-K change there. Prefill only
# needs powers of two. The last bucket also serves every M above it.
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# How a bucket's candidates were timed (gen/timing.py): replayed back to back, or each call after the
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


def now() -> str:
    """A measurement's timestamp: UTC, ISO 8601, to the microsecond (ordered as text)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


class TableError(ValueError):
    """A tuned-table file that cannot be trusted; the message says why."""


class TableWarning(UserWarning):
    """A tuned-table file, or some of its entries, was ignored or replaced."""


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

    from .kernels import tilelang_version

    return {"tilemarlin": _tilemarlin_version(), "tilelang": tilelang_version(),
            "cuda": str(torch.version.cuda), "torch": torch.__version__}


@dataclass
class Entry:
    """The winner of one (problem, bucket): its schedule, median us per call at the bucket's upper
    edge, FP16 torch.matmul's time in the same run, achieved GB/s, when it was measured, every
    candidate's result (the history), and the harness that timed them (one of HARNESSES)."""

    schedule: Schedule
    us: float
    fp16_us: float | None = None
    gbps: float | None = None
    all_timings: list[dict] = field(default_factory=list)
    harness: str = REPLAY
    measured_at: str = ""       # empty: unknown, older than any timestamp

    def __post_init__(self):
        if self.harness not in HARNESSES:
            raise ValueError(f"harness {self.harness!r} is not one of {HARNESSES}")
        if not _positive_finite(self.us) or (self.fp16_us is not None and not _positive_finite(self.fp16_us)):
            raise ValueError(f"times must be finite and positive, got us={self.us!r}, fp16_us={self.fp16_us!r}")
        if self.gbps is not None and not _positive_finite(self.gbps):
            raise ValueError(f"GB/s must be finite and positive, got gbps={self.gbps!r}")

    @property
    def speedup(self) -> float | None:
        return self.fp16_us / self.us if self.fp16_us else None


def _positive_finite(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:      # an integer past float's range
        return False


def _timings(value) -> list[dict]:
    """A file's list of candidate results; anything else is a TypeError."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise TypeError(f"all_timings is not a list of objects: {str(value)[:80]}")
    return list(value)


def _problem_dict(p: Problem) -> dict:
    """The problem's fields as a table entry keeps them; zero_points and act only where they are not
    the default, so that the symmetric W4A16 entries read as they always have."""
    fields = {"n": p.n, "k": p.k, "group": p.group, "dtype": p.dtype, "bits": p.bits}
    if p.zero_points:
        fields["zero_points"] = True
    if p.act != "dtype":
        fields["act"] = p.act
    return fields


def knobs_reason(schedule: Schedule, problem: Problem, arch_name: str) -> str | None:
    """Why a schedule read from a file cannot be trusted: a knob of the wrong type or outside its
    family's axes (as defined, or as a tune's --axes set them for its run), or the family's check on
    `arch_name`; None when it can."""
    from schedules.arch import get_arch
    from schedules.registry import DEFINED_AXES

    fam = schedule.module
    defaults = {f.name: f.default for f in dataclasses.fields(fam.Knobs)}
    for name, values in fam.AXES.items():
        # The axis values, and the knob's default (a form a search may have left out of the axes
        # once it stopped winning, while tuned winners still use it).
        allowed = (tuple(values) + tuple(DEFINED_AXES[fam.NAME][name])
                   + ((defaults[name],) if name in defaults else ()))
        value = getattr(schedule.knobs, name)
        if not any(_same_typed(value, a) for a in allowed):
            return f"knob {name}={value!r} is not one of the {fam.NAME} axis values {tuple(values)}"
    return fam.check(problem, schedule.knobs, get_arch(arch_name))


def _same_typed(value, allowed) -> bool:
    """value == allowed with the same types throughout (1.0 and True are not 1; tuples element by element)."""
    if isinstance(allowed, tuple):
        return (isinstance(value, tuple) and len(value) == len(allowed)
                and all(_same_typed(v, a) for v, a in zip(value, allowed)))
    return type(value) is type(allowed) and value == allowed


class TunedTable:
    """Entries keyed by (problem, bucket) for one GPU."""

    def __init__(self, gpu: GpuKey | None = None, versions: dict | None = None):
        self.gpu = gpu
        self.versions = dict(versions) if versions else {}
        self.skipped: list[str] = []         # why entries of the file it was read from were left out
        self._entries: dict[tuple[Problem, int], Entry] = {}
        self._recorded: set[tuple[Problem, int]] = set()   # what this process adds on save

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[tuple[Problem, int], Entry]]:
        """Entries sorted by problem and bucket."""
        return sorted(self._entries.items(), key=lambda kv: (dataclasses.astuple(kv[0][0]), kv[0][1]))

    def entry(self, problem: Problem, bucket: int) -> Entry | None:
        return self._entries.get((problem, bucket))

    def lookup(self, problem: Problem, m: int) -> Schedule | None:
        """The tuned schedule for `problem` at M = m, or None when its bucket was not tuned."""
        found = self._entries.get((problem, bucket_of(m)))
        return found.schedule if found else None

    def record(self, problem: Problem, bucket: int, schedule: Schedule, us: float, **extra) -> None:
        """Set the winner of (problem, bucket), measured now; `extra` are Entry's other fields."""
        if bucket not in BUCKETS:
            raise ValueError(f"{bucket} is not a bucket edge; buckets are {BUCKETS}")
        extra.setdefault("measured_at", now())
        self._entries[(problem, bucket)] = Entry(schedule=schedule, us=float(us), **extra)
        self._recorded.add((problem, bucket))

    def overlay(self, other: "TunedTable") -> None:
        """Take `other`'s entries, replacing this table's of the same keys, and its versions when it
        has entries (a table read beneath another: the shipped one beneath the user's)."""
        if len(other):
            self._entries.update(other._entries)
            self.versions = dict(other.versions)
        self.skipped += other.skipped

    # --- files -------------------------------------------------------------------------------

    def _header(self, fmt: str) -> dict:
        return {"format": fmt, "schema": SCHEMA_VERSION, "gpu": self.gpu.to_dict() if self.gpu else None,
                "versions": self.versions}

    def to_json(self) -> dict:
        """The winners file."""
        return {**self._header(FORMAT), "entries": [
            {"problem": _problem_dict(p), "bucket": b, "schedule": e.schedule.to_dict(), "us": e.us,
             "fp16_us": e.fp16_us, "gbps": e.gbps, "measured_at": e.measured_at,
             **({"harness": e.harness} if e.harness != REPLAY else {})}
            for (p, b), e in self.items()]}

    def history_json(self) -> dict:
        """The history file: every entry's candidates."""
        return {**self._header(HISTORY_FORMAT), "entries": [
            {"problem": _problem_dict(p), "bucket": b, "measured_at": e.measured_at, "all_timings": e.all_timings}
            for (p, b), e in self.items() if e.all_timings]}

    @classmethod
    def read(cls, path, history: bool = False) -> "TunedTable":
        """Parse a table file as it is, stale or not, with its history file when `history`; raises
        TableError when it cannot be parsed. Entries that cannot be trusted are left out and named in
        `skipped`."""
        table = cls.from_json(_read_json(Path(path)))
        if history:
            hist = history_path_of(Path(path))
            if hist.exists():
                try:
                    table.add_history(_read_json(hist))
                except TableError as exc:     # the winners stand, without their candidates' timings
                    warnings.warn(f"tuned table {path}: ignoring its history {hist}: {exc}", TableWarning,
                                  stacklevel=2)
        return table

    @classmethod
    def from_json(cls, data) -> "TunedTable":
        """A table from a parsed winners file, stale or not; raises TableError when it is not one."""
        table = cls._from_header(data, FORMAT)
        for i, e in enumerate(data["entries"]):
            try:
                key, entry = _parse_entry(e, table.gpu.arch)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                table.skipped.append(f"entry {i} {_entry_name(e)}: {exc}")
                continue
            if key in table._entries:
                table.skipped.append(f"entry {i} {_entry_name(e)}: repeats an earlier entry's key")
                continue
            table._entries[key] = entry
        return table

    @classmethod
    def _from_header(cls, data, fmt: str) -> "TunedTable":
        if not isinstance(data, dict) or data.get("format") != fmt:
            raise TableError(f"not a {fmt} file (format field {_field(data, 'format')!r})")
        if data.get("schema") not in READABLE_SCHEMAS:
            raise TableError(f"table schema {data.get('schema')!r}, this tilemarlin reads schemas {READABLE_SCHEMAS}")
        try:
            if not isinstance(data["versions"], dict) or not isinstance(data["entries"], list):
                raise TypeError("'versions' is not an object or 'entries' not a list")
            return cls(GpuKey(**data["gpu"]), versions=data["versions"])
        except (KeyError, TypeError) as exc:
            raise TableError(f"missing or malformed header field ({type(exc).__name__}: {exc})") from None

    def add_history(self, data) -> None:
        """Attach a history file's timings to the entries measured at the same time."""
        history = TunedTable._from_header(data, HISTORY_FORMAT)
        if history.gpu != self.gpu:
            raise TableError(f"the history is of {history.gpu}, the table of {self.gpu}")
        for h in data["entries"]:
            try:
                key = (Problem(**h["problem"]), int(h["bucket"]))
                entry = self._entries.get(key)
                if entry is not None and entry.measured_at == h.get("measured_at", ""):
                    entry.all_timings = _timings(h["all_timings"])
            except (KeyError, TypeError, ValueError):
                continue      # a history record that does not parse only loses its timings

    def stale_reason(self, gpu: GpuKey | None = None) -> str | None:
        """Why this table's kernels cannot be trusted now (other tilemarlin or TileLang, other GPU)."""
        now_versions = current_versions()
        for name, label in (("tilemarlin", "tilemarlin"), ("tilelang", "TileLang")):
            if self.versions.get(name) != now_versions[name]:
                return f"stale: tuned with {label} {self.versions.get(name)}, this is {label} {now_versions[name]}"
        if gpu is not None and self.gpu != gpu:
            return f"tuned for {self.gpu}, not for {gpu}"
        return None

    def version_notes(self) -> list[str]:
        """The versions that differ from this process's but leave the table usable (CUDA, torch)."""
        now_versions = current_versions()
        return [f"tuned with {name} {self.versions.get(name)}, this is {name} {now_versions[name]}"
                for name in ("cuda", "torch") if self.versions.get(name) != now_versions[name]]

    @classmethod
    def load(cls, path, gpu: GpuKey | None = None, history: bool = False) -> "TunedTable":
        """The table at `path`, or an empty one (for `gpu`) when it is missing or untrusted.

        An untrusted file (corrupt, truncated, other schema, stale, other GPU) is reported with a
        TableWarning naming the file and the problem; so are skipped entries and version differences.
        """
        path = Path(path)
        try:
            table = _read_trusted(path, gpu, history)
        except TableError as exc:
            warnings.warn(f"ignoring tuned table {path}: {exc}", TableWarning, stacklevel=2)
            table = None
        if table is None:
            return cls(gpu)
        if table.skipped:
            warnings.warn(f"tuned table {path}: skipped {len(table.skipped)} entries: " + "; ".join(table.skipped),
                          TableWarning, stacklevel=2)
        notes = table.version_notes()
        if notes and gpu is not None:
            warnings.warn(f"tuned table {path}: {'; '.join(notes)}; its kernels are rebuilt here and checked "
                          "against the reference before they serve, but the timings may not hold",
                          TableWarning, stacklevel=2)
        return table

    def subset(self, keys) -> "TunedTable":
        """A table of the same GPU and versions with only the entries of these (problem, bucket) keys
        (those it holds), without their history: what a deployment artifact ships."""
        part = TunedTable(self.gpu, self.versions)
        part._entries = {key: dataclasses.replace(self._entries[key], all_timings=[])
                         for key in keys if key in self._entries}
        return part

    def save(self, path, overwrite: bool = False) -> None:
        """Write the winners and the history atomically, merged under a file lock with what other
        tuners saved meanwhile: per key, the more recent measurement wins (see the module docstring).
        With `overwrite` every entry of this table wins whatever its age: installing a deployment
        artifact, whose kernels were built for exactly these entries."""
        if self.gpu is None:
            raise ValueError("a tuned table needs its GpuKey before it can be saved")
        path = Path(path)
        history = history_path_of(path)
        for folder in (path.parent, history.parent):
            writable_folder(folder)
        with table_lock(path):
            try:
                on_disk = _read_trusted(path, self.gpu, history=True)
            except TableError as exc:
                warnings.warn(f"replacing tuned table {path}: {exc}", TableWarning, stacklevel=2)
                on_disk = None
            merged = dict(on_disk._entries) if on_disk is not None else {}
            for key in set(self._entries) if overwrite else self._recorded:
                theirs = merged.get(key)
                if overwrite or theirs is None or self._entries[key].measured_at >= theirs.measured_at:
                    merged[key] = self._entries[key]
            self._entries = merged
            self.versions = current_versions()
            atomic_write(history, json.dumps(self.history_json(), indent=1) + "\n")
            atomic_write(path, json.dumps(self.to_json(), indent=1) + "\n")


def _parse_entry(e: dict, arch: str) -> tuple[tuple[Problem, int], Entry]:
    bucket = e["bucket"]
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket not in BUCKETS:
        raise ValueError(f"bucket {bucket!r} is not one of {BUCKETS}")
    problem = Problem(**e["problem"])
    schedule = Schedule.from_dict(e["schedule"])
    reason = knobs_reason(schedule, problem, arch)
    if reason:
        raise ValueError(f"{schedule.name}: {reason}")
    measured_at = e.get("measured_at", "")
    if not isinstance(measured_at, str):
        raise ValueError(f"measured_at {measured_at!r} is not a timestamp")
    entry = Entry(schedule=schedule, us=e["us"], fp16_us=e.get("fp16_us"), gbps=e.get("gbps"),
                  harness=e.get("harness", REPLAY), measured_at=measured_at,
                  all_timings=_timings(e.get("all_timings", [])))
    return (problem, bucket), entry


def _entry_name(e) -> str:
    try:
        return f"({Problem(**e['problem']).name}, bucket {e['bucket']})"
    except Exception:      # noqa: BLE001 - naming a malformed entry must not fail
        return "(unreadable problem or bucket)"


def _field(data, name):
    return data.get(name) if isinstance(data, dict) else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TableError(f"{path.name} is not valid JSON ({exc}); the file is corrupt or truncated") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TableError(f"{path.name} cannot be read ({exc})") from None


def _read_trusted(path: Path, gpu: GpuKey | None, history: bool = False) -> TunedTable | None:
    """The table at `path`, None when missing; TableError when present but untrusted."""
    if not path.exists():
        return None
    table = TunedTable.read(path, history)
    reason = table.stale_reason(gpu)
    if reason:
        raise TableError(reason)
    return table


def tables_dir() -> Path:
    """The folder of the tuned tables (winners) that tune writes, one JSON file per GPU:
    cache_root()/tuned."""
    from .kernels import cache_root

    return cache_root() / "tuned"


def shipped_tables_dir() -> Path:
    """The tables that ship with tilemarlin: the package's own cache/tuned."""
    return Path(__file__).resolve().parent.parent / "cache" / "tuned"


def table_folders() -> list[Path]:
    """Where tuned tables are read, the lowest precedence first: the shipped tables, then tables_dir()
    where TILEMARLIN_CACHE_DIR moves it elsewhere. A moved cache (a read-only install, a shared
    volume) keeps the shipped entries; what is tuned into it wins."""
    shipped, own = shipped_tables_dir(), tables_dir()
    return [shipped] if own.resolve() == shipped else [shipped, own]


def table_files() -> list[Path]:
    """Every table file of table_folders(), in precedence order."""
    return [path for folder in table_folders() if folder.is_dir() for path in sorted(folder.glob("*.json"))]


def history_path_of(table: Path) -> Path:
    """The history file beside a winners file: <root>/history/<same name>."""
    return table.parent.parent / "history" / table.name


def table_path(gpu: GpuKey, root=None) -> Path:
    """Where the table of `gpu` lives: <root or tables_dir()>/<gpu.slug>.json."""
    return Path(root if root is not None else tables_dir()) / f"{gpu.slug}.json"


def winners_for_arch(arch: str) -> tuple:
    """The winners (runtime.fallback.TunedWinner: problem, bucket, schedule) of every trusted tuned
    table for `arch` in table_folders() (each table's, so another GPU of the arch adds its winners
    and replaces none): what an untuned shape's fallback chooses from."""
    from .fallback import TunedWinner

    found: dict[tuple, TunedWinner] = {}
    for path in table_files():
        try:
            table = _read_trusted(path, None)
        except TableError:
            continue
        if table is not None and table.gpu.arch == arch:
            found.update(((path, p, b), TunedWinner(p, b, entry.schedule)) for (p, b), entry in table.items())
    return tuple(found.values())


def load_tuned_table(gpu: GpuKey | None = None) -> TunedTable:
    """The tuned table of `gpu` (this process's GPU when None), empty when there is none: the table
    of each of table_folders() in turn, an entry of a later one replacing the same key's."""
    gpu = gpu or GpuKey.current()
    merged = TunedTable(gpu)
    for folder in table_folders():
        merged.overlay(TunedTable.load(table_path(gpu, folder), gpu))
    return merged
