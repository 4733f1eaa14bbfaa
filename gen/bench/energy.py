"""The board's energy counter and SM clock, read through NVML (libnvidia-ml, which every NVIDIA driver
installs), for `gen bench --sustain`.

Under a sustained load the H200 sits at its 700 W power cap from M = 256 on, and the clock then
follows the power each kernel draws: a point timed for tens of milliseconds meets the power
controller mid-correction, while one run for a second or more shows the clock the kernel holds at
the cap and the joules it spends per call (H200; docs/performance.md). NVML's total-energy counter
(millijoules since the driver loaded) gives the joules exactly, where nvidia-smi's power readings
are samples.
"""
from __future__ import annotations

import ctypes

NVML_SUCCESS = 0
NVML_CLOCK_SM = 1


class EnergyUnavailable(RuntimeError):
    """NVML cannot be loaded or does not report energy for this GPU; the message says which."""


class Nvml:
    """One GPU's energy counter and SM clock. `library` replaces the loaded libnvidia-ml (tests)."""

    def __init__(self, device: str, library=None):
        """`device` is nvidia-smi's name for the GPU: "GPU-<uuid>" or an index ("0")."""
        if library is None:
            try:
                library = ctypes.CDLL("libnvidia-ml.so.1")
            except OSError as exc:
                raise EnergyUnavailable(f"NVML (libnvidia-ml.so.1) cannot be loaded: {exc}") from None
        self._lib = library
        self._call("nvmlInit_v2")
        self._handle = ctypes.c_void_p()
        if device.startswith("GPU-"):
            self._call("nvmlDeviceGetHandleByUUID", device.encode(), ctypes.byref(self._handle))
        else:
            self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(int(device)), ctypes.byref(self._handle))
        self.energy_mj()   # a GPU without the counter (before Volta) says so now, not mid-run

    def _call(self, name: str, *args) -> None:
        status = getattr(self._lib, name)(*args)
        if status != NVML_SUCCESS:
            raise EnergyUnavailable(f"NVML {name} failed with status {status}")

    def energy_mj(self) -> int:
        """Millijoules the board has used since the driver loaded."""
        value = ctypes.c_ulonglong()
        self._call("nvmlDeviceGetTotalEnergyConsumption", self._handle, ctypes.byref(value))
        return value.value

    def sm_mhz(self) -> int:
        """The SM clock now."""
        value = ctypes.c_uint()
        self._call("nvmlDeviceGetClockInfo", self._handle, ctypes.c_int(NVML_CLOCK_SM), ctypes.byref(value))
        return value.value
