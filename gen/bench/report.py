"""The bench report: terminal table, markdown summary and plots, all built from the JSON `gen bench` records.

Nothing here needs a GPU or torch, so a report can be rebuilt anywhere from a recorded file
(`gen bench --from-json FILE`). matplotlib is optional: without it the plots are skipped with a
message saying how to make them later.

The JSON holds `meta` (GPU, versions, ceilings, command) and `rows`, one per (layer, M, kernel), with
`us` null where the kernel failed or was wrong at that point (its `error` says why).
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

BASELINE = "fp16"        # every speedup is over torch.matmul in FP16
OURS = "tilemarlin"
PER_ROUND = f"{OURS} speedup per round"   # the summary's column of a --rounds run
CLOCK = "SM clock (MHz)"                     # ... of a run with nvidia-smi's readings (gen/bench/clocks.py)
ENERGY = "{} mJ per call (sum)"              # ... of a --sustain run with NVML's energy counter (gen/bench/energy.py)
HELD = f"SM clock held, {BASELINE} / {OURS} (MHz)"   # ... of a --sustain run: the median over the layers


# --- the cost model: what one call must move and compute -------------------------------------

# Layers that a loaded act-order checkpoint serves without a gather, and why: the layer that reads a
# gated MLP's product has its permutation in gate_proj's and up_proj's output columns
# (runtime/checkpoint/fold.py); the layers that read an RMSNorm's output get it in their order from the
# norm (runtime/checkpoint/norm_fold.py), fused or not.
_FROM_GATED_MLP = ("a gated MLP serves with its permutation in gate_proj's and up_proj's output columns "
                   "(runtime/checkpoint/fold.py)")
_FROM_NORM = "take an RMSNorm's output, written by the norm in their order (runtime/checkpoint/norm_fold.py)"
ACT_ORDER_FOLDED = {"down_proj": _FROM_GATED_MLP,
                    **dict.fromkeys(("qkv_proj", "q_proj", "k_proj", "v_proj", "gate_up_proj", "gate_proj", "up_proj"),
                                    _FROM_NORM)}


def gathers(kernel: str, layer: str) -> bool:
    """Whether `kernel` gathers the activations' columns by a permutation before the GEMM at `layer`."""
    return kernel == "tilemarlin_act" and layer not in ACT_ORDER_FOLDED


def weight_bytes(kernel: str, k: int, n: int, group: int, layer: str = "") -> int:
    """Bytes of weights (and scales, zeros; act-order's permutation) one call must read, in the kernel's
    own storage format."""
    groups = 1 if group == -1 else k // group
    if kernel == BASELINE:
        return 2 * k * n
    if kernel == "torch_int4":   # tinygemm stores a bf16 (scale, zero) pair per group and column
        return k * n // 2 + 4 * groups * n
    if kernel == "tilemarlin_zp":   # a zero point beside each scale
        return k * n // 2 + 4 * groups * n
    if gathers(kernel, layer):   # and the permutation, int32 per input feature
        return k * n // 2 + 2 * groups * n + 4 * k
    if kernel == "fp8_w8a8":   # a byte per weight
        return k * n
    return k * n // 2 + 2 * groups * n   # INT4 codes + fp16 scales (tilemarlin, humming)


def bytes_moved(kernel: str, k: int, n: int, m: int, group: int, layer: str = "") -> int:
    """Weights (+scales) read, activations read and output written, at 2 bytes per element (act-order:
    the gathered copy of the activations written and read again, at the layers that gather)."""
    gathered = 4 * m * k if gathers(kernel, layer) else 0
    return weight_bytes(kernel, k, n, group, layer) + 2 * m * k + 2 * m * n + gathered


def flops(k: int, n: int, m: int) -> int:
    return 2 * m * k * n


def ideal_us(kernel: str, k: int, n: int, m: int, group: int, ceilings: dict) -> float:
    """Roofline time: the larger of moving the bytes at the read ceiling and computing at the FP16 rate."""
    memory = bytes_moved(kernel, k, n, m, group) / (ceilings["hbm_read_gbps"] * 1e9)
    compute = flops(k, n, m) / (ceilings["fp16_tflops"] * 1e12)
    return max(memory, compute) * 1e6


