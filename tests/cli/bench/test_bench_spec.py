"""``flotilla bench spec``: the chat workload reader, the edit/questions workloads, and one tiny run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.bench.spec.run import SpecCounters, format_table, run
from cli.bench.spec.workloads import edit_requests, questions_requests, write_workloads
from cli.bench.workload import chat_texts, read_workload, workload_prompt_ids
from cli.main import main
from scheduling.errors import InvalidParameterError
from scheduling.scheduler_stats import SchedulerStats

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 4}
IDS = {"prompt_token_ids": [5, 6, 7], "max_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _write(tmp_path: Path, lines: list[Any]) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


class FakeTokenizer:
    """Records conversations; a conversation's ids are its message count and content lengths."""

    def apply_chat_template(self, conv: list[dict[str, str]], *, add_generation_prompt: bool,
                            tokenize: bool) -> list[int]:
        assert add_generation_prompt and tokenize
        return [len(conv), *(len(m["content"]) for m in conv)]


def test_reader_takes_chat_and_token_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, [CHAT, "", IDS])
    reqs = read_workload(path, chat=True)
    assert reqs == [CHAT, IDS]
    assert workload_prompt_ids(reqs, FakeTokenizer()) == [[2, 9, 2], [5, 6, 7]]


def test_reader_refuses_chat_lines_unless_asked(tmp_path: Path) -> None:
    path = _write(tmp_path, [IDS, CHAT])
    with pytest.raises(InvalidParameterError, match=r"w\.jsonl:2: a chat line") as e:
        read_workload(path)
    assert e.value.param == "workload"


@pytest.mark.parametrize(("bad", "why"), [
    ("{not json", "Expecting"),
    ({"max_tokens": 3}, "exactly one of"),
    ({**IDS, "messages": CHAT["messages"]}, "exactly one of"),
    ({"messages": [], "max_tokens": 3}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 3}, r"messages\[0\]\.role"),
    ({"messages": [{"role": "user", "content": ""}], "max_tokens": 3}, r"messages\[0\]\.content"),
    ({"messages": [{"role": "user"}], "max_tokens": 3}, "exactly 'role' and 'content'"),
    ({"messages": CHAT["messages"], "max_tokens": 0}, "max_tokens >= 1"),
    ({"prompt_token_ids": [], "max_tokens": 3}, "non-empty"),
    ({"prompt_token_ids": ["a"], "max_tokens": 3}, "integers"),
    ([1, 2], "JSON object"),
])
def test_a_bad_line_is_an_error_naming_it(tmp_path: Path, bad: Any, why: str) -> None:
    path = _write(tmp_path, [CHAT, IDS, bad])
    with pytest.raises(InvalidParameterError, match=rf"w\.jsonl:3: .*{why}"):
        read_workload(path, chat=True)


def test_an_empty_workload_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="no requests"):
        read_workload(_write(tmp_path, [""]), chat=True)


def test_workloads_are_deterministic_for_a_seed() -> None:
    assert edit_requests(12, seed=3) == edit_requests(12, seed=3)
    assert questions_requests(12, seed=3) == questions_requests(12, seed=3)
    assert edit_requests(12, seed=3) != edit_requests(12, seed=4)
    assert questions_requests(12, seed=3) != questions_requests(12, seed=4)


def _differing_words(a: str, b: str) -> int:
    wa, wb = a.split(" "), b.split(" ")
    return abs(len(wa) - len(wb)) + sum(x != y for x, y in zip(wa, wb, strict=False))


def test_edit_prompts_hold_the_text_the_reply_copies() -> None:
    reqs = edit_requests(32, seed=0)
    assert len(reqs) == 32 and all(128 <= r["max_tokens"] <= 192 for r in reqs)
    kinds = set()
    for r in reqs:
        [msg] = r["messages"]
        instruction, *paragraphs = msg["content"].split("\n\n")
        kinds.add(instruction.split()[0])
        assert 1 <= len(paragraphs) <= 2
        for p in paragraphs:  # each a passage, at most a few typos away
            assert min(_differing_words(p, passage) for passage in chat_texts().passages) <= 4
    assert kinds == {"Repeat", "Fix", "Add"}


