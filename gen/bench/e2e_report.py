"""The report of `gen bench --e2e`: terminal tables, markdown and a tokens/s plot, built from the
recorded JSON alone (no GPU, no torch), so `gen bench --e2e --from-json FILE` rebuilds it anywhere.

The JSON holds `meta` (GPU, versions, model config, dtype, the batches, contexts and prefill lengths
asked for, skipped variants), `variants` (per variant: weight bytes, and `decode` points
{batch, context, us, tokens_per_s} and `prefill` points {tokens, us, tokens_per_s}, `us` null with
`skipped` or `error` saying why) and `correctness` (the greedy-token check).
"""
from __future__ import annotations

import json
from pathlib import Path

from gen.bench import report

DENSE = "dense"
_SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}
_COLORS = {DENSE: "C7", "tilemarlin": "C0", "humming": "C2"}   # as in the GEMM bench's plots
_LINESTYLES = ("-", "--", ":", "-.")
GIB = 1 << 30


_META_FIELDS = {"gpu", "model", "dtype", "date", "command", "config", "batches", "contexts", "prefill", "variants",
                "replays"}


def load(path: str | Path) -> dict:
    """A recorded --e2e run, checked for the fields the report relies on (a ValueError that names the
    first one missing)."""
    data = json.loads(Path(path).read_text())
    meta = data.get("meta") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or meta.get("kind") != "e2e" or not isinstance(data.get("variants"), dict):
        raise ValueError(f"{path}: not a gen bench --e2e file (expected meta.kind 'e2e' and an object 'variants')")
    missing = _META_FIELDS - meta.keys()
    if missing:
        raise ValueError(f"{path}: its meta lacks {sorted(missing)}")
    if not isinstance(meta["config"], dict) or {"num_hidden_layers", "hidden_size"} - meta["config"].keys():
        raise ValueError(f"{path}: its meta's config lacks num_hidden_layers or hidden_size")
    if not isinstance(meta["replays"], dict) or {"decode", "prefill"} - meta["replays"].keys():
        raise ValueError(f"{path}: its meta's replays lack decode or prefill")
    for name, record in data["variants"].items():
        if not isinstance(record, dict):
            raise ValueError(f"{path}: variant {name} is not an object")
        for kind, keys in (("decode", {"batch", "context", "us"}), ("prefill", {"tokens", "us"})):
            for i, point in enumerate(record.get(kind, [])):
                if not isinstance(point, dict) or keys - point.keys():
                    raise ValueError(f"{path}: {name} {kind} point {i} lacks "
                                     f"{sorted(keys - point.keys()) if isinstance(point, dict) else sorted(keys)}")
    return data


def incomplete_note(data: dict) -> str | None:
    """What an interrupted run (meta.complete false) measured, for the report's heading; None for a
    complete run."""
    meta = data["meta"]
    if meta.get("complete", True):
        return None
    done = [v for v in meta["variants"] if v in data["variants"]]
    return (f"Incomplete run: {len(done)} of {len(meta['variants'])} variants measured "
            f"({', '.join(done) or 'none'})")


def stem(meta: dict) -> str:
    return f"{report.slug(meta['gpu'])}-{report.slug(meta['model'])}-e2e-{meta['dtype']}"


def output_paths(out_dir: str | Path, file_stem: str) -> dict[str, Path]:
    out = Path(out_dir)
    return {"json": out / f"{file_stem}.json", "plot": out / f"{file_stem}.png", "markdown": out / f"{file_stem}.md"}


# --- the numbers ---------------------------------------------------------------------------------

def label(data: dict, variant: str) -> str:
    """The dense model is named by its dtype (fp16, bf16)."""
    return _SHORT_DTYPE.get(data["meta"]["dtype"], data["meta"]["dtype"]) if variant == DENSE else variant


def measured(data: dict) -> list[str]:
    """The variants that were built and measured, in the order of the run."""
    return [v for v in data["meta"]["variants"] if v in data["variants"] and "error" not in data["variants"][v]]


def _times(data: dict, kind: str, key) -> dict:
    """{key(point): {variant: us}} over the points with a time."""
    times: dict = {}
    for variant in measured(data):
        for point in data["variants"][variant].get(kind, []):
            if point["us"] is not None:
                times.setdefault(key(point), {})[variant] = point["us"]
    return times


def decode_times(data: dict) -> dict[tuple[int, int], dict[str, float]]:
    """{(context, batch): {variant: microseconds per step}}."""
    return _times(data, "decode", lambda p: (p["context"], p["batch"]))


def prefill_times(data: dict) -> dict[int, dict[str, float]]:
    """{tokens: {variant: microseconds}}."""
    return _times(data, "prefill", lambda p: p["tokens"])


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _speedup(times: dict[str, float], variant: str) -> float | None:
    return times[DENSE] / times[variant] if DENSE in times and variant in times else None


# --- tables ----------------------------------------------------------------------------------------

