"""gen/sass.py: the SASS listing parser on a canned listing (always), and on real kernels when ptxas,
cuobjdump and nvdisasm are on PATH (they are not part of the install: see gen/sass.py)."""
import pytest

from gen.dev import sass

# A loop of cuobjdump -sass (sm_90a): two loads tracked on sb5, a consumer that waits for sb5 (wait
# mask bit 5) three instructions after the second load, and the backward branch.
LISTING = """
        /*0780*/                   LDG.E.64.CONSTANT R22, desc[UR10][R22.64] ;                       /* 0x0000000a16167981 */
                                                                                                   /* 0x000ea2000c1e9b00 */
        /*0790*/                   LDG.E.64.CONSTANT R24, desc[UR10][R24.64] ;                       /* 0x0000000a18187981 */
                                                                                                   /* 0x000f62000c1e9b00 */
        /*07a0*/                   IADD3 R1, R1, 0x1, RZ ;                                           /* 0x0000000101017810 */
                                                                                                   /* 0x000fe20007ffe0ff */
        /*07b0*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;                             /* 0x0000000f03027812 */
                                                                                                   /* 0x000fe200078ec0ff */
        /*07c0*/                   SHF.R.U32.HI R4, RZ, 0x8, R24 ;                                   /* 0x00000008ff047819 */
                                                                                                   /* 0x020fe20000011618 */
        /*07d0*/               @P0 BRA 0x780 ;                                                      /* 0xfffffffc00e80947 */
                                                                                                   /* 0x000fea000383ffff */
"""


def test_parse_reads_scoreboards_from_the_control_bits():
    code = sass.parse(LISTING)
    assert [ins.opcode for ins in code] == ["LDG", "LDG", "IADD3", "LOP3", "SHF", "BRA"]
    assert code[1].write_barrier == 5 and code[2].write_barrier == 7
    assert code[4].wait_mask == 1 << 5


def test_load_waits_follow_the_scoreboard():
    loop = sass.main_loop(sass.parse(LISTING))
    assert len(loop) == 6
    waits = sass.load_waits(loop)
    # The second load (sb5) is waited for three instructions later; the first is on sb2 (never waited).
    assert [(load.address, distance) for load, distance, _ in waits] == [(0x790, 3)]
    assert "waited for within 40 instructions: 1" in sass.report(LISTING)


def test_retry_branches_after_exit_are_not_the_main_loop():
    # ptxas puts the retry path of an mbarrier wait after EXIT, branching far back into the loop.
    tail = """
        /*07e0*/                   EXIT ;                                                            /* 0x000000000000794d */
                                                                                                   /* 0x000fea0003800000 */
        /*07f0*/                   BRA 0x700 ;                                                       /* 0xfffffffc00c07947 */
                                                                                                   /* 0x000fea000383ffff */
"""
    assert [ins.address for ins in sass.main_loop(sass.parse(LISTING + tail))][0] == 0x780


def test_no_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        sass.main_loop(sass.parse(LISTING.replace("@P0 BRA 0x780", "@P0 BRA 0x7e0")))


needs_tools = pytest.mark.skipif(bool(sass.missing_tools()), reason="ptxas, cuobjdump and nvdisasm are not all on PATH")


@needs_tools
@pytest.mark.parametrize("family,knobs", [
    ("stream_mma", dict(m_tiles=1, warps=4, unroll=4, split_k=1, ahead=3, fold_zero_point=True,
                        x_ldmatrix=True, async_weights=True)),
    ("stream_wgmma", dict(block_m=128, groups=2, warpgroups=2, block_k=64, stages=4)),
])
def test_async_weight_paths_leave_no_global_load_in_the_main_loop(family, knobs, tmp_path):
    from runtime.kernels import compile_schedule
    from schedules.arch import get_arch
    from schedules.problem import Problem
    from schedules.registry import Schedule, family as family_named

    kernel = compile_schedule(Problem(4096, 4096), Schedule(family, family_named(family).Knobs(**knobs)),
                              get_arch("sm_90a"))
    kernel.export_ptx(str(tmp_path / "k.ptx"))
    loop = sass.main_loop(sass.parse(sass.disassemble((tmp_path / "k.ptx").read_text(), "sm_90a")))
    assert sass.load_waits(loop) == []
    assert not any(ins.opcode == "LDG" for ins in loop)


@needs_tools
def test_ptxas_findings_name_registers_and_serialized_wgmmas(tmp_path):
    from runtime.kernels import compile_schedule
    from schedules.arch import get_arch
    from schedules.problem import Problem
    from schedules.registry import Schedule
    from schedules.stream_wgmma import Knobs

    tma = Knobs(128, 1, 2, 64, 4)
    kernel = compile_schedule(Problem(4096, 4096), Schedule("stream_wgmma", tma), get_arch("sm_90a"))
    kernel.export_ptx(str(tmp_path / "k.ptx"))
    findings = sass.ptxas_findings((tmp_path / "k.ptx").read_text(), "sm_90a")
    assert any(line.startswith("Used ") and "registers" in line for line in findings)
    assert not any("serialized" in line for line in findings)


def test_conversions_before_the_last_wgmma_wait_are_found():
    listing = LISTING.replace("IADD3 R1, R1, 0x1, RZ", "HGMMA.64x128x16.F32 R24, R88, gdesc[UR12], R24, gsb0") \
        .replace("LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT", "F2FP.F16.F32.PACK_AB R4, R87, R86") \
        .replace("SHF.R.U32.HI R4, RZ, 0x8, R24", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    early = sass.conversions_before_the_last_wait(sass.parse(listing))
    assert [ins.address for ins in early] == [0x7b0]
    assert sass.conversions_before_the_last_wait(sass.parse(LISTING)) == []


@needs_tools
@pytest.mark.parametrize("shape,knobs", [
    # the large-M winners' forms: plain TMA pipeline with two warpgroups, and the producer warpgroup
    ((12288, 4096), dict(block_m=128, groups=1, warpgroups=2, block_k=64, stages=4)),
    ((12288, 4096), dict(block_m=256, groups=1, warpgroups=2, block_k=64, stages=4, release_barriers=True,
                         producer_warp=True, setmaxnreg=True)),
    # the two staged_store kernels that once measured wrong (docs/performance.md, staged_store)
    ((12288, 4096), dict(block_m=128, groups=1, warpgroups=2, block_k=64, stages=4, staged_store=True)),
    ((4096, 11008), dict(block_m=128, groups=1, warpgroups=2, block_k=128, stages=4, release_barriers=True,
                         producer_warp=True, staged_store=True)),
])
def test_the_sums_are_converted_after_the_last_wgmma_wait(shape, knobs, tmp_path):
    from runtime.kernels import compile_schedule
    from schedules import stream_wgmma
    from schedules.arch import get_arch
    from schedules.problem import Problem
    from schedules.registry import Schedule

    schedule = Schedule("stream_wgmma", stream_wgmma.Knobs(**knobs))
    compile_schedule(Problem(*shape, 128), schedule, get_arch("sm_90a")).export_ptx(str(tmp_path / "k.ptx"))
    code = sass.parse(sass.disassemble((tmp_path / "k.ptx").read_text(), "sm_90a"))
    assert any(ins.opcode == "F2FP" for ins in code)
    assert sass.conversions_before_the_last_wait(code) == []
