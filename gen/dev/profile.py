"""`gen profile`: run one layer's kernel through the runtime op, exactly as serving does, a few times,
for an external profiler (it measures nothing itself).

    ncu -k regex:w4a16_gemm --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python -m gen profile --shape 4096x12288 --m 4096

`--read-ncu FILE.csv` instead reads what `ncu --import R.ncu-rep --page source --csv --print-source sass`
printed (on any machine) and says where the warps waited (gen/ncu_source.py).
"""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="run one layer's tuned kernel a few times, for ncu or nsys",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="KxN, e.g. 4096x12288 (required to run a kernel)")
    p.add_argument("--m", type=int, help="rows of the activations, the batch (required to run a kernel)")
    p.add_argument("--group", type=int, default=128, help="rows per quantization group; -1 = channelwise")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--calls", type=int, default=3, help="calls to make (default 3: two to warm up, one to profile)")
    p.add_argument("--read-ncu", metavar="FILE.csv", help="summarize ncu's SASS source page (stall reasons, "
                   "opcodes, the lines with the most stall samples) instead of running anything")
    p.add_argument("--top", type=int, default=15, help="with --read-ncu: lines to list (default 15)")
    p.set_defaults(func=run)


def run(args) -> int:
    from gen.models import parse_shapes

    if args.read_ncu:
        return _read_ncu(args.read_ncu, args.top)
    from runtime import dispatch, op      # importing op registers torch.ops.tilemarlin

    try:
        if args.shape is None or args.m is None:
            raise ValueError("--shape and --m name the kernel to run (or --read-ncu FILE.csv reads a profile)")
        layers = parse_shapes(args.shape)
        if len(layers) != 1:
            raise ValueError(f"--shape takes one KxN, got {args.shape!r}")
        layer = layers[0]
        if args.m < 1 or args.calls < 1:
            raise ValueError(f"--m and --calls must be positive, got {args.m} and {args.calls}")
        problem = op.problem_of(layer.n, layer.k, args.group, args.dtype)
    except ValueError as exc:
        print(f"gen profile: {exc}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gen profile: no CUDA GPU is visible; it runs a kernel for a profiler", file=sys.stderr)
        return 2
    from schedules.quant import quantize_rtn

    k, n, dtype = layer.k, layer.n, getattr(torch, args.dtype)
    schedule = dispatch.schedule_for(problem, args.m)
    codes, scales = quantize_rtn(torch.randn(k, n, device="cuda", dtype=dtype), args.group, dtype=args.dtype)
    qweight, qscales = op.layout_family(op.DEFAULT_LAYOUT).pack(codes, scales)
    x = torch.randn(args.m, k, device="cuda", dtype=dtype)
    for _ in range(args.calls):
        torch.ops.tilemarlin.w4a16_gemm(x, qweight, qscales, n, k, args.group)
    torch.cuda.synchronize()
    print(f"ran {schedule.name} on {k}x{n} at M={args.m} {args.calls} times")
    return 0


def _read_ncu(path: str, top: int) -> int:
    from gen.dev.ncu_source import read, summary

    try:
        lines = read(path)
    except (OSError, ValueError) as exc:
        print(f"gen profile: {exc}", file=sys.stderr)
        return 2
    print(summary(lines, top))
    return 0
