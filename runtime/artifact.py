"""Deployment artifacts: a model's tuned entries and compiled kernels in one file, built once (by
`gen export`) and loaded by every machine of a serving fleet, which then compiles nothing.

An artifact is a gzip'd tar holding

- `manifest.json`: the format, what was exported (`about`: model, shapes, buckets), the table and
  kernel paths, and `built_with`, everything that decides whether its kernels are the ones this
  machine would build and can load: tilemarlin's version, the fingerprint of the kernel code
  (schedules/, templates/), TileLang's version, the CUDA toolkit that built the kernels (from their
  meta.json), the CUDA and torch versions (as the tuned tables record them), and the GPU (name, arch,
  SM count) of the tuned table;
- `tuned/<gpu slug>.json`: the tuned table's entries for the exported (problem, bucket) pairs;
- `kernels/<arch>/<problem>/<schedule>-<hash>/{kernel.so, kernel.cu, meta.json}`: the store's
  entries, under the folder names the store finds them by (runtime/kernels.py: the hash of their
  identity).

`load_artifact(path)` reads only members of exactly those names (no absolute paths, no `..`, no
links), compares `built_with` with this machine and refuses, naming every field that differs, then
unpacks into the cache root (TILEMARLIN_CACHE_DIR, else the default): each kernel folder renamed into
the store whole, the entries written into this GPU's tuned table over those of the same keys. A
machine without nvcc skips the toolkit comparison, as the store does: it can only load what was built.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

FORMAT = "tilemarlin-kernel-artifact"
SCHEMA = 1
MANIFEST = "manifest.json"
KERNEL_FILES = ("kernel.so", "kernel.cu", "meta.json")

# built_with's fields, in the order a refusal names them, with their names in a message.
FIELDS = {"tilemarlin": "tilemarlin", "kernel_code": "kernel code (schedules/, templates/)", "tilelang": "TileLang",
          "cuda_toolkit": "CUDA toolkit", "cuda": "CUDA", "torch": "torch", "gpu": "GPU", "arch": "arch",
          "sm_count": "SM count"}
_GPU_FIELDS = ("gpu", "arch", "sm_count")
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"        # a path component that cannot be '.' or '..'
_TABLE_PATH = re.compile(rf"tuned/{_NAME}\.json")
_KERNEL_PATH = re.compile(rf"kernels(/{_NAME}){{3}}")


class ArtifactError(ValueError):
    """An artifact that cannot be loaded here; the message says why."""


# --- what an artifact is checked against ---------------------------------------------------------

def this_machine() -> dict:
    """built_with's fields for this machine and its current GPU (cuda_toolkit None without nvcc)."""
    from .kernels import _code_fingerprint, cuda_toolkit
    from .table import GpuKey, current_versions

    try:
        gpu = GpuKey.current()
    except RuntimeError:
        raise ArtifactError("an artifact is checked against this machine's GPU, and no CUDA GPU is visible") from None
    versions = current_versions()
    return {"tilemarlin": versions["tilemarlin"], "kernel_code": _code_fingerprint(), "tilelang": versions["tilelang"],
            "cuda_toolkit": cuda_toolkit(), "cuda": versions["cuda"], "torch": versions["torch"],
            "gpu": gpu.name, "arch": gpu.arch, "sm_count": gpu.sm_count}


def differences(built_with: dict, here: dict) -> list[str]:
    """Every field of `built_with` that differs from `here`, as 'artifact built with CUDA 13.0, this
    machine has 12.8'. A machine without nvcc (cuda_toolkit None) loads whatever toolkit built them."""
    found = []
    for field, label in FIELDS.items():
        if field == "cuda_toolkit" and here[field] is None:
            continue
        if built_with.get(field) != here[field]:
            verb = "for" if field in _GPU_FIELDS else "with"
            found.append(f"artifact built {verb} {label} {built_with.get(field)}, this machine has {here[field]}")
    return found


# --- writing -------------------------------------------------------------------------------------

