"""The first-run check of a served kernel, on the GPU: it passes a right kernel once per bucket (then the
stamp answers), catches a wrong element, and its cost is printed."""
import time

import pytest
import torch

from runtime import selfcheck
from runtime.kernels import compile_schedule
from schedules.arch import current_arch
from schedules.problem import Problem
from schedules.registry import Schedule
from schedules.stream_mma import Knobs

pytestmark = pytest.mark.gpu

PROBLEM = Problem(4096, 4096, 128)
SCHEDULE = Schedule("stream_mma", Knobs(warps=4, unroll=4, ahead=2))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return compile_schedule(PROBLEM, SCHEDULE, current_arch())


def test_a_right_kernel_passes_once_and_is_stamped(kernel):
    device = torch.device("cuda", torch.cuda.current_device())
    stamp = selfcheck.stamp_path(kernel.folder, device, selfcheck.checked_m(16))
    costs = []
    for _ in range(2):    # the first check in a process also pays the process's first cuBLAS and RNG calls
        stamp.unlink(missing_ok=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        selfcheck.check_once(kernel, PROBLEM, SCHEDULE, 16, device)
        torch.cuda.synchronize()
        costs.append(1e3 * (time.perf_counter() - start))
        assert stamp.is_file()
    print(f"first-run check of {SCHEDULE.name} at M={selfcheck.checked_m(16)}, {PROBLEM.name}: {costs[0]:.1f} ms as the process's "
          f"first, {costs[1]:.1f} ms for a further kernel")


class OneElementOff:
    """The real kernel, then one output element moved by 5 % of the output's largest magnitude: what a
    rare indexing bug looks like. Over 1024 x 4096 outputs that is far below the relative-norm tolerance,
    so only the element check can see it."""

    def __init__(self, kernel):
        self.kernel, self.folder = kernel, kernel.folder

    def __call__(self, *args):
        self.kernel(*args)
        out = args[3]          # kernel_args: activations, packed weight, scales, output, ...
        out.view(-1)[out.numel() // 2] += 0.05 * out.abs().max()


@pytest.mark.parametrize("m", [1, 1024])
def test_one_wrong_element_is_caught(kernel, m):
    device = torch.device("cuda", torch.cuda.current_device())
    assert selfcheck.run_check(kernel, PROBLEM, SCHEDULE, m, device) is None
    reason = selfcheck.run_check(OneElementOff(kernel), PROBLEM, SCHEDULE, m, device)
    assert reason is not None
    if m == 1024:
        assert "element" in reason, reason
