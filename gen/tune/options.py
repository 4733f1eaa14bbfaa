"""What the flags of `gen tune` (and of `gen sweep`, which shares some) name, parsed and checked: the
layers to tune, the buckets, the families and their axes, the knob variants, the seed records. A bad
value is a ValueError whose message names it; the commands print it and exit 2.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
from dataclasses import dataclass

from gen.cli import positive_int
from runtime.table import BUCKETS, FORMAT as TABLE_FORMAT, TableError, TunedTable
from schedules.problem import Problem


@dataclass
class Target:
    """One problem to tune and the layers that share it; `gathered`: some of them gather their input's
    columns first (act-order), so the gather kernel of its K is built with them; `normed`: some take
    their input from an RMSNorm that writes it in their order, whose kernel is built with them."""

    problem: Problem
    layers: list[str]
    gathered: bool = False
    normed: bool = False

    @property
    def label(self) -> str:
        return ",".join(self.layers)


def targets_from_args(args) -> list[Target]:
    """The distinct problems of --model and --shapes, each with the names of its layers, or those of
    --checkpoint's model. A layer the kernels cannot run (N, K, the group size: runtime.op.problem_of)
    is a ValueError naming it."""
    from runtime.op import problem_of

    from gen.models import layers_from_config, parse_shapes, read_config

    if getattr(args, "checkpoint", None):
        return checkpoint_targets(args)
    models = [name.strip() for name in (args.model or "").split(",") if name.strip()]
    if not models and not args.shapes:
        raise ValueError("name the layers: --model NAME|PATH/config.json[,...] and/or --shapes KxN,..., or "
                         "--checkpoint DIR")
    named = []      # (layer name, layer); with several models each name says its model
    for model in models:
        prefix = f"{model}:" if len(models) > 1 else ""
        config, registered = read_config(model)
        _note_config_dtype(model, config, registered, args.dtype)
        named += [(prefix + layer.name, layer) for layer in layers_from_config(config, args.tp, not args.unfused)]
    named += [(layer.name, layer) for layer in (parse_shapes(args.shapes) if args.shapes else [])]
    targets: dict[Problem, Target] = {}
    for name, layer in named:
        try:
            problem = problem_of(layer.n, layer.k, args.group, args.dtype, zero_points=args.zero_points,
                                 act=args.act)
        except ValueError as exc:
            raise ValueError(f"layer {name} ({layer.shape}): {exc}") from None
        targets.setdefault(problem, Target(problem, [])).layers.append(name)
    return list(targets.values())


def _note_config_dtype(model: str, config: dict, registered: bool, dtype: str) -> None:
    """A note where a config.json given by path names the other activation dtype than --dtype: its
    model, served in its own dtype, would look up the other dtype's entries."""
    import sys

    from schedules.problem import SUPPORTED_DTYPES

    wanted = config.get("torch_dtype", config.get("dtype"))
    if not registered and wanted in SUPPORTED_DTYPES and wanted != dtype:
        print(f"note: {model} says {wanted}; its layers are planned in --dtype {dtype}", file=sys.stderr)


# The layer flags that --checkpoint decides itself, with their defaults.
CHECKPOINT_DECIDES = {"model": None, "shapes": None, "tp": 1, "unfused": False, "group": 128, "zero_points": False,
                      "act": "dtype"}


def checkpoint_targets(args) -> list[Target]:
    """The problems of --checkpoint's INT4 layers as load_quantized serves them (gen/checkpoints.py),
    in --dtype; a flag that would name other layers or another form is a ValueError."""
    import sys

    from gen.checkpoints import checkpoint_layers, config_dtype

    given = [f"--{name.replace('_', '-')}" for name, default in CHECKPOINT_DECIDES.items()
             if getattr(args, name, default) != default]
    if given:
        raise ValueError(f"{', '.join(given)}: --checkpoint's layers come with their shapes, group sizes and zero "
                         "points; only --dtype applies to them")
    wanted = config_dtype(args.checkpoint)
    if wanted is not None and wanted != args.dtype:
        print(f"note: {args.checkpoint}'s config.json says {wanted}; its layers are planned in --dtype {args.dtype}",
              file=sys.stderr)
    found = checkpoint_layers(args.checkpoint, args.dtype)
    return [Target(problem, names, problem in found.gathered, problem in found.normed)
            for problem, names in found.layers.items()]


