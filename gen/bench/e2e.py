"""`gen bench --e2e`: a whole model, dense against its INT4 variants, served as engines serve it.

Each variant (gen/bench/e2e_models.py: the dense model, tilemarlin's replace_linear, humming's
layers) is built on the GPU from the model's config with the same random weights, measured, and freed
before the next. With --checkpoint the model is a quantized checkpoint's (GPTQ, AWQ,
compressed-tensors): tilemarlin serves it as runtime.load_quantized loads it, and the dense variant
holds its dequantized weights. Every variant is measured the same way: a static KV cache and one forward step
captured in a CUDA graph from fixed input buffers (gen/bench/e2e_steps.py), timed by the shared
harness (gen.timing.time_calls: warm-up, then the median over replays timed with CUDA events).

- decode: one token for each of `batch` sequences at the end of a `context`-long cache, per batch
  and context; tokens/s = batch / time per step. A point whose cache does not fit in the free
  memory is recorded as skipped.
- prefill: one sequence of N tokens into an empty cache; tokens/s = N / time.
- memory: the bytes of the model's parameters and buffers, and of its converted layers.
- tokens: 32 greedy decode steps of the tilemarlin model (captured steps, as timed) against the same
  model with each INT4 layer turned back into an nn.Linear holding the dequantized weights, from the
  same prompt: how many of the 32 tokens match.

The run is saved as JSON after each variant; the report (gen/bench/e2e_report.py) is built from that
JSON alone, so `gen bench --e2e --from-json FILE` rebuilds it anywhere.
"""
from __future__ import annotations

import argparse
import gc
import shlex
import sys
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gen.bench import common, e2e_report
from gen.bench import e2e_models as models
from gen.bench import e2e_steps as steps

DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (512, 4096)
DEFAULT_PREFILL = (512, 2048, 4096)
DECODE_REPLAYS = 30
PREFILL_REPLAYS = 10   # a prefill runs milliseconds: fewer replays give as steady a median
PROMPT_TOKENS = 16
CHECK_STEPS = 32
# A point runs when its KV cache takes at most this share of the free memory; the rest is for the
# step's activations and the graph's pool.
KV_SHARE = 0.9
GIB = 1 << 30


@dataclass(frozen=True)
class Options:
    model: str
    dtype: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: tuple[int, ...]
    variants: tuple[str, ...]
    group: int
    checkpoint: str | None
    compile: bool
    out: str
    markdown: bool


# --- command line ------------------------------------------------------------------------------------

def parse_variants(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in models.KNOWN_VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown) or repr(text)}; "
                                         f"known: {', '.join(models.KNOWN_VARIANTS)}")
    return list(dict.fromkeys(names))


def add_arguments(parser) -> None:
    """The --e2e flags of `gen bench`. Their defaults are applied by `options`, so that giving one
    without --e2e can be refused."""
    group = parser.add_argument_group("end to end (--e2e)")
    group.add_argument("--e2e", action="store_true",
                       help="time a whole model (--model) built with random weights: decode steps and prefills "
                            "over a static KV cache in CUDA graphs, dense against tilemarlin and humming; "
                            "weight memory; greedy tokens of tilemarlin against its dequantized weights")
    group.add_argument("--dtype", choices=tuple(models.DTYPES),
                       help="the activations' and scales' dtype, or with --e2e the model's (default: float16; with --e2e "
                            "--checkpoint the checkpoint's torch_dtype)")
    group.add_argument("--batches", type=common.parse_ms, metavar="B,...",
                       help="decode batch sizes (default: %s)" % ",".join(map(str, DEFAULT_BATCHES)))
    group.add_argument("--contexts", type=common.parse_ms, metavar="T,...",
                       help="decode context lengths (default: %s)" % ",".join(map(str, DEFAULT_CONTEXTS)))
    group.add_argument("--prefill", type=common.parse_ms, metavar="N,...",
                       help="prefill lengths at batch 1 (default: %s)" % ",".join(map(str, DEFAULT_PREFILL)))
    group.add_argument("--variants", type=parse_variants, metavar="NAME,...",
                       help="variants to measure (default: %s; also known: %s)"
                            % (",".join(models.VARIANTS), ",".join(models.KNOWN_VARIANTS[len(models.VARIANTS):])))
    group.add_argument("--compile", action="store_true",
                       help="run every variant's steps through torch.compile before capturing them")
    group.add_argument("--checkpoint", metavar="DIR",
                       help="a quantized checkpoint folder (config.json with its quantization_config, safetensors: "
                            "GPTQ, AWQ or compressed-tensors) instead of --model's random weights: tilemarlin "
                            "serves it as runtime.load_quantized loads it, dense holds its dequantized weights")


