"""Code generation without a GPU: nvcc compiles each schedule for an explicit arch, and the PTX must
really contain the five parts of the design (no GPU is needed for any of this)."""
import re

import pytest

from runtime.kernels import compile_schedule
from schedules.arch import get_arch
from schedules.marlin_mma import Knobs
from schedules.problem import Problem
from schedules.registry import Schedule
from tests.test_codegen_stream import assert_split_sums_move_vectors

CASES = {
    # arch, problem, knobs: split-K with group scales on the fp32 sums (sm_80) and on the weights (sm_90a),
    # and a channelwise kernel without split-K.
    "sm80_splitk_scale_on_acc": ("sm_80", Problem(256, 1024, 128), Knobs(16, 128, 128, 1, 2, 2, 3, 2, True)),
    "sm90a_splitk_scale_on_weights": ("sm_90a", Problem(512, 1024, 128), Knobs(32, 256, 64, 1, 4, 1, 4, 3)),
    "sm90a_channelwise": ("sm_90a", Problem.make(256, 512, -1), Knobs(64, 128, 128, 2, 2, 1, 3, 1)),
}
KERNELS = [(problem, Schedule("marlin_mma", knobs), get_arch(arch)) for arch, problem, knobs in CASES.values()]


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    arch, problem, knobs = CASES[request.param]
    kernel = compile_schedule(problem, Schedule("marlin_mma", knobs), get_arch(arch))
    ptx_path = tmp_path_factory.mktemp("ptx") / "kernel.ptx"
    kernel.export_ptx(str(ptx_path))
    return arch, problem, knobs, kernel.get_kernel_source(), ptx_path.read_text()


def count(pattern, text):
    return len(re.findall(pattern, text))


def test_ptx_targets_the_requested_arch(compiled):
    arch, *_, ptx = compiled
    assert re.search(rf"\.target\s+{arch}\b", ptx)


def test_async_copy_pipeline(compiled):
    *_, knobs, src, ptx = compiled
    assert count(r"cp\.async\.cg\.shared\.global", ptx) > 0
    assert count(r"cp\.async\.(wait_group|wait_all)", ptx) > 0
    assert count(r"cp\.async\.commit_group", ptx) >= knobs.num_stages


def test_tensor_core_mma_with_ldmatrix_a(compiled):
    *_, ptx = compiled
    assert count(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx) > 0
    assert count(r"ldmatrix\.sync\.aligned\.x4\.m8n8\.shared\.b16", ptx) > 0


def test_lop3_decode_in_registers(compiled):
    *_, problem, knobs, src, ptx = compiled
    # Four lop3 per 32-bit word, and the decode is called from the k-loop, not only defined.
    assert count(r"lop3\.b32", ptx) >= 4
    plain, scaled = "tm_dequant_f16_u4(", "tm_dequant_scaled_f16_u4("
    body = src.split("__global__", 1)[1]
    scale_on_weights = not problem.channelwise and not knobs.scale_on_acc
    assert (scaled if scale_on_weights else plain) in body


def test_split_k_reduction_present_only_when_split(compiled):
    arch, problem, knobs, src, ptx = compiled
    body = src.split("__global__", 1)[1]
    if knobs.split_k == 1:
        assert "tm_split_k_arrive" not in body and count(r"(atom|red)\.global(\.\w+)*\.add\.(v4\.)?f32", ptx) == 0
        return
    assert "tm_split_k_arrive(" in body and "tm_workspace_store(" in body   # the last block's read-back
    # fp32 adds into the global workspace: vector reductions on sm_90, scalar atomics on sm_80.
    assert_split_sums_move_vectors(knobs, ptx, hopper=arch == "sm_90a")
    assert count(r"atom\.global(\.\w+)*\.add\.u32|atom\.global(\.\w+)*\.add\.s32", ptx) > 0   # the tile counter


def test_one_kernel_serves_any_m(compiled):
    *_, src, _ = compiled
    assert re.search(r"__global__ void .*\bint m\b", src)
