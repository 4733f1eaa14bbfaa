"""`gen bench --e2e`: the command line, the no-GPU and no-transformers messages, the report from a
recorded sample, the static-cache steps and the variants' conversions on the CPU, and the whole path on
a small Llama on the GPU.

tests/data/bench_e2e_sample.json is a hand-made fixture in the recorded format: llama-2-7b, decode
at batches 1 and 8 and contexts 512 and 4096, prefill 512; humming skipped; one decode point skipped
for its KV cache in both variants, one failed for tilemarlin. Dense 8 / 8 / 10 ms per step, tilemarlin
2.5 / 4 ms, so the speedups are 3.2 and 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from gen.bench import command as bench
from gen.bench import e2e, e2e_report
from gen.bench import e2e_models as models
from gen.bench import e2e_steps as steps

SAMPLE = Path(__file__).parent / "data" / "bench_e2e_sample.json"
GEMM_SAMPLE = Path(__file__).parent / "data" / "bench_sample.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# tests/test_runtime_gpu.py's SMALL_LLAMA, as a config.json
SMALL_LLAMA = dict(model_type="llama", hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=1000, max_position_embeddings=256)
# small enough for the CPU: grouped-query attention, fp32
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gen")
    bench.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


@pytest.fixture
def sample() -> dict:
    return e2e_report.load(SAMPLE)


def write_config(folder: Path, fields: dict) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps(fields))
    return path


# --- the command line ----------------------------------------------------------------------------

def test_defaults():
    args = parse(["--e2e"])
    assert args.func is bench.run
    assert e2e.options(args) == e2e.Options(
        model="llama-2-7b", dtype="float16", batches=(1, 8, 32, 64, 128, 256), contexts=(512, 4096),
        prefill=(512, 2048, 4096), variants=("dense", "tilemarlin", "humming"), group=128, compile=False,
        checkpoint=None, out="docs/bench", markdown=False)


def test_overrides():
    args = parse(["--e2e", "--model", "llama-3-8b", "--dtype", "bfloat16", "--batches", "8, 1,8", "--contexts", "64",
                  "--prefill", "128,64", "--variants", "tilemarlin,dense", "--group", "-1", "--compile"])
    opts = e2e.options(args)
    assert (opts.model, opts.dtype, opts.group, opts.compile) == ("llama-3-8b", "bfloat16", -1, True)
    assert (opts.batches, opts.contexts, opts.prefill) == ((1, 8), (64,), (64, 128))
    assert opts.variants == ("tilemarlin", "dense")


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float32"], "invalid choice: 'float32'"),
    (["--batches", "0"], "'0' is not a positive integer"),
    (["--contexts", "4k"], "'4k' is not a positive integer"),
    (["--prefill", "512,"], "'' is not a positive integer"),
    (["--variants", "dense,cutlass"], "unknown variant(s) cutlass; known: dense, tilemarlin, humming"),
    (["--variants", ","], "unknown variant(s) ','"),
])
def test_bad_values_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--e2e", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--shapes", "4096x4096"], ["--ms", "1,2"], ["--kernels", "fp16"],
                                  ["--rounds", "5"], ["--between"], ["--sustain", "1"]])
def test_gemm_bench_flags_are_refused_with_e2e(flag, capsys):
    args = parse(["--e2e", *flag])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} belong to the GEMM bench" in err and "--e2e takes --model" in err


@pytest.mark.parametrize("flag", [["--batches", "1"], ["--compile"], ["--variants", "dense"],
                                  ["--checkpoint", "some/folder"]])
def test_e2e_flags_are_refused_without_e2e(flag, capsys):
    args = parse(flag)
    assert args.func(args) == 2
    assert f"{flag[0]} apply to --e2e runs only" in capsys.readouterr().err


def test_no_gpu_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse(["--e2e"])
    assert args.func(args) == bench.NO_GPU_EXIT == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU" in err and "--from-json" in err and "\n" not in err


def test_no_transformers_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers raises ImportError
    args = parse(["--e2e"])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert "needs transformers" in err and "pip install transformers" in err and "\n" not in err


def test_an_unknown_model_is_named(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse(["--e2e", "--model", "gpt-17"])
    assert args.func(args) == 2
    assert "unknown model 'gpt-17'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--model", "llama-3-8b"], ["--group", "64"]])
def test_a_checkpoint_brings_its_own_model_and_group(flag, capsys):
    args = parse(["--e2e", "--checkpoint", "ckpt", *flag])
    assert args.func(args) == 2
    assert f"{flag[0]}: --checkpoint's config.json says which model it is" in capsys.readouterr().err


def test_a_checkpoint_runs_in_its_own_dtype_unless_told(tmp_path):
    write_config(tmp_path, {**SMALL_LLAMA, "torch_dtype": "bfloat16"})
    assert e2e.options(parse(["--e2e", "--checkpoint", str(tmp_path)])).dtype == "bfloat16"
    assert e2e.options(parse(["--e2e", "--checkpoint", str(tmp_path), "--dtype", "float16"])).dtype == "float16"
    assert e2e.options(parse(["--e2e"])).dtype == "float16"


def test_a_checkpoint_that_cannot_be_loaded_is_named_before_the_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    write_config(tmp_path, SMALL_LLAMA)   # a dense model's config.json: no quantization_config
    args = parse(["--e2e", "--checkpoint", str(tmp_path)])
    assert args.func(args) == 2
    assert "config.json: quantization_config: missing (and no compression_config, quantize_config.json or quant_config.json): not a quantized checkpoint" \
        in capsys.readouterr().err
    write_config(tmp_path, {**SMALL_LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 3}})
    assert args.func(args) == 2
    assert "bits" in capsys.readouterr().err
    args = parse(["--e2e", "--checkpoint", str(tmp_path / "absent")])
    assert args.func(args) == 2
    assert "absent: no such folder" in capsys.readouterr().err


# --- configs ---------------------------------------------------------------------------------------

def test_a_registered_model_gets_its_architecture():
    pytest.importorskip("transformers")
    config = models.hf_config(models.config_fields("llama-2-7b"))
    assert config.model_type == "llama" and config.num_hidden_layers == 32 and config.vocab_size == 32000
    assert (config.hidden_size, config.intermediate_size, config.num_key_value_heads) == (4096, 11008, 32)
    # keys and values, 32 layers, 32 heads of 128, fp16: 512 KiB per position
    assert models.kv_bytes(config, 1, 4096, torch.float16) == 2 * 1024 ** 3
    assert models.kv_bytes(config, 8, 512, torch.bfloat16) == 2 * 1024 ** 3


def test_every_registered_model_has_an_architecture():
    from gen import models as registry

    assert set(models.ARCHITECTURES) == set(registry.MODELS)


def test_a_config_file_needs_its_model_type(tmp_path):
    fields = {k: v for k, v in SMALL_LLAMA.items() if k != "model_type"}
    with pytest.raises(ValueError, match="has no model_type"):
        models.config_fields(str(write_config(tmp_path, fields)))


def test_a_config_file_drops_what_would_quantize_or_load_code(tmp_path):
    path = write_config(tmp_path, {**SMALL_LLAMA, "quantization_config": {"bits": 4}, "torch_dtype": "float32"})
    fields = models.config_fields(str(path))
    assert fields == SMALL_LLAMA
    assert e2e.model_label(str(path)) == tmp_path.name and e2e.model_label("llama-2-7b") == "llama-2-7b"
    assert e2e.model_label("llama-2-7b", str(tmp_path / "ckpt" / "..")) == tmp_path.name


# --- the report from the recorded sample -----------------------------------------------------------

def test_sample_is_marked_as_a_fixture(sample):
    assert "not a measurement" in sample["meta"]["fixture"].lower()


def test_measured_variants_leave_out_the_skipped(sample):
    assert e2e_report.measured(sample) == ["dense", "tilemarlin"]


def test_decode_times_leave_out_points_without_a_time(sample):
    times = e2e_report.decode_times(sample)
    assert times == {(512, 1): {"dense": 8000.0, "tilemarlin": 2500.0},
                     (512, 8): {"dense": 8000.0, "tilemarlin": 4000.0},
                     (4096, 1): {"dense": 10000.0}}


def test_decode_table(sample):
    header, rows = e2e_report.decode_table(sample)
    assert header == ["context", "batch", "fp16 ms", "fp16 tok/s", "tilemarlin ms", "tilemarlin tok/s",
                      "tilemarlin x fp16"]
    assert rows == [["512", "1", "8.000", "125", "2.500", "400", "3.20"],
                    ["512", "8", "8.000", "1,000", "4.000", "2,000", "2.00"],
                    ["4096", "1", "10.000", "100", "-", "-", "-"],
                    ["4096", "8", "-", "-", "-", "-", "-"]]


def test_prefill_and_memory_tables(sample):
    assert e2e_report.prefill_table(sample)[1] == [["512", "40.000", "12,800", "50.000", "10,240", "0.80"]]
    header, rows = e2e_report.memory_table(sample)
    assert header == ["variant", "weights (GiB)", "INT4 layers (GiB)", "x fp16"]
    assert rows == [["fp16", "13.00", "0.00", "1.00"], ["tilemarlin", "3.50", "3.25", "0.27"]]


def test_correctness_line(sample):
    line = e2e_report.correctness_line(sample)
    assert "30 of 32 decode steps of tilemarlin match" in line and "first differs at step 29" in line
    sample["correctness"].update(matching=32, first_mismatch=None)
    assert "differs" not in e2e_report.correctness_line(sample)
    sample["correctness"]["same_history"] = {"agreeing": 31, "logits_rel_error": 0.0042, "max_logit_difference": 0.031,
                                             "disagreements": [{"step": 5, "lead": 0.004}], "median_top2_lead": 0.29}
    line = e2e_report.correctness_line(sample)
    assert "fed the same tokens, they agree on 31 of 32, logits within 0.42% (largest difference 0.031)" in line
    assert "led by at most 0.004, against a median lead of 0.29" in line
    sample["correctness"] = None
    assert "not checked" in e2e_report.correctness_line(sample)


def test_notes_say_what_was_not_measured_and_why(sample):
    notes = e2e_report.notes(sample)
    assert notes[0] == "humming not measured: humming is not importable: No module named 'humming'"
    assert "dense decode batch 8 context 4096: KV cache 16.0 GiB > 90% of the 10.0 GiB free" in notes
    assert any(n.startswith("tilemarlin decode batch 1 context 4096: failed: RuntimeError") for n in notes)
    assert any(n.startswith("tilemarlin: no tuned kernel") for n in notes)


def test_terminal_report_and_markdown(sample):
    text = e2e_report.terminal_report(sample)
    assert "NVIDIA H200, llama-2-7b (32 layers, hidden 4096), float16, INT4 group 128" in text
    assert "decode (time per step" in text and "prefill (batch 1)" in text and "30 of 32" in text
    md = e2e_report.markdown(sample)
    assert "## End to end: llama-2-7b on NVIDIA H200" in md
    assert "| 512 | 1 | 8.000 | 125 | 2.500 | 400 | 3.20 |" in md
    assert "| fp16 | 13.00 | 0.00 | 1.00 |" in md and "- humming not measured" in md



@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(meta=None), "not a gen bench --e2e file"),
    (lambda d: d.update(variants=[]), "not a gen bench --e2e file"),
    (lambda d: d["meta"].pop("config"), r"its meta lacks \['config'\]"),
    (lambda d: d["meta"].update(replays={}), "replays lack decode or prefill"),
    (lambda d: d["variants"].update(dense="oops"), "variant dense is not an object"),
    (lambda d: d["variants"]["dense"]["decode"].append(3), "dense decode point"),
])
def test_a_malformed_record_is_one_clear_error(sample, tmp_path, capsys, change, message):
    change(sample)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(sample))
    with pytest.raises(ValueError, match=message):
        e2e_report.load(path)
    args = parse(["--e2e", "--from-json", str(path), "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert "cannot read" in capsys.readouterr().err


def test_an_interrupted_run_says_so_in_the_heading(sample):
    sample["meta"]["complete"] = False
    del sample["variants"]["tilemarlin"]
    measured = [v for v in sample["meta"]["variants"] if v in sample["variants"]]
    note = (f"Incomplete run: {len(measured)} of {len(sample['meta']['variants'])} variants measured "
            f"({', '.join(measured)})")
    assert e2e_report.terminal_report(sample).startswith(note)
    assert note in e2e_report.markdown(sample)

def test_a_checkpoint_run_says_what_its_layers_hold(sample):
    sample["meta"].update(group=None, model="llama-2-7b-gptq", checkpoint={"path": "/m/llama-2-7b-gptq",
                                                                           "quant_method": "gptq"})
    sample["variants"]["tilemarlin"]["layers"] = {"int4_layers": 224, "zero_points": 224, "group_sizes": [128],
                                                  "gathers": 32, "gathering_norms": 64}
    assert ("llama-2-7b-gptq (32 layers, hidden 4096), float16, gptq checkpoint (224 INT4 layers, group 128, "
            "zero points in 224, 32 act-order gathers per forward, 64 norms writing act-order layers' input in "
            "their order)") in e2e_report.terminal_report(sample)
    assert "The checkpoint's own weights" in e2e_report.markdown(sample)
    assert "tilemarlin runs its 64 gathering norms as one kernel each" in e2e_report.terminal_report(sample)
    sample["meta"]["compile"] = True
    assert "gathering norms as one kernel" not in e2e_report.terminal_report(sample)
    sample["meta"]["compile"] = False
    del sample["variants"]["tilemarlin"]
    assert "float16, gptq checkpoint; " in e2e_report.terminal_report(sample)


def test_from_json_writes_the_plot_and_markdown_beside(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = parse(["--e2e", "--from-json", str(SAMPLE), "--out", str(tmp_path), "--markdown"])
    assert args.func(args) == 0
    assert (tmp_path / "bench_e2e_sample.png").read_bytes().startswith(PNG_MAGIC)
    assert "| context | batch |" in (tmp_path / "bench_e2e_sample.md").read_text()
    assert "tilemarlin x fp16" in capsys.readouterr().out


def test_load_rejects_a_gemm_bench_file(tmp_path, capsys):
    with pytest.raises(ValueError, match="not a gen bench --e2e file"):
        e2e_report.load(GEMM_SAMPLE)
    args = parse(["--e2e", "--from-json", str(GEMM_SAMPLE), "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert "cannot read" in capsys.readouterr().err


def test_stem_names_gpu_model_and_dtype(sample):
    assert e2e_report.stem(sample["meta"]) == "nvidia-h200-llama-2-7b-e2e-float16"


# --- the steps and the variants on the CPU ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    pytest.importorskip("transformers")
    model = models.build_dense(models.hf_config(TINY_LLAMA), torch.float32, device="cpu")
    for p in model.parameters():   # larger weights than the init's, so that greedy paths move
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return model


def full_recompute_greedy(model, prompt, steps_: int) -> list[int]:
    """Greedy decoding without a cache: every step runs the whole sequence."""
    seq, tokens = prompt, []
    for _ in range(steps_):
        token = model(input_ids=seq).logits[0, -1].argmax()
        tokens.append(int(token))
        seq = torch.cat([seq, token.view(1, 1)], dim=1)
    return tokens


@torch.no_grad()
def test_static_cache_steps_decode_as_the_model_does_without_a_cache(tiny_model):
    prompt = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0))
    reference = full_recompute_greedy(tiny_model, prompt, 9)
    run = steps.greedy_decode(tiny_model, prompt, 8)
    # the prefill's token is the reference's first, then the decode steps'
    assert [run.prefill_token, *run.tokens] == reference
    assert run.logits.shape == (8, TINY_LLAMA["vocab_size"])
    assert run.logits.argmax(-1).tolist() == run.tokens


@torch.no_grad()
def test_a_decode_fed_another_runs_tokens_sees_that_history(tiny_model):
    prompt = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0))
    own = steps.greedy_decode(tiny_model, prompt, 6)
    assert torch.equal(steps.greedy_decode(tiny_model, prompt, 6, follow=own).logits, own.logits)
    other = steps.Greedy(prefill_token=(own.prefill_token + 1) % TINY_LLAMA["vocab_size"], tokens=[3, 1, 4, 1, 5, 9],
                         logits=own.logits)
    followed = steps.greedy_decode(tiny_model, prompt, 6, follow=other)
    # step t sees other's tokens up to t; step 0's input is other's prefill token
    expected = full_recompute_greedy(tiny_model, torch.cat([prompt, torch.tensor([[other.prefill_token, 3]])], 1), 1)
    assert followed.tokens[1] == expected[0]
    assert not torch.equal(followed.logits, own.logits)


def test_logit_agreement_measures_the_gap_a_flip_happened_in():
    ref_logits = torch.tensor([[5.0, 4.9, 0.0], [3.0, 0.0, 1.0], [0.0, 2.0, 1.5]])
    reference = steps.Greedy(0, [0, 0, 1], ref_logits)
    own_logits = ref_logits.clone()
    own_logits[0, 1] = 5.05   # a flip in a near tie at step 0
    own = steps.Greedy(0, [1, 0, 1], own_logits)
    agreement = e2e._logit_agreement(own, reference)
    assert agreement["agreeing"] == 2
    assert agreement["disagreements"] == [{"step": 0, "lead": pytest.approx(0.1)}]
    assert agreement["max_logit_difference"] == pytest.approx(0.15)
    assert agreement["logits_rel_error"] == pytest.approx(0.15 / float(torch.linalg.vector_norm(ref_logits[0])))
    assert agreement["median_top2_lead"] == pytest.approx(0.5)


@torch.no_grad()
def test_a_step_runs_through_a_compiled_model(tiny_model):
    """--compile hands the steps torch.compile's module (dynamo's eager backend here: the plumbing, not
    the compiler), which has no truth value of its own."""
    compiled = torch.compile(tiny_model, backend="eager")
    step = steps.decode_step(tiny_model, batch=2, context=16, forward=compiled)
    step.tokens.copy_(torch.tensor([[1], [2]]))
    step()
    plain = steps.decode_step(tiny_model, batch=2, context=16)
    plain.tokens.copy_(torch.tensor([[1], [2]]))
    plain()
    assert torch.equal(step.next_tokens, plain.next_tokens)


@torch.no_grad()
def test_a_compiled_step_compiles_nothing_inside_the_capture(tiny_model, monkeypatch):
    """time_calls runs the step once, then captures it: a compile during the capture fails on the GPU.
    The static cache allocates on its first update, and a compiled forward recompiles for that, so the
    point primes the cache through the eager model first: one compile a point, before the capture."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = torch.compile(tiny_model, backend="eager")
    graphs_at_capture = []

    def warm_then_capture(calls, replays):
        calls[0]()                                           # time_calls' call before the capture
        graphs_at_capture.append(counters["stats"]["unique_graphs"])
        calls[0]()                                           # the captured call
        graphs_at_capture.append(counters["stats"]["unique_graphs"])
        return 1.0

    monkeypatch.setattr("gen.timing.time_calls", warm_then_capture)
    before = counters["stats"]["unique_graphs"]
    for batch in (2, 3):
        point = e2e._timed_point({"batch": batch}, lambda: steps.decode_step(tiny_model, batch, 16, compiled), 1, batch)
        assert point["us"] == 1.0, point
    assert graphs_at_capture[0] == graphs_at_capture[1] and graphs_at_capture[2] == graphs_at_capture[3], \
        graphs_at_capture
    assert graphs_at_capture[-1] - before == 2, "one compile a point: the eager priming call allocates the cache"


