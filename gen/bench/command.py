"""`gen bench`: tilemarlin against FP16 and the other W4A16 kernels at hand, per layer and batch size.

Every kernel (gen/bench/contenders.py) is timed the one way tilemarlin times anything
(gen.timing.time_calls: a CUDA graph over enough weight copies that L2 holds none), in the same run,
next to the ceilings measured in that run (HBM read bandwidth, FP16 tensor-core rate), with
nvidia-smi's readings of the SM clock and the power cap while each batch size was timed
(gen/bench/clocks.py). Before a kernel is timed at a point, one call is checked against the fp32
reference where the kernel computes exactly our quantized weight; a wrong result is recorded as a
failure, never as a time. The run is saved as JSON (`meta` + one row per layer, M and kernel) after
every layer, and the report (gen/bench/report.py) is built from that JSON alone, so `--from-json` can
rebuild tables and plots on a machine without a GPU.

`--e2e` measures a whole model instead (gen/bench/e2e.py): decode steps and prefills in CUDA graphs,
the dense model against its INT4 variants.
"""
from __future__ import annotations

import argparse
import functools
import math
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from gen.bench import report
from gen.bench.common import (DEFAULT_GROUP, DEFAULT_MODEL, DEFAULT_MS, DEFAULT_ROUNDS, KERNELS, NO_GPU_EXIT,
                               check_output_folder, error_text, parse_ms, save_json, versions)
from gen.bench.clocks import ClockLog, summarize
from gen.bench.contenders import CONTENDERS, KernelUnavailable, LayerWeights, layer_weights
from gen.cli import positive_int

# Timed only when named, beside the symmetric kernels in the same run: tilemarlin on the same codes
# and scales with zero points drawn over 0..15 (asymmetric checkpoints' layers), and with act-order
# (the activations' columns gathered by a permutation before each GEMM).
# W4A8 (Hopper): tilemarlin's, FP8 W8A8 torch._scaled_mm and humming's W4A8. And tilemarlin_untuned: the
# kernels the fallback would run were the layers' shapes in no tuned table (beside a tune of them).
OPTIONAL_KERNELS = ("tilemarlin_zp", "tilemarlin_act", "tilemarlin_w4a8", "fp8_w8a8", "humming_w4a8",
                    "tilemarlin_untuned")
# fp16 results land near 1e-3 and bf16 ones (torch_int4) near 5e-3 of the reference; a wrong layout,
# scale or reduction lands near 1.
REL_ERR_LIMIT = 2e-2


# --- command line ------------------------------------------------------------------------------------

def parse_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds <= 60:
        raise argparse.ArgumentTypeError(f"--sustain takes seconds per point and kernel, more than 0 and at most 60, "
                                         f"got {text!r}")
    return seconds


def bench_dtype(args) -> str:
    """The activations' dtype of a GEMM run (--dtype; float16 by default)."""
    return args.dtype or "float16"


def parse_kernels(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in KERNELS + OPTIONAL_KERNELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kernel(s) {', '.join(unknown)}; known: "
                                         f"{', '.join(KERNELS + OPTIONAL_KERNELS)}")
    if report.BASELINE not in names:
        raise argparse.ArgumentTypeError(f"the list must include {report.BASELINE}: every speedup is over it")
    return list(dict.fromkeys(names))


