"""`gen timeline`: where one kernel's time goes, block by block, back to back as the tune times it.

The kernel is compiled afresh with %globaltimer stamps, and thread 0 of every block records when the
block started, when its wait for the previous kernel returned, when its consumers saw the first full
stage, when its k-loop ended and when it left, and on which SM it ran. The stamps go into a buffer that
this process allocates: its address is compiled into the kernel, so the stamped kernel runs only here
and never enters the kernel cache. Each block keeps its last RING calls (a per-block call counter picks
the slot), and the summary times every call from the previous call's last exit: how long the next
kernel's wait, first loads, k-loop and epilogue take, and how far apart its blocks finish.
%globaltimer ticks in 32 ns steps on the H200 but updates about every 256 ns (H200; docs/performance.md).
"""
from __future__ import annotations

import re
import statistics
import sys

from runtime.kernels import cuda_postproc, own_prelude

RING = 8            # calls kept per block
SLOTS = 8           # stamps per block and call: entry, waited, first stage, k-loop end, exit, SM, blocks, spare

TIMER_HELPERS = r"""
__device__ __forceinline__ unsigned long long tm_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
  return t;
}
__device__ __forceinline__ unsigned tm_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
"""


def stamp_source(code: str, stamps: int, counters: int, max_blocks: int) -> str:
    """The kernel's CUDA source with the timeline stamps written into device addresses `stamps`
    ([RING, max_blocks, SLOTS] u64) and `counters` ([max_blocks] u32). A ValueError names a landmark
    that the source lacks (the kernel's entry; its wait, first stage or k-loop end are optional and
    stay 0 without one)."""
    entry = re.search(r'extern "C" __global__ void[^;{]*\{', code)
    if entry is None:
        raise ValueError("no kernel definition (extern \"C\" __global__ ... {) in the source")
    head, body = code[:entry.start()], code[entry.start():]
    cut = entry.end() - entry.start()
    # Thread 0 keeps the stamps in shared memory: held in registers through the kernel they cost ten,
    # which took down_proj 16's kernel from 128 to 134 and from 3 blocks per SM to 2 (H200; docs/performance.md).
    body = (body[:cut] + "\n  __shared__ unsigned long long tm_ts[5];\n  bool tm_zero = threadIdx.x == 0;"
            "\n  if (tm_zero) { tm_ts[1] = tm_ts[2] = tm_ts[3] = 0; tm_ts[0] = tm_globaltimer(); }"
            "\n  bool tm_first_stage = true;" + body[cut:])
    wait = re.search(r"\n\s*(tm_wait_for_prior_grids|cudaGridDependencySynchronize)\(\);", body)
    if wait:
        body = body[:wait.end()] + " if (tm_zero) tm_ts[1] = tm_globaltimer();" + body[wait.end():]
    else:       # nothing to wait for (a plain launch): the block is past it at entry
        body = body.replace("tm_ts[0] = tm_globaltimer();", "tm_ts[0] = tm_globaltimer(); tm_ts[1] = tm_ts[0];", 1)
    # The consumers' first wait for a stage: an mbarrier of the TMA pipeline, or a cp.async group.
    stage = re.search(r"\n\s*full\[[^\n]*\]\.wait\([^\n]*\);", body) or \
        re.search(r"\n\s*tl::cp_async_wait<[^\n]*;", body)
    if stage:
        body = (body[:stage.end()] + " if (tm_zero && tm_first_stage) { tm_ts[2] = tm_globaltimer(); "
                "tm_first_stage = false; }" + body[stage.end():])
        # The k-loop ends where the warps first meet again at the top level of the kernel.
        loop_end = re.compile(r"\n  bool if_condition|\n  __syncthreads\(\);").search(body, stage.end())
        if loop_end:
            body = body[:loop_end.start()] + "\n  if (tm_zero) tm_ts[3] = tm_globaltimer();" + body[loop_end.start():]
    exit_at = body.rstrip().rfind("}")
    store = f"""
  if (tm_zero) tm_ts[4] = tm_globaltimer();
  unsigned tm_block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x == 0 && tm_block < {max_blocks}u) {{     // (block 0 records the grid's size: too many is refused)
    unsigned tm_call = atomicAdd(reinterpret_cast<unsigned*>({counters}ULL) + tm_block, 1u) % {RING}u;
    unsigned long long* tm_s = reinterpret_cast<unsigned long long*>({stamps}ULL) + (tm_call * {max_blocks}ull + tm_block) * {SLOTS};
    for (int i = 0; i < 5; ++i) tm_s[i] = tm_ts[i];
    tm_s[5] = tm_smid();
    tm_s[6] = gridDim.x * gridDim.y * gridDim.z;
  }}
"""
    return head + TIMER_HELPERS + body[:exit_at] + store + body[exit_at:]