@torch.no_grad()
def test_a_step_run_again_writes_the_same_positions(tiny_model):
    step = steps.decode_step(tiny_model, batch=3, context=16)
    step.tokens.copy_(torch.tensor([[1], [2], [3]]))
    step()
    first = step.next_tokens.clone()
    step()
    assert torch.equal(step.next_tokens, first)
    for layer in getattr(step.cache, "layers", ()):   # caches that count their writes end one past the step
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            assert int(layer.cumulative_length) == 16


@torch.no_grad()
def test_prefill_step_predicts_as_the_plain_forward(tiny_model):
    step = steps.prefill_step(tiny_model, 12)
    step.tokens.copy_(torch.arange(12)[None])
    step()
    assert int(step.next_tokens[0]) == int(tiny_model(input_ids=torch.arange(12)[None]).logits[0, -1].argmax())


def test_causal_mask():
    mask = steps.causal_mask(torch.tensor([1, 2]), torch.arange(4), torch.float16)
    lowest = torch.finfo(torch.float16).min
    assert mask.shape == (1, 1, 2, 4) and mask.dtype == torch.float16
    assert mask[0, 0].tolist() == [[0, 0, lowest, lowest], [0, 0, 0, lowest]]


@torch.no_grad()
def test_the_dequantized_twin_holds_the_int4_weights():
    pytest.importorskip("transformers")
    from runtime import QuantLinear
    from schedules.quant import dequantize

    model = models.build_dense(models.hf_config(SMALL_LLAMA), torch.float16, device="cpu")
    dense_bytes = models.weight_bytes(model)
    assert models.quantized_bytes(model) == 0
    models.to_tilemarlin(model, group=128)
    names = [name for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(names) == 8 and isinstance(model.lm_head, torch.nn.Linear)   # qkv, o, gate_up, down in each
    expected = {name: dequantize(*model.get_submodule(name).unpack()).t().half() for name in names}
    int4_bytes, quantized = models.weight_bytes(model), models.quantized_bytes(model)
    # 14 layers of K x N (8 once fused) at half a byte per weight and a 2-byte scale per 128 rows
    shapes = 2 * (4 * 512 * 512 + 3 * 512 * 1408)
    assert quantized == shapes // 2 + shapes // 128 * 2
    assert int4_bytes == dense_bytes - 2 * shapes + quantized
    models.to_dequantized(model)
    for name in names:
        linear = model.get_submodule(name)
        assert type(linear) is torch.nn.Linear and torch.equal(linear.weight, expected[name])


@pytest.fixture(scope="module")
def act_order_checkpoint(tmp_path_factory):
    """A 2-layer Llama in GPTQ with zero points and act-order (q/k/v and gate/up sharing their
    permutations, as GPTQ's do), with the layers as drawn."""
    pytest.importorskip("transformers")
    from tests.checkpoint_writers import write_checkpoint

    folder = tmp_path_factory.mktemp("e2e") / "llama-gptq-act-order"
    return folder, write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True, seed=3)