E2E_ONLY = ("batches", "contexts", "prefill", "variants", "compile", "checkpoint")


def misplaced_e2e_flags(args) -> list[str]:
    """The --e2e flags given to a run without --e2e."""
    return [f"--{name}" for name in E2E_ONLY if getattr(args, name) not in (None, False)]


def _gemm_only_flags(args) -> list[str]:
    """The GEMM bench's flags given to an --e2e run."""
    given = {"--shapes": args.shapes is not None, "--between": args.between, "--sustain": args.sustain is not None,
             "--ms": args.ms != list(common.DEFAULT_MS), "--kernels": args.kernels != list(common.KERNELS),
             "--rounds": args.rounds != common.DEFAULT_ROUNDS}
    return [flag for flag, present in given.items() if present]


def options(args) -> Options:
    """The run's options with their defaults; a GEMM-bench flag given with --e2e, or with --checkpoint a
    model or group size of its own, is a ValueError."""
    wrong = _gemm_only_flags(args)
    if wrong:
        raise ValueError(f"{', '.join(wrong)} belong to the GEMM bench; --e2e takes --model, --dtype, --batches, "
                         "--contexts, --prefill, --variants, --group, --compile, --checkpoint")
    if args.checkpoint is not None:
        given = [flag for flag, present in (("--model", args.model != common.DEFAULT_MODEL),
                                            ("--group", args.group != common.DEFAULT_GROUP)) if present]
        if given:
            raise ValueError(f"{', '.join(given)}: --checkpoint's config.json says which model it is, and its "
                             "layers carry their own group size")
    return Options(model=args.model, dtype=args.dtype or _checkpoint_dtype(args.checkpoint) or "float16",
                   batches=tuple(args.batches or DEFAULT_BATCHES), contexts=tuple(args.contexts or DEFAULT_CONTEXTS),
                   prefill=tuple(args.prefill or DEFAULT_PREFILL), variants=tuple(args.variants or models.VARIANTS),
                   group=args.group, compile=args.compile, checkpoint=args.checkpoint, out=args.out,
                   markdown=args.markdown)


def _checkpoint_dtype(checkpoint: str | None) -> str | None:
    """A checkpoint's own dtype (config.json's), the default of its run."""
    from gen.checkpoints import config_dtype

    return None if checkpoint is None else config_dtype(checkpoint)


def model_label(name_or_path: str, checkpoint: str | None = None) -> str:
    """A registered name as it is; a config.json's folder name for a path; a checkpoint's folder name."""
    if checkpoint is not None:
        return Path(checkpoint).resolve().name
    path = Path(name_or_path)
    return path.parent.name if path.is_file() else name_or_path


def checkpoint_method(folder: str) -> str:
    """The checkpoint's quant_method, once its quantization_config is read and checked as the loader
    will (runtime.CheckpointError, naming the file and field, where it cannot be loaded)."""
    from runtime.checkpoint.loader import checkpoint_format, read_quantization_config

    qcfg, place = read_quantization_config(Path(folder))
    checkpoint_format(qcfg, place)
    return str(qcfg["quant_method"]).lower()


def model_config(opts: Options):
    """The transformers config of the run's model: --model's, or the checkpoint's config.json."""
    if opts.checkpoint is None:
        return models.hf_config(models.config_fields(opts.model))
    return models.hf_config(models.config_fields(str(Path(opts.checkpoint) / "config.json")))


