"""Deployment artifacts: a model's tuned entries and compiled kernels in one file, built once (by
`gen export`) and loaded by every machine of a serving fleet, which then compiles nothing.

An artifact is a gzip'd tar holding

- `manifest.json`: the format, what was exported (`about`: model, shapes, buckets, forms), the table
  and kernel paths, the sha256 of every other file, and `built_with`, everything that decides whether
  its kernels are the ones this machine would build and can load: tilemarlin's version, the
  fingerprint of the kernel code (schedules/, templates/), TileLang's version, the CUDA toolkit that
  built the kernels (from their meta.json), the CUDA and torch versions of the exporting machine (of
  the machine the table was tuned on where the exporting torch has no CUDA: a build host without a
  GPU exports for the servers), and the GPU (name, arch, SM count) of the tuned table;
- `tuned/<gpu slug>.json`: the tuned table's entries for the exported (problem, bucket) pairs;
- `kernels/<arch>/<problem>/<schedule>-<hash>/{kernel.so, kernel.cu, meta.json}`: the store's
  entries, under the folder names the store finds them by (runtime/kernels.py: the hash of their
  identity).

`load_artifact(path)` reads only members of exactly those names (no absolute paths, no `..`, no
links) whose bytes match their sha256, compares `built_with` with this machine and refuses, naming
every field that differs, then unpacks into the cache root (TILEMARLIN_CACHE_DIR, else the default):
each kernel folder whose files differ from the artifact's renamed into the store whole, the entries
written into this GPU's tuned table over those of the same keys where they differ. Loading an
artifact that is in place already writes nothing, so a read-only cache loads it at every start. A
machine without nvcc skips the toolkit comparison, as the store does: it can only load what was built.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

FORMAT = "tilemarlin-kernel-artifact"
SCHEMA = 2          # 2: the sha256 of every file
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
    except ValueError as exc:     # a GPU of an arch that tilemarlin has no kernels for
        raise ArtifactError(f"this machine's GPU cannot load an artifact: {exc}") from None
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
    import torch

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
    if torch.version.cuda is None:       # a build host without CUDA torch exports for the tune's machines
        versions.update({k: v for k, v in table.versions.items() if k in ("cuda", "torch")})
    files = {f"tuned/{table.gpu.slug}.json": (json.dumps(table.to_json(), indent=1) + "\n").encode()}
    files.update({f"{relative}/{name}": (root / relative / name).read_bytes()
                  for relative in sorted(metas) for name in KERNEL_FILES})
    manifest = {
        "format": FORMAT, "schema": SCHEMA, "created_at": now(), "about": about,
        "built_with": {"tilemarlin": versions["tilemarlin"], "kernel_code": built["kernel_code"],
                       "tilelang": built["tilelang"], "cuda_toolkit": built["cuda_toolkit"],
                       "cuda": versions["cuda"], "torch": versions["torch"],
                       "gpu": table.gpu.name, "arch": table.gpu.arch, "sm_count": table.gpu.sm_count},
        "table": f"tuned/{table.gpu.slug}.json",
        "kernels": sorted(metas),
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    out = Path(out)
    if out.is_dir() or not out.parent.is_dir():
        raise ArtifactError(f"cannot write {out}: " + ("it is a folder" if out.is_dir() else
                                                        f"no folder {out.parent}"))
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            _add(tar, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
            for name, data in files.items():
                _add(tar, name, data)
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
    for a file that is not an artifact, is damaged or holds a member it should not."""
    from .kernels import cache_root
    from .dispatch import forget_tables
    from .table import table_path

    contents, folders = _read_members(path)
    manifest = _read_manifest(contents, path)
    _check_contents(contents, folders, manifest, path)
    mismatches = differences(manifest["built_with"], this_machine())
    if mismatches:
        raise ArtifactError(f"{path} does not fit this machine: " + "; ".join(mismatches))
    table = _read_table(contents[manifest["table"]], manifest, path)
    _install_kernels(contents, manifest, cache_root())
    if not _holds_entries(table):
        table.save(table_path(table.gpu), overwrite=True)
        forget_tables()
    return manifest


def _read_members(path) -> tuple[dict[str, bytes], set[str]]:
    """(file name -> bytes, folder names) of the archive, names checked (_checked_name); ArtifactError
    for a file that is not a gzip'd tar or is truncated or damaged."""
    contents, folders = {}, set()
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                name = _checked_name(member)
                if member.isfile():
                    contents[name] = tar.extractfile(member).read()
                else:
                    folders.add(name)
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        raise ArtifactError(f"{path} is not a tilemarlin artifact, or is truncated or damaged "
                            f"({type(exc).__name__}: {exc})") from None
    return contents, folders


def _checked_name(member: tarfile.TarInfo) -> str:
    """The member's name, refused when it could write outside the folder or is not a plain file or folder."""
    name = member.name
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) or ".." in re.split(r"[/\\]", name):
        raise ArtifactError(f"unsafe member {name!r} (an absolute path or '..'); refusing the artifact")
    if not (member.isfile() or member.isdir()):
        raise ArtifactError(f"unsafe member {name!r} (a link or special file); refusing the artifact")
    return name.rstrip("/")


