"""QuantLinear.from_gptq on the CPU: GPTQ tensors as tests/checkpoint_writers.py writes them from the
format's definition, read back into the weights that definition gives, and the layers it refuses."""
import pytest
import torch

from runtime import QuantLinear
from schedules.quant import quantize_rtn
from tests.checkpoint_writers import draw_layer, gptq_tensors, layer_of

FORMATS = ["gptq", "gptq_v2"]
K, N, GROUP = 256, 128, 64


def from_gptq(tensors, **options) -> QuantLinear:
    return QuantLinear.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                                 **options)


def dense_weight(module: QuantLinear) -> torch.Tensor:
    """fp32 W[K, N] in the input features' order from what the module holds: its unpacked codes and
    scales, less its zero points (8 where it has none), its act-order permutation undone."""
    codes, scales = module.unpack()
    zeros = 8.0 if module.zeros() is None else module.zeros().float().unsqueeze(1)
    w = ((codes.float().unflatten(0, (-1, module.group_size)) - zeros) * scales.float().unsqueeze(1)).flatten(0, 1)
    return w if module.perm is None else torch.empty_like(w).index_copy_(0, module.perm.long(), w)


def test_word_layout_by_hand():
    """Nibble i (bits 4i..4i+3) of qweight's word row r is input row 8r + i; of qzeros' word column c,
    output column 8c + i; v1 stores zero points minus one."""
    qweight = torch.zeros(8, 64, dtype=torch.int32)
    qweight[0, 0] = 0x76543210
    qweight[0, 1] = 0xFEDCBA98 - (1 << 32)          # nibble 7 = 15 sets the sign bit
    qzeros = torch.full((1, 8), 0x77777777, dtype=torch.int32)
    qzeros[0, 0] = 0x76543210                        # columns 0..7: zero points 1..8
    scales = torch.ones(1, 64, dtype=torch.float16)
    module = QuantLinear.from_gptq(qweight, qzeros, scales, None, group_size=-1)
    codes, _ = module.unpack()
    assert codes[:8, 0].tolist() == list(range(8)) and codes[:8, 1].tolist() == list(range(8, 16))
    assert module.zeros()[0, :9].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert module.perm is None


@pytest.mark.parametrize("checkpoint_format", FORMATS)
@pytest.mark.parametrize("group", [GROUP, -1])
def test_symmetric_layer_holds_the_same_codes_and_scales(checkpoint_format, group):
    torch.manual_seed(0)
    codes, scales = quantize_rtn(torch.randn(K, N), group)
    bias = torch.randn(N, dtype=torch.float16)
    tensors = gptq_tensors(layer_of(codes, scales), checkpoint_format)
    module = from_gptq(tensors, bias=bias, group_size=group, checkpoint_format=checkpoint_format)
    assert (module.in_features, module.out_features, module.group_size) == (K, N, K if group == -1 else group)
    got_codes, got_scales = module.unpack()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales) and torch.equal(module.bias, bias)
    assert module.perm is None and module.zeros() is None and not module.zero_points


@pytest.mark.parametrize("checkpoint_format", FORMATS)
@pytest.mark.parametrize("symmetric, act_order", [(False, False), (True, True), (False, True)])
def test_asymmetric_and_act_order_layers_give_the_definitions_weights(checkpoint_format, symmetric, act_order):
    """perm sorts the input rows by group (row i holds input feature perm[i]); the zero points are
    kept exactly, in the scales' dtype; with the codes and scales they give
    w[k, n] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]) exactly."""
    drawn = draw_layer(K, N, GROUP, symmetric, act_order, torch.float16, torch.Generator().manual_seed(3))
    module = from_gptq(gptq_tensors(drawn, checkpoint_format), group_size=GROUP, checkpoint_format=checkpoint_format)
    codes, scales = module.unpack()
    if act_order:
        perm = module.perm
        assert perm.dtype == torch.int32 and torch.equal(perm.sort().values, torch.arange(K, dtype=torch.int32))
        assert torch.equal(drawn.g_idx[perm], torch.arange(K) // GROUP), "groups not contiguous"
    else:
        perm = torch.arange(K)
        assert module.perm is None
    assert torch.equal(codes.long(), drawn.codes[perm]) and torch.equal(scales, drawn.scales)
    if symmetric:
        assert module.zeros() is None
    else:
        assert torch.equal(module.zeros().long(), drawn.zeros.long())
    assert torch.equal(dense_weight(module), drawn.weight)


def test_missing_g_idx_means_contiguous_groups():
    drawn = draw_layer(K, N, GROUP, False, False, torch.float16, torch.Generator().manual_seed(4))
    tensors = gptq_tensors(drawn, "gptq")
    module = QuantLinear.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, group_size=GROUP)
    assert module.perm is None and torch.equal(module.unpack()[0].long(), drawn.codes)


# --- refusals ------------------------------------------------------------------------------------

def _tensors(group=GROUP):
    return gptq_tensors(draw_layer(K, N, group, True, False, torch.float16, torch.Generator().manual_seed(1)), "gptq")


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_other_bit_widths_are_refused(bits):
    with pytest.raises(ValueError, match=f"bits: tilemarlin runs 4-bit weights only; this GPTQ layer has bits={bits}"):
        from_gptq(_tensors(), bits=bits, group_size=GROUP)


