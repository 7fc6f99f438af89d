"""Content digests of weight files (``actors.load.weights_digest``): what cached KV names weights by.

A digest follows the bytes, not the path, the name or the mtime, and a
restart reads it back from the on-disk cache rather than hashing again; a
model's KV blocks on disk are found again only by the weights that made them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import IO

import pytest

from actors.config import EngineConfig
from actors.engine.kv_tiers import model_identity
from actors.load import weights_digest
from actors.load.weights_digest import adapter_digest, file_digest, model_digest
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import write_llama_with_tokenizer

ENGINE: dict[str, object] = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 128,
                             "dtype": "float32", "device": "cpu", "num_kv_pages": 32}  # fmt: skip
PROMPT = [7 + (j * 5) % 190 for j in range(70)]  # four full pages, and a last token to compute
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A private digest cache; the files each call really hashed, in order."""
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []
    real = hashlib.file_digest

    def counting(f: IO[bytes], name: str) -> hashlib._Hash:
        calls.append(f.name if isinstance(f.name, str) else repr(f.name))
        return real(f, name)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    return calls


def test_a_settled_file_is_hashed_once_and_again_when_replaced(
    tmp_path: Path, hashed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights_digest, "SETTLED_NS", 0)  # the files here were written just now
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 4096)
    want = hashlib.sha256(b"a" * 4096).hexdigest()
    assert file_digest(f) == want and file_digest(f) == want
    assert len(hashed) == 1  # the second call (a restarted process alike: the cache is on disk) read no byte
    # A fine-tune renamed over it: same size, same mtime put back; another file, so hashed again.
    st = f.stat()
    new = tmp_path / "new.safetensors"
    new.write_bytes(b"b" * 4096)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, f)
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert file_digest(f) == hashlib.sha256(b"b" * 4096).hexdigest() and len(hashed) == 2


def test_a_file_rewritten_in_place_with_its_old_stamp_is_never_served_a_stale_digest(
    tmp_path: Path, hashed: list[str]
) -> None:
    """Rewritten in place within a timestamp tick, a file may keep every stamp: a file that recent is not cached."""
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 4096)
    assert file_digest(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    st = f.stat()
    f.write_bytes(b"b" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(f) == hashlib.sha256(b"b" * 4096).hexdigest()
    assert not list((tmp_path / "cache" / "digests").glob("*.json"))  # nothing cached: both were hashed


def test_adapter_digests_follow_the_files_not_the_folder(tmp_path: Path, hashed: list[str]) -> None:
    one, same, other = (tmp_path / n for n in ("one", "same", "other"))
    for folder, weights in ((one, b"w1"), (same, b"w1"), (other, b"w2")):
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 8}')
        (folder / "adapter_model.safetensors").write_bytes(weights)
    assert adapter_digest(one) == adapter_digest(same) != adapter_digest(other)
    (same / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 4}')
    assert adapter_digest(one) != adapter_digest(same)


def test_the_model_identity_follows_weights_swapped_in_place(tmp_path: Path, hashed: list[str]) -> None:
    """A fine-tune copied over the old files at the same path, config.json unchanged: another identity
    (before, the identity was the model setting, its quantization and config.json's hash: unchanged)."""
    folder = write_llama_with_tokenizer(tmp_path / "model", seed=0)
    config = EngineConfig(model=str(folder), device="cpu")
    before, config_json = model_identity(config, folder), (folder / "config.json").read_bytes()
    tuned = write_llama_with_tokenizer(tmp_path / "tuned", seed=1)
    shutil.copyfile(tuned / "model.safetensors", folder / "model.safetensors")
    assert (folder / "config.json").read_bytes() == config_json
    assert model_identity(config, folder) != before
    assert model_digest(folder) == model_digest(tuned)  # the same weights elsewhere: the same digest


def _generate(llm: LLM) -> tuple[list[int], int]:
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert llm.engine.kv_tiers is None or llm.engine.policy.stats.tier_hit_tokens == out.num_cached_tokens
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_base_weights_swapped_in_place_meet_none_of_the_old_blocks_on_disk(tmp_path: Path) -> None:
    """An engine fills a disk folder; a fine-tune is copied over its weights at the same path, config.json
    unchanged; the restarted engine gets no block of the old weights (before, it got every full page, and
    KV of the old weights under the new) and the tokens of the new weights; its own blocks come back."""
    folder = write_llama_with_tokenizer(tmp_path / "model", seed=0)
    tuned = write_llama_with_tokenizer(tmp_path / "tuned", seed=1)
    want = _generate(LLM(model=str(tuned), **ENGINE))[0]
    offload = {"disk_bytes": 1 << 24, "disk_path": str(tmp_path / "blocks")}
    old = LLM(model=str(folder), kv_offload=offload, **ENGINE)
    old_tokens, _ = _generate(old)
    assert old_tokens != want and old.engine.kv_tiers is not None
    old.engine.kv_tiers.wait_for_saves()
    assert list((tmp_path / "blocks").glob("*.kvb"))
    old.shutdown()

    config_json = (folder / "config.json").read_bytes()
    shutil.copyfile(tuned / "model.safetensors", folder / "model.safetensors")
    assert (folder / "config.json").read_bytes() == config_json
    new = LLM(model=str(folder), kv_offload=offload, **ENGINE)
    assert _generate(new) == (want, 0)
    assert new.engine.kv_tiers is not None
    new.engine.kv_tiers.wait_for_saves()
    new.shutdown()
    again = LLM(model=str(folder), kv_offload=offload, **ENGINE)
    assert _generate(again) == (want, (len(PROMPT) - 1) // 16 * 16)
    again.shutdown()