def parse_group(text: str) -> int:
    try:
        group = int(text)
    except ValueError:
        group = 0
    if group != -1 and group <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a group size; use a positive integer, or -1 for channelwise")
    return group


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time tilemarlin against FP16 and other W4A16 kernels, write table, JSON and plots",
        description="Times tilemarlin, FP16 torch.matmul, torch's INT4 kernel and any other W4A16 kernel "
                    "importable, per layer and batch size, next to the measured ceilings. Needs a CUDA GPU, "
                    "except with --from-json.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name or config path (default: %(default)s); with --e2e, a config.json "
                             "needs its model_type")
    source.add_argument("--shapes", metavar="KxN,...",
                        help="layer shapes instead of a model's, e.g. 4096x12288,4096x4096")
    source.add_argument("--from-json", metavar="FILE",
                        help="rebuild the table, plots and markdown from a recorded run; no GPU needed")
    parser.add_argument("--group", type=parse_group, default=DEFAULT_GROUP,
                        help="rows per scale, -1 for channelwise (default: %(default)s)")
    parser.add_argument("--ms", type=parse_ms, default=list(DEFAULT_MS), metavar="M,...",
                        help="batch sizes (default: %s)" % ",".join(map(str, DEFAULT_MS)))
    parser.add_argument("--kernels", type=parse_kernels, default=list(KERNELS), metavar="NAME,...",
                        help="kernels to time; must include fp16 (default: %s; also known: %s)"
                        % (",".join(KERNELS), ",".join(OPTIONAL_KERNELS)))
    parser.add_argument("--rounds", type=positive_int("--rounds must be a positive whole number"), default=DEFAULT_ROUNDS,
                        help="times each point is timed, the kernels taking turns; the median counts "
                             "(default: %(default)s)")
    parser.add_argument("--between", action="store_true",
                        help="run the activations' producer (x.mul_(1), in place) before every timed call, as "
                             "a model's elementwise kernels run before its GEMMs, and subtract the producer's "
                             "own time, timed alone in the same round: a kernel that starts early then overlaps "
                             "a kernel that does not release it early, not a replay of itself")
    parser.add_argument("--sustain", type=parse_seconds, metavar="SECONDS",
                        help="run each kernel at each point back to back for this long (per round), as a long "
                             "prefill does, so that the power controller settles: times are means over the run, "
                             "and the rows get the board's millijoules per call (NVML's energy counter) and the "
                             "SM clock held")
    parser.add_argument("--out", default="docs/bench",
                        help="folder for the JSON, plots and markdown (default: %(default)s)")
    parser.add_argument("--markdown", action="store_true",
                        help="also write the layers-summed table as markdown, for the docs")
    from gen.bench import e2e   # the --e2e flags

    e2e.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from gen.bench import e2e

    try:
        check_output_folder(args.out)
    except ValueError as exc:
        print(f"gen bench: {exc}", file=sys.stderr)
        return 2
    if args.e2e:
        return e2e.run(args)
    misplaced = e2e.misplaced_e2e_flags(args)
    if misplaced:
        print(f"gen bench: {', '.join(misplaced)} apply to --e2e runs only", file=sys.stderr)
        return 2
    if args.from_json:
        return _report_from_json(args)
    if args.sustain and args.between:
        print("gen bench: --sustain and --between time different things (a steady load at the power cap, "
              "a GEMM after a model's elementwise kernel); run them separately", file=sys.stderr)
        return 2
    try:
        model, layers = _layers(args)
    except (ImportError, ValueError, OSError, KeyError) as exc:
        print(f"gen bench: {exc}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gen bench measures kernels and needs a CUDA GPU, but torch sees none "
              "(torch.cuda.is_available() is False).\n"
              "To rebuild the table and plots from a recorded run, no GPU needed:\n"
              f"  gen bench --from-json {args.out}/<gpu>-<model>.json [--markdown]", file=sys.stderr)
        return NO_GPU_EXIT
    return _measure_and_report(args, model, layers)


def _report_from_json(args) -> int:
    try:
        data = report.load(args.from_json)
    except (OSError, ValueError) as exc:
        print(f"gen bench: cannot read {args.from_json}: {exc}", file=sys.stderr)
        return 2
    for message in report.write_report(data, args.out, Path(args.from_json).stem, args.markdown):
        print(message, file=sys.stderr)
    return 0


