"""stream_mma code generation without a GPU: nvcc compiles each schedule for an explicit arch, and the
PTX must show the family's design: weights streamed from global memory into registers (no shared-memory
weights, cp.async and ldmatrix only for x_ldmatrix's activations), the lop3 decode, swapped m16n8k16 MMAs, register buffers that stay
in registers, and the split-K epilogue only when split."""
import dataclasses
import re
import shutil
import subprocess

import pytest

from runtime.kernels import build_kernel, compile_schedule
from schedules import stream_mma
from schedules.arch import SM90_SHARED_PER_SM, get_arch
from schedules.problem import Problem
from schedules.registry import Schedule

Knobs = stream_mma.Knobs

CASES = {
    # arch, problem, knobs (at most a handful: every case is one nvcc run of several seconds).
    # split-K, two m-tiles, group scales on the decoded weights.
    "sm80_splitk_scale_on_weights": ("sm_80", Problem(256, 2048, 128), Knobs(2, 4, 4, 2, ahead=2)),
    # three batches in flight in register buffers.
    "sm90a_ahead3": ("sm_90a", Problem(512, 1024, 128), Knobs(1, 4, 4, 1, ahead=3)),
    # channelwise with split-K, a single register buffer.
    "sm90a_channelwise_splitk": ("sm_90a", Problem.make(256, 512, -1), Knobs(1, 4, 2, 2, ahead=1)),
    # raw codes into the MMA, zero point and scale on the sums; bf16 on sm_80 for the other template.
    "sm80_bf16_fold_zero_point": ("sm_80", Problem(256, 1024, 128, dtype="bfloat16"),
                                  Knobs(2, 4, 4, 2, ahead=1, fold_zero_point=True)),
    # activations staged per warp by cp.async and read by ldmatrix, two batches in flight.
    "sm90a_x_ldmatrix": ("sm_90a", Problem(512, 1024, 128), Knobs(2, 4, 4, 1, ahead=2, x_ldmatrix=True)),
    # every load of the k-loop a cp.async into the warp's slots: weights and scales too, three batches ahead.
    "sm90a_async_weights": ("sm_90a", Problem(512, 2048, 128), Knobs(1, 4, 4, 1, ahead=3, fold_zero_point=True,
                                                                   x_ldmatrix=True, async_weights=True)),
    # split-K through a thread-block cluster and distributed shared memory instead of the workspace.
    "sm90a_cluster_reduce": ("sm_90a", Problem(512, 1024, 128), Knobs(1, 2, 4, 4, ahead=1, cluster_reduce=True)),
    # the warps' sums meet through a slice each, then the cluster's split-K.
    "sm90a_sum_slices": ("sm_90a", Problem(512, 4096, 128), Knobs(1, 4, 4, 2, ahead=2, fold_zero_point=True,
                                                                cluster_reduce=True, sum_slices=True)),
    # ... with 8 ranks, 2 chunks of a row each; with 3, whose chunks do not divide a row
    "sm90a_cluster8": ("sm_90a", Problem(512, 4096, 128), Knobs(1, 4, 4, 8, ahead=1, cluster_reduce=True)),
    "sm90a_cluster3": ("sm_90a", Problem(512, 4096, 128), Knobs(1, 4, 8, 3, ahead=1, fold_zero_point=True,
                                                             cluster_reduce=True, sum_slices=True)),
    # ... and through the workspace (two m-tiles)
    "sm90a_split4": ("sm_90a", Problem(512, 4096, 128), Knobs(2, 4, 4, 4, ahead=1, fold_zero_point=True)),
    "sm80_split4": ("sm_80", Problem(512, 4096, 128), Knobs(2, 4, 4, 4, ahead=1, fold_zero_point=True)),
    # launched with programmatic stream serialization, split-K through the workspace.
    "sm90a_pdl_splitk": ("sm_90a", Problem(512, 4096, 128), Knobs(1, 4, 4, 2, ahead=2, fold_zero_point=True,
                                                                pdl=True)),
    # the next kernel launched early, the first two batches' weights asked of L2 before the wait.
    "sm90a_early_start": ("sm_90a", Problem(512, 4096, 128), Knobs(1, 4, 4, 2, ahead=1, fold_zero_point=True,
                                                                 cluster_reduce=True, sum_slices=True,
                                                                 early_start=2)),
    # ... with the next kernel's launch after the k-loop (a workspace split, launched by pdl)
    "sm90a_early_start_late_trigger": ("sm_90a", Problem(512, 4096, 128),
                                       Knobs(1, 4, 8, 2, ahead=1, fold_zero_point=True, sum_slices=True, pdl=True,
                                             early_start=2, late_trigger=True)),
    # each batch's sums folded during the next one: on Ampere from register buffers, and down_proj 16's
    # shape (two m-tiles, four cp.async slots)
    "sm80_fold_lag": ("sm_80", Problem(512, 4096, 128), Knobs(1, 4, 4, 2, ahead=2, fold_zero_point=True,
                                                              fold_lag=True)),
    "sm90a_fold_lag": ("sm_90a", Problem(4096, 11008, 128),
                       Knobs(2, 8, 4, 2, ahead=4, fold_zero_point=True, cluster_reduce=True, x_ldmatrix=True,
                             async_weights=True, sum_slices=True, fold_lag=True)),
    # W4A8 on the weight stream: the activations rounded to their FP8 values in registers, after
    # ldmatrix (qkv_proj M = 1's form) and straight from global memory into bf16 registers
    "sm90a_fp8_rounded": ("sm_90a", Problem(12288, 4096, 128, act="fp8_rounded"),
                          Knobs(1, 4, 4, 2, ahead=3, fold_zero_point=True, cluster_reduce=True, x_ldmatrix=True,
                                async_weights=True, sum_slices=True, early_start=2)),
    "sm90a_fp8_rounded_bf16_registers": ("sm_90a", Problem(512, 4096, 128, dtype="bfloat16", act="fp8_rounded"),
                                         Knobs(2, 4, 4, 2, ahead=2, fold_zero_point=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_are_valid_schedules(name):
    arch, problem, knobs = CASES[name]
    assert stream_mma.check(problem, knobs, get_arch(arch)) is None


KERNELS = [(problem, Schedule("stream_mma", knobs), get_arch(arch)) for arch, problem, knobs in CASES.values()]


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    arch, problem, knobs = CASES[request.param]
    kernel = compile_schedule(problem, Schedule("stream_mma", knobs), get_arch(arch))
    ptx_path = tmp_path_factory.mktemp("ptx") / "kernel.ptx"
    kernel.export_ptx(str(ptx_path))
    return arch, problem, knobs, kernel.get_kernel_source(), ptx_path.read_text()


def ptxas_output(ptx: str, arch: str, tmp_path) -> str:
    """What `ptxas -v` prints for `ptx`: register allocation and wgmma scheduling happen there, the
    PTX cannot show them."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not found")
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "kernel.cubin")],
                         capture_output=True, text=True, check=True)
    return res.stdout + res.stderr


def ptxas_spills(ptx: str, arch: str, tmp_path) -> tuple[int, int]:
    """(spill store bytes, spill load bytes) that ptxas reports for `ptx`."""
    out = ptxas_output(ptx, arch, tmp_path)
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    assert found, out
    return int(found.group(1)), int(found.group(2))


def count(pattern, text):
    return len(re.findall(pattern, text))


def kernel_body(src):
    return src.split("__global__", 1)[1]


def test_ptx_targets_the_requested_arch(compiled):
    arch, *_, ptx = compiled
    assert re.search(rf"\.target\s+{arch}\b", ptx)


def test_weights_stream_from_global_memory_into_registers(compiled):
    *_, knobs, _, ptx = compiled
    if knobs.async_weights:   # through the warp's shared slots instead (next test)
        return
    assert count(r"ld\.global\.nc\.L1::no_allocate\.v4", ptx) > 0


def test_async_weights_leave_no_global_load_in_the_k_loop(compiled):
    # ptxas waits for all of a loop's global loads on one scoreboard (docs/performance.md, cp.async warp
    # slots): with async_weights the k-loop's only global reads are cp.async, waited for per batch with
    # cp.async.wait_group.
    *_, knobs, src, _ = compiled
    loop = k_loop(kernel_body(src))
    if not knobs.async_weights:
        assert "tm_load_stream_16B" in loop
        return
    assert "tm_load_stream_16B" not in loop
    assert not re.search(r"= S\[", loop) and not re.search(r"= A\[", loop)    # no scale or activation reads
    assert count(r"cp_async_gs", loop) >= 2 and "tm_cp_async_l1_16B" in loop and "cp_async_wait" in loop


def test_weights_never_go_through_shared_memory(compiled):
    *_, knobs, _, ptx = compiled
    if knobs.async_weights:   # they do, by design
        assert count(r"cp\.async\.cg\.shared\.global", ptx) > 0
        return
    if knobs.x_ldmatrix:     # only the activations do: 16 bytes per cp.async, through L1
        assert count(r"cp\.async\.cg", ptx) == 0
        assert count(r"cp\.async\.ca\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx) > 0
        return
    assert count(r"cp\.async(?!\.bulk\.prefetch\.L2)", ptx) == 0    # early_start's L2 prefetch lands nowhere
    assert count(r"ldmatrix", ptx) == 0


def test_activation_slots_zero_fill_rows_past_m(compiled):
    # Rows past M that repeated row M-1 made every warp ask L2 for the same lines (at M = 1 eight
    # times over; docs/performance.md, cp.async warp slots). They are zero-filled instead: every
    # activation chunk's copy takes a condition on m (its source size is 0 when false).
    *_, knobs, src, _ = compiled
    if not knobs.x_ldmatrix:
        return
    body = kernel_body(src)
    copies = re.findall(r"tm_cp_async_l1_16B\([^;]*;", body)
    assert copies
    for copy in copies:
        assert "X_s" in copy and re.search(r"< m\)\);$", copy), copy
    assert not re.search(r"cp_async_gs[^;]*X_s", body)


def test_register_buffers_stay_in_registers(compiled):
    *_, ptx = compiled
    # Any dynamically indexed w/x/scale/a/acc buffer would become a local-memory array.
    assert count(r"\bld\.local", ptx) == 0
    assert count(r"\bst\.local", ptx) == 0


def test_ptxas_spills_nothing(compiled, tmp_path):
    arch, *_, ptx = compiled
    assert ptxas_spills(ptx, arch, tmp_path) == (0, 0)


def braced(src: str, start: int) -> str:
    """src from `start` to the brace that closes the first one opened there."""
    depth, i = 0, src.index("{", start)
    for i in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[start:i + 1]
    raise AssertionError("unbalanced braces")


def k_loop(src: str) -> str:
    """The source of the kernel's main loop over batches (`for (int it0 = 0; ...) { ... }`, unrolled by `ahead` inside)."""
    return braced(src, src.index("for (int it0 = 0;"))


def test_no_block_barrier_inside_the_k_loop(compiled):
    # The family's point: warps stream on their own and meet once, after the loop.
    *_, knobs, src, ptx = compiled
    loop = k_loop(kernel_body(src))
    assert "__syncthreads" not in loop and "sync_thread_partial" not in loop
    if knobs.x_ldmatrix:      # a warp's own cp.async chunks are waited for and shared within the warp only
        assert "cp_async_wait" in loop and "__syncwarp" in loop and "ldmatrix" in loop
        assert count(r"cp\.async\.ca\.shared\.global", ptx) > 0
        assert count(r"ldmatrix\.sync\.aligned\.x4\.m8n8\.shared\.b16", ptx) > 0


def test_swapped_tensor_core_mma(compiled):
    _, problem, *_, ptx = compiled
    ab = "f16" if problem.dtype == "float16" else "bf16"
    assert count(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ab}\.{ab}\.f32", ptx) > 0


def test_lop3_decode_in_a_fragment_order(compiled):
    _, problem, knobs, src, ptx = compiled
    assert count(r"lop3\.b32", ptx) >= 4
    body = kernel_body(src)
    name = "f16_u4" if problem.dtype == "float16" else "bf16_u4"
    plain, scaled, raw = f"tm_dequant_a_{name}(", f"tm_dequant_scaled_a_{name}(", f"tm_decode_raw_a_{name}("
    if knobs.fold_zero_point:
        assert raw in body and plain not in body and scaled not in body
    elif not problem.channelwise:
        assert scaled in body
    else:
        assert plain in body and scaled not in body
    # Never the B-order decode of marlin_mma: its pairs would land in the wrong A registers.
    assert f"tm_dequant_{name}(" not in body and f"tm_dequant_scaled_{name}(" not in body


def test_half_precision_arithmetic_per_weight_only_without_fold(compiled):
    # The decode hands raw codes to the MMA: no subtraction, fma or multiply on packed halves, and one
    # extra MMA per k-step and m-tile (the offsets) on top of one per word and m-tile.
    _, problem, knobs, _, ptx = compiled
    half_ops = count(r"(sub|fma|mul)(\.rn)?\.(f16x2|bf16x2)", ptx)
    if not knobs.fold_zero_point:
        assert half_ops > 0          # the pattern does see the decode's arithmetic where it is
        return
    assert half_ops == 0
    per_batch = knobs.unroll * knobs.m_tiles * (4 + 1)
    assert count(r"mma\.sync\.aligned\.m16n8k16", ptx) % per_batch == 0


def test_fp8_rounded_rounds_every_activation_register_before_the_mmas(compiled):
    """Each register of two activations: add the rounding bias and the last kept bit, then clear the
    dropped bits (7 of float16's mantissa: 0xFF80FF80, 4 of bfloat16's: 0xFFF0FFF0), once per register
    of a batch in each of the unrolled loop's `ahead` copies of it."""
    _, problem, knobs, src, ptx = compiled
    masks = re.findall(r"\band\.b32\s+%r\d+, %r\d+, (-8323200|-983056);", ptx)
    registers = knobs.unroll * knobs.m_tiles * 2
    if not problem.rounds_fp8:
        assert not masks and "tm_round_e4m3" not in src
        return
    assert set(masks) == {"-8323200" if problem.dtype == "float16" else "-983056"}
    assert len(masks) >= registers * knobs.ahead
    # the rounded registers are the MMAs' B operands: no other conversion of the activations
    assert count(r"\bcvt\.\w*e4m3", ptx) == 0


def test_split_k_reduction_present_only_when_split(compiled):
    arch, problem, knobs, src, ptx = compiled
    body = kernel_body(src)
    global_f32_adds = count(r"(atom|red)\.global(\.\w+)*\.add(\.v4)?\.f32", ptx)
    counter_adds = count(r"atom\.global(\.\w+)*\.add\.(u32|s32)", ptx)
    cluster_ops = count(r"barrier\.cluster\.(arrive|wait)", ptx), count(r"ld\.shared::cluster", ptx)
    if not knobs.uses_workspace:
        assert "tm_split_k_arrive" not in body
        assert global_f32_adds == 0 and counter_adds == 0
        assert not re.search(r"__global__ void[^(]*\([^)]*\bws\b", src)
        if knobs.cluster_reduce:  # two cluster barriers, and each split's share read from every block
            assert cluster_ops[0] >= 4 and cluster_ops[1] > 0 and count(r"mapa\.shared::cluster", ptx) > 0
        else:
            assert cluster_ops == (0, 0)
        return
    assert "tm_split_k_arrive(" in body and "tm_workspace_store(" in body   # the last block's read-back
    assert global_f32_adds > 0     # fp32 partials into the global workspace
    assert counter_adds > 0        # the per-tile arrival counter


def test_registers_are_left_to_the_compiler(compiled):
    # No minimum of blocks per SM (TileLang writes the default 1): a register cap for occupancy measured
    # slower (docs/performance.md).
    *_, knobs, src, _ = compiled
    assert re.search(rf"__launch_bounds__\({knobs.threads}(, 1)?\)", kernel_body(src))


def test_one_kernel_serves_any_m(compiled):
    *_, src, _ = compiled
    assert re.search(r"__global__ void .*\bint m\b", src)


def test_warps_sums_meet_in_turn_or_through_slices(compiled):
    *_, knobs, src, _ = compiled
    body = kernel_body(src)
    after = body[body.index(k_loop(body)) + len(k_loop(body)):]
    in_turn = re.search(r"if \(\(\(\(int\)threadIdx\.x\) >> 5\) == r", after)
    if knobs.sum_slices:
        # every warp stores at once, then a barrier, then one element's slices are added per thread
        assert "P_s" in after and not in_turn
        stores = after[:after.index("__syncthreads", after.index("P_s"))]
        assert "P_s" in stores
    else:
        assert in_turn and "P_s" not in after


def test_split_k_sums_move_whole_vectors(compiled):
    arch, _, knobs, _, ptx = compiled
    assert_split_sums_move_vectors(knobs, ptx, hopper=arch == "sm_90a")


def assert_split_sums_move_vectors(knobs, ptx: str, hopper: bool = True):
    """Split-K (the three mma families): every access to the other blocks' partial sums is 16 bytes
    wide and unrolled, a thread's share of the tile in ceil(chunks / threads) accesses (before sm_90
    the workspace's reductions are four 4-byte ones: no 16-byte float reduction there)."""
    remote = count(r"ld\.shared::cluster\.v4\.f32", ptx)
    reduced = count(r"(atom|red)\.global(\.\w+)*\.v4\.f32", ptx)
    read_back = count(r"ld\.global\.cg\.v4\.f32", ptx)
    if knobs.split_k == 1:
        assert remote == read_back == 0
        return
    chunks = knobs.block_m * knobs.block_n // 4
    if getattr(knobs, "cluster_reduce", False):    # per rank, its share of the 4-column chunks
        per_thread = -(-(-(-chunks // knobs.split_k)) // knobs.threads)
        assert remote == count(r"ld\.shared::cluster", ptx) == per_thread * knobs.split_k
        assert reduced == read_back == 0
    elif getattr(knobs, "split_wait", False):     # stored into slots, read by the last split
        polled = count(r"ld\.relaxed\.gpu\.global\.v4\.u32", ptx)
        assert remote == read_back == reduced == 0
        assert polled == (knobs.split_k - 1) * -(-chunks // knobs.threads)
    else:                          # the workspace: added and (by the tile's last block) read back
        per_thread = -(-chunks // knobs.threads)
        scalar = count(r"(atom|red)\.global(\.\w+)*\.add\.f32", ptx)
        assert remote == 0 and read_back == per_thread
        assert (reduced, scalar) == ((per_thread, 0) if hopper else (0, 4 * per_thread))


def test_a_cluster_kernel_waits_for_the_previous_kernel_before_it_reads(compiled):
    # as for stream_wgmma: a cluster kernel may start before the previous kernel's writes are visible
    # (or, with pdl, one that asked for that launch: TileLang's pdl_sync, cudaGridDependencySynchronize)
    *_, knobs, src, ptx = compiled
    if not (knobs.cluster_reduce or knobs.pdl):
        assert "griddepcontrol" not in ptx
        return
    assert count(r"griddepcontrol\.wait", ptx) == 1
    body = kernel_body(src)
    first_read = min(i for i in (body.find("tm_load_stream_16B"), body.find("cp_async"), body.find("A["),
                                 body.find("C[")) if i >= 0)
    wait = "tm_wait_for_prior_grids();" if knobs.cluster_reduce else "cudaGridDependencySynchronize();"
    assert -1 < body.find(wait) < first_read


def test_early_start_prefetches_weights_before_the_wait_and_launches_dependents(compiled):
    *_, knobs, _, ptx = compiled
    prefetches = count(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)
    if not knobs.early_start:
        assert prefetches == 0 and "launch_dependents" not in ptx
        return
    # one weight row per lane and one scale row per batch: both unrolled over the batches
    assert prefetches == 2 * knobs.early_start
    launch, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert count(r"griddepcontrol\.launch_dependents", ptx) == 1
    # first, or with late_trigger after the k-loop: behind the last weight load, before the sums meet
    if knobs.late_trigger:
        last_weight_load = max(m.start() for m in re.finditer(r"ld\.global\.nc\.L1::no_allocate", ptx))
        assert launch > last_weight_load
    else:
        assert launch < wait
    assert all(m.start() < wait for m in re.finditer(r"cp\.async\.bulk\.prefetch", ptx))
    # nothing is loaded from global memory into registers before the wait
    assert not re.search(r"ld\.global", ptx[:wait])


def test_early_start_needs_a_programmatic_launch():
    problem = Problem(512, 4096, 128)
    assert "pdl or cluster_reduce" in stream_mma.check(problem, Knobs(1, 4, 4, 2, early_start=1), get_arch("sm_90a"))
    assert "must be 0" in stream_mma.check(problem, Knobs(1, 4, 4, 2, pdl=True, early_start=-1), get_arch("sm_90a"))
    assert stream_mma.check(problem, Knobs(1, 4, 4, 2, pdl=True, early_start=4), get_arch("sm_90a")) is None
    assert "needs early_start" in stream_mma.check(problem, Knobs(1, 4, 4, 2, pdl=True, late_trigger=True),
                                                   get_arch("sm_90a"))


def test_pdl_asks_the_launcher_for_programmatic_serialization():
    # TileLang tags a kernel that calls pdl_sync; TVM's launcher then sets the launch attribute. The tag
    # is in the compiled library of the pdl kernel only.
    arch, problem, knobs = CASES["sm90a_pdl_splitk"]
    tag = b"tirx.use_programtic_dependent_launch"
    for pdl in (True, False):
        kernel = compile_schedule(problem, Schedule("stream_mma", dataclasses.replace(knobs, pdl=pdl)), get_arch(arch))
        library = kernel.folder / "kernel.so"
        assert (tag in library.read_bytes()) == pdl


def test_pdl_is_refused_where_it_cannot_apply():
    problem = Problem(512, 4096, 128)
    assert "sm_90" in stream_mma.check(problem, Knobs(pdl=True), get_arch("sm_80"))
    assert "cluster" in stream_mma.check(problem, Knobs(1, 4, 4, 2, cluster_reduce=True, pdl=True),
                                         get_arch("sm_90a"))


def test_fold_lag_needs_the_fold_and_an_even_ahead():
    problem, arch = Problem(512, 4096, 128), get_arch("sm_90a")
    assert "needs fold_zero_point" in stream_mma.check(problem, Knobs(1, 4, 4, 2, ahead=2, fold_lag=True), arch)
    assert "even ahead" in stream_mma.check(problem, Knobs(1, 4, 4, 2, ahead=3, fold_zero_point=True,
                                                           fold_lag=True), arch)
    assert stream_mma.check(problem, Knobs(1, 4, 4, 2, ahead=2, fold_zero_point=True, fold_lag=True), arch) is None


def test_fold_lag_keeps_two_sets_of_sums_and_no_more_mmas(tmp_path):
    """The lag costs registers (a second set of sums, offsets and scales), not MMAs or spills."""
    arch, problem, knobs = CASES["sm90a_fold_lag"]
    sources = {}
    for lag in (False, True):
        kernel = build_kernel(problem, Schedule("stream_mma", dataclasses.replace(knobs, fold_lag=lag)),
                              get_arch(arch))
        ptx = tmp_path / f"lag{lag}.ptx"
        kernel.export_ptx(str(ptx))
        sources[lag] = (kernel.get_kernel_source(), ptx.read_text())
    sums = 4 * knobs.m_tiles * 4
    assert re.search(rf"float acc\[{sums}\]", sources[False][0])
    assert re.search(rf"float acc\[{2 * sums}\]", sources[True][0])
    assert count(r"mma\.sync", sources[True][1]) == count(r"mma\.sync", sources[False][1])
    assert ptxas_spills(sources[True][1], arch, tmp_path) == (0, 0)


def padded_launches(problem: Problem, schedule: Schedule, max_blocks: int) -> tuple[int, int, str, str]:
    """Compile `schedule` without and with max_blocks: (dynamic shared bytes of each launch, each
    kernel's source). TileLang's host code passes the launch's shared memory as an int64 constant;
    padding changes that constant and nothing else among them."""
    padded = Schedule(schedule.family, dataclasses.replace(schedule.knobs, max_blocks=max_blocks))
    kernels = [build_kernel(problem, s, get_arch("sm_90a")) for s in (schedule, padded)]
    plain, capped = ({int(v) for v in re.findall(r"\(\(int64_t\)(\d+)\)", k.get_host_source())} for k in kernels)
    (before,), (after,) = plain - capped, capped - plain
    return before, after, kernels[0].get_kernel_source(), kernels[1].get_kernel_source()


def blocks_per_sm(shared_bytes: int) -> int:
    return SM90_SHARED_PER_SM // (shared_bytes + 1024)


@pytest.mark.parametrize("max_blocks", (1, 2))
def test_max_blocks_caps_the_blocks_per_sm_by_shared_memory(max_blocks):
    """max_blocks pads the warps' activation slots: the kernel launches with shared memory for at most
    B blocks per SM (down_proj M = 8's form two batches deep fits 4 unpadded; at its own 4 batches 2);
    the code is the same but for the slots' offsets."""
    problem = Problem(4096, 11008, 128)
    knobs = Knobs(1, 8, 4, 2, 2, x_ldmatrix=True, async_weights=True, fold_zero_point=True,
                  cluster_reduce=True, sum_slices=True, early_start=2, late_trigger=True)
    assert stream_mma.check(problem, dataclasses.replace(knobs, max_blocks=max_blocks), get_arch("sm_90a")) is None
    assert stream_mma.check(problem, dataclasses.replace(knobs, max_blocks=1), get_arch("sm_80"))
    before, after, src, padded_src = padded_launches(problem, Schedule("stream_mma", knobs), max_blocks)
    assert blocks_per_sm(before) > 2 and blocks_per_sm(after) == max_blocks
    assert re.sub(r"\d+", "#", padded_src) == re.sub(r"\d+", "#", src)
