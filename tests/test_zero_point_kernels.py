"""Zero points in the kernels, without a GPU: the problem that keys them, the scales tensor that brings
them (each group's scale row, then its zero-point row), which families and knobs take them, and the
code nvcc makes of them for sm_90a and sm_80 (the symmetric decode's instructions, z in place of 8)."""
import re

import pytest
import torch

from runtime import QuantLinear
from runtime.kernels import compile_schedule
from runtime.table import TunedTable, GpuKey
from schedules import marlin_mma, stream_mma, stream_wgmma
from schedules.arch import get_arch
from schedules.marlin_mma.layout import packed_shapes, split_zero_points, stack_zero_points
from schedules.problem import Problem
from schedules.quant import dequantize, quantize_rtn, quantize_rtn_asymmetric, reference_matmul
from schedules.registry import Schedule
from templates import render_dequant, zero_decode

SM90, SM80 = get_arch("sm_90a"), get_arch("sm_80")
TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SCALING_MULTIPLY = re.compile(r"\bmul(\.rn)?\.f16x2\b")     # the symmetric decode's HMUL2 by the scales
GROUPED = Problem(1024, 4096, 128, zero_points=True)
CHANNELWISE = Problem.make(1024, 4096, -1, zero_points=True)
WGMMA = Schedule("stream_wgmma", stream_wgmma.Knobs(16, 1, 1, 128, 6, split_k=2, release_barriers=True,
                                                    producer_warp=True, cluster_reduce=True, early_start=2))
WGMMA_STAGED = Schedule("stream_wgmma", stream_wgmma.Knobs(64, 1, 1, 64, 6, release_barriers=True,
                                                           producer_warp=True, staged_store=True))
MMA_ASYNC = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 2, ahead=3, x_ldmatrix=True, async_weights=True,
                                                    cluster_reduce=True, early_start=2))
MMA_REGISTERS = Schedule("stream_mma", stream_mma.Knobs(2, 4, 4, 2, ahead=1))
MMA_FOLD = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 2, ahead=2, fold_zero_point=True, fold_lag=True))

KERNELS = [(GROUPED, WGMMA, SM90), (CHANNELWISE, WGMMA_STAGED, SM90), (GROUPED, MMA_ASYNC, SM90),
           (CHANNELWISE, MMA_REGISTERS, SM80), (GROUPED, MMA_FOLD, SM90),
           (Problem(1024, 4096, 128), WGMMA, SM90), (Problem(1024, 4096, 128), MMA_ASYNC, SM90),
           (Problem(1024, 4096, 128), MMA_FOLD, SM90)]


# --- the problem and the layout contract -----------------------------------------------------------

def test_zero_points_are_part_of_the_problem_and_its_name():
    assert GROUPED.name == "n1024_k4096_g128_float16_w4_zp" and GROUPED != Problem(1024, 4096, 128)
    assert Problem(1024, 4096, 128).name == "n1024_k4096_g128_float16_w4"      # symmetric names unchanged
    assert (GROUPED.scale_rows, CHANNELWISE.scale_rows, Problem(1024, 4096, 128).scale_rows) == (64, 2, 32)
    assert GROUPED.weight_bytes() - Problem(1024, 4096, 128).weight_bytes() == 32 * 1024 * 2
    with pytest.raises(ValueError, match="zero_points must be True or False"):
        Problem(1024, 4096, 128, zero_points="yes")


def test_zero_points_stack_after_their_scale_rows_and_split_back():
    scales = torch.arange(6.0).reshape(3, 2).half()
    zeros = torch.tensor([[0, 15], [7, 8], [3, 12]])
    stacked = stack_zero_points(scales, zeros)
    assert stacked.dtype == torch.float16
    assert stacked.tolist() == [[0, 1], [0, 15], [2, 3], [7, 8], [4, 5], [3, 12]]
    assert all(torch.equal(x, y) for x, y in zip(split_zero_points(stacked), (scales, zeros.half())))
    assert packed_shapes(4096, 1024, GROUPED.scale_rows) == ((256, 2048), (64, 1024))
    with pytest.raises(ValueError, match="same"):
        stack_zero_points(scales, zeros[:2])
    for bad in (16, -1, 7.5):
        with pytest.raises(ValueError, match="whole numbers in 0..15"):
            stack_zero_points(scales, torch.full((3, 2), bad))