def ideal_int4_speedup(shapes: list[tuple[int, int]], m: int, group: int, ceilings: dict) -> float:
    """The best an INT4 kernel could do over an ideal FP16 one, summed over `shapes` (K, N)."""
    fp16 = sum(ideal_us(BASELINE, k, n, m, group, ceilings) for k, n in shapes)
    int4 = sum(ideal_us(OURS, k, n, m, group, ceilings) for k, n in shapes)
    return fp16 / int4


# --- reading the recorded file -------------------------------------------------------------------

def load(path: str | Path) -> dict:
    """The recorded bench, checked for the fields the report relies on."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "meta" not in data or "rows" not in data:
        e2e = " (a whole-model file: read it with --e2e)" if isinstance(data, dict) and "variants" in data else ""
        raise ValueError(f"{path}: not a gen bench file (expected an object with 'meta' and 'rows'){e2e}")
    missing = {"group", "ceilings"} - set(data["meta"]) if isinstance(data["meta"], dict) else {"meta"}
    if missing or not isinstance(data["rows"], list) or not data["rows"]:
        raise ValueError(f"{path}: not a complete gen bench file ("
                         + (f"its meta lacks {sorted(missing)}" if missing else "it holds no rows") + ")")
    for i, row in enumerate(data["rows"]):
        missing = {"layer", "k", "n", "m", "kernel", "us"} - row.keys()
        if missing:
            raise ValueError(f"{path}: row {i} lacks {sorted(missing)}")
    return data


def slug(text: str) -> str:
    """A file-name-safe lower-case form: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unknown"


def output_paths(out_dir: str | Path, stem: str) -> dict[str, Path]:
    out = Path(out_dir)
    return {"json": out / f"{stem}.json", "speedup": out / f"{stem}-speedup.png",
            "roofline": out / f"{stem}-roofline.png", "markdown": out / f"{stem}.md"}


def layers(data: dict) -> list[tuple[str, int, int]]:
    """(name, K, N) of each layer, in the order measured."""
    seen: dict[str, tuple[str, int, int]] = {}
    for row in data["rows"]:
        seen.setdefault(row["layer"], (row["layer"], row["k"], row["n"]))
    return list(seen.values())


def batch_sizes(data: dict) -> list[int]:
    return sorted({row["m"] for row in data["rows"]})


def kernels(data: dict) -> list[str]:
    """Kernels with at least one time, baseline first, then in the order the run listed them."""
    timed = {row["kernel"] for row in data["rows"] if row["us"] is not None}
    order = [BASELINE] + list(data["meta"].get("kernels", [])) + sorted(timed)
    return [k for k in dict.fromkeys(order) if k in timed]


def layer_times(data: dict, layer: str, field: str = "us") -> dict[int, dict[str, float]]:
    """m -> kernel -> us (or another field of the rows, e.g. mj_per_call) for one layer (failed
    points, and points without that field, left out)."""
    table: dict[int, dict[str, float]] = {}
    for row in data["rows"]:
        if row["layer"] == layer and row["us"] is not None and row.get(field) is not None:
            table.setdefault(row["m"], {})[row["kernel"]] = row[field]
    return table


def summed_times(data: dict, field: str = "us") -> dict[int, dict[str, float]]:
    """m -> kernel -> us (or `field`) summed over all layers; only where the kernel has a value for
    every layer, since a sum with a layer missing would flatter it."""
    names = [name for name, _, _ in layers(data)]
    per_layer = [layer_times(data, name, field) for name in names]
    table: dict[int, dict[str, float]] = {}
    for m in batch_sizes(data):
        for kernel in kernels(data):
            parts = [t.get(m, {}).get(kernel) for t in per_layer]
            if all(p is not None for p in parts):
                table.setdefault(m, {})[kernel] = sum(parts)
    return table


