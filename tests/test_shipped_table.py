"""The shipped H200 table holds every layer and M bucket of the models and forms the README lists, so
that those models serve tuned kernels from the first call (an entry lost in a merge of tables would
otherwise only show as a fallback warning on a GPU)."""
import pytest

from gen.models import layers_from_config, read_config
from runtime.op import problem_of
from runtime.table import BUCKETS, TunedTable, shipped_tables_dir

# (model, tensor-parallel ranks, fused as serving engines run them, dtype, zero points, activations)
SHIPPED = [("llama-2-7b", 1, True, "float16", False, "dtype"),
           ("llama-2-7b", 1, False, "float16", False, "dtype"),
           ("llama-2-7b", 1, True, "float16", True, "dtype"),
           ("llama-2-7b", 1, True, "float16", False, "fp8"),
           ("llama-3-8b", 1, True, "float16", False, "dtype"),
           *[(model, 1, True, "bfloat16", False, "dtype")
             for model in ("llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b",
                           "llama-2-13b")],
           ("llama-2-7b", 1, True, "bfloat16", True, "dtype"),
           ("llama-3-8b", 1, True, "bfloat16", True, "dtype"),
           *[("llama-3-70b", tp, True, "bfloat16", False, "dtype") for tp in (2, 4, 8)],
           *[("qwen2.5-72b-int4", tp, True, "bfloat16", False, "dtype") for tp in (4, 8)]]


@pytest.fixture(scope="module")
def shipped():
    return TunedTable.read(shipped_tables_dir() / "nvidia-h200_sm_90a_132sm.json")


@pytest.mark.parametrize("model, tp, fused, dtype, zero_points, act", SHIPPED)
def test_the_shipped_table_holds_every_layer_and_bucket(shipped, model, tp, fused, dtype, zero_points, act):
    config, _ = read_config(model)
    missing = [(layer.name, bucket) for layer in layers_from_config(config, tp, fused) for bucket in BUCKETS
               if shipped.entry(problem_of(layer.n, layer.k, 128, dtype, zero_points=zero_points, act=act),
                                bucket) is None]
    assert missing == []