def _layers(args) -> tuple[str, list]:
    """(name for the files, layers with .name, .k, .n): a model's linear layers or the --shapes given."""
    from gen import models
    from runtime.op import problem_of

    if args.shapes:
        layers = models.parse_shapes(args.shapes)
        name = "shapes-" + "-".join(f"{layer.k}x{layer.n}" for layer in layers)
    else:
        path = Path(args.model)
        name = (path.parent.name if path.is_file() else path.name) if path.exists() else args.model
        layers = models.model_layers(args.model)
    for layer in layers:   # a layer tilemarlin cannot run fails here, before minutes of measuring
        try:
            problem_of(layer.n, layer.k, args.group, "float16")
        except ValueError as exc:
            raise ValueError(f"layer {layer.name} ({layer.shape}): {exc}") from None
    return name, layers


# --- measuring ---------------------------------------------------------------------------------------

def replays_for(m: int) -> int:
    """Graph replays per point: prefill-sized calls run milliseconds each, and ten replays of those
    give as steady a median as thirty of the microsecond-sized decode calls."""
    return 30 if m <= 256 else 10


def _measure_points(contenders: dict, x, reference, w: LayerWeights, m: int, rounds: int,
                    between: bool = False, sustain: float | None = None, nvml=None) -> dict:
    """A row per kernel at one point: each checked (where exact), then timed `rounds` times, the
    kernels taking turns and each round starting one kernel later, so that a drift of the GPU's
    clocks meets all of them alike; the median counts. Any failure becomes that kernel's error.
    With `between`, every timed call runs after the activations' producer, whose own time (timed
    alone at the start of each round) comes off that round's times (`producer_us` in the rows).
    With `sustain` (seconds), each timing is gen.timing.time_sustained's, and the rows get the
    median of the rounds' millijoules per call and SM clocks (`mj_per_call`, `sm_mhz`; None
    without `nvml`)."""
    from gen.timing import activation_producer, after, time_calls, time_producer, time_sustained
    from schedules.quant import relative_error

    rows, calls, times = {}, {}, {}
    for kernel, contender in contenders.items():
        rows[kernel] = {}
        try:
            calls[kernel] = contender.calls(x)
            if contender.exact:
                err = relative_error(calls[kernel][0](), reference())
                rows[kernel]["rel_err"] = err if math.isfinite(err) else None   # JSON has no inf
                if not err <= REL_ERR_LIMIT:   # NaN and inf (non-finite output) fail too
                    raise ValueError(f"wrong result: relative error {err:.2e} > {REL_ERR_LIMIT:.0e}")
            times[kernel] = []
        except Exception as exc:  # a kernel that fails is a result, not a crash
            rows[kernel].update(us=None, error=error_text(exc))
    order, producer, sustained = list(times), [], {kernel: [] for kernel in times}
    produce = activation_producer(x)
    if between:
        calls = {kernel: [after(produce, call) for call in kernel_calls] for kernel, kernel_calls in calls.items()}
    for r in range(rounds):
        if between and order:
            producer.append(time_producer(produce, replays=replays_for(m)))
        for kernel in order[r % len(order):] + order[:r % len(order)] if order else ():
            if kernel not in times:
                continue
            try:
                if sustain:
                    sustained[kernel].append(time_sustained(calls[kernel], sustain, nvml))
                    us = sustained[kernel][-1]["us"]
                else:
                    us = time_calls(calls[kernel], replays=replays_for(m))
                times[kernel].append(us - producer[-1] if between else us)
            except Exception as exc:
                del times[kernel]
                rows[kernel].update(us=None, error=error_text(exc))
    for kernel, samples in times.items():
        if between:
            rows[kernel]["producer_us"] = statistics.median(producer)
        us = statistics.median(samples)
        nbytes = report.bytes_moved(kernel, w.k, w.n, m, w.group, w.name)
        rows[kernel].update(us=us, bytes=nbytes, gbps=nbytes / us / 1e3, tflops=report.flops(w.k, w.n, m) / us / 1e6)
        if rounds > 1:
            rows[kernel]["us_rounds"] = samples
        if sustain:
            for field in ("mj_per_call", "sm_mhz"):
                values = [run[field] for run in sustained[kernel] if run[field] is not None]
                rows[kernel][field] = statistics.median(values) if values else None
    return rows


