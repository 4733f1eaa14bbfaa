"""What both of `gen bench`'s modes (gen/bench/command.py, and --e2e: gen/bench/e2e.py) share: the
command line's defaults and list parser, and how a run is recorded (the versions it ran with, one
line per error, where it goes, its JSON saved so that a reader never sees half a file)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
KERNELS = ("tilemarlin", "fp16", "torch_int4", "humming")     # what the kernel bench times by default
NO_GPU_EXIT = 2
# FP16's sum moves by up to 3 % between runs on the H200 at M >= 512 while ours stays
# (docs/performance.md, "How things are measured"): rounds in which every kernel takes its turn put
# both under the same drift.
DEFAULT_ROUNDS = 3
DEFAULT_MODEL = "llama-2-7b"
DEFAULT_GROUP = 128


def parse_ms(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, duplicates dropped); anything but positive integers is an error."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) == 0:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a positive integer; expected a list such as 1,2,4,16,512")
        values.append(int(part))
    return sorted(set(values))


def error_text(exc: BaseException) -> str:
    """One line for the row: the message's first line, or its last where it carries a traceback
    (TVM and TileLang errors end with the statement that matters)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else ""
    return f"{type(exc).__name__}: {line}"[:300]


def versions() -> dict:
    """package -> version of what the run ran with (tilemarlin, TileLang and humming where importable,
    torch, and torch's CUDA)."""
    import importlib.metadata

    import torch

    found = {}
    try:
        found["tilemarlin"] = importlib.metadata.version("tilemarlin")
    except importlib.metadata.PackageNotFoundError:   # run from a source checkout
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found["tilemarlin"] = tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"
    for package in ("tilelang", "humming"):
        try:
            found[package] = __import__(package).__version__
        except Exception:   # absent or broken: the run notes what it skipped
            pass
    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    return found


def check_output_folder(folder: str | Path) -> None:
    """A ValueError, before anything is measured, where `folder` (--out) could not be created or
    written to; creates nothing."""
    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {folder}: {existing} is not writable")


def save_json(data: dict, path: Path) -> None:
    """Write the run's JSON to `path` whole (a reader, or a crash, never leaves half a file)."""
    from runtime.cache_files import atomic_write   # a measuring run has the runtime loaded already

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1) + "\n")
