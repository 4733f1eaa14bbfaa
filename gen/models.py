"""Linear-layer shapes of common models, as serving engines run them: q, k and v fused into one qkv
projection and gate and up into one gate_up projection, so each decoder layer has four GEMMs; or, with
`fused=False` (`--unfused`), as transformers' modules run them, seven GEMMs with q, k, v, gate and up
apart.

Shapes are K x N (input features x output features). With tensor parallelism, the column-parallel
layers (qkv, gate_up) split their outputs N across ranks and the row-parallel ones (o, down) split
their inputs K. No downloads: the registry holds the few config.json fields that decide the shapes,
and a dense decoder's Hugging Face config.json can be given by path (mixture-of-experts and latent-
attention configs are refused: their layers are others).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The config.json fields that decide the linear shapes (head_dim only where it is not
# hidden_size / num_attention_heads).
MODELS: dict[str, dict] = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=8),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_attention_heads=64, num_key_value_heads=8),
    # Qwen's own INT4 checkpoints of the 72B (GPTQ-Int4, AWQ) pad the MLP with zeros to 29696 rows, so that
    # 128-row groups split over 2, 4 or 8 ranks (29568 / 128 = 231 groups does not).
    "qwen2.5-72b-int4": dict(hidden_size=8192, intermediate_size=29696, num_attention_heads=64,
                             num_key_value_heads=8),
}


UNFUSED_HELP = ("the --model layers as transformers' modules run them: q, k, v, gate and up apart (seven "
                "GEMMs a decoder layer) instead of the qkv and gate_up projections serving engines fuse")


def add_layer_arguments(p, shapes_help: str = "extra KxN shapes, comma separated, e.g. 4096x12288,11008x4096") -> None:
    """The flags that name the layers and their form, the same in every command that takes them:
    --model, --tp, --unfused, --shapes, --group, --dtype, --zero-points, --checkpoint, --act."""
    from schedules.problem import LAYER_ACTS, SUPPORTED_DTYPES

    p.add_argument("--model", help="a registered model (see gen/models.py) or a path to a Hugging Face config.json; "
                   "several, comma separated, share one run (a layer shape they share is one problem)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks the --model layers are split over (--shapes are taken as given)")
    p.add_argument("--unfused", action="store_true", help=UNFUSED_HELP)
    p.add_argument("--shapes", help=shapes_help)
    p.add_argument("--group", type=int, default=128, help="rows per quantization group; -1 = channelwise")
    p.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float16", help="activation dtype")
    p.add_argument("--zero-points", action="store_true",
                   help="layers with zero points of their own (asymmetric checkpoints: GPTQ sym=false, AWQ)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a quantized checkpoint folder (GPTQ, AWQ, compressed-tensors): its INT4 layers as "
                        "runtime.load_quantized serves them (fused q_k_v_proj and gate_up_proj where the model reads them "
                        "from one input, their group sizes and zero points, "
                        "the act-order gathers), in --dtype; instead of --model and --shapes")
    p.add_argument("--act", choices=LAYER_ACTS, default="dtype",
                   help="the layers' activations: dtype (W4A16) or fp8 (W4A8: FP8 e4m3 per token on FP8 wgmma, "
                        "sm_90a, with its activation kernel for each K, whose time is the same for every "
                        "candidate and not part of tuned times)")


@dataclass(frozen=True)
class Layer:
    """One linear layer: C[M, n] = A[M, k] @ W[k, n]."""

    name: str
    k: int
    n: int
    parallel: str   # "column" (split N under tensor parallelism) or "row" (split K)

    def __post_init__(self):
        if self.parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {self.parallel!r}")
        if self.k <= 0 or self.n <= 0:
            raise ValueError(f"layer {self.name}: K and N must be positive, got {self.k}x{self.n}")

    @property
    def shape(self) -> str:
        return f"{self.k}x{self.n}"


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ValueError(f"{what}={value} is not divisible by --tp {tp}")
    return value // tp


def _positive_int(config: dict, field: str, default: int | None = None) -> int:
    """config[field] as a positive integer; `default` where the field is absent or null. A wrong
    value is a ValueError that names the field and the value."""
    value = config.get(field)
    if value is None:
        if default is None:
            raise ValueError(f"model config lacks {field!r}" if field not in config
                             else f"model config: {field} is null")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model config: {field}={value!r} is not a positive integer")
    return value


def layers_from_config(config: dict, tp: int = 1, fused: bool = True) -> list[Layer]:
    """The linear layers of one decoder layer of a Hugging Face-style config, on one of `tp` ranks:
    the four a serving engine runs (`fused`), or the seven transformers' modules run, with q, k, v,
    gate and up apart."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    hidden = _positive_int(config, "hidden_size")
    intermediate = _positive_int(config, "intermediate_size")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads", default=heads)
    if hidden % heads and config.get("head_dim") is None:
        raise ValueError(f"model config: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                         "and there is no head_dim")
    head_dim = _positive_int(config, "head_dim", default=hidden // heads)

    q_heads = _split(heads, tp, "num_attention_heads")
    # Fewer KV heads than ranks: each rank keeps a replica of one KV head, as vLLM and SGLang do.
    if kv_heads % tp == 0:
        kv_per_rank = kv_heads // tp
    elif tp % kv_heads == 0:
        kv_per_rank = 1
    else:
        raise ValueError(f"num_key_value_heads={kv_heads} can neither be split nor replicated over --tp {tp}")
    inter = _split(intermediate, tp, "intermediate_size")
    if not fused and config.get("model_type") not in FUSED_IN_TRANSFORMERS:
        return [
            Layer("q_proj", hidden, q_heads * head_dim, "column"),
            Layer("k_proj", hidden, kv_per_rank * head_dim, "column"),
            Layer("v_proj", hidden, kv_per_rank * head_dim, "column"),
            Layer("o_proj", q_heads * head_dim, hidden, "row"),
            Layer("gate_proj", hidden, inter, "column"),
            Layer("up_proj", hidden, inter, "column"),
            Layer("down_proj", inter, hidden, "row"),
        ]
    return [
        Layer("qkv_proj", hidden, (q_heads + 2 * kv_per_rank) * head_dim, "column"),
        Layer("o_proj", q_heads * head_dim, hidden, "row"),
        Layer("gate_up_proj", hidden, 2 * inter, "column"),
        Layer("down_proj", inter, hidden, "row"),
    ]


# Fields of configs whose layers are not the dense decoder's q, k, v, o, gate, up and down: experts
# (transformers builds their weights as 3-D parameters, not linear layers) and multi-head latent
# attention (other projections). Their shapes would come out wrong, so they are refused.
OTHER_ARCHITECTURE_FIELDS = {"num_experts": "mixture of experts", "num_local_experts": "mixture of experts",
                             "n_routed_experts": "mixture of experts", "moe_intermediate_size": "mixture of experts",
                             "kv_lora_rank": "multi-head latent attention"}
# Model types whose transformers modules already fuse q, k, v and gate, up (Phi-3's qkv_proj and
# gate_up_proj): their layers as transformers runs them are the fused ones.
FUSED_IN_TRANSFORMERS = ("phi3",)


def read_config(name_or_config_path: str) -> tuple[dict, bool]:
    """(config fields, whether registered): a registered model's (see MODELS) or a config.json's
    given by path (or by its folder), a multimodal config's language-model fields (its text_config).
    A config of another architecture (OTHER_ARCHITECTURE_FIELDS) is a ValueError that names the field."""
    config = MODELS.get(str(name_or_config_path).lower())
    if config is not None:
        return dict(config), True
    path = Path(name_or_config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_config_path!r}: neither a registered model "
                         f"({', '.join(MODELS)}) nor a config.json file (or a folder that holds one)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config {path} is not a JSON object")
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {"torch_dtype": config.get("torch_dtype"), **config["text_config"]}
    other = next((field for field in OTHER_ARCHITECTURE_FIELDS if config.get(field)), None)
    if other:
        raise ValueError(f"model config {path}: {other}={config[other]!r}: a {OTHER_ARCHITECTURE_FIELDS[other]} model, "
                         "whose layers are not a dense decoder's q, k, v, o, gate, up and down; name its layers "
                         "with --shapes, or tune a checkpoint's with --checkpoint")
    return config, False


def model_layers(name_or_config_path: str, tp: int = 1, fused: bool = True) -> list[Layer]:
    """Linear layers of a registered model (see MODELS) or of a config.json given by path (`fused`:
    see layers_from_config)."""
    return layers_from_config(read_config(name_or_config_path)[0], tp, fused)


def parse_shapes(text: str) -> list[Layer]:
    """"4096x12288,11008x4096" -> layers named by their K x N shape (taken as given: no --tp split)."""
    layers = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad shape {item!r}: expected KxN such as 4096x12288") from None
        if k <= 0 or n <= 0:
            raise ValueError(f"bad shape {item!r}: K and N must be positive")
        layers.append(Layer(f"{k}x{n}", k, n, "column"))
    if not layers:
        raise ValueError(f"no shapes in {text!r}")
    return layers