def test_a_group_size_no_kernel_runs_is_refused():
    with pytest.raises(ValueError, match="group_size: group size 32 with K=256 cannot run .* multiple of 64"):
        from_gptq(_tensors(group=32), group_size=32)


@pytest.mark.parametrize("edit, group, match", [
    (lambda t: None, 128, r"scales: expected shape \(2, 128\) for K=256, N=128 .* found \(4, 128\)"),
    (lambda t: t.update(qzeros=t["qzeros"][:, :8]), GROUP, r"qzeros: expected shape \(4, 16\) .* found \(4, 8\)"),
    (lambda t: t.update(qweight=t["qweight"].long()), GROUP,
     "qweight: expected 2-D torch.int32 words, found torch.int64"),
    (lambda t: t.update(qweight=t["qweight"].flatten()), GROUP, r"qweight: expected 2-D .* \(4096,\)"),
    (lambda t: t.update(g_idx=t["g_idx"][:128]), GROUP, r"g_idx: expected 256 entries .* got shape \(128,\)"),
])
def test_tensors_that_do_not_fit_together_are_refused(edit, group, match):
    tensors = _tensors()
    edit(tensors)
    with pytest.raises(ValueError, match=match):
        from_gptq(tensors, group_size=group)


def test_another_checkpoint_format_is_refused():
    with pytest.raises(ValueError, match=r"checkpoint_format: must be one of \('gptq', 'gptq_v2'\), got 'awq'"):
        from_gptq(_tensors(), group_size=GROUP, checkpoint_format="awq")


def test_v1_zero_points_of_zero_borrow_from_the_nibble_above_and_read_back_exactly():
    """v1's writers take 0x11111111 off each packed word: zero points (0, 5, 0, 0, 15, 0, 1, 0), packed
    0x010f0050, are stored as 0xeffdef3f (nibble 0: 0 - 1 = 15 and a borrow; nibble 1: 5 - 1 - 1 = 3)."""
    zeros = [0, 5, 0, 0, 15, 0, 1, 0]
    packed = sum(z << (4 * i) for i, z in enumerate(zeros))
    stored = (packed - 0x11111111) % 2 ** 32
    assert stored == 0xEFFDEF3F
    qzeros = torch.full((1, 8), 0x77777777, dtype=torch.int32)
    qzeros[0, 0] = stored - 2 ** 32 if stored >= 2 ** 31 else stored
    module = QuantLinear.from_gptq(torch.zeros(8, 64, dtype=torch.int32), qzeros, torch.ones(1, 64, dtype=torch.float16),
                                   None, group_size=-1)
    assert module.zeros()[0, :9].tolist() == [*zeros, 8]


def _older_autogptq_words(zeros: list[list[int]]) -> torch.Tensor:
    """v1 zero points as AutoGPTQ before 0.8 packed them: z - 1 as an unsigned 32-bit value, shifted
    into its nibble and ORed in unmasked, so z = 0 (0xffffffff) sets every nibble from its own up."""
    words = torch.zeros(len(zeros), 8, dtype=torch.int32)
    for g, row in enumerate(zeros):
        word = 0
        for i, z in enumerate(row):
            word |= ((z - 1) % 2 ** 32 << (4 * i)) % 2 ** 32
        words[g, 0] = word - 2 ** 32 if word >= 2 ** 31 else word
        words[g, 1:] = 0x77777777
    return words


def test_v1_zero_points_an_older_autogptq_overwrote_are_refused():
    """z = 0 below the top nibble left 15 from there up: the zero points above it are lost."""
    qzeros = _older_autogptq_words([[3, 4, 0, 5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match=r"qzeros: group 0, columns 0..7 read 15 from a zero point up: an older "
                                         r"AutoGPTQ's v1 packing"):
        QuantLinear.from_gptq(torch.zeros(8, 64, dtype=torch.int32), qzeros, torch.ones(1, 64, dtype=torch.float16),
                              None, group_size=-1)


def test_v1_zero_points_of_an_older_autogptq_without_loss_read_back():
    """Its words are read as v1's: z = 0 at a word's top nibble alone loses nothing."""
    zeros = [[3, 4, 1, 5, 6, 7, 8, 0]]
    qzeros = _older_autogptq_words(zeros)
    module = QuantLinear.from_gptq(torch.zeros(8, 64, dtype=torch.int32), qzeros,
                                   torch.ones(1, 64, dtype=torch.float16), None, group_size=-1)
    assert module.zeros()[0, :9].tolist() == [*zeros[0], 8]


def test_uneven_act_order_groups_are_refused():
    tensors = _tensors()
    tensors["g_idx"][0] = 1   # group 0 loses a row to group 1
    sizes = r"\[63, 64, 65\]"
    with pytest.raises(ValueError, match=f"g_idx: every group must hold 64 input rows, found group sizes {sizes}"):
        from_gptq(tensors, group_size=GROUP)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_scale_that_is_not_finite_and_positive_is_refused_by_place(value):
    tensors = _tensors()
    tensors["scales"][2, 33] = value
    with pytest.raises(ValueError, match=f"scale {value} at group 2, column 33"):
        from_gptq(tensors, group_size=GROUP)
