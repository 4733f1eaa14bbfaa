"""Writing into tilemarlin's cache safely: the lock tuners share, folders that must be writable,
files replaced whole and store folders swapped in whole. The tuned tables (runtime/table.py), the
kernel store (runtime/kernels.py), deployment artifacts and the gen commands that write use them."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def table_lock(path):
    """The file lock (`<table>.lock`) under which tuners write a table and the files beside it."""
    from filelock import FileLock

    return FileLock(str(path) + ".lock")


def writable_folder(folder: Path) -> Path:
    """`folder`, created: a read-only cache is a clear error that names the path and the fix, and
    creates nothing."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        where = "" if existing == folder else f"cannot create {folder}: "
        raise PermissionError(f"{where}{existing} is not writable; point TILEMARLIN_CACHE_DIR at a writable folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PermissionError(f"cannot create {folder} ({exc.strerror}); point TILEMARLIN_CACHE_DIR at a "
                              "writable folder") from None
    return folder


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)      # mkstemp's 0600 would hide a shared cache's tables from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def swap_in(staging: Path, folder: Path, keep: Callable[[Path], bool]) -> None:
    """Put the finished folder `staging` in place as `folder`, so that a reader sees a whole entry or
    none. Writers of one store folder take turns under a lock beside it: an entry already there that
    `keep` accepts (another process put the same one in place) stays and `staging` goes; any other
    (stale, damaged) is moved aside under a name of its own, then removed."""
    from filelock import FileLock

    with FileLock(str(folder.parent / ".swap.lock")):
        if folder.exists() and keep(folder):
            shutil.rmtree(staging, ignore_errors=True)
            return
        aside = None
        if folder.exists():
            aside = tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".old")
            os.replace(folder, aside)     # onto the empty folder mkdtemp made
        os.replace(staging, folder)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
