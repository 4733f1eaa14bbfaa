"""load_quantized: a Hugging Face model folder with a GPTQ, AWQ or compressed-tensors checkpoint,
served by tilemarlin's kernels.

1. config.json's `quantization_config` picks the format (`quant_method`) and is checked first, so
   that bit widths, group sizes and layouts the kernels cannot run are refused before any tensor is
   read. Older writers keep those settings elsewhere, read as vLLM reads them: compressed-tensors up
   to 0.6 in config.json's `compression_config`, AutoGPTQ in quantize_config.json (GPTQ unless it
   names another method), AutoAWQ up to 0.1.5 in quant_config.json (AWQ).
2. The transformers model is built from config.json with its parameters on the meta device: no
   download, no memory and no time spent on random initialization. Buffers computed at construction
   (rotary frequencies) are real.
3. Every module whose quantized tensors (GPTQ/AWQ `qweight`, compressed-tensors `weight_packed`) are
   in the safetensors files becomes a QuantLinear: the format's tensors are read onto `device`,
   unpacked into a QuantizedLayer (runtime/checkpoint/layer.py) and repacked for the kernels
   (`QuantLinear.from_layer`). Which layers are quantized is read from the files, so lm_head,
   `ignore` lists and `modules_to_not_convert` need no rules of their own. An act-order down_proj
   of a gated MLP hands its permutation to gate_proj's and up_proj's output columns and runs
   without a gather (runtime/checkpoint/fold.py).
4. The other parameters are read from the files in `dtype`, tied parameters once. A tensor that
   nothing reads is refused rather than dropped (AWQ's activation scales, say, would change the
   outputs), unless serving does without it by design (an FP8 KV cache's scales, the per-layer rotary
   frequencies older checkpoints saved).
5. Layers that read the same input (q_proj, k_proj and v_proj; gate_proj and up_proj) become one
   QuantLinear of their columns side by side, which their module runs once (runtime/fuse.py).
6. An act-order layer that reads its module's input leaves the gather to the module
   (runtime/checkpoint/input_gather.py), and where that input is an RMSNorm's output read by nothing
   else, the norm writes it in the gathered order and no gather runs (runtime/checkpoint/norm_fold.py).
7. Every kernel the model will run (the GEMMs of every layer and bucket, the gathers left, the
   gathering norms) is built by one pool of worker processes (runtime/precompile.py), each layer's
   GEMMs queued as soon as step 3 has made it (but those that may be fused, queued once fused), so
   that they build while the rest is read.
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from ..linear import QuantLinear
from ..op import DEFAULT_LAYOUT
from ..fuse import fuse_quantized
from ..precompile import PendingBuild
from .awq import AwqFormat
from .compressed_tensors import CompressedTensorsFormat
from .files import (CONFIG_FILE, OLDER_CONFIG_KEY, QUANTIZATION_CONFIG, SETTINGS_FILES, CheckpointError,
                    LayerTensors, TensorFiles, config_error)
from .fold import GatherFolding
from .gptq import GptqFormat
from .input_gather import input_gathers, share_input_gathers
from .norm_fold import GatheredRMSNorm, fold_gathers_into_norms

FORMATS = {"gptq": GptqFormat, "awq": AwqFormat, "compressed-tensors": CompressedTensorsFormat}


def checkpoint_format(qcfg: dict, place: str = QUANTIZATION_CONFIG):
    """The format reader for quantization settings read at `place` (read_quantization_config's);
    raises CheckpointError naming the place and the field."""
    try:
        if not isinstance(qcfg, dict):
            raise config_error("", f"expected an object, found {type(qcfg).__name__}")
        method = str(qcfg.get("quant_method", "")).lower()
        if method not in FORMATS:
            raise config_error("quant_method", f"{qcfg.get('quant_method')!r}: tilemarlin loads {sorted(FORMATS)}")
        return FORMATS[method](qcfg)
    except CheckpointError as exc:
        if place == QUANTIZATION_CONFIG or not exc.where.startswith(QUANTIZATION_CONFIG.rstrip(".")):
            raise
        field = exc.where[len(QUANTIZATION_CONFIG):]
        raise CheckpointError(f"{place}{field}" if field else place.rstrip(": "), exc.message) from None


def read_quantization_config(model_dir: Path) -> tuple[dict, str]:
    """(settings, place): config.json's quantization_config, else where older writers kept the settings
    (files.OLDER_CONFIG_KEY, then files.SETTINGS_FILES, whose settings take the quant_method their file
    implies unless they name one), with how errors name their place (checkpoint_format's `place`)."""
    if not Path(model_dir).is_dir():
        raise CheckpointError(str(model_dir), "no such folder")
    config = _read_json(Path(model_dir) / CONFIG_FILE)
    for key in ("quantization_config", OLDER_CONFIG_KEY):
        if config.get(key) is not None:
            return config[key], f"{CONFIG_FILE}: {key}."
    for name, method in SETTINGS_FILES.items():
        if (Path(model_dir) / name).is_file():
            settings = _read_json(Path(model_dir) / name)
            return ({"quant_method": method, **settings} if isinstance(settings, dict) else settings), f"{name}: "
    raise CheckpointError(f"{CONFIG_FILE}: quantization_config",
                          f"missing (and no {OLDER_CONFIG_KEY}, {' or '.join(SETTINGS_FILES)}): not a quantized "
                          "checkpoint")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(path), f"cannot be read as JSON ({exc})") from None


def load_quantized(model_dir, dtype: torch.dtype = torch.float16, device="cuda", layout: str = DEFAULT_LAYOUT,
                   precompile: bool = True, fuse: bool = True):
    """A transformers causal LM from a quantized checkpoint folder, its quantized linears on tilemarlin.

    Parameters
    ----------
    model_dir : a local folder with config.json (its `quantization_config`: quant_method "gptq",
        "awq" or "compressed-tensors"; or an older writer's settings file beside it) and
        model.safetensors (or the folder's one .safetensors file) or model.safetensors.index.json and
        its shards.
    dtype : torch.float16 or torch.bfloat16, for activations, scales and the dense parameters.
    device : where the model goes. On a machine without CUDA, "cpu" builds the same model (its
        QuantLinear layers hold the repacked weights), but running it needs a GPU.
    layout : the kernels' weight layout.
    precompile : build the kernels of every layer's shape on a CUDA device before returning (as
        TILEMARLIN_PRECOMPILE does, which also turns it off); False for a model that will not run
        them (converted back to dense layers, say).
    fuse : the layers that read the same input (q_proj, k_proj and v_proj; gate_proj and up_proj) as
        one QuantLinear (runtime/fuse.py), each keeping its name as a FusedSlice; False keeps them
        apart.

    Returns the model in eval mode. Raises CheckpointError (a ValueError) whose message starts with
    the file, the layer and the field at fault: another bit width or layout, a group size the kernels
    cannot run, a missing or malformed tensor, a shape that disagrees with config.json.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    fmt = checkpoint_format(*read_quantization_config(model_dir))
    files = TensorFiles(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config   # the model is built dense; this module does the quantized part
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # The kernels build in worker processes from the first layer on, while the rest are read.
    build = PendingBuild(layout=layout) if precompile else None
    try:
        replace_quantized_linears(model, fmt, files, dtype, device, layout, build, fuse)
        load_dense_parameters(model, files, dtype, device)
        refuse_unread_tensors(model, files)
        model.to(device)   # the buffers computed at construction
        arrange_for_serving(model, fuse)
        if build is not None:
            precompile_model(model, layout, build)
    except BaseException:
        if build is not None:
            build.cancel()
        raise
    return model.eval()


def arrange_for_serving(model: nn.Module, fuse: bool = True) -> None:
    """The loaded layers arranged as they are served: the sets that read one input fused (`fuse`),
    then act-order's gathers, one per module input, and none where an RMSNorm can write that input in
    the gathered order."""
    if fuse:
        fuse_quantized(model)
    share_input_gathers(model)
    fold_gathers_into_norms(model)


def act_order_layers(model: nn.Module) -> tuple[list[QuantLinear], list[QuantLinear], list[QuantLinear]]:
    """(the model's QuantLinear layers, those whose input is gathered first (by the layer or by the
    module that calls it), those whose input a GatheredRMSNorm writes): what its kernels are planned
    from."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    gathered = [m for m in layers if m.perm is not None]
    gathered += [getattr(m, gather.members[0]) for m in model.modules() for gather in input_gathers(m)]
    normed = [m.fed_layer for m in model.modules() if isinstance(m, GatheredRMSNorm)]
    return layers, gathered, normed