def _time_columns(data: dict) -> tuple[list[str], list[str]]:
    """(the time and tokens/s columns per variant, the speedup columns per INT4 variant)."""
    names = measured(data)
    cells = [f"{label(data, v)} {unit}" for v in names for unit in ("ms", "tok/s")]
    gains = [f"{v} x {label(data, DENSE)}" for v in names if v != DENSE]
    return cells, gains


def _time_cells(data: dict, times: dict[str, float], tokens: int) -> list[str]:
    names = measured(data)
    cells = []
    for v in names:
        us = times.get(v)
        cells += ["-", "-"] if us is None else [f"{us / 1000:.3f}", f"{tokens / us * 1e6:,.0f}"]
    return cells + [_fmt(_speedup(times, v), ".2f") for v in names if v != DENSE]


def decode_table(data: dict) -> tuple[list[str], list[list[str]]]:
    """Per context and batch: time per decode step, tokens/s, speedup over the dense model."""
    cells, gains = _time_columns(data)
    times = decode_times(data)
    rows = [[str(context), str(batch), *_time_cells(data, times.get((context, batch), {}), batch)]
            for context in data["meta"]["contexts"] for batch in data["meta"]["batches"]]
    return ["context", "batch", *cells, *gains], rows


def prefill_table(data: dict) -> tuple[list[str], list[list[str]]]:
    cells, gains = _time_columns(data)
    times = prefill_times(data)
    rows = [[str(tokens), *_time_cells(data, times.get(tokens, {}), tokens)] for tokens in data["meta"]["prefill"]]
    return ["tokens", *cells, *gains], rows


def memory_table(data: dict) -> tuple[list[str], list[list[str]]]:
    """Weights on the GPU per variant: all of them, the converted layers' share, and the ratio to dense."""
    dense = data["variants"].get(DENSE, {}).get("weight_bytes")
    rows = []
    for v in measured(data):
        total, quantized = data["variants"][v]["weight_bytes"], data["variants"][v]["quantized_bytes"]
        rows.append([label(data, v), f"{total / GIB:.2f}", f"{quantized / GIB:.2f}",
                     _fmt(total / dense if dense else None, ".2f")])
    return ["variant", "weights (GiB)", "INT4 layers (GiB)", f"x {label(data, DENSE)}"], rows


def correctness_line(data: dict) -> str:
    check = data.get("correctness")
    if not check:
        return "greedy tokens: not checked (tilemarlin was not measured)"
    if "error" in check:
        return f"greedy tokens: the check failed: {check['error']}"
    where = "" if check["first_mismatch"] is None else f"; the first differs at step {check['first_mismatch']}"
    line = (f"greedy tokens: {check['matching']} of {check['steps']} decode steps of {check['variant']} match the "
            f"same model with its dequantized weights in {label(data, DENSE)} nn.Linear layers, from one "
            f"{check['prompt_tokens']}-token prompt{where}")
    return line + _same_history_text(check.get("same_history"), check["steps"])


def _same_history_text(agreement: dict | None, steps: int) -> str:
    """The teacher-forced comparison: whether a flip was a near tie or an error."""
    if not agreement:
        return ""
    text = (f"; fed the same tokens, they agree on {agreement['agreeing']} of {steps}, logits within "
            f"{agreement['logits_rel_error']:.2%} (largest difference {agreement['max_logit_difference']:.3g})")
    if agreement["disagreements"]:
        worst = max(d["lead"] for d in agreement["disagreements"])
        text += (f"; where they differ, the reference's own token led by at most {worst:.3g}, against a median "
                 f"lead of {agreement['median_top2_lead']:.3g} of its top token over the next")
    return text


def norm_note(data: dict) -> list[str]:
    """Where tilemarlin's norms write act-order's gathered order, each is one kernel, while the other
    variants run the model's own RMSNorm (eager: several kernels a norm): part of the difference is the
    norms', not the GEMMs'. torch.compile fuses every variant's norms."""
    layers = data["variants"].get("tilemarlin", {}).get("layers") or {}
    norms = layers.get("gathering_norms", 0)
    if not norms or data["meta"].get("compile"):
        return []
    return [f"tilemarlin runs its {norms} gathering norms as one kernel each, the other variants the model's "
            "RMSNorm in eager mode (several kernels each): part of tilemarlin's lead is the norms' "
            "(--compile fuses every variant's norms)"]


def notes(data: dict) -> list[str]:
    """Skipped variants, variants that failed, points not timed, the runtime's warnings, the norms."""
    lines = [f"{v} not measured: {why}" for v, why in data["meta"].get("skipped", {}).items()]
    for v in data["meta"]["variants"]:
        record = data["variants"].get(v, {})
        if "error" in record:
            lines.append(f"{v} could not be built: {record['error']}")
            continue
        for point in record.get("decode", []) + record.get("prefill", []):
            if point["us"] is None:
                where = (f"decode batch {point['batch']} context {point['context']}" if "batch" in point
                         else f"prefill {point['tokens']}")
                lines.append(f"{v} {where}: {point.get('skipped') or 'failed: ' + point.get('error', '?')}")
        lines += [f"{v}: {note}" for note in record.get("notes", [])]
    return lines + norm_note(data)


