"""The kernels' own prelude (templates/tl_prelude.cuh.j2) in place of TileLang's headers: which code
takes it, and that a kernel compiled with it is the same machine code as with TileLang's headers.

No GPU: TileLang lowers each schedule to CUDA, nvcc compiles that source as TileLang wrote it and with
the prelude, and the kernels' instructions (the cubins' .text sections) must be equal byte for byte.
(Each of the shipped table's distinct winners does, docs/performance.md, as `gen prelude-check`
shows; the forms below keep the three families, and the two cases where nvcc's choices once differed,
so.)"""
import pytest

from gen.dev.prelude_check import machine_code, tilelang_source
from runtime.kernels import compile_schedule
from schedules import stream_mma, stream_wgmma
from schedules.arch import get_arch
from schedules.problem import Problem
from schedules.registry import Schedule
from templates import with_own_prelude
from tests import test_codegen, test_codegen_stream, test_codegen_stream_wgmma, test_codegen_w4a8

Knobs = stream_wgmma.Knobs
SM90 = get_arch("sm_90a")

TILELANG_BLOCK = """#if defined(_MSC_VER) && !defined(__clang__) && _MSC_VER < 1940
#define _tl_orig_alignas alignas
#define alignas(N) _tl_orig_alignas((N) <= 64 ? (N) : 64)
#include <cuda.h>
#undef alignas
#define alignas _tl_orig_alignas
#endif
#include <tl_templates/cuda/instruction/wgmma.h>
#include <tl_templates/cuda/intrin.h>
#include <tl_templates/cuda/barrier.h>
#include <tl_templates/cuda/copy_sm90.h>
#ifdef ENABLE_BF16
#include <tl_templates/cuda/cuda_bf16_fallbacks.cuh>
#endif
"""
WGMMA = ("tl::wgmma_rs<tl::DataType::kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 64, 88, 16, false, "
         "false, 1, 1>(a, desc, c, 1);\n  tl::warpgroup_wait<0>();\n")


def kernel(body: str, block: str = TILELANG_BLOCK, helpers: str = "namespace tilemarlin {}\n") -> str:
    return helpers + block + 'extern "C" __global__ void k() {\n  ' + body + "}\n"


def test_a_wgmma_kernel_takes_the_prelude_with_its_own_wgmma_shapes():
    code = with_own_prelude(kernel(WGMMA))
    assert "tl_templates" not in code and "_MSC_VER" not in code and code.startswith("namespace tilemarlin {}\n")
    assert "struct WgmmaRS<DataType::kFloat16, DataType::kFloat16, DataType::kFloat32, 64, 88, 16," in code
    assert "wgmma.mma_async.sync.aligned.m64n88k16.f32.f16.f16 {%0, " in code and "%43}, {%44, %45, %46, %47}" in code
    assert code.count("struct WgmmaRS<") == 1 and code.endswith(WGMMA + "}\n")


def test_tilelang_code_of_others_keeps_tilelangs_headers():
    code = kernel(WGMMA, helpers="// a kernel of someone else's\n")
    assert with_own_prelude(code) == code


@pytest.mark.parametrize("body, block", [
    ("tl::AllReduce<tl::SumOp, 256>::run(x);\n", TILELANG_BLOCK),                       # a name it lacks
    ("tl::mma_sync<tl::DataType::kFloat16>(a, b, c);\n", TILELANG_BLOCK),                # an mma it lacks
    ("cutlass::half_t x;\n", TILELANG_BLOCK),                                            # cutlass itself
    (WGMMA.replace("kFloat16", "kFloat8_e5m2"), TILELANG_BLOCK),                         # e5m2 operands
    (WGMMA.replace("64, 88, 16", "64, 88, 32"), TILELANG_BLOCK),                         # another wgmma
    ("fp8_e4_4_t x;\n", TILELANG_BLOCK),                                                 # TileLang's FP8 vector
    (WGMMA, TILELANG_BLOCK.replace("intrin.h", "math.h")),                             # a header it lacks
    (WGMMA, ""),                                                                         # no include block
    (WGMMA, TILELANG_BLOCK + "#include <cooperative_groups.h>\n#include <tl_templates/cuda/atomic.h>\n"),
], ids=["name", "mma", "cutlass", "e5m2_wgmma", "k32_f16_wgmma", "fp8_vector", "header", "no_block", "later_include"])
def test_code_the_prelude_does_not_cover_keeps_tilelangs_headers(body, block):
    code = kernel(body, block)
    assert with_own_prelude(code) == code