def _measure_layer(w: LayerWeights, args, skipped: dict, rows: list, windows: dict, nvml=None) -> None:
    """Every point of one layer into `rows`; `windows` (M -> [(start, end)]) gets the wall-clock
    interval in which each batch size was timed, for the clock readings."""
    import torch

    from schedules.quant import reference_matmul

    contenders, layer_errors = {}, {}
    for kernel in args.kernels:
        if kernel in skipped:
            continue
        try:
            contenders[kernel] = CONTENDERS[kernel](w)
        except KernelUnavailable as exc:
            skipped[kernel] = str(exc)
            print(f"skipping {kernel}: {exc}", file=sys.stderr)
        except Exception as exc:  # this layer's shape or format does not suit the kernel
            layer_errors[kernel] = error_text(exc)
    for m in args.ms:
        x = torch.randn(m, w.k, dtype=w.scales.dtype, device="cuda")
        reference = functools.cache(lambda: reference_matmul(x, w.codes, w.scales))   # only if needed
        line = []
        start = time.time()
        measured = _measure_points({k: c for k, c in contenders.items() if k not in layer_errors}, x, reference,
                                   w, m, args.rounds, between=args.between, sustain=args.sustain, nvml=nvml)
        windows.setdefault(m, []).append((start, time.time()))
        for kernel in args.kernels:
            if kernel in skipped:
                continue
            base = {"layer": w.name, "k": w.k, "n": w.n, "m": m, "kernel": kernel}
            if kernel in layer_errors:
                result = {"us": None, "error": layer_errors[kernel]}
            else:
                result = measured[kernel]
            rows.append({**base, **result})
            line.append(f"{kernel} {'FAILED' if result['us'] is None else format(result['us'], '.1f') + ' us'}")
        print(f"{w.name} M={m}: " + ", ".join(line), file=sys.stderr, flush=True)
    contenders.clear()
    torch.cuda.empty_cache()


def _meta(args, model: str, layers: list) -> dict:
    import torch

    from gen.timing import fp16_tensor_flops, hbm_read_bandwidth

    props = torch.cuda.get_device_properties(0)
    print("measuring the ceilings (HBM read, FP16 tensor cores)...", file=sys.stderr, flush=True)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "versions": versions(),
        "ceilings": {"hbm_read_gbps": hbm_read_bandwidth() / 1e9, "fp16_tflops": fp16_tensor_flops() / 1e12},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["gen", *sys.argv[1:]]),
        "model": model,
        "layers": [{"name": layer.name, "k": layer.k, "n": layer.n} for layer in layers],
        "group": args.group,
        "dtype": bench_dtype(args),
        "ms": args.ms,
        "kernels": args.kernels,
        "rounds": args.rounds,
        "between": args.between,
        "sustain": args.sustain,
        "skipped": {},
        "complete": False,
    }




def _precompile_tilemarlin(layers: list, args) -> None:
    """Compile every tilemarlin kernel the run will call, in parallel, before anything is timed:
    compiled one by one at their first calls they would cost 5-7 s each."""
    try:
        from runtime.op import precompile
    except ImportError:
        return   # tilemarlin_contender records why tilemarlin is skipped
    from schedules.problem import Problem

    print("compiling tilemarlin's kernels for these layers and batch sizes...", file=sys.stderr, flush=True)
    forms = {"tilemarlin": {}, "tilemarlin_act": {}, "tilemarlin_zp": {"zero_points": True},
             "tilemarlin_w4a8": {"act": "fp8"}}
    wanted = {tuple(form.items()) for kernel, form in forms.items() if kernel in args.kernels}
    problems = [Problem.make(n=layer.n, k=layer.k, group=args.group, dtype=bench_dtype(args), **dict(form))
                for layer in layers for form in sorted(wanted)]
    try:
        failed = {job: error for job, error in precompile(problems, args.ms).items() if error}
        if "tilemarlin_untuned" in args.kernels:
            failed.update(_precompile_untuned(layers, args))
    except Exception as exc:   # the first calls compile instead, and record any failure per point
        print(f"precompiling failed ({error_text(exc)}); kernels compile at first call", file=sys.stderr)
        return
    from runtime.precompile import job_name

    for job, error in failed.items():
        print(f"  {job_name(job)}: {error}", file=sys.stderr)