def test_the_reference_decodes_what_the_zero_points_mean():
    """The reference's dequantization with zero points is s * (q - z) exactly, and with every zero
    point 8 it is the symmetric one."""
    gen = torch.Generator().manual_seed(7)
    codes, scales = quantize_rtn(torch.randn(256, 64, generator=gen), 128)
    zeros = torch.randint(0, 16, scales.shape, generator=gen)
    expected = (codes.float().reshape(2, 128, 64) - zeros.float().unsqueeze(1)) * scales.float().unsqueeze(1)
    assert torch.equal(dequantize(codes, scales, zeros=zeros), expected.reshape(256, 64))
    assert torch.equal(dequantize(codes, scales, zeros=torch.full_like(zeros, 8)), dequantize(codes, scales))
    a = torch.randn(3, 256, generator=gen)
    torch.testing.assert_close(reference_matmul(a, codes, scales, zeros=zeros), a @ expected.reshape(256, 64))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pack_stacks_the_zero_points_exactly(dtype):
    gen = torch.Generator().manual_seed(3)
    codes, scales = quantize_rtn(torch.randn(256, 64, generator=gen), 128, dtype=dtype)
    zeros = torch.randint(0, 16, scales.shape, generator=gen)
    weight, stacked = marlin_mma.pack(codes, scales, zeros)
    assert torch.equal(weight, marlin_mma.pack(codes, scales)[0])
    got_scales, got_zeros = split_zero_points(stacked)
    assert torch.equal(got_scales, scales) and got_zeros.dtype == scales.dtype
    assert torch.equal(got_zeros.long(), zeros)


def test_the_kernel_arguments_want_the_stacked_scales():
    knobs = MMA_REGISTERS.knobs
    problem = Problem(1024, 4096, 128, zero_points=True)
    a = torch.zeros(3, 4096, dtype=torch.float16)
    weight = torch.zeros(256, 2048, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"scales must have shape \[64x1024\]"):
        stream_mma.kernel_args(problem, knobs, a, weight, torch.zeros(32, 1024, dtype=torch.float16),
                               torch.zeros(3, 1024, dtype=torch.float16))


def test_asymmetric_rtn_spans_each_groups_range_with_zero_kept_exact():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(512, 64, generator=gen) + 0.3
    w[:128, 0] = 0.0            # a zero group: stays zero
    w[128:256, 1] = 0.25        # one repeated value: its range widened to hold 0, the value the top code
    w[256:384, 2] = torch.rand(128, generator=gen) + 1.0     # all positive: zero point 0
    codes, scales, zeros = quantize_rtn_asymmetric(w, 128)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and zeros.min() >= 0 and zeros.max() <= 15
    back = dequantize(codes, scales, zeros=zeros)
    step = scales.float().repeat_interleave(128, dim=0)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert (back[:128, 0] == 0).all() and torch.allclose(back[128:256, 1], torch.full((128,), 0.25), rtol=2e-3)
    assert zeros[2, 2] == 0
    sym_codes, sym_scales = quantize_rtn(w, 128)
    assert (back - w).norm() < (dequantize(sym_codes, sym_scales) - w).norm()   # closer than symmetric


def test_from_linear_with_zero_points_packs_them():
    torch.manual_seed(2)
    linear = torch.nn.Linear(256, 128, bias=False).half()
    module = QuantLinear.from_linear(linear, 128, zero_points=True)
    codes, scales, zeros = quantize_rtn_asymmetric(linear.weight.detach().t(), 128)
    assert module.zero_points and module.problem.name.endswith("_zp")
    assert torch.equal(module.unpack()[0], codes) and torch.equal(module.unpack()[1], scales)
    assert torch.equal(module.zeros().long(), zeros.long())
    assert not QuantLinear.from_linear(linear, 128).zero_points


# --- which kernels take them -----------------------------------------------------------------------

def test_the_families_that_decode_zero_points_and_the_forms_that_do_not():
    assert "zero point 8 only" in marlin_mma.check(GROUPED, marlin_mma.Knobs(16, 256, 128, 1, 4, 1, 4, 1), SM90)
    sacc = stream_wgmma.Knobs(32, 2, 1, 64, 4, split_k=4, scale_on_acc=True)
    assert stream_wgmma.check(Problem(1024, 4096, 128), sacc, SM90) is None
    assert stream_wgmma.check(GROUPED, sacc, SM90) is None           # code - z, scales on the sums
    assert "channelwise" in stream_wgmma.check(CHANNELWISE, sacc, SM90)
    for problem, schedule, arch in KERNELS:
        assert schedule.module.check(problem, schedule.knobs, arch) is None


