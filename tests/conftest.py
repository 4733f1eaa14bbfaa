"""Tests marked `gpu` need CUDA and skip cleanly without it; everything else runs on CI's CPU.

A test module may declare `KERNELS`, a list of (problem, schedule, arch) whose code it reads: the
kernels of every selected module are built into the store up front, in parallel worker processes
(nvcc runs seconds a kernel), their PTX too, and the tests then load both."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_op(monkeypatch):
    """The op computing with the fp32 references on CPU tensors (tests/cpu_op.py)."""
    from tests.cpu_op import install

    install(monkeypatch)


@pytest.fixture(scope="session", autouse=True)
def declared_kernels_built(request):
    modules = {item.module for item in request.session.items if getattr(item, "module", None) is not None
               and not item.get_closest_marker("skip")}
    declared = {job for module in modules for job in getattr(module, "KERNELS", ())}
    if not declared:
        return
    from runtime.kernels import compile_many, compile_schedule, is_stored

    by_arch: dict = {}
    for problem, schedule, arch in declared:
        if not is_stored(problem, schedule, arch):
            by_arch.setdefault(arch, []).append((problem, schedule))
    for arch, jobs in by_arch.items():
        compile_many(jobs, arch)     # a failure shows again, with its reason, in the test that loads it

    def keep_ptx(job):
        try:
            compile_schedule(*job).ptx()
        except Exception:            # (the same)
            pass

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:   # nvcc runs as a child: threads suffice
        list(pool.map(keep_ptx, declared))