def layers_text(layers: dict) -> str:
    """A tilemarlin model's INT4 layers in words (e2e_models.layer_summary's fields)."""
    groups = ", ".join("one over K" if g == -1 else str(g) for g in layers["group_sizes"])
    return (f"{layers['int4_layers']} INT4 layers, group {groups}, zero points in {layers['zero_points']}, "
            f"{layers['gathers']} act-order gathers per forward, {layers.get('gathering_norms', 0)} norms writing "
            "act-order layers' input in their order")


def _quantization(data: dict) -> str:
    """How the model is quantized: --group's round-to-nearest, or the checkpoint's own layers."""
    meta = data["meta"]
    checkpoint = meta.get("checkpoint")
    if not checkpoint:
        return f"INT4 group {meta['group']}"
    layers = data["variants"].get("tilemarlin", {}).get("layers")
    return f"{checkpoint['quant_method']} checkpoint" + (f" ({layers_text(layers)})" if layers else "")


def _heading(data: dict) -> str:
    meta, config = data["meta"], data["meta"]["config"]
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    heading = (f"{meta['gpu']}, {meta['model']} ({config['num_hidden_layers']} layers, hidden "
               f"{config['hidden_size']}), {meta['dtype']}, {_quantization(data)}"
               f"{', torch.compile' if meta.get('compile') else ''}; {meta['date']}; {versions}")
    note = incomplete_note(data)
    return f"{note}. {heading}" if note else heading


def terminal_report(data: dict) -> str:
    parts = [_heading(data),
             "\nweights on the GPU\n" + report.text_table(*memory_table(data)),
             "\ndecode (time per step; tokens/s = batch / step)\n" + report.text_table(*decode_table(data)),
             "\nprefill (batch 1)\n" + report.text_table(*prefill_table(data)),
             "\n" + correctness_line(data)]
    if notes(data):
        parts.append("\n" + "\n".join(notes(data)))
    return "\n".join(parts)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def markdown(data: dict) -> str:
    meta = data["meta"]
    weights = ("The checkpoint's own weights, served as runtime.load_quantized loads them; the dense model holds "
               "them dequantized, and humming quantizes those dequantized weights itself (symmetric, the "
               "checkpoint's group size)." if meta.get("checkpoint") else
               "The whole model with random weights, built from its config.")
    method = (f"{weights} Each step (one decode token per "
              f"sequence at the end of a context-long static KV cache, or one prefill) is captured in a CUDA graph "
              f"from fixed input buffers; times are medians of {meta['replays']['decode']} (decode) and "
              f"{meta['replays']['prefill']} (prefill) replays timed with CUDA events, after warm-up.")
    sections = [f"## End to end: {meta['model']} on {meta['gpu']}", _heading(data), method,
                f"`{meta['command']}`",
                "### Weights on the GPU", markdown_table(*memory_table(data)),
                "### Decode (time per step; tokens/s = batch / step)", markdown_table(*decode_table(data)),
                "### Prefill (batch 1)", markdown_table(*prefill_table(data)),
                correctness_line(data) + "."]
    if notes(data):
        sections.append("\n".join(f"- {line}" for line in notes(data)))
    return "\n\n".join(sections) + "\n"


# --- plot ------------------------------------------------------------------------------------------

def plot_tokens(data: dict, path: str | Path) -> Path:
    """Decode tokens/s against batch size: a color per variant, a line style per context."""
    fig = report.figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.subplots()
    times = decode_times(data)
    batches = data["meta"]["batches"]
    for v in measured(data):
        for i, context in enumerate(data["meta"]["contexts"]):
            points = [(b, b / times[(context, b)][v] * 1e6) for b in batches if v in times.get((context, b), {})]
            if points:
                ax.plot(*zip(*points), marker="o", ms=3.5, color=_COLORS.get(v, "C3"),
                        linestyle=_LINESTYLES[i % len(_LINESTYLES)], label=f"{label(data, v)}, context {context}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (sequences decoded together)")
    ax.set_ylabel("tokens/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    title = f"Decode: {data['meta']['model']} on {data['meta']['gpu']}, {data['meta']['dtype']}"
    ax.set_title(title + (" (incomplete run)" if incomplete_note(data) else ""), fontsize=10)
    fig.savefig(path, dpi=130)
    return Path(path)


def write_report(data: dict, out_dir: str | Path, file_stem: str, with_markdown: bool) -> list[str]:
    """Print the tables, write the plot (and the markdown) beside the JSON; returns messages about
    what was skipped. The JSON itself is written by the measuring run, never here."""
    paths = output_paths(out_dir, file_stem)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    print(terminal_report(data))
    messages = []
    try:
        print(f"wrote {plot_tokens(data, paths['plot'])}")
    except report.PlotsUnavailable as exc:
        messages.append(str(exc))
    if with_markdown:
        paths["markdown"].write_text(markdown(data))
        print(f"wrote {paths['markdown']}")
    return messages
