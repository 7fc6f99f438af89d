"""Find a model, build our implementation of it, and stream its weights in.

``model`` may be a local Hugging Face folder, a ``.gguf`` file, an embedded
model name (``tiny``, ``small``), a preset (``smollm2-135m``) or a hub id.
GGUF files and presets are converted once into a folder in the model cache. Weights are read tensor by tensor from
safetensors files (single or sharded), falling back to ``pytorch_model*.bin``.

``quantization`` (``actors.load.quant.plan``): ``int8`` and ``int4`` quantize the
linear layers (and the LM head, int8) once loaded, freeing their float
weights; ``int4`` on a folder converted from a Q4_0/Q4_1 GGUF file reads the
file's blocks directly; a compressed-tensors checkpoint loads its int4 codes
as they are.
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

from actors.load.embedded import EMBEDDED_MODELS, ensure_embedded_model
from actors.load.gguf import q4_blocks
from actors.load.gguf.convert import ensure_gguf_folder
from actors.load.presets import PRESETS, ensure_preset
from actors.load.quant import compressed_tensors
from actors.load.quant.plan import QuantPlan, resolve_plan
from actors.log import get_logger
from actors.models.decoder import CausalLM
from actors.models.quant_linear import Int4Codes, Int8Blocks
from actors.models.registry import resolve_architecture
from scheduling.errors import InvalidParameterError

# Files a hub download needs; skips e.g. original/*.pth consolidated copies.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]

logger = get_logger("loader")


class ModelNotFoundError(InvalidParameterError):
    """``model`` is neither a local folder, an embedded name, nor a reachable hub id."""

    def __init__(self, message: str, *, param: str = "model") -> None:
        super().__init__(param, message)


@dataclass
class LoadedModel:
    """A model ready for inference plus where it came from.

    ``weight_bytes``: bytes of every parameter and quantized buffer (what the
    weights occupy, after quantization); ``weights``: how they are stored,
    e.g. ``float32`` or ``int4, group 32, ...``.
    """

    model: CausalLM
    hf_config: PretrainedConfig
    path: Path
    weight_bytes: int
    weights: str


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


def iter_checkpoint(
    files: list[Path], *, progress: bool | None = None, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` from every file, one tensor at a time; names in ``skip`` are not read.

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
                        if name not in skip:
                            yield name, f.get_tensor(name)
                        bar.update(1)
            else:
                state: dict[str, torch.Tensor] = torch.load(file, map_location="cpu", weights_only=True)
                bar.total = (bar.total or 0) + len(state)
                for name in list(state):
                    tensor = state.pop(name)  # pop: free each tensor once copied
                    if name not in skip:
                        yield name, tensor
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
    quantization: str | None = None,
    quantization_group_size: int | None = None,
    expert_parallel: bool = False,
) -> LoadedModel:
    """Build ``model``'s tensor-parallel shard ``rank`` of ``world_size`` and load its weights.

    Parameters are allocated directly on ``device`` in ``dtype``; each
    checkpoint tensor is copied (and converted) into place as it is read.
    ``quantization`` (None, ``int8``, ``int4``, ``compressed-tensors``) and
    ``quantization_group_size`` (int4) follow ``actors.load.quant.plan``: the
    quantized layers keep no float weight. Raises ``UnsupportedModelError`` or
    ``ModelNotFoundError`` (``param="model"``), and ``InvalidParameterError``
    naming ``quantization``/``quantization_group_size`` for combinations that
    cannot load. ``expert_parallel`` spreads an MoE model's experts whole over
    the ranks (``EngineConfig.expert_parallel``).
    """
    path = resolve_model_path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json; is it a Hugging Face model folder?")
    raw: dict[str, Any] = json.loads(config_file.read_text())
    cls = resolve_architecture(raw)  # before AutoConfig, which fails unclearly on unknown types
    plan = resolve_plan(path, raw, quantization, quantization_group_size, device)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    files = checkpoint_files(path)
    with torch.device(device), _default_dtype(dtype):
        llm = cls(
            hf_config, max_model_len=max_model_len, tp_rank=rank, tp_size=world_size, expert_parallel=expert_parallel
        )
    plan.check_model(llm)
    with torch.no_grad():
        llm.load_weights(_weights(plan, files, llm, progress))
        if plan.method is not None and plan.source != compressed_tensors.QUANT_METHOD:
            llm.quantize_weights(plan.method, plan.group_size)
    loaded = LoadedModel(model=llm.eval(), hf_config=hf_config, path=path, weight_bytes=llm.weight_bytes(),
                         weights=plan.describe(dtype))
    if rank == 0:
        logger.info("weights: %.1f MiB (%s)", loaded.weight_bytes / 2**20, loaded.weights)
    return loaded


def _weights(
    plan: QuantPlan, files: list[Path], llm: CausalLM, progress: bool | None
) -> Iterator[tuple[str, torch.Tensor | Int4Codes | Int8Blocks]]:
    """The checkpoint's tensors, with quantized weights as ``Int4Codes`` (linears) or ``Int8Blocks`` (vocab)
    where the plan reads them directly."""
    if plan.ct_scheme is not None:
        yield from compressed_tensors.iter_int4_weights(iter_checkpoint(files, progress=progress), plan.ct_scheme)
        return
    # The float copies of the linears read from GGUF blocks are never read.
    yield from iter_checkpoint(files, progress=progress, skip=frozenset(plan.gguf_tensors))
    yield from q4_blocks.iter_int4_weights(
        plan.gguf_tensors, num_heads=llm.args.num_heads, num_kv_heads=llm.args.num_kv_heads,
        permuted_qk=plan.gguf_permuted_qk,
    )


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """The model folder's tokenizer (local files only; never downloads)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