def precompile_model(model: nn.Module, layout: str = DEFAULT_LAYOUT, build: PendingBuild | None = None) -> None:
    """Build every kernel a loaded model will run, in one pool of worker processes
    (runtime/precompile.py): `build`'s, which has the layers queued so far, or a new one."""
    layers, gathered, normed = act_order_layers(model)
    pairs = lambda modules: [(m.problem, m.qweight.device) for m in modules]   # noqa: E731
    build = build if build is not None else PendingBuild(layout=layout)
    build.add(pairs(layers), pairs(gathered), pairs(normed))
    build.wait()


@contextlib.contextmanager
def parameters_on_meta():
    """Every nn.Parameter created inside goes to the meta device (initializing it costs nothing);
    buffers stay where they are created."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def replace_quantized_linears(model: nn.Module, fmt, files: TensorFiles, dtype, device, layout,
                              build: PendingBuild | None = None, fuse: bool = False) -> int:
    """Swap each nn.Linear with quantized tensors in `files` for a QuantLinear, queueing each new
    layer's kernels on `build` (runtime/precompile.py) as it is made, but for those that may be fused
    with a sibling (`fuse`); returns how many."""
    suffix = "." + fmt.marker
    pending = {name[:-len(suffix)] for name in files.names() if name.endswith(suffix)}
    modules = dict(model.named_modules())
    unqueued = _may_fuse(modules, pending) if fuse else set()
    folding = GatherFolding(model, pending)
    replaced: list[QuantLinear] = []
    for name in folding.order([name for name in modules if name in pending]):
        module = modules[name]
        pending.discard(name)
        t = LayerTensors(files, name, device)
        if not isinstance(module, nn.Linear):
            raise t.error(fmt.marker, f"quantized tensors for a {type(module).__name__}, not an nn.Linear")
        bias = _bias(t, module)
        try:
            layer = folding.apply(name, fmt.convert(t, module, bias, dtype))
            new = QuantLinear.from_layer(layer, layout, precompile=False)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as exc:
            file = files.file_of(name + suffix)
            raise CheckpointError(f"{file.name}: {name}", str(exc)) from None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        replaced.append(new)
        if build is not None and name not in unqueued:
            build.add([(new.problem, new.qweight.device)])
    if pending:
        first = sorted(pending)[0]
        raise CheckpointError(f"{files.file_of(first + suffix).name}: {first}{suffix}",
                              f"quantized tensors for a layer the model built from {CONFIG_FILE} does not have"
                              + (f" (and {len(pending) - 1} more)" if len(pending) > 1 else ""))
    if not replaced:
        raise CheckpointError(files.source, f"no quantized layer ({fmt.marker} tensors) in the checkpoint")
    return len(replaced)


def _may_fuse(modules: dict[str, nn.Module], quantized: set[str]) -> set[str]:
    """The quantized layers with a quantized sibling of the same in_features: those fuse_quantized may
    fuse."""
    siblings: dict[tuple, list[str]] = {}
    for name in quantized:
        parent, _, _ = name.rpartition(".")
        siblings.setdefault((parent, getattr(modules.get(name), "in_features", None)), []).append(name)
    return {name for names in siblings.values() if len(names) > 1 for name in names}


def _bias(t: LayerTensors, module: nn.Linear) -> torch.Tensor | None:
    """The layer's bias. AutoGPTQ up to 0.7 saved a bias for every quantized layer, all zeros where the
    model has none (TheBloke's and Qwen's GPTQ releases carry them): such a bias is dropped; any other
    bias on a layer without one is refused."""
    if t.has("bias"):
        bias = t.require("bias", shape=(module.out_features,), why=f"for out_features={module.out_features}",
                         floating=True)
        if module.bias is not None:
            return bias
        if bool((bias == 0).all()):
            return None
        raise t.error("bias", f"the checkpoint has a non-zero bias that the layer built from {CONFIG_FILE} lacks")
    if module.bias is not None:
        raise t.error("bias", "missing from the checkpoint")
    return None


# Tensors serving does without: an FP8 KV cache's (or attention's) scales, the cache staying in the
# model's dtype; and buffers that older checkpoints saved and transformers now computes at
# construction (each layer's rotary frequencies, position ids), which transformers skips too.
UNREAD_BY_DESIGN = (r"\.(k|v|kv|q|prob)_scale$", r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$")


def refuse_unread_tensors(model: nn.Module, files: TensorFiles) -> None:
    """A CheckpointError naming the first tensor in `files` that no QuantLinear's tensors, parameter
    or buffer of the model accounts for (once the quantized layers are in place), unless
    UNREAD_BY_DESIGN or the model class's own `_keys_to_ignore_on_load_unexpected` names it."""
    quantized = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, QuantLinear))
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    held |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    own = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    ignored = re.compile("|".join(f"({pattern})" for pattern in (*UNREAD_BY_DESIGN, *own)))
    unread = sorted(name for name in files.names()
                    if name not in held and not name.startswith(quantized) and not ignored.search(name))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise CheckpointError(f"{files.file_of(unread[0]).name}: {unread[0]}",
                              f"no module of the model built from {CONFIG_FILE} reads this tensor{more}; refused "
                              "rather than dropped, since it may change the outputs (AutoAWQ's activation "
                              "scales of some architectures are such tensors)")


def load_dense_parameters(model: nn.Module, files: TensorFiles, dtype, device) -> None:
    """Read every parameter still on the meta device from `files`; a tied parameter is read once and
    stays tied."""
    names_of: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), (param, []))[1].append(name)
    for param, names in names_of.values():
        source = next((n for n in names if n in files), None)
        if source is None:
            raise CheckpointError(f"{files.source}: {names[0]}", "missing from the checkpoint")
        tensor = files.get(source)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"{files.file_of(source).name}: {source}",
                                  f"shape {tuple(tensor.shape)}, but the model built from {CONFIG_FILE} "
                                  f"expects {tuple(param.shape)}")
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        loaded = nn.Parameter(tensor.to(device), requires_grad=False)
        for name in names:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, loaded)
