"""What every GPU test compares with, and how: seeded inputs, NaN-poisoned outputs, one verdict.

A kernel's output is checked against the fp32 reference (schedules/quant.py) twice over:

* the relative norm ||out - ref|| / ||ref||, which measures the error spread over the whole output;
* the largest element-wise error, max |out - ref| <= elem_tol * max |ref|, which catches what the norm
  averages away: one element left unwritten or zeroed in a 1024 x 4096 output moves the norm by about
  1 / sqrt(4M) of its share and passes any sensible norm tolerance.

Outputs are filled with NaN before the kernel runs, so an element the kernel never writes is NaN and
fails the finiteness check, whatever the reference holds there.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rel: float    # ||out - ref|| / ||ref||
    elem: float   # max |out - ref| / max |ref|


# fp32 accumulation of fp16 / bf16 products, one rounding of the output: the error of a correct kernel
# is about 3e-4 (fp16) and 3.5e-3 (bf16) of max |ref| element-wise, a few times below these.
TOLERANCES = {torch.float16: Tolerance(rel=2e-3, elem=4e-3), torch.bfloat16: Tolerance(rel=1e-2, elem=2e-2)}


def seed_of(*case) -> int:
    """A fixed seed per test case, the same in every process (unlike hash() of a str)."""
    return zlib.crc32(repr(case).encode())


def generator(seed: int, device="cuda") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed`: inputs drawn from it do not depend on what
    other tests drew before."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def relative_norm_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (NaN if out holds a NaN)."""
    ref = ref.float()
    return (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, *, rel_tol: float | None = None,
                             elem_tol: float | None = None, context: str = "") -> None:
    """Assert that `out` is `ref` up to rounding: the same shape, finite everywhere, within `rel_tol` in
    relative norm and within `elem_tol * max |ref|` at every element. Tolerances default to out's dtype
    (TOLERANCES); `context` (the case and its seed) starts every failure message."""
    where = f"{context}: " if context else ""
    assert tuple(out.shape) == tuple(ref.shape), f"{where}output shape {tuple(out.shape)}, reference {tuple(ref.shape)}"
    default = TOLERANCES.get(out.dtype)
    if default is None and (rel_tol is None or elem_tol is None):
        raise ValueError(f"no default tolerance for {out.dtype}; pass rel_tol and elem_tol")
    rel_tol = default.rel if rel_tol is None else rel_tol
    elem_tol = default.elem if elem_tol is None else elem_tol
    if out.numel() == 0:
        return
    out, ref = out.float(), ref.float()
    assert torch.isfinite(ref).all(), f"{where}the reference itself is not finite"
    bad = ~torch.isfinite(out)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{where}{int(bad.sum())} of {out.numel()} output elements are NaN or Inf "
                             f"(unwritten or overflowed), the first at {first}: {out[first].item()}")
    rel = relative_norm_error(out, ref)
    assert rel < rel_tol, f"{where}relative error {rel:.3e} >= {rel_tol:.1e}"
    diff = (out - ref).abs()
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    scale = ref.abs().max().item()
    assert diff[index].item() <= elem_tol * scale, (
        f"{where}element {index} is {out[index].item():.6g}, reference {ref[index].item():.6g}: error "
        f"{diff[index].item():.3e} > {elem_tol:.1e} * max |ref| = {elem_tol * scale:.3e} "
        f"(relative norm error {rel:.3e})")


def poison_next_allocation(shape, dtype: torch.dtype, device) -> int:
    """Fill a block of the size of a `shape` tensor with NaN and give it back to torch's caching
    allocator; returns its address. The next allocation of that size on the current stream gets this
    block, so an op that allocates its own output (torch.empty) hands back NaN wherever its kernel does
    not write. The caller checks that the output's data_ptr() is the returned address."""
    block = torch.full(shape, float("nan"), dtype=dtype, device=device)
    address = block.data_ptr()
    del block
    return address


def int4_weights(model) -> dict:
    """Name -> (codes, scales) of each INT4 layer in the model's own names: a fused set's members
    (FusedSlice) their columns of the fused layer's, the fused layer itself left out."""
    from runtime import QuantLinear
    from runtime.fuse import FusedSlice

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedSlice):
            codes, scales = module.fused.unpack()
            found[name] = codes[:, module.start:module.stop], scales[:, module.start:module.stop]
        elif isinstance(module, QuantLinear):
            found[name] = module.unpack()
    fused = {id(module.fused) for module in model.modules() if isinstance(module, FusedSlice)}
    return {name: weights for name, weights in found.items() if id(model.get_submodule(name)) not in fused}
