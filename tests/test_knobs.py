"""The validity check rejects, with the reason, what could not compile or run."""
import pytest
import torch

from schedules import marlin_mma
from schedules.arch import get_arch
from schedules.marlin_mma import Knobs, check
from schedules.problem import Problem

H200, A100 = get_arch("sm_90a"), get_arch("sm_80")
LLAMA2_7B = [Problem(12288, 4096), Problem(4096, 4096), Problem(22016, 4096), Problem(4096, 11008)]


def test_default_knobs_are_valid_for_every_llama2_7b_layer():
    for p in LLAMA2_7B:
        assert check(p, Knobs(split_k=2), H200) is None, p.name


@pytest.mark.parametrize("problem,knobs,reason", [
    (Problem(4096 + 64, 4096), Knobs(block_n=256), "not a multiple of block_n"),
    (Problem(4096, 4096), Knobs(block_m=48, warps_m=2), "block_m=48"),
    (Problem(4096, 4096), Knobs(block_n=128, warps_n=4), "block_n=128"),
    (Problem(4096, 4096), Knobs(block_k=32, warps_k=4), "multiple of 16 \\* warps_k"),
    (Problem(4096, 4096), Knobs(warps_m=4, warps_n=4, warps_k=4, block_m=64), "1024"),
    (Problem(4096, 4096, group=64), Knobs(block_k=128), "group=64 must be a multiple of block_k=128"),
    (Problem(4096, 4096), Knobs(split_k=32), "fewer than num_stages"),
    (Problem(4096, 4096), Knobs(num_stages=1), "at least 2"),
    (Problem(4096, 4096), Knobs(block_m=128, warps_m=1, warps_n=4, block_n=256, num_stages=6), "shared memory"),
    (Problem.make(4096, 4096, -1), Knobs(scale_on_acc=True), "channelwise"),
    (Problem(4096, 4096), Knobs(block_m=128, block_n=256, warps_m=1, warps_n=1), "registers"),
])
def test_check_names_the_reason(problem, knobs, reason):
    got = check(problem, knobs, H200)
    assert got is not None and __import__("re").search(reason, got), got


def test_shared_memory_limit_depends_on_arch():
    p, kb = Problem(4096, 4096), Knobs(block_m=64, block_n=256, warps_m=2, warps_n=4, num_stages=6)
    assert check(p, kb, H200) is None
    assert "shared memory" in check(p, kb, get_arch("sm_86"))


def test_space_is_valid_and_nonempty_for_both_arches():
    for arch in (H200, A100):
        for p in LLAMA2_7B:
            space = marlin_mma.space(p, arch)
            assert len(space) > 100
            assert all(check(p, kb, arch) is None for kb in space[::37])
            assert len({kb.name for kb in space}) == len(space)   # names are unique keys


def test_split_k_spreads_whole_groups_as_evenly_as_they_go():
    p = Problem(4096, 11008)                      # 86 groups of 128
    kb = Knobs(split_k=8, block_k=64)             # 2 k-tiles per group
    assert kb.split_unit_tiles(p) == 2 and kb.min_iters(p) == (86 // 8) * 2


def test_kernel_args_name_the_bad_tensor():
    p, kb = Problem(128, 256), Knobs(block_n=128, warps_n=2, split_k=2)
    codes = torch.randint(0, 16, (256, 128), dtype=torch.uint8)
    qw, qs = marlin_mma.pack(codes, torch.ones(2, 128, dtype=torch.float16))
    a = torch.randn(3, 256, dtype=torch.float16)
    out = torch.empty(3, 128, dtype=torch.float16)
    ws, cnt = torch.zeros(3 * 128), torch.zeros(4, dtype=torch.int32)
    cases = [
        ((a.float(), qw, qs, out, ws, cnt), TypeError, "activations must be torch.float16"),
        ((torch.randn(3, 200, dtype=torch.float16), qw, qs, out, ws, cnt), ValueError, r"activations must have shape \[Mx256\]"),
        ((a, qw[:, :128].contiguous(), qs, out, ws, cnt), ValueError, "packed weight must have shape"),
        ((a, qw, qs.float(), out, ws, cnt), TypeError, "scales must be torch.float16"),
        ((a, qw, qs, out[:2], ws, cnt), ValueError, r"output must have shape \[3x128\]"),
        ((a.t().contiguous().t(), qw, qs, out, ws, cnt), ValueError, "activations must have shape|contiguous"),
        ((a, qw, qs, out, ws[:10], cnt), ValueError, "split-K workspace has 10 elements"),
        ((a, qw, qs, out, ws, cnt), ValueError, "activations is on cpu; tilemarlin kernels need CUDA"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            marlin_mma.kernel_args(p, kb, *args)
