"""What the GPU's clocks did while `gen bench` timed: nvidia-smi's readings of the SM clock, the board
power and the active clock-throttle reasons, sampled in the background, so that a report says when a
ratio was taken under the power limit. On the H200 at M = 4096 both tilemarlin and FP16 ran at
1.3-1.6 GHz instead of 1.98, held there by the 700 W cap, and the clock of each round decided the
ratio more than the kernels did (H200; docs/performance.md).
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from dataclasses import dataclass
from datetime import datetime

# nvidia-smi's own timestamp dates each reading: its output to a pipe may arrive in bursts.
QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"
# clocks_throttle_reasons.active bits (nvidia-smi -q): the board's software and hardware power caps.
POWER_CAP_BITS = 0x4 | 0x80


@dataclass(frozen=True)
class Sample:
    t: float          # when it was read, as time.time() (nvidia-smi's local timestamp)
    sm_mhz: float
    watts: float
    reasons: int      # clocks_throttle_reasons.active

    @property
    def power_capped(self) -> bool:
        """The power cap is among the throttle reasons. The flag can outlast the load that raised it
        (readings at full clock during M = 1 after an M = 4096 point had it), so summarize counts
        only readings with the clock also below the run's top clock."""
        return bool(self.reasons & POWER_CAP_BITS)


def parse_line(line: str) -> Sample | None:
    """One line of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`, e.g.
    "2026/11/30 17:04:53.604, 1515, 706.49, 0x0000000000000004"; None for a line that is not one (a
    field "[N/A]", a warning)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        t = datetime.strptime(fields[0], TIMESTAMP).timestamp()
        return Sample(t, float(fields[1]), float(fields[2]), int(fields[3], 16))
    except ValueError:
        return None


def summarize(samples: list[Sample], top_mhz: float) -> dict | None:
    """The median and lowest SM clock, the highest power reading and the share of readings in which
    the power cap held the clock below `top_mhz` (the run's highest reading); None without readings
    (a point shorter than the sampling period)."""
    if not samples:
        return None
    held = sum(s.power_capped and s.sm_mhz < top_mhz for s in samples)
    return {"sm_mhz": statistics.median(s.sm_mhz for s in samples), "min_mhz": min(s.sm_mhz for s in samples),
            "max_watts": max(s.watts for s in samples), "power_capped": held / len(samples),
            "readings": len(samples)}


class ClockLog:
    """nvidia-smi reading the GPU every `period_ms` in a process of its own, its lines collected by a
    thread; a context manager. When nvidia-smi is missing or stops, `unavailable` says why and the
    windows simply find no readings: a benchmark never fails for want of them."""

    def __init__(self, device: str = "0", period_ms: int = 20, command: list[str] | None = None):
        self.command = command or ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                   "-i", device, "-lms", str(period_ms)]
        self.samples: list[Sample] = []
        self.unavailable: str | None = None
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> "ClockLog":
        if shutil.which(self.command[0]) is None:
            self.unavailable = f"{self.command[0]} not found"
            return self
        try:
            self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             text=True, bufsize=1)
        except OSError as exc:
            self.unavailable = f"{self.command[0]} did not start: {exc}"
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse_line(line)
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._reader.join(timeout=5)
            if not self.samples and self.unavailable is None:
                self.unavailable = f"{self.command[0]} gave no readings"
            self._process = None

    def __enter__(self) -> "ClockLog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def between(self, windows: list[tuple[float, float]]) -> list[Sample]:
        """The readings taken inside any of `windows` (time.time() intervals)."""
        with self._lock:
            return [s for s in self.samples if any(t0 <= s.t <= t1 for t0, t1 in windows)]