def test_questions_do_not_repeat_before_every_one_is_asked() -> None:
    instructions = chat_texts().instructions
    reqs = questions_requests(len(instructions) + 2, seed=0)
    contents = [r["messages"][0]["content"] for r in reqs]
    assert sorted(contents[: len(instructions)]) == sorted(instructions)
    assert all(r["max_tokens"] == 128 for r in reqs)


def test_spec_workloads_command_writes_readable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "spec-workloads", "--out-dir", str(tmp_path), "--num-requests", "5", "--seed", "7"]) == 0
    paths = json.loads(capsys.readouterr().out)
    for name in ("edit", "questions"):
        assert read_workload(paths[name], chat=True) == {"edit": edit_requests, "questions": questions_requests}[
            name](5, 7)
    with pytest.raises(InvalidParameterError, match="num_requests"):
        write_workloads(tmp_path, num_requests=0)


def test_counters_are_deltas_and_never_divide_by_zero() -> None:
    stats = SchedulerStats()
    start = SpecCounters.of(stats)
    assert start.since(start).figures()["acceptance_rate"] == 0.0
    assert start.since(start).figures()["mean_accepted_tokens"] == 0.0
    stats.record_draft(3, 1)
    mid = SpecCounters.of(stats)
    stats.record_draft(4, 2)
    stats.record_draft(4, 0)
    figs = SpecCounters.of(stats).since(mid).figures()
    assert (figs["spec_num_drafts"], figs["spec_num_draft_tokens"], figs["spec_num_accepted_tokens"]) == (2, 8, 2)
    assert figs["spec_num_accepted_tokens_per_pos"] == [1, 1, 0, 0]
    assert figs["acceptance_per_pos"] == [0.5, 0.5, 0.0, 0.0]
    assert (figs["acceptance_rate"], figs["mean_accepted_tokens"]) == (0.25, 1.0)


def test_run_compares_both_engines_on_a_mixed_workload(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _write(tmp_path, [
        {"messages": [{"role": "user", "content": "abc abc abc abc"}], "max_tokens": 8},
        {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8},
        {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 8},
    ])
    out = run(str(tiny_model_dir), path, speculative_config=json.dumps(NGRAM), runs=1, max_num_seqs=2,
              max_model_len=256, cpu_threads=1)
    for key in ("workload", "model", "requests", "max_num_seqs", "speculative_config", "baseline_output_tok_per_s",
                "spec_output_tok_per_s", "speedup", "baseline_output_tokens", "spec_output_tokens",
                "baseline_engine_steps", "spec_engine_steps", "spec_num_drafts", "spec_num_draft_tokens",
                "spec_num_accepted_tokens", "spec_num_accepted_tokens_per_pos", "acceptance_rate",
                "mean_accepted_tokens", "acceptance_per_pos", "runs"):
        assert key in out, key
    assert out["same_tokens"] is True
    assert (out["requests"], out["max_num_seqs"], out["num_runs"], len(out["runs"])) == (3, 2, 1, 1)
    assert out["speculative_config"]["num_speculative_tokens"] == 3
    assert out["baseline_output_tokens"] == out["spec_output_tokens"] >= 8  # the id line ignores EOS
    assert out["baseline_output_tok_per_s"] > 0 and out["spec_output_tok_per_s"] > 0
    assert 0.0 <= out["acceptance_rate"] <= 1.0
    assert "same_tokens True" in format_table(out)
    json.dumps(out)  # JSON-ready


def test_run_refuses_bad_settings_before_loading(tmp_path: Path) -> None:
    path = _write(tmp_path, [IDS])
    with pytest.raises(InvalidParameterError) as e:
        run("no-such-model", path, speculative_config=NGRAM, runs=0)
    assert e.value.param == "runs"
    with pytest.raises(InvalidParameterError) as e:
        run("no-such-model", path, speculative_config='{"method": "ngram"}')
    assert e.value.param == "speculative_config"