def parse_families(text: str | None) -> list[str] | None:
    """The --families list (None: registry.SEARCHED); an unknown name is an error that lists the known ones."""
    from schedules.registry import family

    if not text:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        family(name)
    return names


def parse_knob_values(text: str | None, flag: str, searched_only: bool) -> dict[str, dict[str, tuple]]:
    """"family.knob=v1,v2 ..." (--axes, --variants) -> {family: {knob: values}}. With `searched_only`
    the knob must be one of the family's AXES. An unknown family, knob or value is an error naming it."""
    from schedules.knob_space import knob_value
    from schedules.registry import family

    values: dict[str, dict[str, tuple]] = {}
    for item in (text or "").split():
        key, sep, listed = item.partition("=")
        family_name, dot, knob = key.partition(".")
        if not (sep and dot and listed):
            raise ValueError(f"bad {flag} item {item!r}: expected family.knob=value[,value...]")
        module = family(family_name)
        if searched_only and knob not in module.AXES:
            raise ValueError(f"{family_name} has no searched axis {knob!r}; its axes: {', '.join(module.AXES)}")
        if knob in values.get(family_name, {}):
            raise ValueError(f"{flag} names {key} twice")
        values.setdefault(family_name, {})[knob] = tuple(knob_value(module.Knobs, knob, v) for v in listed.split(","))
    return values


def parse_axes(text: str | None) -> dict[str, dict[str, tuple]]:
    """--axes "family.knob=v1,v2 ...": the values that replace those axes of the families' AXES for
    this run, so that a prepared knob can be searched (checked against the reference and timed like
    any candidate) without editing the code."""
    return parse_knob_values(text, "--axes", searched_only=True)


def parse_variants(text: str | None) -> dict[str, list[dict]]:
    """--variants "family.knob=v1,v2 ...": per family, the knob changes to apply to its winners (every
    combination of the values named); any knob of the family, searched or not."""
    values = parse_knob_values(text, "--variants", searched_only=False)
    return {name: [dict(zip(knobs, combo)) for combo in itertools.product(*knobs.values())]
            for name, knobs in values.items()}


@contextlib.contextmanager
def searched_axes(overrides: dict[str, dict[str, tuple]]):
    """The families' AXES with `overrides` (parse_axes) in place for the duration of a tune: the plan,
    the cost model's candidate lists and the second round's neighbours all read them there."""
    from schedules.registry import family

    from gen.tune.search import use_axes

    saved = {name: dict(family(name).AXES) for name in overrides}
    try:
        use_axes({name: {**saved[name], **axes} for name, axes in overrides.items()})
        yield
    finally:
        use_axes(saved)


positive_workers = positive_int("takes a positive number of processes")   # --workers


def parse_buckets(text: str | None, flag: str = "--buckets") -> list[int]:
    """"16,1" -> [1, 16]: bucket edges, sorted, each one of BUCKETS; none given: all of them."""
    if not text:
        return list(BUCKETS)
    try:
        buckets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"bad {flag} {text!r}: expected comma-separated integers") from None
    bad = [b for b in buckets if b not in BUCKETS]
    if bad or not buckets:
        raise ValueError(f"{flag} must be bucket edges, one or more of {','.join(map(str, BUCKETS))}; got {text!r}")
    return buckets


def load_seeds(path: str) -> list[dict]:
    """The records of a `gen sweep --json` file, or of a tuned table (another run's or machine's: each
    entry's recorded timings as a sweep record at the bucket's edge), for --seed; a missing or
    unreadable file, or one that is neither, is a ValueError that says so."""
    try:
        with open(path) as f:
            records = json.load(f)
    except OSError as exc:
        raise ValueError(f"--seed {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--seed {path} is not JSON ({exc})") from None
    if isinstance(records, dict) and records.get("format") == TABLE_FORMAT:
        try:
            table = TunedTable.read(path, history=True)     # the timings live in the history file beside it
        except TableError as exc:
            raise ValueError(f"--seed {path}: {exc}") from None
        return [{"problem": dataclasses.asdict(problem), "m": bucket,
                 "results": e.all_timings or [{"schedule": e.schedule.to_dict(), "us": e.us}]}
                for (problem, bucket), e in table.items()]
    if not isinstance(records, list):
        raise ValueError(f"--seed {path} is neither a `gen sweep --json` file (a list of records) nor a tuned table")
    return records