def speedups(times: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """m -> kernel -> baseline us / kernel us, where both were measured."""
    out: dict[int, dict[str, float]] = {}
    for m, row in times.items():
        if BASELINE in row:
            out[m] = {k: row[BASELINE] / us for k, us in row.items() if k != BASELINE}
    return out


def held_clock(data: dict, m: int, kernel: str) -> float | None:
    """The median over the layers of the SM clock `kernel` held at M = m in a --sustain run."""
    clocks = [r["sm_mhz"] for r in data["rows"] if r["m"] == m and r["kernel"] == kernel and r.get("sm_mhz")]
    return statistics.median(clocks) if clocks else None


def round_speedups(data: dict) -> dict[int, list[float]]:
    """m -> tilemarlin's layers-summed speedup in each round of a `--rounds` run, where every layer
    kept its rounds for both kernels. Within a round the kernels took turns point by point, close
    together in time: the spread over rounds shows how much the run's clocks moved the ratio."""
    names = [name for name, _, _ in layers(data)]
    kept = {(r["layer"], r["m"], r["kernel"]): r.get("us_rounds") for r in data["rows"] if r["us"] is not None}
    out: dict[int, list[float]] = {}
    for m in batch_sizes(data):
        ours = [kept.get((name, m, OURS)) for name in names]
        base = [kept.get((name, m, BASELINE)) for name in names]
        if not all(ours + base) or len({len(r) for r in ours + base}) != 1:
            continue
        out[m] = [sum(b[i] for b in base) / sum(o[i] for o in ours) for i in range(len(ours[0]))]
    return out


def failures(data: dict) -> list[str]:
    """One line per (layer, kernel, error) that cost points, listing the M values it failed at."""
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for r in data["rows"]:
        if r["us"] is None:
            grouped.setdefault((r["layer"], r["kernel"], r.get("error", "no time recorded")), []).append(r["m"])
    return [f"{layer} {kernel} at M={','.join(map(str, ms))}: {error}"
            for (layer, kernel, error), ms in grouped.items()]


# --- tables ----------------------------------------------------------------------------------------

def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def baseline_label(meta: dict) -> str:
    """What the baseline is called: torch.matmul in the run's dtype."""
    return "BF16" if meta.get("dtype") == "bfloat16" else "FP16"


def summary_table(data: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the layers-summed table: per M, FP16 and tilemarlin sums, every speedup,
    tilemarlin's lowest and highest speedup over the rounds (a `--rounds` run), and the ideal INT4
    speedup from the measured ceilings."""
    meta = data["meta"]
    others = [k for k in kernels(data) if k != BASELINE]
    times = summed_times(data)
    gains = speedups(times)
    shapes = [(k, n) for _, k, n in layers(data)]
    per_round = round_speedups(data)
    header = ["M", f"{baseline_label(meta)} sum (us)", f"{OURS} sum (us)"] + [f"{k} speedup" for k in others]
    if per_round:
        header.append(PER_ROUND)
    header.append("ideal INT4 speedup")
    energy = summed_times(data, "mj_per_call")
    if energy:
        header += [ENERGY.format(BASELINE), ENERGY.format(OURS), HELD]
    clocks = data["meta"].get("clocks", {}).get("by_m")
    if clocks:
        header.append(CLOCK)
    rows = []
    for m in batch_sizes(data):
        row = [str(m), _fmt(times.get(m, {}).get(BASELINE)), _fmt(times.get(m, {}).get(OURS))]
        row += [_fmt(gains.get(m, {}).get(k), 2) for k in others]
        if per_round:
            spread = per_round.get(m)
            row.append(f"{min(spread):.2f}-{max(spread):.2f}" if spread else "-")
        row.append(_fmt(ideal_int4_speedup(shapes, m, meta["group"], meta["ceilings"]), 2))
        if energy:
            row += [_fmt(energy.get(m, {}).get(kernel), 2) for kernel in (BASELINE, OURS)]
            row.append(" / ".join(_fmt(held_clock(data, m, kernel), 0) for kernel in (BASELINE, OURS)))
        if clocks:
            row.append(clock_cell(clocks.get(str(m))))
        rows.append(row)
    return header, rows


def clock_cell(reading: dict | None) -> str:
    """The median SM clock while a batch size was timed, its lowest reading where lower, and the
    share of readings in which the power cap held it down: "1980", "1980 (min 1275), 23 % capped"."""
    if not reading:
        return "-"
    cell = f"{reading['sm_mhz']:.0f}"
    if reading["min_mhz"] < reading["sm_mhz"]:
        cell += f" (min {reading['min_mhz']:.0f})"
    capped = reading["power_capped"]
    return cell + (f", {100 * capped:.0f} % capped" if capped else "")


def clock_notes(meta: dict) -> list[str]:
    """Why a run has no clock readings, if it should have had them."""
    why = meta.get("clocks", {}).get("unavailable")
    return [f"no SM clock readings: {why}"] if why else []


def layer_table(data: dict, layer: str) -> tuple[list[str], list[list[str]]]:
    """Per M for one layer: every kernel's time and speedup, and how close tilemarlin came to the
    read ceiling, with its relative error against the fp32 reference."""
    by_key = {(r["m"], r["kernel"]): r for r in data["rows"] if r["layer"] == layer}
    others = [k for k in kernels(data) if k != BASELINE]
    read_gbps = data["meta"]["ceilings"]["hbm_read_gbps"]
    header = ["M", "fp16 us"] + [h for k in others for h in (f"{k} us", f"{k} x")]
    header += [f"{OURS} GB/s", "% of read", "rel err"]
    rows = []
    for m in batch_sizes(data):
        base = by_key.get((m, BASELINE), {}).get("us")
        row = [str(m), _fmt(base)]
        for k in others:
            us = by_key.get((m, k), {}).get("us")
            row += [_fmt(us), _fmt(base / us if base and us else None, 2)]
        ours = by_key.get((m, OURS), {})
        gbps = ours.get("gbps") if ours.get("us") is not None else None
        row += [_fmt(gbps, 0), _fmt(100 * gbps / read_gbps if gbps else None, 0)]
        err = ours.get("rel_err")
        row.append("-" if err is None else f"{err:.1e}")
        rows.append(row)
    return header, rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def act_order_notes(data: dict) -> list[str]:
    """Which layers tilemarlin_act timed without a gather, and why, where it ran."""
    folded = [name for name, _, _ in layers(data) if not gathers("tilemarlin_act", name)]
    if "tilemarlin_act" not in kernels(data) or not folded:
        return []
    why = {}
    for name in folded:
        why.setdefault(ACT_ORDER_FOLDED[name], []).append(name)
    reasons = "; ".join(f"{', '.join(names)}, which {reason}" for reason, names in why.items())
    return [f"tilemarlin_act gathers x's columns before each layer's GEMM except {reasons}."]


def incomplete_note(data: dict) -> str | None:
    """What an interrupted run (meta.complete false) measured, since its sums cover those layers only;
    None for a complete run (or a recording from before the field)."""
    meta = data["meta"]
    if meta.get("complete", True):
        return None
    done = [name for name, _, _ in layers(data)]
    planned = meta.get("layers") or []
    of = f" of {len(planned)}" if planned else ""
    return (f"Incomplete run: {len(done)}{of} layers measured ({', '.join(done)}); "
            "the sums cover those layers only")


def terminal_report(data: dict) -> str:
    meta = data["meta"]
    parts = [f"{meta.get('gpu', '?')}  {meta.get('model', '?')}  group {meta['group']}  "
             f"HBM read {meta['ceilings']['hbm_read_gbps'] / 1000:.2f} TB/s  "
             f"FP16 {meta['ceilings']['fp16_tflops']:.0f} TFLOP/s"]
    if incomplete_note(data):
        parts.append(incomplete_note(data))
    for name, k, n in layers(data):
        parts.append(f"\n{name} (K={k}, N={n})\n" + text_table(*layer_table(data, name)))
    parts.append("\nall layers summed\n" + text_table(*summary_table(data)))
    notes = ([f"skipped {k}: {why}" for k, why in meta.get("skipped", {}).items()] + clock_notes(meta)
             + act_order_notes(data) + failures(data))
    if notes:
        parts.append("\n" + "\n".join(notes))
    return "\n".join(parts)


def markdown(data: dict) -> str:
    from templates import render

    header, rows = summary_table(data)
    return render("bench_table.md.j2", meta=data["meta"], header=header, rows=rows, per_round=PER_ROUND in header,
                  clocks=CLOCK in header,
                  layers=[f"{name} {k}x{n}" for name, k, n in layers(data)],
                  notes=[note for note in [incomplete_note(data)] if note]
                  + [f"{k} not measured: {why}" for k, why in data["meta"].get("skipped", {}).items()]
                  + clock_notes(data["meta"]) + act_order_notes(data),
                  failures=failures(data))


# --- plots -----------------------------------------------------------------------------------------

class PlotsUnavailable(RuntimeError):
    pass


_COLORS = {OURS: "C0", BASELINE: "C7", "torch_int4": "C1", "humming": "C2", "tilemarlin_zp": "C9", "tilemarlin_act": "C4",
           "tilemarlin_w4a8": "C6", "fp8_w8a8": "C5", "humming_w4a8": "C8",
           "tilemarlin_untuned": "C3"}


def _color(kernel: str) -> str:
    """The same color for a kernel in every plot."""
    return _COLORS.get(kernel, "C3")


def figure(**kwargs):
    """A matplotlib Figure drawn off-screen (no pyplot, so no display or global state is involved)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(
            "matplotlib is not installed, so no plots were drawn; the JSON has everything: "
            "run `gen bench --from-json FILE` where matplotlib is installed (pip install matplotlib)"
        ) from None
    return Figure(**kwargs)


def plot_speedup(data: dict, path: str | Path) -> Path:
    """Speedup over FP16 against batch size, one panel per layer and one for the layers summed, with
    the roofline-ideal INT4 curve (the layout of the Marlin paper's Figure 1)."""
    meta = data["meta"]
    names = layers(data)
    panels = [(f"{name} ({k}x{n})", layer_times(data, name), [(k, n)]) for name, k, n in names]
    panels.append(("all layers summed", summed_times(data), [(k, n) for _, k, n in names]))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = figure(figsize=(5 * cols, 3.8 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    ms = batch_sizes(data)
    for ax, (title, times, shapes) in zip(axes, panels):
        gains = speedups(times)
        ideal = [ideal_int4_speedup(shapes, m, meta["group"], meta["ceilings"]) for m in ms]
        ax.plot(ms, ideal, "k--", lw=1.2, label="ideal INT4 (roofline)")
        ax.axhline(1.0, color="grey", lw=0.8, label=f"{baseline_label(meta)} (torch.matmul)")
        for kernel in kernels(data):
            points = [(m, gains[m][kernel]) for m in ms if kernel in gains.get(m, {})]
            if points:
                style = dict(lw=2.2, zorder=3) if kernel == OURS else dict(lw=1.2)
                ax.plot(*zip(*points), marker="o", ms=3.5, color=_color(kernel), label=kernel, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms], fontsize=7)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("batch size M")
        ax.set_ylabel(f"speedup over {baseline_label(meta)}")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"W4A16 speedup over {baseline_label(meta)}: {meta.get('model', '')} on {meta.get('gpu', '')}, "
                 f"group {meta['group']}" + (" (incomplete run)" if incomplete_note(data) else ""))
    fig.savefig(path, dpi=130)
    return Path(path)


def plot_roofline(data: dict, path: str | Path) -> Path:
    """Each (layer, M, kernel) point at its arithmetic intensity against the measured ceilings."""
    meta = data["meta"]
    bw, peak = meta["ceilings"]["hbm_read_gbps"] * 1e9, meta["ceilings"]["fp16_tflops"] * 1e12
    fig = figure(figsize=(7.5, 5.5), layout="constrained")
    ax = fig.subplots()
    markers = "osD^v<>p*h"
    intensities = []
    for kernel in kernels(data):
        for li, (name, k, n) in enumerate(layers(data)):
            pts = [(flops(k, n, r["m"]) / bytes_moved(kernel, k, n, r["m"], meta["group"], name),
                    flops(k, n, r["m"]) / (r["us"] * 1e-6) / 1e12)
                   for r in data["rows"] if r["layer"] == name and r["kernel"] == kernel and r["us"] is not None]
            if pts:
                intensities += [x for x, _ in pts]
                ax.scatter(*zip(*pts), s=22, color=_color(kernel), marker=markers[li % len(markers)],
                           label=f"{kernel} {name}", alpha=0.85, zorder=3)
    ridge = peak / bw
    lo = min(intensities + [ridge]) / 2
    hi = max(intensities + [ridge]) * 2
    xs = [lo, ridge, hi]
    ax.plot(xs, [min(bw * x, peak) / 1e12 for x in xs], "k-", lw=1.5,
            label=f"ceilings: {bw / 1e12:.2f} TB/s read, {peak / 1e12:.0f} TFLOP/s FP16")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop / byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Roofline: {meta.get('model', '')} on {meta.get('gpu', '')}")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=130)
    return Path(path)


def write_report(data: dict, out_dir: str | Path, stem: str, with_markdown: bool) -> list[str]:
    """Print the tables and write the plots (and the markdown); returns messages about what was
    skipped. The JSON itself is written by the bench, never here."""
    paths = output_paths(out_dir, stem)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    print(terminal_report(data))
    messages = []
    try:
        for kind, plot in (("speedup", plot_speedup), ("roofline", plot_roofline)):
            print(f"wrote {plot(data, paths[kind])}")
    except PlotsUnavailable as exc:
        messages.append(str(exc))
    if with_markdown:
        paths["markdown"].write_text(markdown(data))
        print(f"wrote {paths['markdown']}")
    return messages
