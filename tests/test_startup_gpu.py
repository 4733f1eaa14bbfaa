"""Start-up on the GPU, each in a fresh process, times printed (not asserted: timings belong to
benchmarks): Llama-2-7B's four tuned layers answering every M bucket, from an empty compiled-kernel
store (every kernel built and checked) and again from the filled one; an untuned shape's first
choice of kernel; and replace_linear on a Llama-2-7B-shaped model from an empty store, its kernels
built while it quantizes, against quantizing alone and quantizing then building. Skipped without
CUDA."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
LLAMA_2_7B = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]   # (K, N) of qkv, o, gate_up, down
UNTUNED = (6144, 13824)                                                    # in no table, in either dtype

ANSWER_EVERY_BUCKET = """
    import json, time
    start = time.perf_counter()
    import torch
    torch_imported = time.perf_counter()
    from runtime.linear import QuantLinear
    from runtime.precompile import precompile_layers
    from runtime.table import BUCKETS
    imported = time.perf_counter()
    layers = [QuantLinear(k, n, device="cuda", precompile=False) for k, n in SHAPES]
    precompile_layers([(layer.problem, layer.qweight.device) for layer in layers])
    built = time.perf_counter()
    answered = 0
    for layer in layers:
        x = torch.randn(max(BUCKETS), layer.in_features, device="cuda", dtype=torch.float16)
        for m in BUCKETS:
            assert layer(x[:m]).shape == (m, layer.out_features)
            answered += 1
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(json.dumps({"pairs": answered, "torch_s": torch_imported - start, "import_s": imported - start,
                      "built_s": built - start,
                      "answered_s": done - start}))
"""

TORCH_ALONE = """
    import json, time
    start = time.perf_counter()
    import torch
    imported = time.perf_counter()
    torch.cuda.init()
    print(json.dumps({"import_s": imported - start, "cuda_s": time.perf_counter() - imported}))
"""

FIRST_CHOICE = """
    import json, time, warnings
    start = time.perf_counter()
    import torch
    from runtime.dispatch import DEFAULT_LAYOUT, dispatch_for
    from runtime.op import problem_of
    imported = time.perf_counter()
    problem = problem_of(N, K, 128, "float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedule, how = dispatch_for().choose(problem, 16, DEFAULT_LAYOUT)
    chosen = time.perf_counter()
    print(json.dumps({"import_s": imported - start, "choose_s": chosen - imported, "schedule": schedule.name,
                      "how": how}))
"""


CONVERT_A_MODEL = """
    import json, time
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from runtime import replace_linear
    from runtime.linear import QuantLinear
    from runtime.precompile import precompile_layers
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).half()
    torch.cuda.synchronize()
    start = time.perf_counter()
    replace_linear(model, precompile=MODE == "overlapped")
    torch.cuda.synchronize()
    converted = time.perf_counter()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if MODE == "serial":
        precompile_layers([(m.problem, m.qweight.device) for m in layers])
    ready = time.perf_counter()
    from runtime.kernels import is_stored
    from runtime.dispatch import DEFAULT_LAYOUT, dispatch_for
    from runtime.precompile import plan
    from runtime.table import BUCKETS
    dispatch = dispatch_for(layers[0].qweight.device)
    planned = plan({m.problem for m in layers}, BUCKETS, dispatch, DEFAULT_LAYOUT)
    missing = sum(not is_stored(problem, schedule, dispatch.arch) for problem, schedule in planned)
    print(json.dumps({"replace_linear_s": converted - start, "ready_s": ready - start, "kernels": len(planned),
                      "missing": missing}))
"""


def _fresh(code: str, cache: Path, **names) -> dict:
    prelude = "".join(f"{name} = {value!r}\n" for name, value in names.items())
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "TILEMARLIN_CACHE_DIR": str(cache), "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_layers_answer_every_bucket_from_an_empty_and_a_filled_store(tmp_path):
    # torch's own import (and CUDA's start) in a fresh process: the floor under the runtime's import
    torch_alone = _fresh(TORCH_ALONE, tmp_path)
    cold = _fresh(ANSWER_EVERY_BUCKET, tmp_path, SHAPES=LLAMA_2_7B)
    warm = _fresh(ANSWER_EVERY_BUCKET, tmp_path, SHAPES=LLAMA_2_7B)
    print(f"torch alone: import {torch_alone['import_s']:.2f} s, then CUDA's start {torch_alone['cuda_s']:.2f} s")
    for name, run in (("empty store", cold), ("filled store", warm)):
        print(f"llama-2-7b, {run['pairs']} (layer, bucket) pairs, {name}: import {run['import_s']:.2f} s "
              f"(torch {run['torch_s']:.2f} s of it), kernels ready {run['built_s']:.2f} s, all answered {run['answered_s']:.2f} s after start")
        assert run["pairs"] == len(LLAMA_2_7B) * 13


def test_an_untuned_shape_chooses_its_kernel_from_the_tuned_winners(tmp_path):
    k, n = UNTUNED
    run = _fresh(FIRST_CHOICE, tmp_path, K=k, N=n)
    print(f"untuned {k}x{n} at M=16: import {run['import_s']:.2f} s, choice {run['choose_s']:.3f} s, "
          f"{run['schedule']} ({run['how']})")
    assert "winner" in run["how"]


def test_replace_linear_builds_while_it_quantizes(tmp_path):
    runs = {mode: _fresh(CONVERT_A_MODEL, tmp_path / mode, MODE=mode) for mode in ("quantize", "overlapped", "serial")}
    print(f"llama-2-7b-shaped model (224 layers, {runs['serial']['kernels']} kernels), empty store: quantizing alone {runs['quantize']['ready_s']:.2f} s; "
          f"replace_linear building while it quantizes {runs['overlapped']['ready_s']:.2f} s; quantizing, then "
          f"building {runs['serial']['ready_s']:.2f} s")
    # replace_linear returns only once its build is done; quantizing alone builds nothing
    assert runs["overlapped"]["missing"] == runs["serial"]["missing"] == 0
    assert runs["quantize"]["missing"] == runs["quantize"]["kernels"] > 0