def missing_requirement() -> str | None:
    """Why this machine cannot run the measurement (one line), or None."""
    import torch

    if not torch.cuda.is_available():
        return ("gen bench --e2e needs a CUDA GPU, but torch sees none (torch.cuda.is_available() is False); "
                "a recorded run's report rebuilds anywhere with: gen bench --e2e --from-json FILE")
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "gen bench --e2e needs transformers to build the model from its config: pip install transformers"
    return None


def run(args) -> int:
    try:
        opts = options(args)
    except ValueError as exc:
        print(f"gen bench --e2e: {exc}", file=sys.stderr)
        return 2
    if args.from_json:
        return _report_from_json(args.from_json, opts)
    try:
        # a checkpoint that cannot be loaded is named before the GPU is asked for
        method = None if opts.checkpoint is None else checkpoint_method(opts.checkpoint)
    except ValueError as exc:
        print(f"gen bench --e2e: {exc}", file=sys.stderr)
        return 2
    why = missing_requirement()
    if why:
        print(why, file=sys.stderr)
        return common.NO_GPU_EXIT
    try:
        config = model_config(opts)
    except (ValueError, OSError, KeyError) as exc:
        print(f"gen bench --e2e: {exc}", file=sys.stderr)
        return 2
    return _measure_and_report(opts, config, method)


