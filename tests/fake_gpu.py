"""A CUDA H200 pretended on a machine without one, for command-line tests that plan, compile and
measure through stand-ins: torch sees a GPU, the arch and GPU keys are the H200's, and every kernel
"compiles" at once (nvcc is not run)."""
import torch

from runtime.table import GpuKey
from schedules.arch import get_arch
from schedules.cost import GpuSpec

H200 = GpuKey("NVIDIA H200", "sm_90a", 132)


def pretend_h200(monkeypatch) -> None:
    arch = get_arch("sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("schedules.arch.current_arch", lambda device=None: arch)
    monkeypatch.setattr(GpuKey, "current", classmethod(lambda cls, device=None: H200))
    monkeypatch.setattr(GpuSpec, "current", classmethod(lambda cls, device=None: GpuSpec.for_arch(arch)))

    def compile_many(jobs, arch, workers=None, progress=None):
        for job in jobs:
            progress(job, None)
        return {}

    monkeypatch.setattr("runtime.kernels.compile_many", compile_many)