@torch.no_grad()
def test_a_checkpoints_dense_variant_holds_its_dequantized_weights(act_order_checkpoint):
    """The dense variant of a checkpoint (loaded, then every INT4 layer dequantized, act-order rows put
    back or left to the module that gathers them) computes the model the format's definition gives."""
    from tests.checkpoint_writers import dense_model
    from tests.test_checkpoint_math import MODEL_TOLERANCE
    from tests.reference import assert_matches_reference

    folder, drawn = act_order_checkpoint
    model = models.checkpoint_variant("dense", folder, torch.float16, device="cpu")
    assert not [name for name, m in model.named_modules() if type(m).__name__ == "QuantLinear"]
    reference = dense_model(folder, drawn)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_matches_reference(model(tokens).logits.float(), reference(tokens).logits,
                             **MODEL_TOLERANCE[torch.float16], context="dense variant of a GPTQ act-order checkpoint")


def test_a_checkpoints_tilemarlin_layers_are_summarized(act_order_checkpoint):
    folder, drawn = act_order_checkpoint
    model = models.checkpoint_variant("tilemarlin", folder, torch.float16, device="cpu")
    # per decoder layer: qkv, o, gate_up and down (q/k/v and gate/up fused); q/k/v's input and gate/up's
    # written in their order by the two norms, o_proj gathering its own, down_proj's permutation folded
    # into gate/up's columns
    assert models.layer_summary(model) == {"int4_layers": 2 * 4, "zero_points": 2 * 4,
                                           "group_sizes": [128], "gathers": 2, "gathering_norms": 2 * 2}