def _report_from_json(path: str, opts: Options) -> int:
    try:
        data = e2e_report.load(path)
    except (OSError, ValueError) as exc:
        print(f"gen bench --e2e: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    for message in e2e_report.write_report(data, opts.out, Path(path).stem, opts.markdown):
        print(message, file=sys.stderr)
    return 0


# --- progress ----------------------------------------------------------------------------------------

def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(stderr=True, log_path=False, highlight=False)


_CONSOLE = _console()


def say(text: str) -> None:
    """A progress line on stderr (timestamped by rich where it is installed)."""
    if _CONSOLE is None:
        print(text, file=sys.stderr, flush=True)
    else:
        _CONSOLE.log(text, markup=False)


# --- measuring ---------------------------------------------------------------------------------------

def _free_memory() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _kv_fits(config, batch: int, context: int, dtype) -> str | None:
    """Why a cache of batch x context positions is not tried (it would not fit), or None."""
    import torch

    _free_memory()
    need, free = models.kv_bytes(config, batch, context, dtype), torch.cuda.mem_get_info()[0]
    if need <= KV_SHARE * free:
        return None
    return f"KV cache {need / GIB:.1f} GiB > {KV_SHARE:.0%} of the {free / GIB:.1f} GiB free"


def _timed_point(point: dict, make_step, replays: int, tokens: int) -> dict:
    """`point` with the median microseconds of the step `make_step()` builds, replayed in a CUDA graph,
    and tokens/s; or with the error that stopped it (a failure is a result, not a crash)."""
    from gen.timing import time_calls

    try:
        step = make_step()
        step.prime()    # else a compiled forward would compile again inside the capture (a CUDA error)
        us = time_calls([step], replays=replays)
    except Exception as exc:
        return {**point, "us": None, "error": common.error_text(exc)}
    finally:
        _free_memory()
    return {**point, "us": us, "tokens_per_s": tokens / us * 1e6}


def _decode_points(model, forward, config, opts: Options, dtype, variant: str) -> list[dict]:
    points = []
    for context in opts.contexts:
        for batch in opts.batches:
            point = {"batch": batch, "context": context}
            skipped = _kv_fits(config, batch, context, dtype)
            if skipped:
                point.update(us=None, skipped=skipped)
            else:
                point = _timed_point(point, lambda: steps.decode_step(model, batch, context, forward),
                                     DECODE_REPLAYS, batch)
            say(f"{variant} decode batch {batch} context {context}: {_point_text(point)}")
            points.append(point)
    return points


def _prefill_points(model, forward, config, opts: Options, dtype, variant: str) -> list[dict]:
    points = []
    for tokens in opts.prefill:
        point = {"tokens": tokens}
        skipped = _kv_fits(config, 1, tokens, dtype)
        if skipped:
            point.update(us=None, skipped=skipped)
        else:
            point = _timed_point(point, lambda: steps.prefill_step(model, tokens, forward), PREFILL_REPLAYS, tokens)
        say(f"{variant} prefill {tokens} tokens: {_point_text(point)}")
        points.append(point)
    return points


def _point_text(point: dict) -> str:
    if point["us"] is None:
        return f"skipped ({point['skipped']})" if "skipped" in point else f"FAILED ({point['error']})"
    return f"{point['us'] / 1000:.3f} ms, {point['tokens_per_s']:,.0f} tokens/s"


def _compiled(model):
    """torch.compile of `model`, shapes made dynamic once a second one comes (dynamo's default): on
    a 2-layer Llama the run's 8 decode points and 3 prefills took 10 graphs, against 22 with a graph
    per shape (dynamic=False), each a cold compile of the whole model; the recompile limit is raised
    to hold them."""
    import torch
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    return torch.compile(model)


def _build(variant: str, config, opts: Options):
    """The variant's model; tilemarlin's kernels are built with it (replace_linear builds those of
    every M bucket up to the largest M the run calls), before anything is timed."""
    max_m = max(*opts.batches, *opts.prefill, PROMPT_TOKENS)
    dtype = models.DTYPES[opts.dtype]
    if opts.checkpoint is not None:
        if variant in models.TILEMARLIN_VARIANTS:
            say(f"{variant}: loading the checkpoint and building its layers' kernels")
        return models.checkpoint_variant(variant, opts.checkpoint, dtype)
    if variant in models.TILEMARLIN_VARIANTS:
        say(f"{variant}: converting the layers and building their kernels for M up to {max_m}")
    return models.build_variant(variant, config, dtype, opts.group, max_m)


def _check_tokens(model, config) -> dict:
    """Greedy tokens of the tilemarlin `model` against its dequantized twin (the model is converted
    in place, so this runs last): each decoding freely, and the twin fed tilemarlin's tokens, so that
    their logits compare on the same history. A random-weight model's top logits are often close,
    so a flip in a near tie is told apart from an error by the gap it happened in."""
    import torch

    from gen.timing import capture_graph

    generator = torch.Generator(device=model.device).manual_seed(models.SEED)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_TOKENS), device=model.device, generator=generator)
    replayed = lambda step: capture_graph([step]).replay   # noqa: E731
    own = steps.greedy_decode(model, prompt, CHECK_STEPS, replayed)
    twin = models.to_dequantized(model)
    reference = steps.greedy_decode(twin, prompt, CHECK_STEPS, replayed)
    same_history = steps.greedy_decode(twin, prompt, CHECK_STEPS, replayed, follow=own)
    same = [a == b for a, b in zip(own.tokens, reference.tokens)]
    return {"variant": "tilemarlin", "prompt_tokens": PROMPT_TOKENS, "steps": CHECK_STEPS, "matching": sum(same),
            "first_mismatch": same.index(False) if False in same else None,
            "tokens": own.tokens, "reference_tokens": reference.tokens,
            "same_history": _logit_agreement(own, same_history)}


def _logit_agreement(own, reference) -> dict:
    """How two decodes over the same history agree: tokens, the logits' relative error (the worst
    step) and largest difference, and at each step where the tokens differ, how far the reference's
    choice leads tilemarlin's in the reference's own logits, beside the median lead of its top
    token over the next (the near-tie scale)."""
    import torch

    ref = reference.logits
    errors = torch.linalg.vector_norm(own.logits - ref, dim=-1) / torch.linalg.vector_norm(ref, dim=-1)
    top2 = ref.topk(2, dim=-1).values
    gaps = [{"step": t, "lead": float(ref[t, b] - ref[t, a])}
            for t, (a, b) in enumerate(zip(own.tokens, reference.tokens)) if a != b]
    return {"agreeing": len(own.tokens) - len(gaps), "logits_rel_error": float(errors.max()),
            "max_logit_difference": float((own.logits - ref).abs().max()), "disagreements": gaps,
            "median_top2_lead": float((top2[:, 0] - top2[:, 1]).median())}


