"""The embedded ``tiny``/``small`` models: size, tokenizer, template, determinism, HF parity."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.load.embedded import EMBEDDED_MODELS, SPECS, ensure_embedded_model, spec_hash
from actors.load.loader import load_model, load_tokenizer
from actors.tokenizing import bytes_to_unicode
from scheduling.errors import InvalidParameterError
from tests.actors.checkpoints import greedy, hf_greedy, hf_logits, new_dense, step_logits


def test_sizes() -> None:
    assert EMBEDDED_MODELS == ("tiny", "small")
    assert 3.3e6 < SPECS["tiny"].num_parameters() < 3.5e6
    assert 95e6 < SPECS["small"].num_parameters() < 105e6


def test_tiny_loads_with_the_advertised_size(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir), dtype=torch.float32, device="cpu", max_model_len=256).model
    assert sum(p.numel() for p in model.parameters()) == SPECS["tiny"].num_parameters()
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (4, 8, 4, 32)


def test_byte_ids_and_round_trip(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert len(tok) == 512
    alphabet = bytes_to_unicode()
    assert [tok.convert_tokens_to_ids(alphabet[b]) for b in range(256)] == list(range(256))
    rng = random.Random(0)
    texts = [
        "".join(chr(c) for c in range(256)),
        "héllo wörld 日本語 🚀 Ελληνικά\n\t  x  ",
        "".join(chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(300)),
        "<s> is literal text here only when not matched; <|user|> is special",
    ]
    for text in texts[:3]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    ids = tok.encode(texts[3], add_special_tokens=False)
    assert 256 in ids and 260 in ids  # specials in text map to their own ids
    assert tok.decode(ids, skip_special_tokens=True) == texts[3].replace("<s>", "").replace("<|user|>", "")


def test_special_tokens(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    roles = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    assert tok.convert_tokens_to_ids(roles) == [259, 260, 261, 262]
    assert tok.decode([104, 105, 262, 300, 511], skip_special_tokens=True) == "hi"


def test_chat_template_renders(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:3] == [256, 259, 10] and ids[-2:] == [261, 10]


def test_weights_are_deterministic_and_build_once(tmp_path: Path, tiny_dir: Path) -> None:
    first = ensure_embedded_model("tiny", root=tmp_path / "a")
    with ThreadPoolExecutor(2) as pool:  # two concurrent builders of one cache
        second, third = pool.map(lambda _: ensure_embedded_model("tiny", root=tmp_path / "b"), range(2))
    assert second == third and first.name == second.name == tiny_dir.name == f"tiny-{spec_hash('tiny')}"
    assert [p.name for p in second.parent.iterdir()] == [second.name]  # no temp folders left
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes() == (tiny_dir / name).read_bytes()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model("tiny", root=tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_dir_from_environment(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tiny_dir.parent.parent))
    assert ensure_embedded_model("tiny") == tiny_dir


def test_unknown_embedded_name() -> None:
    with pytest.raises(InvalidParameterError, match="'huge'.*tiny, small") as err:
        ensure_embedded_model("huge")
    assert err.value.param == "model"


def test_tiny_matches_hf(tiny_dir: Path) -> None:
    ours = load_model(str(tiny_dir), dtype=torch.float32, device="cpu", max_model_len=256).model
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager")
    tok = load_tokenizer(tiny_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there!"}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    logits = step_logits(ours, new_dense(ours), [(0, prompt, 0)])[0]
    expected = hf_logits(hf, prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert expected[-1].std() > 0.5  # logits are spread, not near-uniform
    assert greedy(ours, new_dense(ours), prompt, 16) == hf_greedy(hf, prompt, 16)
