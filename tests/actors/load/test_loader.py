"""Model path resolution and checkpoint loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.load.loader import (
    ModelNotFoundError,
    checkpoint_files,
    iter_checkpoint,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from actors.models.registry import UnsupportedModelError
from tests.actors.checkpoints import new_dense, step_logits

TOKENS = [1, 50, 300, 7, 7, 2, 511]


def _load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(str(path), dtype=dtype, device="cpu", max_model_len=64).model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return step_logits(model, new_dense(model), [(0, TOKENS, 0)])[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resolve_local_folder(llama_dir: Path) -> None:
    assert resolve_model_path(str(llama_dir)) == llama_dir


def test_resolve_missing_path_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a model folder or a .gguf file") as err:
        resolve_model_path(str(tmp_path / "nope"))
    assert err.value.param == "model"


def test_unreachable_hub_id_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="neither a local folder.*nor a hub id") as err:
        resolve_model_path("no-such-org/no-such-model")
    assert err.value.param == "model" and isinstance(err.value, ValueError)


def test_sharded_checkpoint_loads_like_single_file(llama_dir: Path, sharded_llama_dir: Path) -> None:
    index = json.loads((sharded_llama_dir / "model.safetensors.index.json").read_text())
    files = checkpoint_files(sharded_llama_dir)
    assert len(files) == len(set(index["weight_map"].values())) > 2
    single, sharded = _load(llama_dir), _load(sharded_llama_dir)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(_logits(single), _logits(sharded))


def test_pytorch_bin_fallback(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "bin")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    assert checkpoint_files(folder) == [folder / "pytorch_model.bin"]
    torch.testing.assert_close(_logits(_load(folder)), _logits(_load(llama_dir)), atol=0, rtol=0)


def test_loaded_model_dtype_and_mode(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir), dtype=torch.bfloat16, device="cpu", max_model_len=64)
    model = loaded.model
    assert not model.training and loaded.path == llama_dir
    assert loaded.hf_config.model_type == "llama"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos.dtype == torch.float32  # RoPE tables stay exact
    assert model.model.rotary_emb.cos.shape[0] == 64
    logits = _logits(model)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _logits(_load(llama_dir)), atol=0.3, rtol=0.05)


def test_unsupported_architecture_folder(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM") as err:
        _load(folder)
    assert err.value.param == "model"


def test_folder_without_config_or_weights(llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        _load(tmp_path / "empty")
    folder = _copy(llama_dir, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="weights"):
        _load(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("model.layers.1.self_attn.v_proj.weight"), r"missing.*qkv_proj.weight\[v\]"),
        (lambda s: s.pop("model.norm.weight"), "missing.*model.norm.weight"),
        (lambda s: s.update({"model.layers.0.extra.weight": torch.ones(1)}), "no place"),
    ],
)
def test_incomplete_or_foreign_checkpoint_is_rejected(
    llama_dir: Path, tmp_path: Path, edit: object, message: str
) -> None:
    folder = _copy(llama_dir, tmp_path / "edited")
    state = load_file(folder / "model.safetensors")
    edit(state)  # type: ignore[operator]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        _load(folder)


def test_iter_checkpoint_streams_every_tensor(sharded_llama_dir: Path) -> None:
    names = [n for n, _ in iter_checkpoint(checkpoint_files(sharded_llama_dir), progress=False)]
    index = json.loads((sharded_llama_dir / "model.safetensors.index.json").read_text())
    assert sorted(names) == sorted(index["weight_map"])


def test_load_tokenizer_and_embedded_name(flotilla_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(flotilla_cache))
    path = resolve_model_path("tiny")
    assert path.parent == flotilla_cache / "models"
    tok = load_tokenizer(path)
    assert tok.encode("hi", add_special_tokens=False) == [104, 105]


@pytest.mark.slow  # ~10 s: two spawned processes each import torch and transformers
def test_two_rank_tensor_parallel_matches_one_rank(checkpoint_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Real collectives (gloo, two processes): row-parallel all-reduce, vocab-split
    embedding, head gather; qwen2's single KV head is replicated on both ranks."""
    import torch.multiprocessing as mp

    from tests.actors.checkpoints import TP_PROMPT, tensor_parallel_worker

    dirs = [str(checkpoint_dirs[arch]) for arch in ("llama", "qwen2", "mistral")]
    mp.spawn(tensor_parallel_worker, args=(2, dirs, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for i, folder in enumerate(dirs):
        model = load_model(folder, dtype=torch.float32, device="cpu", max_model_len=64).model
        expected = step_logits(model, new_dense(model), [(0, TP_PROMPT, 0)])[0]
        for rank in range(2):
            got = torch.load(tmp_path / f"logits{i}-{rank}.pt")
            assert torch.allclose(got, expected, atol=1e-4, rtol=0), (folder, rank, (got - expected).abs().max())
