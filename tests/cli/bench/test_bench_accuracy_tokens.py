"""``bench accuracy``'s token-level figures: token_top1_agreement and perplexity_ratio (``cli.bench.accuracy.forced``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.load.loader import load_tokenizer
from cli.bench.accuracy.forced import (
    HELDOUT_PATH,
    HeldoutScore,
    heldout_windows,
    perplexity_ratio,
    read_heldout,
    token_nll,
    top1_matches,
)
from cli.bench.accuracy.run import run
from cli.main import main
from scheduling.errors import InvalidParameterError

WORKLOAD = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6},
    {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 6},
]
# Byte-level for the tiny model: 200 bytes are 200 tokens, in windows of max_model_len (64) tokens.
HELDOUT = ("Down, down, down. There was nothing else to do, so Alice soon began talking again. "
           "Dinah will miss me very much to-night, I should think! I hope they will remember her "
           "saucer of milk at tea-time. Do cats eat bats, I wonder?")[:200]


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    workload, heldout = tmp_path / "w.jsonl", tmp_path / "heldout.txt"
    workload.write_text("".join(json.dumps(r) + "\n" for r in WORKLOAD))
    heldout.write_text(HELDOUT)
    return workload, heldout


def _logits(rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_top1_agreement_counts_positions_whose_argmax_moved() -> None:
    base = _logits(8, 13)
    assert top1_matches(base, base.clone()).all()
    assert top1_matches(base, base * 0.5 + 1.0).all()  # a flatter distribution keeps its argmax
    moved = base.clone()
    for row in (1, 5):  # lift the runner-up above the top token in two rows
        second = int(base[row].topk(2).indices[1])
        moved[row, second] = base[row].max() + 1.0
    assert top1_matches(base, moved).tolist() == [i not in (1, 5) for i in range(8)]
    with pytest.raises(InvalidParameterError) as e:
        top1_matches(base, base[:, :12])
    assert e.value.param == "against"


def test_perplexity_ratio_is_one_for_the_same_model_and_above_one_for_a_flatter_one() -> None:
    base = _logits(40, 17)
    targets = base.argmax(dim=-1).tolist()
    uniform = token_nll(torch.zeros(3, 17), [0, 5, 16])
    assert uniform.dtype == torch.float64 and torch.allclose(uniform, torch.full((3,), math.log(17), dtype=torch.float64))
    scored = HeldoutScore(token_nll(base, targets), base.argmax(dim=-1))
    assert perplexity_ratio(scored, HeldoutScore(scored.nll.clone(), scored.argmax.clone())) == 1.0
    # Halving every logit keeps each argmax and lowers its probability: higher perplexity, equal top-1.
    flat = HeldoutScore(token_nll(base * 0.5, targets), (base * 0.5).argmax(dim=-1))
    ratio = perplexity_ratio(scored, flat)
    assert ratio > 1.0 and ratio == pytest.approx(flat.perplexity / scored.perplexity, rel=1e-12)
    assert torch.equal(flat.argmax, scored.argmax)


def test_heldout_windows_cut_the_text_and_drop_a_lone_last_token(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("abcdefghij", add_special_tokens=False)
    assert len(ids) == 10  # byte-level
    assert heldout_windows(tok, "abcdefghij", 4) == [ids[0:4], ids[4:8], ids[8:10]]
    assert heldout_windows(tok, "abcdefghij", 3) == [ids[0:3], ids[3:6], ids[6:9]]  # ids[9:] scores nothing
    with pytest.raises(InvalidParameterError) as e:
        heldout_windows(tok, "abc", 1)
    assert e.value.param == "max_model_len"


def test_the_heldout_text_is_read_or_refused_naming_it(tmp_path: Path) -> None:
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n")
    for path in (tmp_path / "missing.txt", blank):
        with pytest.raises(InvalidParameterError) as e:
            read_heldout(path)
        assert e.value.param == "heldout"
    shipped = read_heldout(HELDOUT_PATH)
    assert shipped.startswith("CHAPTER I. Down the Rabbit-Hole") and len(shipped.split()) > 2000
    readme = (HELDOUT_PATH.parent / "README.md").read_text()
    assert all(s in readme for s in ("Lewis Carroll", "public domain", "heldout_prose.txt"))


def test_an_int8_kv_candidate_moves_the_teacher_forced_figures(tiny_model_dir: Path,
                                                             files: tuple[Path, Path]) -> None:
    # A teacher-forced prefill that attended over its in-step float K/V instead of the
    # quantized pages would leave every figure equal to the base's (cli.bench.accuracy.forced's docstring).
    workload, heldout = files
    out = run(str(tiny_model_dir), workload, against={"kv_cache_dtype": "int8"}, kv_budget_mib=8,
              batch1_tokens=0, max_model_len=64, max_num_seqs=2, heldout=heldout)
    h = out["heldout"]
    assert (h["window"], h["tokens"], h["path"]) == (64, 200 - 4, str(heldout))  # 4 windows, first tokens unscored
    assert out["mean_kl"] > 0.0
    assert out["perplexity_ratio"] != 1.0
    assert out["perplexity_ratio"] == pytest.approx(h["against_perplexity"] / h["base_perplexity"], rel=1e-9)
    assert 0.0 <= out["token_top1_agreement"] <= 1.0 and 0.0 <= h["top1_agreement"] <= 1.0
    assert out["token_top1_agreement"] == out["token_top1_matches"] / out["output_tokens"]


def test_the_command_prints_the_token_level_keys(tiny_model_dir: Path, files: tuple[Path, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    workload, heldout = files
    args = ["bench", "accuracy", "--model", str(tiny_model_dir), "--workload", str(workload),
            "--against", '{"kv_cache_dtype": "fp8"}', "--max-model-len", "64", "--kv-budget-mib", "8",
            "--batch1-tokens", "0", "--heldout", str(heldout), "--no-progress"]
    assert main([*args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert isinstance(out["token_top1_agreement"], float) and isinstance(out["perplexity_ratio"], float)
    assert out["heldout"]["path"] == str(heldout)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert f"token_top1_agreement {out['token_top1_agreement']:.5f} ({out['token_top1_matches']} of" in table
    assert f"perplexity_ratio {out['perplexity_ratio']:.5f}" in table
