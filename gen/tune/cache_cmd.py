"""`gen cache list|show|clear`: look at and clear the tuned tables and the compiled-kernel cache.

Tuned tables are per GPU (named by its slug, e.g. nvidia-h200_sm_90a_132sm); compiled kernels are
shared by every GPU of an arch, so `--gpu` narrows the tables only.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("cache", help="list, show or clear tuned tables and compiled kernels",
                              description=__doc__.split("\n\n")[0])
    actions = p.add_subparsers(dest="action", required=True)
    for name, help_text in (("list", "the tuned tables (GPU, entries, versions) and the kernel cache"),
                            ("show", "the entries of the tuned tables"),
                            ("clear", "delete tuned tables and/or compiled kernels")):
        a = actions.add_parser(name, help=help_text)
        a.add_argument("--gpu", metavar="SLUG", help="only the table of this GPU (see `gen cache list`)")
        if name == "clear":
            a.add_argument("--tables", action="store_true", help="clear tuned tables (default: tables and kernels)")
            a.add_argument("--kernels", action="store_true", help="clear compiled kernels (default: tables and kernels)")
    p.set_defaults(func=run)


def run(args) -> int:
    paths = table_files(args.gpu)
    if args.gpu and not paths:
        known = ", ".join(p.stem for p in table_files(None)) or "none"
        print(f"gen cache: no tuned table for GPU {args.gpu!r} (tables: {known})", file=sys.stderr)
        return 2
    return {"list": list_cache, "show": show_tables, "clear": clear}[args.action](args, paths)


def table_files(slug: str | None) -> list[Path]:
    """The table files of every table folder (the shipped ones first), or those of one GPU."""
    from runtime.table import table_files as all_table_files

    return [p for p in all_table_files() if slug is None or p.stem == slug]


def _read(path: Path):
    """(table or None, status) of one table file."""
    from runtime.table import TableError, TunedTable

    try:
        table = TunedTable.read(path, history=True)
    except TableError as exc:
        return None, f"ignored: {exc}"
    reason = table.stale_reason()
    skipped = f", {len(table.skipped)} entries skipped" if table.skipped else ""
    return table, (f"ignored: {reason}" if reason else "ok") + skipped


def _folder_size(folder: Path) -> tuple[int, int]:
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
    return len(files), sum(f.stat().st_size for f in files)


def list_cache(args, paths: list[Path]) -> int:
    from runtime.kernels import kernel_dir
    from runtime.table import shipped_tables_dir, table_folders

    from gen.tune.command import format_table

    rows = []
    for path in paths:
        table, status = _read(path)      # (a table of no entries is a table too: not `if table`)
        name, entries, v = (table.gpu.name, len(table), table.versions) if table is not None else ("?", "-", {})
        folder = "shipped" if path.parent == shipped_tables_dir() else "TILEMARLIN_CACHE_DIR"
        rows.append([path.stem, folder, name, entries, v.get("tilemarlin", "?"), v.get("tilelang", "?"),
                     v.get("cuda", "?"), v.get("torch", "?"), status])
    print(f"tuned tables in {' and '.join(str(f) for f in table_folders())}:")
    headers = ["gpu", "folder", "name", "entries", "tilemarlin", "tilelang", "cuda", "torch", "status"]
    print(format_table(headers, rows) if rows else "  (none)")
    count, size = _folder_size(kernel_dir())
    print(f"compiled kernels in {kernel_dir()}: {count} files, {size / 2**20:.1f} MiB")
    return 0


def show_tables(args, paths: list[Path]) -> int:
    from gen.tune.command import format_table

    if not paths:
        print("no tuned tables")
    for path in paths:
        table, status = _read(path)
        print(f"{path} [{status}]")
        if table is None:
            continue
        print(f"  {table.gpu.name} ({table.gpu.arch}, {table.gpu.sm_count} SMs); tuned with "
              + ", ".join(f"{k} {v}" for k, v in table.versions.items()))
        rows = []
        for (p, bucket), e in table.items():
            ok = sum(t.get("us") is not None and not t.get("error") for t in e.all_timings)
            rows.append([f"{p.k}x{p.n}", "cw" if p.channelwise else p.group, p.dtype, bucket, e.schedule.name,
                         f"{e.us:.1f}", f"{e.fp16_us:.1f}" if e.fp16_us else "-",
                         f"{e.speedup:.2f}x" if e.speedup else "-", f"{e.gbps:.0f}" if e.gbps else "-",
                         f"{ok}/{len(e.all_timings)}", e.harness])
        print(format_table(["KxN", "group", "dtype", "bucket", "winner", "us", "FP16 us", "vs FP16", "GB/s",
                            "correct/tried", "timed"], rows))
        for why in table.skipped:        # entries that cannot be trusted: left out, and said so
            print(f"  skipped {why}")
    return 0


def clear(args, paths: list[Path]) -> int:
    from runtime.kernels import kernel_dir
    from runtime.cache_files import table_lock
    from runtime.table import tables_dir

    from gen.tune.command import unwritable_cache

    both = not args.tables and not args.kernels
    # only the tables tune writes: the shipped ones stay beneath them
    tables = [p for p in paths if p.parent.resolve() == tables_dir().resolve()] if args.tables or both else []
    kernels = args.kernels or (both and not args.gpu)
    folders = {p.parent for p in tables} | ({kernel_dir()} if kernels and kernel_dir().exists() else set())
    why = unwritable_cache(sorted(folders))
    if why:
        print(f"gen cache: cannot clear a read-only cache: {why}", file=sys.stderr)
        return 2
    for path in tables:
        # Under the tuners' lock, so that a save in progress finishes first. The lock file stays:
        # deleting it could let two processes hold "the" lock on different files.
        with table_lock(path):
            path.unlink(missing_ok=True)
        print(f"removed tuned table {path}")
    if kernels:
        count, size = _folder_size(kernel_dir())
        shutil.rmtree(kernel_dir(), ignore_errors=True)
        print(f"removed {count} compiled-kernel files ({size / 2**20:.1f} MiB) from {kernel_dir()}")
    return 0
