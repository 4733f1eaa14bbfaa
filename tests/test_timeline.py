"""gen timeline on the CPU: the stamps land at the kernel's landmarks and compile for sm_90a in both
stream families; the summary reads a stamp buffer."""
import re

import pytest

from gen.dev.timeline import RING, compile_stamped, most_at_once, stamp_source, summarize
from schedules import stream_mma, stream_wgmma
from schedules.arch import get_arch
from schedules.problem import Problem

SM90 = get_arch("sm_90a")
PRODUCER = dict(release_barriers=True, producer_warp=True)
CASES = {
    # qkv 16's form: 2 splits in a cluster (griddepcontrol.wait), the mbarrier pipeline
    "stream_wgmma_cluster": (stream_wgmma, stream_wgmma.Knobs(16, 1, 1, 128, 6, split_k=2, cluster_reduce=True,
                                                              early_start=2, stage_unroll=True, **PRODUCER)),
    # o_proj 16's form: pdl (cudaGridDependencySynchronize), cp.async groups
    "stream_mma_pdl": (stream_mma, stream_mma.Knobs(m_tiles=1, warps=8, unroll=4, split_k=1, ahead=4,
                                                    fold_zero_point=True, x_ldmatrix=True, async_weights=True,
                                                    sum_slices=True, pdl=True, early_start=2, late_trigger=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def stamped(request):
    import tilelang

    fam, knobs = CASES[request.param]
    problem = Problem(4096, 4096, 128)
    assert fam.check(problem, knobs, SM90) is None
    before = tilelang.env.is_cache_enabled()      # off once this process built a store kernel
    kernel, plain = compile_stamped(fam, problem, knobs, SM90, 0x7f0000001000, 0x7f0000002000, 1024)
    assert tilelang.env.is_cache_enabled() == before   # as it was before the stamped compile
    return plain, kernel.get_kernel_source()


def test_stamps_mark_every_landmark_and_compile(stamped):
    plain, source = stamped
    for point in range(5):
        assert len(re.findall(rf"tm_ts\[{point}\] = tm_globaltimer\(\)", source)) == 1, point
    body = source[source.index('extern "C" __global__ void __launch_bounds__'):]
    # in order: entry, the wait for the previous kernel, the first stage, the k-loop's end, the exit
    at = [body.index(f"tm_ts[{point}] = tm_globaltimer()") for point in range(5)]
    assert at == sorted(at)
    assert re.search(r"(tm_wait_for_prior_grids|cudaGridDependencySynchronize)\(\); if \(tm_zero\) tm_ts\[1\]", body)
    # thread 0 writes them, into shared memory (not registers held through the kernel)
    assert "__shared__ unsigned long long tm_ts[5];" in body and "bool tm_zero = threadIdx.x == 0;" in body
    assert all(f"if (tm_zero) tm_ts[{p}] = tm_globaltimer();" in body for p in (1, 3, 4))
    assert "0x7f0000001000"[2:] not in body and str(0x7f0000001000) in body     # the buffer, as a constant
    assert "tm_globaltimer" not in plain


def test_a_kernel_without_a_wait_is_past_it_at_entry_and_blocks_past_the_buffer_write_nothing():
    code = 'extern "C" __global__ void k(int* x) {\n  x[0] = 1;\n}\n'
    source = stamp_source(code, 4096, 8192, 64)
    # zeroed first, then the entry stamp, which the wait's stamp copies
    assert "tm_ts[1] = tm_ts[2] = tm_ts[3] = 0; tm_ts[0] = tm_globaltimer(); tm_ts[1] = tm_ts[0];" in source
    assert "threadIdx.x == 0 && tm_block < 64u" in source


def test_stamps_leave_the_registers_and_so_the_blocks_per_sm_as_they_were(tmp_path):
    # down_proj 16's table form sits at 128 registers, the most that lets 3 blocks of 160 threads share
    # an SM; stamps held in registers took it to 134 and to 2 blocks per SM (a second wave)
    from runtime.kernels import compile_schedule
    from schedules.registry import Schedule
    from tests.test_codegen_stream import ptxas_output

    problem = Problem(4096, 11008, 128)
    knobs = stream_wgmma.Knobs(16, 1, 1, 128, 6, split_k=6, pdl=True, early_start=2, panel_m=4, stage_unroll=True,
                               scale_on_acc=True, fold_lag=True, rotate=True, **PRODUCER)
    assert stream_wgmma.check(problem, knobs, SM90) is None
    stamped, _ = compile_stamped(stream_wgmma, problem, knobs, SM90, 0x7f0000001000, 0x7f0000002000, 1024)
    plain = compile_schedule(problem, Schedule("stream_wgmma", knobs), SM90)
    used = {}
    for name, kernel in (("plain", plain), ("stamped", stamped)):
        ptx = tmp_path / f"{name}.ptx"
        kernel.export_ptx(str(ptx))
        (tmp_path / name).mkdir()
        out = ptxas_output(ptx.read_text(), "sm_90a", tmp_path / name)
        used[name] = int(re.search(r"Used (\d+) registers", out).group(1))
    assert used["stamped"] <= used["plain"] + 2 and used["stamped"] <= 128, used


def test_a_source_without_a_kernel_is_refused():
    with pytest.raises(ValueError, match="no kernel definition"):
        stamp_source("__device__ void f() {}", 1, 2, 8)


def test_summary_times_each_call_from_the_previous_exit():
    # 4 blocks on 2 SMs (3 + 1), 3 calls 10 us apart; in each call the blocks wait 0.5 us, see their
    # first stage 0.5 us later, loop 7 us and leave 1 us later, the block alone on its SM 1 us earlier.
    stamps = [[[0] * 8 for _ in range(4)] for _ in range(RING)]
    for call in range(3):
        start = call * 10_000
        for b in range(4):
            alone = b == 3
            exit_ns = start + 10_000 - (1000 if alone else 0)
            stamps[call % RING][b][:7] = [start, start + 500, start + 1000, start + 8000, exit_ns, 1 if alone else 0, 4]
    report = summarize(stamps, 3)
    lines = report.splitlines()
    assert lines[0].startswith("4 blocks")
    first = lines[2].split("|")
    assert first[0].split() == ["1", "10.00"]              # period: last exit to last exit
    assert first[1].split() == ["0.00", "0.00", "0.00"]    # entries at the previous call's last exit
    assert first[3].split() == ["0.50", "0.50"] and first[4].split() == ["7.00", "7.00"]
    assert "SMs with 1 block(s): 1 blocks, exit median 9.00" in report
    assert "SMs with 3 block(s): 3 blocks, exit median 10.00" in report
    # blocks 0-2 on SM 0, block 3 on SM 1: the first two (as many as SMs) share an SM
    assert "launch order, 2 blocks at a time: [1, 2] different SMs" in report
    assert "at most 3 block(s) at once on an SM; 0 block(s) entered after" in report
    with pytest.raises(ValueError, match="two recorded calls"):
        summarize(stamps, 1)


def test_summary_counts_blocks_that_waited_for_a_slot_on_their_sm():
    # 3 blocks on SM 0 per call: two at once from the start, the third entering when the first leaves.
    stamps = [[[0] * 8 for _ in range(3)] for _ in range(RING)]
    for call in range(2):
        start = call * 20_000
        for b, (entry, exit_) in enumerate([(0, 6000), (0, 9000), (6000, 12_000)]):
            stamps[call % RING][b][:7] = [start + entry, start + entry, 0, 0, start + exit_, 0, 3]
    report = summarize(stamps, 2)
    assert "SMs with 3 block(s)" in report
    assert "at most 2 block(s) at once on an SM; 1 block(s) entered after a block of the call had left" in report


def test_most_at_once_counts_overlapping_spans_only():
    assert most_at_once([(0, 5), (5, 9), (1, 2)]) == 2       # (0, 5) with (1, 2); (5, 9) starts as (0, 5) ends
    assert most_at_once([(0, 10), (1, 9), (2, 8)]) == 3