def test_the_dequantized_twin_undoes_a_layers_own_permutation():
    from runtime import QuantLinear
    from runtime.checkpoint.layer import build_layer

    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (256, 64), generator=gen)
    scales = torch.rand(2, 64, generator=gen).half() / 100
    zeros = torch.randint(0, 16, (2, 64), generator=gen)
    g_idx = (torch.arange(256) // 128)[torch.randperm(256, generator=gen)]
    layer = QuantLinear.from_layer(build_layer(codes, scales, zeros, g_idx, 128, None, torch.float16), precompile=False)
    assert layer.perm is not None and layer.zero_points
    model = torch.nn.Sequential(layer)
    models.to_dequantized(model)
    # the format's definition: W[k, n] = s[g_idx[k], n] * (codes[k, n] - z[g_idx[k], n]) in the input's own order
    expected = (scales.float()[g_idx] * (codes - zeros[g_idx]).float()).half()
    assert torch.equal(model[0].weight.t(), expected)


def test_humming_missing_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)
    monkeypatch.setitem(sys.modules, "humming.layer", None)
    with pytest.raises(models.VariantUnavailable, match="humming is not importable"):
        models.build_variant("humming", None, torch.float16, 128)


# --- the whole path on the GPU ---------------------------------------------------------------------

@pytest.mark.gpu
def test_a_small_llama_end_to_end(tmp_path):
    """Every variant built, measured at batches 1 and 8, context 64 and a 64-token prefill, and the
    tilemarlin model's greedy tokens checked, in one run; humming may only be skipped with a reason."""
    pytest.importorskip("transformers")
    config = write_config(tmp_path, SMALL_LLAMA)
    out = tmp_path / "out"
    args = parse(["--e2e", "--model", str(config), "--batches", "1,8", "--contexts", "64", "--prefill", "64",
                  "--out", str(out), "--markdown"])
    assert args.func(args) == 0
    (path,) = out.glob("*-e2e-float16.json")
    data = e2e_report.load(path)
    meta = data["meta"]
    assert meta["complete"] and set(meta["skipped"]) <= {"humming"}
    for variant in meta["variants"]:
        if variant in meta["skipped"]:
            assert meta["skipped"][variant]
            continue
        record = data["variants"][variant]
        assert "error" not in record, record
        assert [(p["batch"], p["context"]) for p in record["decode"]] == [(1, 64), (8, 64)]
        assert [p["tokens"] for p in record["prefill"]] == [64]
        for point in record["decode"] + record["prefill"]:
            assert point["us"] is not None and point["us"] > 0 and point["tokens_per_s"] > 0, (variant, point)
        assert record["weight_bytes"] > 0
    assert data["variants"]["tilemarlin"]["weight_bytes"] < data["variants"]["dense"]["weight_bytes"]
    check = data["correctness"]
    assert "error" not in check, check
    assert check["steps"] == 32 and 0 <= check["matching"] <= 32 and len(check["tokens"]) == 32
    # on the same history the two models' logits differ by fp16 rounding (about 1 % after Llama-2-7B's
    # 32 layers on the H200); a wrong kernel gives errors of order one
    assert check["same_history"]["logits_rel_error"] < 0.05
    assert (out / f"{path.stem}.png").exists() and (out / f"{path.stem}.md").exists()


