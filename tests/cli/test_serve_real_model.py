"""``flotilla serve --model smollm2-135m`` as a user runs it, asked by the official openai client.

The console script runs in its own process (its own local Ray cluster, token
auth off for it) with the session's converted SmolLM2 folder as its model
cache; every process it started is gone at the end (checked by pid).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from scripts import openai_surface_check as check
from tests.cli.cli_server import cli_server
from tests.kernel_cache import link_built_kernels


@pytest.fixture(scope="module")
def served_smollm2(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--model", "smollm2-135m", "--cpu-threads", "1", "--max-model-len", "1024", "--num-kv-pages", "128"]
    cache = smollm2_dir.parent.parent
    link_built_kernels(cache)  # the server's cache is the model's
    with cli_server(args, tmp_path_factory.mktemp("smollm2_serve") / "serve.log", env={"FLOTILLA_CACHE_DIR": str(cache)}) as (url, _):
        yield url


def test_the_real_model_answers_through_the_openai_client(served_smollm2: str) -> None:
    client = openai.OpenAI(base_url=f"{served_smollm2}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        temperature=0, max_tokens=48)
    choice = reply.choices[0]
    assert "Tokyo" in (choice.message.content or ""), choice.message.content
    assert choice.finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert reply.model == "smollm2-135m" and reply.usage is not None and reply.usage.prompt_tokens > 20
    # Streaming gives the same greedy text, chunk by chunk.
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        temperature=0, max_tokens=48, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == choice.message.content



def test_responses_and_embeddings_through_the_openai_client(served_smollm2: str, smollm2_dir: Path) -> None:
    """Step 28's checks (``scripts/openai_surface_check.py``): each comparison holds, vectors within 1e-5."""
    client = openai.OpenAI(base_url=f"{served_smollm2}/v1", api_key="unused", max_retries=0, timeout=120)
    report = check.responses_report(client, "smollm2-135m")
    assert "Tokyo" in report["plain_text"] and report["plain_status"] == "completed", report
    assert report["stream_first_last"] == ["response.created", "response.completed"], report
    assert report["stream_deltas_equal_plain"] and report["stream_final_equals_plain"], report
    assert report["json_schema_valid"] and report["tool_arguments_valid"], report
    assert report["second_turn_equals_whole_history"] and "Paris" in report["second_turn_text"], report
    embeddings = check.embeddings_report(client, "smollm2-135m", smollm2_dir)
    assert embeddings["max_abs_diff_batched"] <= 1e-5 and embeddings["max_abs_diff_one_by_one"] <= 1e-5, embeddings
    assert check.bad_input(served_smollm2) == {"status": 400, "param": "input"}
    assert check.held(served_smollm2) == {"num_requests_running": 0, "num_requests_waiting": 0,
                                          "kv_cache_usage_perc": 0}
