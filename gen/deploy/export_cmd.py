"""`gen export`: a model's tuned entries and compiled kernels in one artifact for a serving fleet.

    gen precompile --model llama-2-7b && gen export --model llama-2-7b --out l2-7b.tar.gz
    gen export --model llama-3-70b --tp 4 --arch sm_90a --gpu nvidia-h200_sm_90a_132sm --out l3-70b.tar.gz

The layers are the fused qkv and gate_up projections that serving engines run and replace_linear and
load_quantized fuse too (runtime/fuse.py); --unfused, transformers' q, k, v, gate and up modules as a
model converted with fuse=False runs them.

The artifact (runtime/artifact.py) holds the tuned table's entries for the model's (problem, bucket)
pairs, the store entries of every kernel the op will load for them (runtime/precompile.py `plan`),
and a manifest of the versions and the GPU they were built for. Serving machines load it with
`runtime.load_artifact(path)`, which refuses it where any of them differs.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from gen.deploy.targets import add_arguments, deployment_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="pack a model's tuned entries and compiled kernels for serving machines",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="the artifact to write, e.g. llama-2-7b-h200.tar.gz")
    p.set_defaults(func=run)


def run(args) -> int:
    from runtime.artifact import ArtifactError, write_artifact
    from runtime.kernels import activation_kernel_folder, is_activation_kernel_stored, is_stored, kernel_folder
    from .precompile_cmd import activation_label

    try:
        deployment = deployment_from_args(args)
        if deployment.gpu is None:
            raise ValueError(f"no tuned table of {deployment.dispatch.arch.name} to export: an artifact is for one "
                             "GPU model; name its table with --gpu (see `gen cache list`)")
        planned = deployment.plan()
    except ValueError as exc:
        print(f"gen export: {exc}", file=sys.stderr)
        return 2
    arch = deployment.dispatch.arch
    activations = deployment.activation_kernels()
    missing = [f"{p.name} {s.name}" for p, s in planned if not is_stored(p, s, arch)]
    missing += [activation_label(kernel) for kernel in activations if not is_activation_kernel_stored(*kernel, arch)]
    if missing:
        print(f"gen export: {len(missing)} of the {len(planned) + len(activations)} kernels are not in the store "
              f"(e.g. {missing[0]}); build them first with: gen precompile {_same_layers(args)}", file=sys.stderr)
        return 1
    pairs = [(problem, bucket) for (problem, _), served in planned.items() for bucket, how in served if how is None]
    untuned = sum(len(served) for served in planned.values()) - len(pairs)
    if untuned:
        print(f"note: {untuned} (problem, bucket) pairs are not tuned; the artifact carries the kernels the fallback "
              "picks here, and a serving machine whose tuned tables differ may pick, and build, others. Tune them "
              f"for an artifact that covers every choice: gen tune {_same_layers(args, with_target=False)}")
    # A W4A8 bucket is decided by its own and its W4A16 twin's entries (Dispatch.serving_problem): both ship,
    # so that a serving machine makes the choice made here.
    pairs += [(problem, bucket) for t in deployment.targets if t.problem.fp8
              for problem in (t.problem, t.problem.w4a16_twin) for bucket in deployment.buckets
              if deployment.dispatch.table.entry(problem, bucket) is not None and (problem, bucket) not in pairs]
    table = deployment.dispatch.table.subset(pairs)
    table.gpu = deployment.gpu
    about = {"model": args.model, "tp": args.tp, "unfused": args.unfused, "shapes": args.shapes, "group": args.group,
             "dtype": args.dtype, "zero_points": args.zero_points, "act_order": args.act_order, "act": args.act,
             "checkpoint": args.checkpoint, "buckets": deployment.buckets}
    folders = [kernel_folder(p, s, arch) for p, s in planned]
    folders += [activation_kernel_folder(*kernel, arch) for kernel in activations]
    try:
        manifest = write_artifact(args.out, table, folders, about)
    except (ArtifactError, OSError) as exc:
        print(f"gen export: {exc}", file=sys.stderr)
        return 1
    built = manifest["built_with"]
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**10:.0f} KiB): {len(manifest['kernels'])} kernels and "
          f"{len(table)} tuned entries for {built['gpu']} ({built['arch']}, {built['sm_count']} SMs), built with "
          f"tilemarlin {built['tilemarlin']}, TileLang {built['tilelang']}, {built['cuda_toolkit']}, "
          f"torch {built['torch']} (CUDA {built['cuda']})")
    return 0


def _same_layers(args, with_target: bool = True) -> str:
    """The flags that name the same layers (and, for `gen precompile`, target and gathers), for a command
    the user is told to run."""
    names = ("model", "tp", "shapes", "group", "dtype", "act", "checkpoint", "buckets") + (
        ("arch", "gpu") if with_target else ())
    defaults = {"tp": 1, "group": 128, "dtype": "float16", "act": "dtype"}
    flags = [f"--{name} {shlex.quote(str(getattr(args, name)))}" for name in names
             if getattr(args, name) is not None and defaults.get(name) != getattr(args, name)]
    return " ".join(flags + ["--unfused"] * bool(args.unfused) + ["--zero-points"] * bool(args.zero_points)
                    + ["--act-order"] * bool(with_target and args.act_order))