def _precompile_untuned(layers: list, args) -> dict:
    """Build the kernels tilemarlin_untuned will run (the fallback's, each layer's shape left out) in
    one parallel compile; returns the failed jobs with their errors."""
    from gen.bench.contenders import untuned_dispatch
    from runtime.op import DEFAULT_LAYOUT
    from runtime.precompile import build_missing, plan
    from schedules.problem import Problem

    jobs, arch = {}, None
    for layer in layers:
        problem = Problem.make(n=layer.n, k=layer.k, group=args.group, dtype=bench_dtype(args))
        dispatch = untuned_dispatch(problem)
        jobs.update(dict.fromkeys(plan([problem], args.ms, dispatch, DEFAULT_LAYOUT)))
        arch = dispatch.arch
    return {job: error for job, error in build_missing(list(jobs), arch).items() if error} if jobs else {}


def _smi_device() -> str:
    """nvidia-smi's name for CUDA device 0: its UUID (CUDA_VISIBLE_DEVICES may renumber the GPUs)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    return f"GPU-{uuid}" if uuid else "0"


def _energy_counter(meta: dict):
    """The GPU's NVML energy counter for --sustain, or None with the reason in meta["energy"]
    (the run then times without energy)."""
    from gen.bench.energy import EnergyUnavailable, Nvml

    try:
        return Nvml(_smi_device())
    except EnergyUnavailable as exc:
        meta["energy"] = {"unavailable": str(exc)}
        print(f"no energy readings: {exc}", file=sys.stderr)
        return None


def clock_record(clocks: ClockLog, windows: dict) -> dict:
    """The run's clock readings per batch size (all layers' intervals together; JSON keys are
    strings), or why there are none."""
    if clocks.unavailable:
        return {"unavailable": clocks.unavailable}
    top = max(s.sm_mhz for s in clocks.samples)
    return {"by_m": {str(m): summarize(clocks.between(spans), top) for m, spans in sorted(windows.items())}}


def _measure_and_report(args, model: str, layers: list) -> int:
    import torch

    torch.manual_seed(0)
    data = {"meta": _meta(args, model, layers), "rows": []}
    dtype = data["meta"]["dtype"]
    stem = f"{report.slug(data['meta']['gpu'])}-{report.slug(model)}" + ("" if dtype == "float16" else f"-{dtype}")
    json_path = report.output_paths(args.out, stem)["json"]
    if {"tilemarlin", "tilemarlin_zp", "tilemarlin_act", "tilemarlin_w4a8", "tilemarlin_untuned"} & set(args.kernels):
        _precompile_tilemarlin(layers, args)
    windows: dict[int, list] = {}
    nvml = _energy_counter(data["meta"]) if args.sustain else None
    with torch.no_grad(), ClockLog(_smi_device()) as clocks:
        for layer in layers:
            weights = layer_weights(layer, args.group, bench_dtype(args))
            _measure_layer(weights, args, data["meta"]["skipped"], data["rows"], windows, nvml)
            del weights
            save_json(data, json_path)   # a crash later still leaves the layers done
    data["meta"]["clocks"] = clock_record(clocks, windows)
    data["meta"]["complete"] = True
    save_json(data, json_path)
    print(f"wrote {json_path}")
    for message in report.write_report(data, args.out, stem, args.markdown):
        print(message, file=sys.stderr)
    return 0
