"""A compile worker: `python -m runtime.compile_worker`, one per core, started by
runtime.kernels.compile_many.

It reads one job a line on stdin (JSON: problem, schedule and arch, each as the tuned table writes
them, or an activation kernel's kind, K and dtype and the arch) and answers each with a line on stdout, marked (kernels.REPLY) so that whatever else reaches
stdout first (an import's print) is skipped: {"error": null} once the kernel is in the store, else
the error. Everything printed after start-up (TileLang's warnings, nvcc) goes to stderr. A plain child process rather than a multiprocessing worker: those import the caller's main
script first, so a serving script that converts a model at import time would run again, model and
all, in every worker.
"""
from __future__ import annotations

import json
import os
import sys


def _protocol_stream():
    """stdout for the answers only: anything printed later, by Python or by C code, goes to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return answers


def main() -> int:
    answers = _protocol_stream()
    try:
        os.nice(10)   # a tune measures on the GPU while the next problem compiles: leave it a core
    except OSError:
        pass
    from .kernels import REPLY, _compile_job

    for line in sys.stdin:
        error = _compile_job(json.loads(line))
        answers.write(REPLY + json.dumps({"error": error}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