def _built(variant: str, config, opts: Options, data: dict):
    """The variant's model, or None with the reason recorded (skipped, or the error that stopped it)."""
    say(f"{variant}: building the model")
    try:
        return _build(variant, config, opts)
    except models.VariantUnavailable as exc:
        data["meta"]["skipped"][variant] = str(exc)
        say(f"skipping {variant}: {exc}")
    except Exception as exc:  # a model this GPU cannot hold, a layer a kernel does not take
        data["variants"][variant] = {"error": common.error_text(exc)}
        say(f"{variant} could not be built: {data['variants'][variant]['error']}")
    _free_memory()
    return None


def _measured(model, variant: str, config, opts: Options, data: dict) -> dict:
    """Memory, decode and prefill points of one built variant (and the token check for tilemarlin)."""
    import torch

    record = {"weight_bytes": models.weight_bytes(model), "quantized_bytes": models.quantized_bytes(model)}
    if variant in models.TILEMARLIN_VARIANTS:
        record["layers"] = models.layer_summary(model)
    say(f"{variant}: {record['weight_bytes'] / GIB:.2f} GiB of weights on the GPU")
    forward = _compiled(model) if opts.compile else None
    with torch.no_grad():
        record["decode"] = _decode_points(model, forward, config, opts, model.dtype, variant)
        record["prefill"] = _prefill_points(model, forward, config, opts, model.dtype, variant)
        if variant == "tilemarlin":   # last: it turns the model into its dequantized twin
            data["correctness"] = _guarded(_check_tokens, model, config)
            say(e2e_report.correctness_line(data))
    return record


def _measure_variant(variant: str, config, opts: Options, data: dict) -> None:
    """Build, measure and free one variant, into data["variants"] (or meta's skipped). The tilemarlin
    runtime's warnings (untuned shapes, kernels replaced after their first-run check) are kept in
    the variant's notes."""
    from runtime.dispatch import UntunedShapeWarning
    from runtime.op import KernelCheckWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntunedShapeWarning)
        model = _built(variant, config, opts, data)
        if model is None:
            return
        data["variants"][variant] = _measured(model, variant, config, opts, data)
    messages = list(dict.fromkeys(str(w.message) for w in caught))
    for message in messages:
        say(f"warning: {message}")
    data["variants"][variant]["notes"] = list(dict.fromkeys(
        str(w.message) for w in caught if issubclass(w.category, (UntunedShapeWarning, KernelCheckWarning))))
    del model
    _free_memory()


def _guarded(measure, *args) -> dict:
    try:
        return measure(*args)
    except Exception as exc:
        return {"error": common.error_text(exc)}


def _meta(opts: Options, config, method: str | None = None) -> dict:
    import torch
    import transformers

    fields = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size")
    return {
        "kind": "e2e",
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "versions": {**common.versions(), "transformers": transformers.__version__},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["gen", *sys.argv[1:]]),
        "model": model_label(opts.model, opts.checkpoint),
        "config": {field: getattr(config, field, None) for field in fields},
        "dtype": opts.dtype, "group": None if opts.checkpoint else opts.group, "compile": opts.compile,
        "checkpoint": None if opts.checkpoint is None else {"path": str(opts.checkpoint), "quant_method": method},
        "batches": list(opts.batches), "contexts": list(opts.contexts), "prefill": list(opts.prefill),
        "variants": list(opts.variants),
        "replays": {"decode": DECODE_REPLAYS, "prefill": PREFILL_REPLAYS},
        "skipped": {},
        "complete": False,
    }


def _measure_and_report(opts: Options, config, method: str | None = None) -> int:
    data = {"meta": _meta(opts, config, method), "variants": {}, "correctness": None}
    stem = e2e_report.stem(data["meta"])
    json_path = e2e_report.output_paths(opts.out, stem)["json"]
    for variant in opts.variants:
        _measure_variant(variant, config, opts, data)
        common.save_json(data, json_path)   # a crash later still leaves the variants done
    data["meta"]["complete"] = True
    common.save_json(data, json_path)
    print(f"wrote {json_path}")
    for message in e2e_report.write_report(data, opts.out, stem, opts.markdown):
        print(message, file=sys.stderr)
    return 0