def test_stream_mma_counts_the_zero_points_registers():
    knobs = stream_mma.Knobs(1, 4, 4, 1, ahead=2, fold_zero_point=True, fold_lag=True)
    symmetric = Problem(1024, 4096, 128)
    assert knobs.registers_estimate(symmetric) == knobs.registers_estimate()
    assert knobs.registers_estimate(GROUPED) == knobs.registers_estimate(symmetric) + 2 * 4 + 2 * 4   # buffers, lag
    unfolded = stream_mma.Knobs(1, 4, 4, 1, ahead=2)        # z beside the scales, and the offsets
    assert unfolded.registers_estimate(GROUPED) == unfolded.registers_estimate(symmetric) + 2 * 4 + 4


def test_the_gpu_tests_zero_point_forms_are_offered_on_sm90():
    """A form the family refuses for zero points (its zero points' registers would spill) would fail its
    GPU test at check(), where no CI machine sees it."""
    from tests.test_kernel_gpu import SCHEDULES, ZERO_POINT_CASES, problem_of

    refused = {(layer, group, name): reason for layer, group, name in ZERO_POINT_CASES
               if (reason := SCHEDULES[name].module.check(problem_of(layer, group, zero_points=True),
                                                          SCHEDULES[name].knobs, SM90))}
    assert not refused, refused
    assert SCHEDULES["stream_m16_fold_lag_aw_cluster2"].module.check(
        problem_of("down", 128, zero_points=True), SCHEDULES["stream_m16_fold_lag_aw_cluster2"].knobs, SM90)


@pytest.mark.parametrize("problem", [GROUPED, CHANNELWISE], ids=["g128", "channelwise"])
def test_every_arch_has_zero_point_kernels_to_search(problem):
    mma = stream_mma.space(problem, SM80)
    assert any(kb.fold_zero_point for kb in mma) and any(not kb.fold_zero_point for kb in mma)
    assert marlin_mma.space(problem, SM90) == []
    wgmma = stream_wgmma.space(Problem(4096, 4096, 128, zero_points=True), SM90)
    assert any(kb.scale_on_acc for kb in wgmma) and any(not kb.scale_on_acc for kb in wgmma)


def test_a_table_keys_zero_point_entries_apart_and_reads_them_back(tmp_path):
    gpu = GpuKey("NVIDIA H200", "sm_90a", 132)
    table = TunedTable(gpu)
    table.record(GROUPED, 16, WGMMA, 9.0)
    table.record(Problem(1024, 4096, 128), 16, MMA_ASYNC, 8.0)
    table.save(tmp_path / "t.json")
    back = TunedTable.read(tmp_path / "t.json")
    assert back.lookup(GROUPED, 16) == WGMMA and back.lookup(Problem(1024, 4096, 128), 16) == MMA_ASYNC
    assert sum('"zero_points": true' in line for line in (tmp_path / "t.json").read_text().splitlines()) == 1


# --- the code ---------------------------------------------------------------------------------------

def test_the_template_takes_the_zero_points_off_in_place_of_8():
    """The zero decode has the symmetric decode's instructions per word, the subtrahends in place of
    its constants (templates/dequant.cuh.j2); the scaled form has an HFMA2 with the offsets per pair
    where the symmetric one has its HMUL2."""
    for dtype in ("float16", "bfloat16"):
        source, zero = render_dequant(dtype), zero_decode(dtype)
        unscaled = source.split(f"void {zero.unscaled}(")[1].split("\n}\n")[0]
        symmetric = source.split("void decode_" + ("f16_u4" if dtype == "float16" else "bf16_u4") + "(")[1]
        symmetric = symmetric.split("\n}\n")[0]
        for op in ("__hsub2(", "__hfma2(", "lop3_and_or("):
            assert unscaled.count(op) == symmetric.count(op), (dtype, op)
        scaled = source.split(f"void {zero.scaled}(")[1].split("\n}\n")[0]
        assert scaled.count("__hfma2(") == 4 and "__hmul2" not in scaled
        assert [line.split("= ")[1] for line in scaled.splitlines() if line.strip().startswith("out[")] == [
            "__hfma2(p[0], s0, o0);", "__hfma2(p[2], s1, o1);", "__hfma2(p[1], s0, o0);", "__hfma2(p[3], s1, o1);"]


