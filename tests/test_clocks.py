"""gen/bench/clocks.py and the bench's clock column, without a GPU: nvidia-smi's lines parsed, a fake
nvidia-smi read in the background and cut into the windows of the batch sizes, the report's cells."""
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from gen.bench import command as bench
from gen.bench import report
from gen.bench.clocks import TIMESTAMP, ClockLog, Sample, parse_line, summarize

SAMPLE = Path(__file__).parent / "data" / "bench_sample.json"


@pytest.fixture
def sample() -> dict:
    return report.load(SAMPLE)


def smi_line(t: float, mhz: int, watts: float, reasons: int) -> str:
    return f"{datetime.fromtimestamp(t).strftime(TIMESTAMP)[:-3]}, {mhz}, {watts}, 0x{reasons:016x}"


def test_parse_line_reads_nvidia_smis_fields():
    t = time.time()
    sample = parse_line(smi_line(t, 1515, 706.49, 0x4))
    assert sample.sm_mhz == 1515 and sample.watts == 706.49 and sample.power_capped
    assert sample.t == pytest.approx(t, abs=2e-3)
    assert not parse_line(smi_line(t, 1980, 131.5, 0x0)).power_capped


@pytest.mark.parametrize("line", ["", "[N/A], 1980, 131.5, 0x0", "2026/11/30 17:04:36.160, [N/A], 80.7, 0x1",
                                  "Failed to initialize NVML: Driver/library version mismatch"])
def test_parse_line_skips_what_is_not_a_reading(line):
    assert parse_line(line) is None


def test_summarize_gives_the_clock_peak_power_and_the_share_held_down_by_the_cap():
    samples = [Sample(0, 1980, 130, 0), Sample(1, 1515, 700, 0x4), Sample(2, 1485, 690, 0x4), Sample(3, 1965, 540, 0x4),
               Sample(4, 1980, 200, 0x4)]       # the flag outlasting the load: at the top clock it does not count
    assert summarize(samples, 1980) == {"sm_mhz": 1965, "min_mhz": 1485, "max_watts": 700, "power_capped": 0.6,
                                        "readings": 5}
    assert summarize([], 1980) is None


def fake_smi(lines: list[str]) -> list[str]:
    """A stand-in for nvidia-smi: prints `lines`, then keeps running until stopped."""
    return [sys.executable, "-c", f"import sys, time\nprint('\\n'.join({lines!r}), flush=True)\ntime.sleep(30)"]


def test_clock_log_collects_in_the_background_and_cuts_windows():
    now = time.time()
    lines = [smi_line(now - 10, 1980, 130, 0), smi_line(now - 5, 1500, 700, 4), smi_line(now - 4, 1600, 650, 4),
             "garbage", smi_line(now - 1, 1980, 300, 0)]
    with ClockLog(command=fake_smi(lines)) as clocks:
        deadline = time.time() + 10
        while len(clocks.samples) < 4 and time.time() < deadline:
            time.sleep(0.05)
    assert clocks.unavailable is None and len(clocks.samples) == 4
    assert [s.sm_mhz for s in clocks.between([(now - 6, now - 3)])] == [1500, 1600]
    assert [s.sm_mhz for s in clocks.between([(now - 11, now - 9), (now - 2, now)])] == [1980, 1980]
    record = bench.clock_record(clocks, {4096: [(now - 6, now - 3)], 1: [(now - 0.5, now)]})
    assert record["by_m"]["4096"]["power_capped"] == 1.0 and record["by_m"]["4096"]["min_mhz"] == 1500
    assert record["by_m"]["1"] is None


def test_without_nvidia_smi_the_log_says_why_and_finds_nothing():
    with ClockLog(command=["no-such-nvidia-smi-here"]) as clocks:
        pass
    assert clocks.unavailable == "no-such-nvidia-smi-here not found" and clocks.between([(0, time.time())]) == []
    assert bench.clock_record(clocks, {1: [(0, 1)]}) == {"unavailable": "no-such-nvidia-smi-here not found"}
    with ClockLog(command=fake_smi([])) as silent:
        pass
    assert silent.unavailable.endswith("gave no readings")


def test_the_summary_shows_the_clock_per_batch_size(sample):
    data = {**sample, "meta": {**sample["meta"], "clocks": {"by_m": {
        str(m): {"sm_mhz": 1980.0, "min_mhz": 1980.0, "max_watts": 300.0, "power_capped": 0.0, "readings": 9}
        for m in report.batch_sizes(sample)}}}}
    m_last = str(report.batch_sizes(sample)[-1])
    data["meta"]["clocks"]["by_m"][m_last] = {"sm_mhz": 1515.0, "min_mhz": 1275.0, "max_watts": 706.0,
                                              "power_capped": 0.8, "readings": 20}
    header, rows = report.summary_table(data)
    assert header[-1] == report.CLOCK
    assert rows[0][-1] == "1980" and rows[-1][-1] == "1515 (min 1275), 80 % capped"
    text = report.markdown(data)
    assert "TFLOP/s.\nThe SM clock is" in text and "held the clock down.\n\n| M |" in text
    assert report.CLOCK not in report.summary_table(sample)[0]      # a run from before the readings


def test_a_run_without_readings_says_why(sample):
    data = {**sample, "meta": {**sample["meta"], "clocks": {"unavailable": "nvidia-smi not found"}}}
    assert report.CLOCK not in report.summary_table(data)[0]
    assert "no SM clock readings: nvidia-smi not found" in report.terminal_report(data)
    assert "no SM clock readings: nvidia-smi not found" in report.markdown(data)