def _read_manifest(contents: dict, path) -> dict:
    if MANIFEST not in contents:
        raise ArtifactError(f"{path} has no {MANIFEST}: not a tilemarlin artifact")
    try:
        manifest = json.loads(contents[MANIFEST])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a {FORMAT} file")
    if manifest.get("schema") != SCHEMA:
        raise ArtifactError(f"{path} has artifact schema {manifest.get('schema')!r}; this tilemarlin reads {SCHEMA} "
                            "(export it again with this tilemarlin)")
    table, kernels, hashes = manifest.get("table"), manifest.get("kernels"), manifest.get("sha256")
    well_formed = (isinstance(manifest.get("built_with"), dict)
                   and isinstance(table, str) and _TABLE_PATH.fullmatch(table)
                   and isinstance(kernels, list)
                   and all(isinstance(k, str) and _KERNEL_PATH.fullmatch(k) for k in kernels)
                   and isinstance(hashes, dict) and all(isinstance(h, str) for h in hashes.values()))
    if not well_formed:
        raise ArtifactError(f"{path}: {MANIFEST} is malformed (built_with, table, kernels or sha256)")
    return manifest


def _check_contents(contents: dict, folders: set, manifest: dict, path) -> None:
    """Exactly the manifest, its table and its kernels' files (and the folders above them), each with
    the sha256 the manifest gives it."""
    files = {manifest["table"]} | {f"{k}/{name}" for k in manifest["kernels"] for name in KERNEL_FILES}
    allowed_folders = {parent.as_posix() for name in files for parent in Path(name).parents} - {"."}
    for name in [*contents, *folders]:
        if name not in (files | {MANIFEST} if name in contents else allowed_folders):
            raise ArtifactError(f"unexpected member {name!r} in {path}; refusing the artifact")
    absent = sorted(files - set(contents))
    if absent:
        raise ArtifactError(f"{path} lacks {len(absent)} files its manifest lists, e.g. {absent[0]}")
    damaged = sorted(name for name in files
                     if hashlib.sha256(contents[name]).hexdigest() != manifest["sha256"].get(name))
    if damaged:
        raise ArtifactError(f"{path} is damaged: {len(damaged)} files differ from their sha256 in the manifest, "
                            f"e.g. {damaged[0]}")


def _read_table(data: bytes, manifest: dict, path):
    from .table import TableError, TunedTable

    try:
        table = TunedTable.from_json(json.loads(data))
    except (ValueError, UnicodeDecodeError, TableError) as exc:
        raise ArtifactError(f"{path}: its tuned table cannot be read ({exc})") from None
    if table.skipped:
        raise ArtifactError(f"{path}: its tuned table has entries this tilemarlin does not trust: "
                            + "; ".join(table.skipped))
    built = manifest["built_with"]
    if table.gpu is None or (table.gpu.name, table.gpu.arch, table.gpu.sm_count) != \
            (built.get("gpu"), built.get("arch"), built.get("sm_count")):
        raise ArtifactError(f"{path}: its tuned table is for {table.gpu}, its kernels for {built.get('gpu')}, "
                            f"{built.get('arch')}, {built.get('sm_count')} SMs")
    return table


def _holds_entries(table) -> bool:
    """Whether this GPU's tuned table on disk already holds every entry of `table` as it is."""
    from .table import TableError, TunedTable, table_path

    path = table_path(table.gpu)
    try:
        on_disk = TunedTable.read(path) if path.is_file() else None
    except (TableError, OSError, ValueError):
        return False
    return on_disk is not None and all(on_disk.entry(problem, bucket) is not None
                                       and on_disk.entry(problem, bucket).schedule == entry.schedule
                                       and on_disk.entry(problem, bucket).us == entry.us
                                       for (problem, bucket), entry in table.items())


def _installed(folder: Path, relative: str, manifest: dict) -> bool:
    """Whether the store's folder holds the artifact's files byte for byte."""
    try:
        return all(hashlib.sha256((folder / name).read_bytes()).hexdigest() == manifest["sha256"][f"{relative}/{name}"]
                   for name in KERNEL_FILES)
    except OSError:
        return False


def _install_kernels(contents: dict, manifest: dict, root: Path) -> None:
    """Write into a staging folder inside the cache, then rename each kernel folder into the store (a
    reader sees a whole entry or none); a folder that already holds the artifact's files stays, and
    nothing is written when all do."""
    from .cache_files import swap_in, writable_folder

    wanted = [relative for relative in manifest["kernels"] if not _installed(root / relative, relative, manifest)]
    if not wanted:
        return
    writable_folder(root / "kernels")
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".artifact-"))
    try:
        for relative in wanted:
            (staging / relative).mkdir(parents=True)
            for name in KERNEL_FILES:
                (staging / relative / name).write_bytes(contents[f"{relative}/{name}"])
            folder = root / relative
            folder.parent.mkdir(parents=True, exist_ok=True)
            # one that another server of the same artifact installed meanwhile stays; a stale,
            # incomplete or damaged one is replaced
            swap_in(staging / relative, folder, keep=lambda f, relative=relative: _installed(f, relative, manifest))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