@pytest.mark.parametrize("problem, schedule, arch", KERNELS[:4], ids=["wgmma", "wgmma_cw", "mma_async", "mma_sm80_cw"])
def test_zero_point_kernels_decode_as_many_words_as_the_symmetric_ones(problem, schedule, arch):
    """The zero-point kernel makes its offsets once per group and decodes with an HFMA2 per pair where
    its symmetric twin (same knobs) has its HMUL2: per word as many f16x2 operations, plus the
    offsets' few per group (channelwise: the twin scales the sums instead)."""
    kernel = compile_schedule(problem, schedule, arch)
    source, ptx = (kernel.folder / "kernel.cu").read_text(), kernel.ptx()
    zero = zero_decode(problem.dtype)
    assert source.count(zero.scaled + "(") >= 2 and source.count(zero.offsets + "(") >= 2
    assert ptx.count("fma.rn.f16x2") >= 8
    if not problem.channelwise:
        twin = compile_schedule(Problem(problem.n, problem.k, problem.group), schedule, arch)
        multiplies = [len(SCALING_MULTIPLY.findall(k.ptx())) for k in (twin, kernel)]
        assert multiplies[1] * 4 <= multiplies[0], multiplies      # the offsets' HMUL2, once per group
        half2 = [k.ptx().count(".f16x2") for k in (twin, kernel)]
        assert half2[0] < half2[1] <= half2[0] * 1.15, half2


def test_zero_points_must_be_whole_numbers():
    codes, scales = torch.randint(0, 16, (256, 64), dtype=torch.uint8), torch.rand(2, 64).half() + 0.1
    zeros = torch.full((2, 64), 7.0)
    zeros[1, 5] = 7.5
    with pytest.raises(ValueError, match=r"zero point 7.5 at group 1, column 5: .* whole numbers in 0..15"):
        QuantLinear.from_codes(codes, scales, zeros=zeros, precompile=False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scales_on_the_sums_take_the_zero_points_off_the_codes(dtype, tmp_path):
    """scale_on_acc with zero points: the words decode to code - z (the zero decode, its subtrahends
    made once per k-tile from z), so the k-loop has the decode of its symmetric twin (same knobs) and
    only the subtrahends' few f16x2 operations more; ptxas needs at most a few registers more than
    the twin's."""
    from tests.test_codegen_stream import ptxas_output

    knobs = stream_wgmma.Knobs(16, 1, 1, 128, 6, split_k=2, release_barriers=True, producer_warp=True, pdl=True,
                               early_start=2, stage_unroll=True, scale_on_acc=True, fold_lag=True, rotate=True)
    zp = compile_schedule(Problem(12288, 4096, 128, dtype=dtype, zero_points=True), Schedule("stream_wgmma", knobs), SM90)
    twin = compile_schedule(Problem(12288, 4096, 128, dtype=dtype), Schedule("stream_wgmma", knobs), SM90)
    source = (zp.folder / "kernel.cu").read_text()
    zero = zero_decode(dtype)
    assert source.count(zero.unscaled + "(") >= 2 and zero.scaled + "((" not in source
    decode = [k.ptx().count(".f16x2") + k.ptx().count(".bf16x2") for k in (twin, zp)]
    assert 0 < decode[0] < decode[1] <= decode[0] * 1.1, decode
    registers = [int(re.search(r"Used (\d+) registers", ptxas_output(k.ptx(), "sm_90a", tmp_path)).group(1))
                 for k in (twin, zp)]
    assert registers[1] <= registers[0] + 20 and registers[1] <= 128, registers


def test_the_fold_takes_the_activation_sums_times_the_zero_points_off():
    """fold_zero_point with zero points: the offsets' MMA sums the activations in its rows g + 8 (a
    constant A of ones there), and each fold takes that sum times z off as well: one more fp32 FMA
    per sum and fold than the symmetric fold, which takes (sums - offsets) x scale alone."""
    problem, schedule, arch = GROUPED, MMA_FOLD, SM90
    zp = compile_schedule(problem, schedule, arch)
    twin = compile_schedule(Problem(problem.n, problem.k, problem.group), schedule, arch)
    folds = [kernel.ptx().count("fma.rn.f32") for kernel in (twin, zp)]
    assert folds[1] >= 2 * folds[0] > 0, folds


# --- the tools --------------------------------------------------------------------------------------

def test_the_tools_name_zero_point_layers():
    from gen.cli import build_parser
    from gen.bench import command as bench, report
    from gen.tune.options import targets_from_args

    args = build_parser().parse_args(["tune", "--model", "llama-2-7b", "--zero-points"])
    assert all(t.problem.zero_points and t.problem.name.endswith("_zp") for t in targets_from_args(args))
    args = build_parser().parse_args(["tune", "--model", "llama-2-7b"])
    assert not any(t.problem.zero_points for t in targets_from_args(args))
    assert bench.parse_kernels("tilemarlin,tilemarlin_zp,fp16") == ["tilemarlin", "tilemarlin_zp", "fp16"]
    assert "tilemarlin_zp" not in bench.KERNELS      # timed only when named
    assert report.weight_bytes("tilemarlin_zp", 4096, 4096, 128) - report.weight_bytes("tilemarlin", 4096, 4096, 128) \
        == 32 * 4096 * 2
