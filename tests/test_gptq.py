"""GPTQ import: the on-disk layout is built here with plain loops, independently of runtime/gptq.py."""
import pytest
import torch

from runtime import QuantLinear
from runtime.gptq import from_gptq, to_gptq
from schedules.quant import quantize_rtn


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _pack_words(rows: list[list[int]], along_rows: bool) -> torch.Tensor:
    """Eight 4-bit values per int32 word, value i in bits 4i..4i+3, grouped along rows or columns."""
    height, width = len(rows), len(rows[0])
    if along_rows:
        words = [[sum(rows[8 * r + i][c] << (4 * i) for i in range(8)) for c in range(width)] for r in range(height // 8)]
    else:
        words = [[sum(rows[r][8 * c + i] << (4 * i) for i in range(8)) for c in range(width // 8)] for r in range(height)]
    return torch.tensor([[_int32(w) for w in row] for row in words], dtype=torch.int32)


def gptq_tensors(codes, scales, zeros=None, checkpoint_format="gptq"):
    """What AutoGPTQ / GPTQModel write for one layer: qweight, qzeros, scales, g_idx."""
    k, n = codes.shape
    groups = scales.shape[0]
    zeros = [[8] * n for _ in range(groups)] if zeros is None else zeros
    stored = [[(z - 1) & 0xF if checkpoint_format == "gptq" else z for z in row] for row in zeros]
    return {"qweight": _pack_words(codes.tolist(), along_rows=True),
            "qzeros": _pack_words(stored, along_rows=False),
            "scales": scales.clone(),
            "g_idx": torch.tensor([i // (k // groups) for i in range(k)], dtype=torch.int32)}


def _layer(k=256, n=128, group=64, seed=0):
    torch.manual_seed(seed)
    return quantize_rtn(torch.randn(k, n), group)


def test_word_layout_by_hand():
    codes = torch.zeros(8, 8, dtype=torch.uint8)
    codes[:, 0] = torch.arange(8)
    codes[:, 1] = torch.arange(8, 16)       # nibble 7 = 15 sets the sign bit
    t = to_gptq(codes, torch.ones(1, 8, dtype=torch.float16))
    assert t["qweight"][0, 0].item() == 0x76543210
    assert t["qweight"][0, 1].item() == _int32(0xFEDCBA98)
    assert t["qzeros"][0, 0].item() == 0x77777777   # v1 stores zero - 1


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group", [64, -1])
def test_unpack_recovers_codes_and_scales(checkpoint_format, group):
    codes, scales = _layer(group=group)
    t = gptq_tensors(codes, scales, checkpoint_format=checkpoint_format)
    got_codes, got_scales = from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, group, checkpoint_format)
    assert got_codes.dtype == torch.uint8 and torch.equal(got_codes, codes)
    assert torch.equal(got_scales, scales)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_to_gptq_writes_the_on_disk_layout(checkpoint_format):
    codes, scales = _layer()
    ours, theirs = to_gptq(codes, scales, checkpoint_format), gptq_tensors(codes, scales, checkpoint_format=checkpoint_format)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


def test_missing_g_idx_means_no_act_order():
    codes, scales = _layer()
    t = gptq_tensors(codes, scales)
    got, _ = from_gptq(t["qweight"], t["qzeros"], t["scales"], None, group_size=64)
    assert torch.equal(got, codes)


def test_act_order_is_refused():
    codes, scales = _layer()
    t = gptq_tensors(codes, scales)
    g_idx = t["g_idx"][torch.randperm(256, generator=torch.Generator().manual_seed(1))]
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group_size=64)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_asymmetric_zero_points_are_refused(checkpoint_format):
    codes, scales = _layer()
    zeros = [[8] * 128 for _ in range(4)]
    zeros[2][77] = 5
    t = gptq_tensors(codes, scales, zeros, checkpoint_format)
    with pytest.raises(ValueError, match="asymmetric.*found \\[5, 8\\]"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 64, checkpoint_format)


def test_v2_checkpoint_read_as_v1_says_so():
    codes, scales = _layer()
    t = gptq_tensors(codes, scales, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="checkpoint_format='gptq_v2'"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 64, "gptq")


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_other_bit_widths_are_refused(bits):
    codes, scales = _layer()
    t = gptq_tensors(codes, scales)
    with pytest.raises(ValueError, match=f"4-bit weights only.*bits={bits}"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, 64)


def test_shapes_that_do_not_fit_are_refused():
    codes, scales = _layer()
    t = gptq_tensors(codes, scales)
    with pytest.raises(ValueError, match="expected scales"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=128)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=96)
    with pytest.raises(ValueError, match="checkpoint_format"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=64, checkpoint_format="awq")


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_quant_linear_from_gptq_holds_the_same_weights(checkpoint_format):
    codes, scales = _layer()
    bias = torch.randn(128, dtype=torch.float16)
    t = gptq_tensors(codes, scales, checkpoint_format=checkpoint_format)
    layer = QuantLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bias=bias, group_size=64,
                                  checkpoint_format=checkpoint_format)
    assert (layer.in_features, layer.out_features, layer.group_size) == (256, 128, 64)
    got_codes, got_scales = layer.unpack()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales) and torch.equal(layer.bias, bias)


def test_quant_linear_from_act_order_gptq_is_refused():
    codes, scales = _layer()
    t = gptq_tensors(codes, scales)
    with pytest.raises(ValueError, match="desc_act=False"):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"].flip(0), group_size=64)


def test_quant_linear_from_gptq_refuses_a_group_size_no_kernel_runs():
    codes, scales = _layer(group=32)
    t = gptq_tensors(codes, scales)
    with pytest.raises(ValueError, match="group size 32 with K=256 cannot run .* multiple of 64"):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=32)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_quant_linear_from_gptq_refuses_a_scale_that_is_not_finite_and_positive(value):
    codes, scales = _layer()
    t = gptq_tensors(codes, scales)
    t["scales"][2, 33] = value
    with pytest.raises(ValueError, match=f"scale {value} at group 2, column 33"):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=64)