@pytest.mark.gpu
def test_an_act_order_checkpoint_end_to_end(tmp_path):
    """A GPTQ checkpoint with zero points and act-order as the loader serves it (gathers shared and
    folded), against the same model with its dequantized weights, in one run."""
    pytest.importorskip("transformers")
    from tests.checkpoint_writers import write_checkpoint

    folder = tmp_path / "llama-gptq"
    drawn = write_checkpoint(folder, "gptq", torch.float16, 128, symmetric=False, act_order=True, seed=5,
                             max_position_embeddings=256)
    out = tmp_path / "out"
    args = parse(["--e2e", "--checkpoint", str(folder), "--variants", "dense,tilemarlin", "--batches", "1,8",
                  "--contexts", "64", "--prefill", "64", "--out", str(out)])
    assert args.func(args) == 0
    (path,) = out.glob("*-llama-gptq-e2e-float16.json")
    data = e2e_report.load(path)
    meta = data["meta"]
    assert meta["complete"] and meta["checkpoint"]["quant_method"] == "gptq" and meta["group"] is None
    for variant in ("dense", "tilemarlin"):
        record = data["variants"][variant]
        assert "error" not in record, record
        for point in record["decode"] + record["prefill"]:
            assert point["us"] is not None and point["us"] > 0, (variant, point)
    assert data["variants"]["tilemarlin"]["layers"] == {"int4_layers": len(drawn), "zero_points": len(drawn),
                                                        "group_sizes": [128], "gathers": 2, "gathering_norms": 4}
    assert data["variants"]["dense"]["quantized_bytes"] == 0
    check = data["correctness"]
    assert "error" not in check, check
    assert check["same_history"]["logits_rel_error"] < 0.05


