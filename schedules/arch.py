"""What the schedules need to know about a GPU: its compile target and its per-block limits."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str                  # the nvcc arch, e.g. "sm_90a"
    sm: int                    # compute capability as an integer, e.g. 90
    max_shared_bytes: int      # dynamic shared memory one block may opt into
    registers_per_sm: int = 65536

    @property
    def target(self) -> dict:
        """The TileLang target dict (0.1.15 rejects the string form)."""
        return {"kind": "cuda", "arch": self.name}

    @property
    def hopper(self) -> bool:
        return self.sm >= 90


SM90_SHARED_PER_SM = 228 * 1024     # an sm_90 SM's shared memory; each resident block also takes 1 KB


def padding_for_at_most(blocks: int, unpadded: int, unit: int, spare: int) -> int:
    """How many `unit`-byte slices a block with `unpadded` bytes of dynamic shared memory must add so
    that at most `blocks` blocks fit an sm_90 SM (a family's max_blocks knob), with `spare` bytes over
    for what the family's estimate of its own bytes may miss."""
    least = SM90_SHARED_PER_SM // (blocks + 1) - 1024 + 1
    return max(0, -(-(least + spare - unpadded) // unit))


_KNOWN = {
    "sm_80": Arch("sm_80", 80, 163 * 1024),
    "sm_86": Arch("sm_86", 86, 99 * 1024),
    "sm_89": Arch("sm_89", 89, 99 * 1024),
    "sm_90a": Arch("sm_90a", 90, 227 * 1024),
}


def get_arch(name: str) -> Arch:
    """An Arch by nvcc name; "sm_90" is promoted to "sm_90a" (TileLang's Hopper code needs it)."""
    name = "sm_90a" if name == "sm_90" else name
    try:
        return _KNOWN[name]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}; known: {sorted(_KNOWN)}") from None


def current_arch(device=None) -> Arch:
    """The Arch of a CUDA device (needs a GPU)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible; pass an explicit arch such as 'sm_90a'")
    major, minor = torch.cuda.get_device_capability(device)
    return get_arch("sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}")
