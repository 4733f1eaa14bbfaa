"""A checkpoint folder's safetensors shards, read tensor by tensor, and errors that say where.

Shards are listed in `model.safetensors.index.json` (`weight_map`: tensor name -> file) or the
folder holds one `model.safetensors` (or one other .safetensors file, as older GPTQ folders name
theirs). Tensors are read one at a time (safetensors.safe_open), so a
model never has to fit in host memory twice.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint the loader cannot serve; the message starts with the file, layer and field."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


class TensorFiles:
    """The tensors of a checkpoint folder, by name, with the file each comes from."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(str(index), f"not a safetensors index with a weight_map ({exc})") from None
            self._file_of = {name: self.model_dir / file for name, file in weight_map.items()}
            self.source = INDEX_FILE
        else:
            path = self._single_file()
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                self._file_of = {name: path for name in f.keys()}
            self.source = path.name
        self._open: dict[Path, object] = {}

    def _single_file(self) -> Path:
        """model.safetensors, else the folder's only .safetensors file (older GPTQ folders name theirs
        after the quantization, e.g. gptq_model-4bit-128g.safetensors)."""
        if (self.model_dir / SINGLE_FILE).exists():
            return self.model_dir / SINGLE_FILE
        found = sorted(self.model_dir.glob("*.safetensors"))
        if len(found) != 1:
            listed = f": {', '.join(p.name for p in found)}" if found else ""
            raise CheckpointError(str(self.model_dir), f"no {INDEX_FILE} or {SINGLE_FILE}, and {len(found)} other "
                                                       f".safetensors files{listed}")
        return found[0]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self):
        return self._file_of.keys()

    def file_of(self, name: str) -> Path | None:
        return self._file_of.get(name)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` on the CPU, as stored."""
        path = self._file_of[name]
        handle = self._open.get(path)
        if handle is None:
            from safetensors import safe_open

            if not path.exists():
                raise CheckpointError(str(path), f"missing, though {INDEX_FILE} lists {name} in it")
            handle = self._open[path] = safe_open(str(path), framework="pt")
        try:
            return handle.get_tensor(name)
        except Exception as exc:   # safetensors raises its own error types for unreadable tensors
            raise CheckpointError(f"{path.name}: {name}", f"cannot be read ({exc})") from None


class LayerTensors:
    """The tensors of one quantized layer (`prefix.field`), read onto `device`, with errors that name
    file, layer and field."""

    def __init__(self, files: TensorFiles, prefix: str, device="cpu"):
        self.files, self.prefix, self.device = files, prefix, torch.device(device)

    def where(self, field: str) -> str:
        name = f"{self.prefix}.{field}"
        path = self.files.file_of(name)
        return f"{path.name if path else self.files.source}: {name}"

    def error(self, field: str, message: str) -> CheckpointError:
        return CheckpointError(self.where(field), message)

    def has(self, field: str) -> bool:
        return f"{self.prefix}.{field}" in self.files

    def optional(self, field: str) -> torch.Tensor | None:
        return self.files.get(f"{self.prefix}.{field}").to(self.device) if self.has(field) else None

    def require(self, field: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
                why: str = "", floating: bool = False) -> torch.Tensor:
        """The tensor `field`; a CheckpointError when it is missing, not of `dtype` (`floating`: of a
        floating-point dtype) or not of `shape`. `why` (e.g. "for K=4096, N=11008 from config.json")
        goes into the shape error."""
        if not self.has(field):
            raise self.error(field, "missing from the checkpoint")
        tensor = self.files.get(f"{self.prefix}.{field}")
        if dtype is not None and tensor.dtype != dtype:
            raise self.error(field, f"expected {dtype}, found {tensor.dtype}")
        if floating and not tensor.is_floating_point():
            raise self.error(field, f"expected floating-point values, found {tensor.dtype}")
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise self.error(field, f"expected shape {tuple(shape)}{' ' + why if why else ''}, "
                                    f"found {tuple(tensor.shape)}")
        return tensor.to(self.device)


CONFIG_FILE = "config.json"
# Where older writers keep the settings, in the order they are looked for when config.json has no
# quantization_config: compressed-tensors up to 0.6 in config.json's compression_config; AutoGPTQ in
# quantize_config.json and AutoAWQ up to 0.1.5 in quant_config.json, files that name no quant_method
# (the method each implies).
OLDER_CONFIG_KEY = "compression_config"
SETTINGS_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
# How errors name a field of the quantization settings, by where they were read: prefix + field.
QUANTIZATION_CONFIG = f"{CONFIG_FILE}: quantization_config."


def config_error(field: str, message: str) -> CheckpointError:
    """An error in config.json's quantization_config, naming the field (the loader renames the place
    for settings read elsewhere: OLDER_CONFIG_KEY, SETTINGS_FILES)."""
    return CheckpointError(f"{QUANTIZATION_CONFIG}{field}".rstrip("."), message)
