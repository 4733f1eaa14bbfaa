"""The op computing on the CPU: the CUDA launches replaced by the fp32 references of what the kernels
compute from the packed tensors, so that everything around a kernel is what runs (shapes, transposes,
bias, the gathers by perm, the packing of the zero points). The `cpu_op` fixture (tests/conftest.py)
installs them."""
import torch

import runtime.op as op
from schedules import marlin_mma
from schedules.marlin_mma.layout import split_zero_points
from schedules.quant import dequantize


def reference_launch(a, qweight, scales, out, problem, layout):
    """The GEMM: a times the codes less their zero points (8, or the zero-point rows'), times the scales."""
    scales, zeros = split_zero_points(scales) if problem.zero_points else (scales, None)
    codes, scales = marlin_mma.unpack(qweight, scales)
    out.copy_((a.float() @ dequantize(codes, scales, zeros=zeros)).to(out.dtype))


def gather_on_the_cpu(a, perm, out):
    out.copy_(a[:, perm.long()])


def norm_gather_on_the_cpu(a, weight, perm, eps, out):
    """The RMSNorm kernel's definition (schedules/norm_gather.py), in torch: transformers' RMSNorm of
    each row, its columns in perm's order, times the weight already in that order."""
    h = a.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps.item())).to(a.dtype)
    out.copy_(weight * h[:, perm.long()])


def install(monkeypatch) -> None:
    monkeypatch.setattr(op, "_check_device", lambda *tensors: None)
    monkeypatch.setattr(op, "_launch", reference_launch)
    monkeypatch.setattr(op, "_gather_into", gather_on_the_cpu)
    monkeypatch.setattr(op, "_norm_gather_into", norm_gather_on_the_cpu)