# Forms of the tuned winners, each compiled both ways: stream_wgmma in fp16, bf16 and with zero points;
# split-K through the workspace and in clusters; producer warps and warpgroups; staged stores; scales on
# the sums; W4A8's FP8 wgmma. stream_mma and marlin_mma on sm_90a and sm_80.
WGMMA_CASES = ["m8_split4", "release", "producer_warpgroup_setmaxnreg", "k128_staged_store_channelwise",
               "producer_m88_staged", "producer_ring", "bf16_channelwise_ring", "producer_staged_unrolled_sacc",
               "g2_odd_k_tiles_sacc_lag", "producer_cluster_split4", "producer_cluster_unrolled_sacc_lag"]
ZERO_POINTS = {
    "zero_points_sacc": (Problem.make(4096, 4096, 128, zero_points=True),
                         Knobs(16, 1, 1, 128, 6, release_barriers=True, producer_warp=True, pdl=True,
                               staged_store=True, early_start=2, stage_unroll=True, scale_on_acc=True)),
    "zero_points_bf16_scaled": (Problem.make(4096, 4096, 128, dtype="bfloat16", zero_points=True),
                                Knobs(64, 1, 1, 64, 4, release_barriers=True, producer_warp=True)),
}
# The shipped table's o_proj winner at M = 64: its producer's loop runs two trips, which nvcc unrolled
# when the prelude's elect asm indented its lines with tabs (it weighs asm by its text).
ROLLED_PRODUCER = {
    "o_proj_m64_cluster_split2": (Problem.make(4096, 4096, 128),
                                  Knobs(block_m=64, groups=1, block_k=128, stages=6, split_k=2, cluster_reduce=True,
                                        release_barriers=True, producer_warp=True, stage_unroll=True,
                                        scale_on_acc=True, rotate=True, early_start=2)),
}
# The shipped table's bf16 o_proj winner at M = 1: it folds the zero point, its sums take the bf16 scales
# converted to float, which nvcc schedules differently when the 16 bits are moved rather than shifted.
BF16_SCALES_TO_FLOAT = {
    "sm90a_bf16_fold_cluster_split2": ("sm_90a", Problem.make(4096, 4096, 128, dtype="bfloat16"),
                                       stream_mma.Knobs(warps=8, unroll=4, split_k=2, ahead=3, fold_zero_point=True,
                                                        cluster_reduce=True, x_ldmatrix=True, async_weights=True,
                                                        sum_slices=True, early_start=2, late_trigger=True)),
}
STREAM_MMA_CASES = ["sm80_splitk_scale_on_weights", "sm90a_x_ldmatrix", "sm90a_async_weights", "sm90a_cluster_reduce",
                    "sm90a_pdl_splitk", "sm90a_fold_lag"]
MARLIN_CASES = ["sm80_splitk_scale_on_acc", "sm90a_splitk_scale_on_weights", "sm90a_channelwise"]
SAME_CODE = {
    **{f"stream_wgmma-{name}": ("stream_wgmma", "sm_90a", *test_codegen_stream_wgmma.CASES[name])
       for name in WGMMA_CASES},
    **{f"stream_wgmma-{name}": ("stream_wgmma", "sm_90a", *case)
       for name, case in {**ZERO_POINTS, **ROLLED_PRODUCER}.items()},
    **{f"w4a8-{name}": ("stream_wgmma", "sm_90a", *case) for name, case in test_codegen_w4a8.CASES.items()},
    **{f"stream_mma-{name}": ("stream_mma", *test_codegen_stream.CASES[name])
       for name in STREAM_MMA_CASES},
    **{f"stream_mma-{name}": ("stream_mma", *case) for name, case in BF16_SCALES_TO_FLOAT.items()},
    **{f"marlin_mma-{name}": ("marlin_mma", *test_codegen.CASES[name]) for name in MARLIN_CASES},
}