def compile_stamped(fam, problem, knobs, arch, stamps: int, counters: int, max_blocks: int):
    """The kernel of `knobs` compiled with stamp_source's stamps, outside every cache: TileLang's kernel
    cache does not key on a source post-processor, so with it on, a stamped binary could be served to
    a later plain compile (or a plain one served here). Returns (kernel, plain CUDA source)."""
    import tilelang

    seen = {}

    def stamp(code, target):
        seen["plain"] = code
        return stamp_source(own_prelude(code, target), stamps, counters, max_blocks)

    was_enabled = tilelang.env.is_cache_enabled()
    tilelang.disable_cache()
    try:
        with cuda_postproc(tilelang, stamp):
            kernel = tilelang.compile(fam.build(problem, knobs), target=arch.target, pass_configs=fam.PASS_CONFIGS)
    finally:
        if was_enabled:
            tilelang.enable_cache()
    return kernel, seen["plain"]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of the (entry, exit) spans that overlap at one time (a span ending as another starts
    does not overlap it)."""
    events = sorted([(exit_, -1) for _, exit_ in spans] + [(entry, 1) for entry, _ in spans])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def summarize(stamps, calls: int) -> str:
    """The report of a stamp buffer: stamps[slot][block] = [entry, waited, first stage, k-loop end, exit,
    SM, blocks] in ns (sequence of lists or an array), every block having run `calls` calls (the last RING
    are kept). Times are in us from the previous call's last exit."""
    blocks = int(stamps[0][0][6])
    if blocks < 1 or calls < 2:
        raise ValueError(f"need at least two recorded calls of a launched kernel (calls={calls}, blocks={blocks})")
    kept = min(calls, RING)
    order = [(calls - kept + i) % RING for i in range(kept)]
    rows = [[[float(x) for x in stamps[slot][b][:6]] for b in range(blocks)] for slot in order]
    lines = [f"{blocks} blocks; us from the previous call's last exit (E); min / median / max unless named",
             "call  period |   entry (min med max)  |  waited (min med max)  | first stage-waited | "
             "k-loop (med max) | epilogue (med max) | exit (min p10 med p90 max)"]
    def med_max(v):
        return f"{statistics.median(v):5.2f} {max(v):5.2f}" if v else "  n/a   n/a"

    def three(v):
        return f"{min(v):6.2f} {statistics.median(v):6.2f} {max(v):6.2f}"

    for i in range(1, len(rows)):
        last_exit = max(r[4] for r in rows[i - 1])
        cur = rows[i]
        col = [[(r[j] - last_exit) / 1000.0 for r in cur] for j in range(5)]
        # from stamp a to stamp b, in the blocks that have both (a missing landmark stays 0)
        first, loop, epi = ([(r[b] - r[a]) / 1000.0 for r in cur if r[a] and r[b]] for a, b in ((1, 2), (2, 3), (3, 4)))
        lines.append(f"{i:4d} {max(col[4]):7.2f} | {three(col[0])} | {three(col[1])} |   {med_max(first)}  |"
                     f"   {med_max(loop)}    |    {med_max(epi)}     | {min(col[4]):6.2f} "
                     f"{_quantile(col[4], .1):6.2f} {statistics.median(col[4]):6.2f} {_quantile(col[4], .9):6.2f} "
                     f"{max(col[4]):6.2f}")
    # The newest call's exits by how many of its blocks shared an SM.
    last_exit = max(r[4] for r in rows[-2])
    per_sm: dict[int, list[float]] = {}
    for r in rows[-1]:
        per_sm.setdefault(int(r[5]), []).append((r[4] - last_exit) / 1000.0)
    by_load: dict[int, list[float]] = {}
    for exits in per_sm.values():
        by_load.setdefault(len(exits), []).extend(exits)
    lines.append(f"newest call: {len(per_sm)} SMs used")
    # "SMs with N blocks" counts the call's blocks over time: whether they ran at once, or some waited
    # for a slot on their SM (a second wave; v55's at down_proj 16 came from stamps held in registers).
    spans: dict[int, list[tuple[float, float]]] = {}
    for r in rows[-1]:
        spans.setdefault(int(r[5]), []).append((r[0], r[4]))
    at_once = max(most_at_once(s) for s in spans.values())
    late = sum(any(exit_ <= entry for _, exit_ in s) for s in spans.values() for entry, _ in s)
    lines.append(f"  at most {at_once} block(s) at once on an SM; {late} block(s) entered after a block of "
                 f"the call had left their SM")
    for load in sorted(by_load):
        exits = by_load[load]
        lines.append(f"  SMs with {load} block(s): {len(exits)} blocks, exit median {statistics.median(exits):.2f} "
                     f"max {max(exits):.2f} us")
    # Whether the blocks went out a round at a time: in launch order (blockIdx.x fastest), each run of
    # as many blocks as SMs used landing on that many different SMs.
    sms = [int(r[5]) for r in rows[-1]]
    used = len(per_sm)
    rounds = [len(set(sms[i:i + used])) for i in range(0, len(sms), used)]
    lines.append(f"  launch order, {used} blocks at a time: {rounds} different SMs")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("timeline", help="per-block timestamps of one kernel, back to back (GPU)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="KxN, e.g. 4096x12288")
    p.add_argument("--m", type=int, required=True, help="rows of the activations")
    p.add_argument("--family", help="with --knobs: the schedule to stamp (default: the tuned table's winner)")
    p.add_argument("--knobs", default="", help='with --family: "k=v,k=v" (unnamed knobs keep their defaults)')
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--max-blocks", type=int, default=16384, help="room for this many blocks in the stamp buffer")
    p.set_defaults(func=run)


def run(args) -> int:
    import argparse

    import torch

    from runtime import dispatch, op
    from schedules.arch import current_arch
    from schedules.registry import Schedule, family

    from gen.dev.compile_cmd import parse_knobs
    from gen.timing import time_calls
    from gen.models import parse_shapes
    from gen.tune.measuring import Bench

    try:
        layers = parse_shapes(args.shape)
        if len(layers) != 1:
            raise ValueError(f"--shape takes one KxN, got {args.shape!r}")
        if args.m < 1:
            raise ValueError(f"--m must be positive, got {args.m}")
        problem = op.problem_of(layers[0].n, layers[0].k, args.group, args.dtype)
        knobs = parse_knobs(family(args.family), args.knobs) if args.family else None
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"gen timeline: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gen timeline: no CUDA GPU is visible; it runs the kernel", file=sys.stderr)
        return 2
    schedule = Schedule(args.family, knobs) if args.family else dispatch.schedule_for(problem, args.m)
    arch = current_arch()
    fam = schedule.module
    reason = fam.check(problem, schedule.knobs, arch)
    if reason:
        print(f"gen timeline: {schedule.name} is not valid for {problem.name}: {reason}", file=sys.stderr)
        return 2
    stamps = torch.zeros(RING * args.max_blocks * SLOTS, dtype=torch.int64, device="cuda")
    counters = torch.zeros(args.max_blocks, dtype=torch.int32, device="cuda")
    kernel, _ = compile_stamped(fam, problem, schedule.knobs, arch, stamps.data_ptr(), counters.data_ptr(),
                                args.max_blocks)
    bench = Bench(problem)
    ws_elems, counter_elems = fam.workspace_elems(problem, schedule.knobs, args.m)
    ws = torch.zeros(ws_elems, dtype=torch.float32, device="cuda")
    tiles = torch.zeros(counter_elems, dtype=torch.int32, device="cuda")
    a = torch.randn(args.m, problem.k, dtype=bench.dtype, device="cuda")
    out = torch.empty(args.m, problem.n, dtype=bench.dtype, device="cuda")
    calls = bench.rotated_calls(kernel, fam, schedule.knobs, a, out, ws, tiles)
    us = time_calls(calls)
    torch.cuda.synchronize()
    blocks = stamps.view(RING, args.max_blocks, SLOTS)[0, 0, 6].item()
    if blocks > args.max_blocks:
        print(f"gen timeline: the kernel launched {blocks} blocks; rerun with --max-blocks {blocks}", file=sys.stderr)
        return 2
    print(f"{schedule.name} at {problem.name}, M = {args.m}: {us:.2f} us per call back to back "
          f"({len(calls)} weight copies; stamps cost a few instructions per block)")
    counts = counters[:blocks].cpu()
    if not bool((counts == counts[0]).all()):
        print("gen timeline: blocks ran different numbers of calls", file=sys.stderr)
        return 1
    print(summarize(stamps.view(RING, args.max_blocks, SLOTS).cpu().tolist(), int(counts[0])))
    return 0
