"""Turn a GGUF file into a Hugging Face model folder, once, in the model cache.

The engine loads folders; a GGUF file is converted on first use into
``<cache>/models/<label>-<key>/`` (config.json, model.safetensors in float32,
tokenizer, generation_config.json, ``gguf_source.json``) and then loaded like
any folder. float32 holds every dequantized value exactly (``d * q + m`` of
fp16 scales and small integers), so the folder is the GGUF model itself, and
the engine's ``dtype`` decides what it runs in. The same folder serves a peer
(vLLM, transformers) for side-by-side measurements. Which llama.cpp
architectures convert, and to what, is ``archs``' table.

The key hashes the file's resolved path, size and mtime with the converter
version: a replaced file or a new converter gives a new folder. The source
path is recorded in ``gguf_source.json`` so later steps (weight quantization)
can read the original blocks rather than requantizing dequantized floats.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig

from actors.load.gguf.archs import gguf_architecture, permuted_heads, unpermute_rows
from actors.load.gguf.dequant import check_supported, dequantize
from actors.load.gguf.reader import GGUFError, GGUFFile, read_gguf
from actors.load.model_cache import build_once, models_dir, update_json

# Bump when the folder a GGUF file converts to would change.
CONVERTER_VERSION = 1
SOURCE_FILE = "gguf_source.json"
# float32 shards of the converted folder: bounded memory while converting a large model.
SHARD_BYTES = 2 << 30


def _rope_theta(g: GGUFFile) -> float:
    return float(g.get(f"{g.architecture}.rope.freq_base", 10000.0))


def hf_config(g: GGUFFile) -> PretrainedConfig:
    """The Hugging Face config of a GGUF file's header (its architecture's class, ``archs.ARCHITECTURES``);
    ``GGUFError`` for what it cannot express."""
    arch = g.architecture
    family = gguf_architecture(g)
    if g.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise GGUFError(f"rope scaling {g.get(f'{arch}.rope.scaling.type')!r} in a GGUF file is not supported")
    heads = g.require(f"{arch}.attention.head_count")
    kv_heads = g.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise GGUFError("per-layer head counts in a GGUF file are not supported")
    hidden = int(g.require(f"{arch}.embedding_length"))
    tokens = g.get("tokenizer.ggml.tokens") or []
    # head_dim is always explicit: Qwen3's may differ from hidden / heads, and Qwen3Config's default (128)
    # is no file's. Qwen2's q/k/v biases need no field: the architecture name implies them.
    config = family.config_class(
        vocab_size=int(g.get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(g.require(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(g.require(f"{arch}.block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(kv_heads),
        head_dim=int(g.get(f"{arch}.attention.key_length", g.get(f"{arch}.rope.dimension_count", hidden // heads))),
        max_position_embeddings=int(g.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(g)},
        tie_word_embeddings="output.weight" not in g.tensors,
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=g.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=g.get("tokenizer.ggml.padding_token_id"),
    )
    config.architectures = [family.hf_architecture]
    config.dtype = "float32"
    return config


def iter_hf_tensors(g: GGUFFile, config: PretrainedConfig, *, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for every tensor, dequantized (and un-permuted where the architecture is)."""
    family = gguf_architecture(g)
    for t in g.tensors.values():  # refuse before any work, naming the first bad tensor
        check_supported(t)
        family.hf_name(t.name)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
    bar = tqdm(g.tensors.values(), desc="converting GGUF", unit="tensor", disable=not progress)
    for t in bar:
        name, w = family.hf_name(t.name), dequantize(t)
        rows_over = permuted_heads(name, heads, kv_heads) if family.permuted_qk else 0
        yield name, unpermute_rows(w, rows_over) if rows_over else w


def write_folder(g: GGUFFile, folder: Path, *, progress: bool | None = None) -> None:
    """Write the Hugging Face folder of ``g`` into ``folder`` (which exists)."""
    if progress is None:
        progress = sys.stderr.isatty()
    config = hf_config(g)
    _write_weights(iter_hf_tensors(g, config, progress=progress), folder)
    config.save_pretrained(folder)
    # Readers on transformers 4 (e.g. a vLLM peer) look for the older rope key.
    update_json(folder / "config.json", {"rope_theta": _rope_theta(g), "torch_dtype": "float32"})
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(folder)
    _write_tokenizer(g, folder)
    types: dict[str, int] = {}
    for t in g.tensors.values():
        types[t.type_name] = types.get(t.type_name, 0) + 1
    (folder / SOURCE_FILE).write_text(json.dumps(
        {"gguf": str(g.path.resolve()), "converter_version": CONVERTER_VERSION, "tensor_types": types},
        indent=2, sort_keys=True) + "\n")


def _write_weights(tensors: Iterator[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Stream tensors into safetensors shards of at most ``SHARD_BYTES`` (one file when it fits).

    Memory stays at about one shard, not the whole float32 model.
    """
    groups: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def save() -> None:
        groups.append(list(shard))
        save_file(shard, str(folder / f"shard-{len(groups):05d}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            save()
            size = 0
        shard[name] = tensor
        size += nbytes
    save()
    if len(groups) == 1:
        (folder / "shard-00001.safetensors").rename(folder / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        (folder / f"shard-{i:05d}.safetensors").rename(folder / file)
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(g: GGUFFile, folder: Path) -> None:
    if g.get("tokenizer.ggml.model") is None:
        raise GGUFError(f"{g.path} carries no tokenizer (no tokenizer.ggml.model key)")
    try:
        tok = AutoTokenizer.from_pretrained(str(g.path.parent), gguf_file=g.path.name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise GGUFError(f"cannot build the tokenizer of {g.path}: {type(e).__name__}: {e}") from e
    tok.save_pretrained(folder)
    updates: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    template = g.get("tokenizer.chat_template")
    if template:
        updates["chat_template"] = template
    update_json(folder / "tokenizer_config.json", updates)


def gguf_key(path: Path) -> str:
    """Short hash of what decides a GGUF file's converted folder."""
    st = path.stat()
    blob = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, CONVERTER_VERSION])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_gguf_folder(path: Path | str, *, label: str | None = None, root: Path | None = None,
                       progress: bool | None = None) -> Path:
    """The converted folder of GGUF file ``path``, converting it on first use.

    ``label`` names the folder (default: the file's stem); ``root`` overrides the
    cache root. Safe when several processes ask at once (``model_cache.build_once``).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"{path} is not a file")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", label or path.stem)
    final = models_dir(root) / f"{name}-{gguf_key(path)}"
    if final.is_dir():
        return final
    g = read_gguf(path)  # parse (and refuse) before announcing a conversion
    hf_config(g)
    print(f"flotilla: converting {path} into {final} (once)", file=sys.stderr)
    return build_once(final, lambda tmp: write_folder(g, tmp, progress=progress))


def gguf_source(folder: Path) -> dict[str, Any] | None:
    """What ``folder`` was converted from (``gguf_source.json``), or None for a native HF folder."""
    source = folder / SOURCE_FILE
    return json.loads(source.read_text()) if source.is_file() else None

