"""Find a model, build our implementation of it, and stream its weights in.

``model`` may be a local Hugging Face folder, a ``.gguf`` file, an embedded
model name (``tiny``, ``small``), a preset (``smollm2-135m``) or a hub id.
GGUF files and presets are converted once into a folder in the model cache. Weights are read tensor by tensor from
safetensors files (single or sharded), falling back to ``pytorch_model*.bin``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from actors.embedded_models import EMBEDDED_MODELS, ensure_embedded_model
from actors.gguf.convert import ensure_gguf_folder
from actors.models.llama import LlamaForCausalLM
from actors.models.registry import resolve_architecture
from actors.presets import PRESETS, ensure_preset
from scheduling.errors import InvalidParameterError

# Files a hub download needs; skips e.g. original/*.pth consolidated copies.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class ModelNotFoundError(InvalidParameterError):
    """``model`` is neither a local folder, an embedded name, nor a reachable hub id."""

    def __init__(self, message: str, *, param: str = "model") -> None:
        super().__init__(param, message)


@dataclass
class LoadedModel:
    """A model ready for inference plus where it came from."""

    model: LlamaForCausalLM
    hf_config: PretrainedConfig
    path: Path


def resolve_model_path(model: str) -> Path:
    """Turn a ``model`` setting into a local Hugging Face model folder.

    Order: an existing folder; a ``.gguf`` file (converted once); an embedded
    name; a preset name (converted once from its package); a hub id via
    ``huggingface_hub.snapshot_download`` (cache only when ``HF_HUB_OFFLINE``
    is set, and as a fallback when the hub cannot be reached).
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if local.is_file() and local.suffix.lower() == ".gguf":
        return ensure_gguf_folder(local)
    if model in EMBEDDED_MODELS:
        return ensure_embedded_model(model)
    if model in PRESETS:
        return ensure_preset(model)
    if local.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{model!r} is not a model folder or a .gguf file")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    errors: list[str] = []
    for local_only in ([True] if offline else [False, True]):
        try:
            return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS, local_files_only=local_only))
        except Exception as e:  # noqa: BLE001 - any hub failure becomes one user error
            errors.append(f"{type(e).__name__}: {e}")
    raise ModelNotFoundError(
        f"{model!r} is neither a local folder, a .gguf file, an embedded model ({', '.join(EMBEDDED_MODELS)}), "
        f"a preset ({', '.join(PRESETS)}), "
        f"nor a hub id that can be reached or is cached ({errors[-1].splitlines()[0]})"
    )


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a model folder, in load order.

    Prefers safetensors (through the shard index when there is one, so
    extra copies such as ``consolidated.safetensors`` are not read twice).
    """
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            return [path / f for f in sorted(set(weight_map.values()))]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ModelNotFoundError(f"no *.safetensors or pytorch_model.bin weights in {path}")
    return found


def iter_checkpoint(files: list[Path], *, progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` from every file, one tensor at a time.

    The progress bar ticks once per tensor; by default it shows only on a terminal.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    bar = tqdm(desc="loading weights", unit="tensor", disable=not progress)
    with bar:
        for file in files:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    names = list(f.keys())
                    bar.total = (bar.total or 0) + len(names)
                    for name in names:
                        yield name, f.get_tensor(name)
                        bar.update(1)
            else:
                state: dict[str, torch.Tensor] = torch.load(file, map_location="cpu", weights_only=True)
                bar.total = (bar.total or 0) + len(state)
                for name in list(state):
                    yield name, state.pop(name)  # pop: free each tensor once copied
                    bar.update(1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int,
    rank: int = 0,
    world_size: int = 1,
    progress: bool | None = None,
) -> LoadedModel:
    """Build ``model``'s tensor-parallel shard ``rank`` of ``world_size`` and load its weights.

    Parameters are allocated directly on ``device`` in ``dtype``; each
    checkpoint tensor is copied (and converted) into place as it is read.
    Raises ``UnsupportedModelError`` or ``ModelNotFoundError`` (``param="model"``).
    """
    path = resolve_model_path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json; is it a Hugging Face model folder?")
    raw: dict[str, Any] = json.loads(config_file.read_text())
    cls = resolve_architecture(raw)  # before AutoConfig, which fails unclearly on unknown types
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    files = checkpoint_files(path)
    with torch.device(device), _default_dtype(dtype):
        llm = cls(hf_config, max_model_len=max_model_len, tp_rank=rank, tp_size=world_size)
    with torch.no_grad():
        llm.load_weights(iter_checkpoint(files, progress=progress))
    return LoadedModel(model=llm.eval(), hf_config=hf_config, path=path)


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """The model folder's tokenizer (local files only; never downloads)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