@pytest.mark.parametrize("case", SAME_CODE)
def test_the_prelude_compiles_to_the_same_machine_code_as_tilelangs_headers(case):
    family, arch, problem, knobs = SAME_CODE[case]
    plain = tilelang_source(family, arch, problem, knobs)
    own = with_own_prelude(plain)
    assert own != plain and "tl_templates" not in own
    text = machine_code(own, arch)
    assert text and text == machine_code(plain, arch)


def test_a_build_composes_with_the_hook_already_set_and_puts_it_back():
    import tilelang
    import tvm_ffi

    from runtime.kernels import build_kernel

    name = "tilelang_callback_cuda_postproc"
    tilelang.engine.register_cuda_postproc(lambda code, target: code + "\n// marked by the caller's hook\n")
    marker = tvm_ffi.get_global_func(name)
    problem, knobs = test_codegen_stream_wgmma.CASES["release"]
    source = build_kernel(problem, Schedule("stream_wgmma", knobs), SM90).get_kernel_source()
    assert "marked by the caller's hook" in source and "union GmmaDescriptor" in source
    assert tvm_ffi.get_global_func(name).same_as(marker)
    tilelang.engine.register_cuda_postproc(lambda code, target: code)


def test_code_nvcc_refuses_with_the_prelude_is_built_with_tilelangs_headers(monkeypatch):
    from runtime import kernels

    monkeypatch.setattr(kernels, "own_prelude", lambda code, target: with_own_prelude(code) + "\nnot_a_name x;\n")
    problem, knobs = test_codegen_stream_wgmma.CASES["release"]
    source = kernels.build_kernel(problem, Schedule("stream_wgmma", knobs), SM90).get_kernel_source()
    assert "tl_templates" in source and "not_a_name" not in source


def test_kernels_built_into_the_store_take_the_prelude():
    problem, knobs = test_codegen_stream_wgmma.CASES["release"]
    source = compile_schedule(problem, Schedule("stream_wgmma", knobs), SM90).get_kernel_source()
    assert "tl_templates" not in source and "struct GmmaDescriptor" not in source and "union GmmaDescriptor" in source


def _table_of(tmp_path, *cases) -> str:
    from runtime.table import GpuKey, TunedTable, current_versions

    table = TunedTable(GpuKey("NVIDIA H200", "sm_90a", 132), current_versions())
    for bucket, (problem, knobs) in zip((64, 128), cases):
        table.record(problem, bucket, Schedule("stream_wgmma", knobs), 7.4)
    path = tmp_path / "table.json"
    table.save(path)
    return str(path)


def test_prelude_check_compares_each_distinct_winner_of_a_table(tmp_path, capsys):
    from gen.cli import main

    case = ROLLED_PRODUCER["o_proj_m64_cluster_split2"]
    assert main(["prelude-check", "--table", _table_of(tmp_path, case, case), "--workers", "1"]) == 0
    assert capsys.readouterr().out.strip() == "winners compared: 1 (same: 1)"


def test_prelude_check_names_a_kernel_that_differs_or_fails(tmp_path, capsys, monkeypatch):
    import gen.dev.prelude_check as check
    from gen.cli import main

    first, second = ROLLED_PRODUCER["o_proj_m64_cluster_split2"], ZERO_POINTS["zero_points_sacc"]
    monkeypatch.setattr(check, "compare", lambda problem, schedule, arch: (
        check.DIFFERENT if problem == first[0] else (_ for _ in ()).throw(RuntimeError("nvcc refused"))))
    assert main(["prelude-check", "--table", _table_of(tmp_path, first, second)]) == 1
    out = capsys.readouterr().out
    assert f"sm_90a {first[0].name} {Schedule('stream_wgmma', first[1]).name}: different" in out
    assert "error: RuntimeError: nvcc refused" in out and "(different: 1, error: 1)" in out
