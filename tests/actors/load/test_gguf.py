"""The GGUF loader against the gguf package's reference and transformers' own GGUF load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from actors.load.gguf import convert
from actors.load.gguf.convert import ensure_gguf_folder, gguf_source
from actors.load.gguf.dequant import SUPPORTED_TYPES, dequantize
from actors.load.gguf.reader import GGUFError, GGUFTensor, read_gguf
from actors.load.loader import checkpoint_files, resolve_model_path
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.gguf_files import T, encode, write_gguf
from tests.kernel_cache import link_built_kernels

ALL_TYPES = [T[name] for name in SUPPORTED_TYPES]
PROMPT = [256, 72, 101, 108, 108, 111, 263, 264, 9, 300, 40, 41, 42, 266, 267, 268]


def _hf_from_gguf(path: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    per_block = GGML_QUANT_SIZES[qtype][0]
    w = rng.normal(size=(6, 2 * max(per_block, 32))).astype(np.float32)
    raw = encode(w, qtype, rng)
    ref = quants.dequantize(raw, qtype)
    got = dequantize(GGUFTensor("w", qtype, w.shape, raw))
    assert got.dtype == torch.float32 and tuple(got.shape) == w.shape
    assert np.array_equal(got.numpy(), ref)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_converted_folder_equals_transformers_load(gguf_dir: Path, qtype: T) -> None:
    path = write_gguf(gguf_dir / f"llama-{qtype.name}.gguf", qtype, seed=3)
    folder = ensure_gguf_folder(path, root=gguf_dir / "cache")
    ours = load_file(str(folder / "model.safetensors"))
    theirs = _hf_from_gguf(path).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():  # float32 holds every dequantized value: exact
        assert torch.equal(ours[name], tensor), name
    source = gguf_source(folder)
    assert source is not None and source["gguf"] == str(path.resolve())
    expected = {qtype.name: 7 * 2 + 2}  # 7 matrices a layer, embedding, head
    expected["F32"] = expected.get("F32", 0) + 2 * 2 + 1  # norms stay F32
    assert source["tensor_types"] == expected


def test_llm_on_a_gguf_path_matches_transformers(gguf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM("/path/model.gguf")``: greedy tokens and top-20 logprobs equal transformers on the file."""
    link_built_kernels(gguf_dir / "env_cache")  # before the variable moves this process's cache there
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(gguf_dir / "env_cache"))
    path = write_gguf(gguf_dir / "llama-q4k-for-llm.gguf", T.Q4_K, seed=5)
    hf = _hf_from_gguf(path)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    llm = LLM(str(path), max_model_len=64, num_kv_pages=32, dtype="float32", device="cpu")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=20),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    assert out.logprobs is not None
    top = torch.topk(ref, 20)
    assert out.logprobs[0].top_token_ids == top.indices.tolist()
    assert torch.allclose(torch.tensor(out.logprobs[0].top_logprobs), top.values, atol=1e-4)
    # The tokenizer came from the file: same ids as transformers' GGUF tokenizer, and the chat template.
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "hello the world <|end|>"
    assert llm.tokenizer(text)["input_ids"] == theirs(text)["input_ids"]
    assert llm.tokenizer.chat_template == theirs.chat_template is not None
    # Converted once: the second resolve reuses the folder.
    folder = resolve_model_path(str(path))
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(str(path)) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_unsupported_tensor_type_is_named(gguf_dir: Path) -> None:
    path = write_gguf(gguf_dir / "llama-q5k.gguf", T.Q5_K)
    with pytest.raises(GGUFError, match="GGML type Q5_K.*supported types: F32, F16, BF16") as err:
        ensure_gguf_folder(path, root=gguf_dir / "cache")
    assert err.value.param == "model"
    assert not list((gguf_dir / "cache" / "models").glob("llama-q5k*"))  # nothing half-written


def test_unsupported_architecture_is_named(gguf_dir: Path) -> None:
    path = write_gguf(gguf_dir / "falcon.gguf", T.F16, architecture="falcon")
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported; supported: llama"):
        ensure_gguf_folder(path, root=gguf_dir / "cache")


@pytest.mark.parametrize("keep", [0.5, 0.01, 12 / 1e9])
def test_truncated_file_is_a_clear_error(gguf_dir: Path, keep: float) -> None:
    whole = write_gguf(gguf_dir / f"whole-{keep}.gguf", T.Q8_0).read_bytes()
    cut = gguf_dir / f"cut-{keep}.gguf"
    cut.write_bytes(whole[: max(12, int(len(whole) * keep))])
    with pytest.raises(GGUFError, match="not a complete GGUF file") as err:
        read_gguf(cut)
    assert str(cut) in str(err.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf at all")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        resolve_model_path(str(fake))


def test_unknown_tensor_name_is_named(gguf_dir: Path) -> None:
    path = gguf_dir / "extra.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", 256), ("block_count", 1), ("feed_forward_length", 512),
                       ("head_count", 4), ("context_length", 64)):
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((256, 256), np.float32))
    writer.add_tensor("blk.0.mystery.weight", np.zeros((4,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'blk.0.mystery.weight' has no Llama counterpart"):
        ensure_gguf_folder(path, root=gguf_dir / "cache")


def test_large_models_convert_into_shards(gguf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model bigger than one shard is written as an indexed set of shards that loads the same."""
    path = write_gguf(gguf_dir / "sharded-q8.gguf", T.Q8_0, seed=4)
    whole = load_file(str(ensure_gguf_folder(path, root=gguf_dir / "cache_whole") / "model.safetensors"))
    monkeypatch.setattr(convert, "SHARD_BYTES", 600_000)  # ~ two of the 512x256 float32 matrices
    folder = ensure_gguf_folder(path, root=gguf_dir / "cache_sharded")
    files = checkpoint_files(folder)
    assert len(files) > 3 and not (folder / "model.safetensors").exists()
    sharded: dict[str, torch.Tensor] = {}
    for file in files:
        sharded.update(load_file(str(file)))
    assert set(sharded) == set(whole) and all(torch.equal(sharded[k], whole[k]) for k in whole)