def write_artifact(out, table, folders: list[Path], about: dict) -> dict:
    """Write an artifact of `table` (a TunedTable: the entries to ship, and the GPU they are for) and
    the store entries `folders` to `out`, atomically; returns its manifest. Raises ArtifactError when
    an entry is incomplete, outside the store, or the entries were not all built alike."""
    from .kernels import cache_root
    from .table import current_versions, now

    if not folders:
        raise ArtifactError("no kernels to export")
    root = cache_root()
    metas = {}
    for folder in folders:
        missing = [name for name in KERNEL_FILES if not (folder / name).is_file()]
        if missing:
            raise ArtifactError(f"store entry {folder} lacks {', '.join(missing)}")
        try:
            relative = folder.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            raise ArtifactError(f"{folder} is not in the store under {root}") from None
        metas[relative] = json.loads((folder / "meta.json").read_text())
    built = {}
    for field, key in (("kernel_code", "code"), ("tilelang", "tilelang"), ("cuda_toolkit", "cuda"), ("arch", "arch")):
        values = sorted({str(meta.get(key)) for meta in metas.values()})
        if len(values) > 1:
            raise ArtifactError(f"the kernels disagree on {FIELDS[field]} ({', '.join(values)}); rebuild them "
                                "alike (gen cache clear --kernels, then gen precompile)")
        built[field] = next(iter(metas.values())).get(key)
    if built["arch"] != table.gpu.arch:
        raise ArtifactError(f"the kernels are for {built['arch']}, the tuned table for {table.gpu.arch}")
    versions = current_versions()
    manifest = {
        "format": FORMAT, "schema": SCHEMA, "created_at": now(), "about": about,
        "built_with": {"tilemarlin": versions["tilemarlin"], "kernel_code": built["kernel_code"],
                       "tilelang": built["tilelang"], "cuda_toolkit": built["cuda_toolkit"],
                       "cuda": versions["cuda"], "torch": versions["torch"],
                       "gpu": table.gpu.name, "arch": table.gpu.arch, "sm_count": table.gpu.sm_count},
        "table": f"tuned/{table.gpu.slug}.json",
        "kernels": sorted(metas),
    }
    out = Path(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            _add(tar, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
            _add(tar, manifest["table"], (json.dumps(table.to_json(), indent=1) + "\n").encode())
            for relative in manifest["kernels"]:
                for name in KERNEL_FILES:
                    _add(tar, f"{relative}/{name}", (root / relative / name).read_bytes())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(data))


# --- loading -------------------------------------------------------------------------------------

def load_artifact(path) -> dict:
    """Check the artifact at `path` against this machine and unpack it into the cache root, so that the
    op serves its kernels without compiling; returns its manifest. Call it before the model is built
    or converted. Raises ArtifactError naming every field that differs (versions, toolkit, GPU), and
    for a file that is not an artifact or holds a member it should not."""
    from .kernels import cache_root

    try:
        tar = tarfile.open(path, "r:gz")
    except (OSError, tarfile.TarError) as exc:
        raise ArtifactError(f"{path} is not a tilemarlin artifact ({exc})") from None
    with tar:
        members = {_checked_name(m): m for m in tar.getmembers()}
        manifest = _read_manifest(tar, members, path)
        _check_contents(members, manifest, path)
        mismatches = differences(manifest["built_with"], this_machine())
        if mismatches:
            raise ArtifactError(f"{path} does not fit this machine: " + "; ".join(mismatches))
        table = _read_table(tar, members[manifest["table"]], path)
        _install_kernels(tar, [members[name] for name in members if name.startswith("kernels/")
                               and members[name].isfile()], manifest["kernels"], cache_root())
    from .op import forget_tables
    from .table import table_path

    table.save(table_path(table.gpu), overwrite=True)
    forget_tables()
    return manifest


def _checked_name(member: tarfile.TarInfo) -> str:
    """The member's name, refused when it could write outside the folder or is not a plain file or folder."""
    name = member.name
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) or ".." in re.split(r"[/\\]", name):
        raise ArtifactError(f"unsafe member {name!r} (an absolute path or '..'); refusing the artifact")
    if not (member.isfile() or member.isdir()):
        raise ArtifactError(f"unsafe member {name!r} (a link or special file); refusing the artifact")
    return name.rstrip("/")


def _read_manifest(tar: tarfile.TarFile, members: dict, path) -> dict:
    if MANIFEST not in members or not members[MANIFEST].isfile():
        raise ArtifactError(f"{path} has no {MANIFEST}: not a tilemarlin artifact")
    try:
        manifest = json.loads(tar.extractfile(members[MANIFEST]).read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a {FORMAT} file")
    if manifest.get("schema") != SCHEMA:
        raise ArtifactError(f"{path} has artifact schema {manifest.get('schema')!r}; this tilemarlin reads {SCHEMA}")
    table, kernels = manifest.get("table"), manifest.get("kernels")
    well_formed = (isinstance(manifest.get("built_with"), dict)
                   and isinstance(table, str) and _TABLE_PATH.fullmatch(table)
                   and isinstance(kernels, list)
                   and all(isinstance(k, str) and _KERNEL_PATH.fullmatch(k) for k in kernels))
    if not well_formed:
        raise ArtifactError(f"{path}: {MANIFEST} is malformed (built_with, table or kernels)")
    return manifest


def _check_contents(members: dict, manifest: dict, path) -> None:
    """Exactly the manifest, its table and its kernels' files (and the folders above them)."""
    files = {MANIFEST, manifest["table"]} | {f"{k}/{name}" for k in manifest["kernels"] for name in KERNEL_FILES}
    folders = {parent.as_posix() for name in files for parent in Path(name).parents} - {"."}
    for name, member in members.items():
        if name not in (files if member.isfile() else folders):
            raise ArtifactError(f"unexpected member {name!r} in {path}; refusing the artifact")
    absent = sorted(files - {name for name, member in members.items() if member.isfile()})
    if absent:
        raise ArtifactError(f"{path} lacks {len(absent)} files its manifest lists, e.g. {absent[0]}")


def _read_table(tar: tarfile.TarFile, member: tarfile.TarInfo, path):
    from .table import TableError, TunedTable

    try:
        table = TunedTable.from_json(json.loads(tar.extractfile(member).read()))
    except (ValueError, UnicodeDecodeError, TableError) as exc:
        raise ArtifactError(f"{path}: its tuned table cannot be read ({exc})") from None
    if table.skipped:
        raise ArtifactError(f"{path}: its tuned table has entries this tilemarlin does not trust: "
                            + "; ".join(table.skipped))
    return table


def _install_kernels(tar: tarfile.TarFile, members: list, kernels: list[str], root: Path) -> None:
    """Extract into a staging folder inside the cache, then rename each kernel folder into the store
    (a reader sees a whole entry or none); an entry the store already holds, current, stays."""
    from .kernels import _is_current
    from .cache_files import writable_folder

    writable_folder(root / "kernels")
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".artifact-"))
    try:
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(staging, members=members, **extra)
        for relative in kernels:
            folder = root / relative
            if _is_current(folder):
                continue
            folder.parent.mkdir(parents=True, exist_ok=True)
            old = folder.with_name(f"{folder.name}.{os.getpid()}.old")
            if folder.exists():        # stale or incomplete: moved aside, then removed
                os.replace(folder, old)
            os.replace(staging / relative, folder)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
