"""What `gen precompile` and `gen export` act on: a model's problems, the M buckets, and the GPU whose
kernel choices they follow, this one or, with --arch, the tuned table of another (no GPU needed).

With a GPU whose arch is --arch (or no --arch) the choices are exactly the op's on this GPU
(runtime.dispatch.dispatch_for). Otherwise they follow the tuned table named by --gpu, or the only one of
--arch, and rank untuned shapes with the arch's nominal GPU numbers (schedules.cost.GpuSpec.for_arch):
a tuned (problem, bucket) is planned exactly, an untuned one as closely as the cost model's numbers
for that GPU allow.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.table import BUCKETS

from gen.models import add_layer_arguments


def add_arguments(p) -> None:
    """The flags that name the layers, the buckets and the target GPU."""
    add_layer_arguments(p)
    p.add_argument("--buckets", help=f"M buckets, comma separated (default: all of {','.join(map(str, BUCKETS))})")
    p.add_argument("--arch", help="target arch, e.g. sm_90a (default: this GPU's); needs no GPU")
    p.add_argument("--gpu", metavar="SLUG", help="the tuned table to follow (see `gen cache list`; default: this "
                   "GPU's, or without one the only table of --arch)")
    p.add_argument("--act-order", action="store_true",
                   help="the layers gather their input's columns (act-order checkpoints): also the gather kernel of each K")


@dataclass
class Deployment:
    """The layers (gen.tune.options.Target), the buckets and the choices of one GPU."""

    targets: list
    buckets: list[int]
    dispatch: object          # runtime.dispatch.Dispatch
    gpu: object               # runtime.table.GpuKey of the table followed; None where there is none
    here: bool                # the choices are this GPU's own
    act_order: bool = False   # the layers gather their input's columns first (act-order checkpoints)

    def plan(self) -> dict:
        """(problem, schedule) -> [(bucket, how chosen)], as runtime.precompile.plan gives it."""
        from runtime.op import DEFAULT_LAYOUT
        from runtime.precompile import plan

        return plan([t.problem for t in self.targets], self.buckets, self.dispatch, DEFAULT_LAYOUT)

    def labels(self) -> dict:
        """problem -> its name and the layers that share it; a W4A8 problem's fp8_rounded twin, whose
        kernels serve some of its buckets (Dispatch.serving_problem), is named after the same layers."""
        labels = {}
        for t in self.targets:
            if t.problem.fp8:
                twin = t.problem.rounded_twin
                labels.setdefault(twin, f"{twin.name} ({t.label}, W4A8 on W4A16 kernels)")
            labels[t.problem] = f"{t.problem.name} ({t.label})"
        return labels

    def activation_kernels(self) -> list[tuple[str, int, str]]:
        """(kind, K, dtype) of the activation kernels the layers run beside their GEMMs
        (runtime.precompile.activation_kernels): act-order's gather for every layer with --act-order,
        else for those that gather, and the norms that write act-order layers' input in their order
        (a checkpoint's)."""
        from runtime.precompile import activation_kernels

        problems = [t.problem for t in self.targets]
        gathered = [t.problem for t in self.targets if self.act_order or t.gathered]
        normed = [t.problem for t in self.targets if t.normed]
        return activation_kernels(problems, gathered=gathered, normed=normed)

    def describe(self) -> str:
        arch = self.dispatch.arch.name
        if self.here:
            return f"{self.gpu.name} ({arch}, {self.gpu.sm_count} SMs)"
        table = f"the tuned table {self.gpu.slug}" if self.gpu else "no tuned table"
        return f"{arch}, following {table} (untuned shapes ranked with the nominal {arch} numbers)"


def deployment_from_args(args) -> Deployment:
    """The Deployment the flags name; a bad or ambiguous flag is a ValueError that says which."""
    from gen.tune.options import parse_buckets, targets_from_args

    targets = targets_from_args(args)
    buckets = parse_buckets(args.buckets)
    dispatch, gpu, here = _dispatch(args.arch, args.gpu)
    if any(t.problem.fp8 for t in targets) and not dispatch.arch.hopper:
        raise ValueError(f"--act fp8 (W4A8) runs on FP8 wgmma, sm_90a; {dispatch.arch.name} has none")
    return Deployment(targets, buckets, dispatch, gpu, here, args.act_order)


def _dispatch(arch_name: str | None, slug: str | None):
    """(Dispatch, GpuKey or None, whether it is this GPU's)."""
    import torch

    from runtime.dispatch import Dispatch, dispatch_for
    from runtime.table import GpuKey, winners_for_arch
    from schedules.arch import get_arch
    from schedules.cost import GpuSpec

    arch = get_arch(arch_name) if arch_name else None
    if torch.cuda.is_available():
        here = GpuKey.current()
        if (arch is None or arch.name == here.arch) and slug in (None, here.slug):
            return dispatch_for(), here, True
    elif arch is None and slug is None:
        raise ValueError("no CUDA GPU is visible: name the target with --arch (e.g. sm_90a) and, where several "
                         "tuned tables share it, the table to follow with --gpu")
    table, gpu = _tuned_table(arch, slug)
    arch = arch or get_arch(gpu.arch)
    return Dispatch(arch, GpuSpec.for_arch(arch), table, winners_for_arch(arch.name)), gpu, False


def _tuned_table(arch, slug: str | None):
    """(the trusted entries, GpuKey) of the tuned table named `slug`, or of the only table of `arch`;
    (an empty table, None) when no table is of `arch` and none is named. A GPU's table is its file
    in each of the table folders, merged (runtime.table.load_tuned_table)."""
    from runtime.table import TableError, TunedTable, load_tuned_table, table_files, table_folders

    found = {}
    for path in table_files():
        try:
            header = TunedTable.read(path)
        except TableError:
            continue
        if slug is not None and path.stem == slug and arch is not None and header.gpu.arch != arch.name:
            raise ValueError(f"the tuned table {slug!r} is for {header.gpu.arch}, not --arch {arch.name}")
        if (slug is None or path.stem == slug) and (arch is None or header.gpu.arch == arch.name):
            found[path.stem] = header.gpu
    what = f"{slug!r}" if slug else "of " + arch.name
    if slug and not found:
        known = ", ".join(sorted({p.stem for p in table_files()})) or "none"
        folders = " and ".join(str(f) for f in table_folders())
        raise ValueError(f"no tuned table {what}{' for ' + arch.name if arch else ''} in {folders} "
                         f"(tables: {known})")
    if len(found) > 1:
        raise ValueError(f"several tuned tables {what}: {', '.join(found)}; pick one with --gpu")
    if not found:
        return TunedTable(), None
    (gpu,) = found.values()
    return load_tuned_table(gpu), gpu
