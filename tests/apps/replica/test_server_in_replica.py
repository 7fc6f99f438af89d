"""An app whose scheduler runs in its replica's process (``scheduler_placement: replica``).

It runs beside the package's default app (scheduler actor) on the same Ray
cluster and Serve instance, under the route prefix ``/in-replica``: the same
greedy text from both, the real ``openai`` client streaming, a disconnect
that frees every page, and the forward thread found inside the replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import psutil
import pytest

from apps.builder import build_app
from scheduling.errors import InvalidParameterError
from tests.serve_harness import ENGINE, TIMEOUT, LiveServer, app_beside, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

APP = "in-replica"
GREEDY = {"model": "tiny", "prompt": "the same text", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def in_replica(live: LiveServer, tiny_model_dir: Path) -> Iterator[LiveServer]:
    args = {**ENGINE, "model": str(tiny_model_dir), "served_model_name": "tiny", "scheduler_placement": "replica"}
    with app_beside(live, args, APP, None) as server:
        yield server


def test_greedy_text_is_the_same_as_the_actor_placed_app(in_replica: LiveServer, live: LiveServer) -> None:
    ok, mine = http(f"{in_replica.url}/v1/completions", GREEDY)
    assert ok == 200, mine
    ok, theirs = http(f"{live.url}/v1/completions", GREEDY)
    assert ok == 200, theirs
    assert mine["usage"] == theirs["usage"] and mine["usage"]["completion_tokens"] == 24
    assert mine["choices"][0]["text"] == theirs["choices"][0]["text"]


def test_the_openai_client_streams_a_chat(in_replica: LiveServer) -> None:
    oai = openai.OpenAI(base_url=f"{in_replica.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    chunks = list(oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    in_replica.assert_pages_free()


def test_a_streaming_disconnect_frees_every_page(in_replica: LiveServer) -> None:
    steps_before = in_replica.stats().num_steps
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx2.Client(timeout=TIMEOUT) as web, \
            web.stream("POST", f"{in_replica.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: the request is running; now hang up
    in_replica.assert_pages_free(10.0)
    assert in_replica.stats().num_steps - steps_before < 1000, "the request was not aborted on disconnect"


def test_the_forward_runs_in_the_replica_process(in_replica: LiveServer) -> None:
    """The replica's process (named by Ray's process title) holds the engine's forward thread."""
    title = f"ray::ServeReplica:{APP}:LLMServer"
    pids = [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(title)]
    assert len(pids) == 1, pids
    threads = {t.read_text().strip() for t in Path(f"/proc/{pids[0]}/task").glob("*/comm")}
    assert "engine-step" in threads, f"no engine-step thread in the replica (pid {pids[0]}): {sorted(threads)}"
    assert in_replica.stats().num_steps > 0  # and its engine answers through the replica


def test_actor_options_with_replica_placement_are_refused_at_build_time(tiny_model_dir: Path) -> None:
    args = {**ENGINE, "model": str(tiny_model_dir), "scheduler_placement": "replica",
            "scheduler_options": {"num_gpus": 1}}
    with pytest.raises(InvalidParameterError) as err:
        build_app(args)
    assert err.value.param == "scheduler_options"
    with pytest.raises(InvalidParameterError) as err:
        build_app({**ENGINE, "model": str(tiny_model_dir), "scheduler_placement": "shard"})
    assert err.value.param == "scheduler_placement"