def test_a_run_records_every_variant_and_rebuilds_its_report(tmp_path, monkeypatch, tiny_model):
    """The measuring loop on the CPU, with the GPU's parts stood in for: the tiny model for every
    variant, a fixed time per step, the steps run as they are instead of captured. What is checked
    is the recording: every point, the skipped variant, the check, and a report from the JSON."""
    from types import SimpleNamespace

    from gen import timing

    def build(variant, config, dtype, group, max_m):
        assert max_m == 16   # the check's prompt: the largest M of this run
        if variant == "humming":
            raise models.VariantUnavailable("humming is not importable: stood in")
        return tiny_model

    ran = []
    monkeypatch.setattr(models, "build_variant", build)
    monkeypatch.setattr(timing, "time_calls", lambda calls, replays: ran.append(replays) or calls[0]() or 2000.0)
    monkeypatch.setattr(timing, "capture_graph", lambda calls: SimpleNamespace(replay=calls[0]))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (80 * 1024 ** 3, 141 * 1024 ** 3))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    opts = e2e.options(parse(["--e2e", "--batches", "1,2", "--contexts", "8", "--prefill", "6", "--out", str(tmp_path)]))
    assert e2e._measure_and_report(opts, models.hf_config(TINY_LLAMA)) == 0

    data = e2e_report.load(tmp_path / "nvidia-h200-llama-2-7b-e2e-float16.json")
    assert data["meta"]["complete"] and data["meta"]["skipped"] == {"humming": "humming is not importable: stood in"}
    assert ran == [e2e.DECODE_REPLAYS, e2e.DECODE_REPLAYS, e2e.PREFILL_REPLAYS] * 2
    for variant in ("dense", "tilemarlin"):
        record = data["variants"][variant]
        assert [(p["batch"], p["us"], p["tokens_per_s"]) for p in record["decode"]] == [(1, 2000.0, 500.0),
                                                                                         (2, 2000.0, 1000.0)]
        assert record["prefill"] == [{"tokens": 6, "us": 2000.0, "tokens_per_s": 3000.0}]
        assert record["weight_bytes"] == models.weight_bytes(tiny_model) and record["quantized_bytes"] == 0
    check = data["correctness"]
    assert check["matching"] == 32 and check["first_mismatch"] is None and check["tokens"] == check["reference_tokens"]
    assert check["same_history"]["agreeing"] == 32 and check["same_history"]["max_logit_difference"] == 0
    assert "32 of 32 decode steps" in e2e_report.terminal_report(data)


def test_a_cache_that_does_not_fit_is_skipped_with_its_size(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * 1024 ** 3, 141 * 1024 ** 3))
    config = models.hf_config(models.config_fields("llama-2-7b"))
    assert e2e._kv_fits(config, 32, 4096, torch.float16) is None   # 64 GiB
    assert e2e._kv_fits(config, 256, 4096, torch.float16) == "KV cache 512.0 GiB > 90% of the 100.0 GiB free"
