"""``flotilla serve --model smollm2-135m`` as a user runs it, asked by the official openai client.

The console script runs in its own process (its own local Ray cluster, token
auth off for it) with the session's converted SmolLM2 folder as its model
cache; every process it started is gone at the end (checked by pid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.serve_harness import free_port, http

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"
START_TIMEOUT_S = 240.0


def _wait_serving(url: str, proc: psutil.Popen, log: Path) -> None:
    """Until ``/health`` answers 200; fails at once if the server process exits. Polls with backoff."""
    deadline, pause = time.monotonic() + START_TIMEOUT_S, 0.05
    while True:
        assert proc.poll() is None, f"flotilla serve exited {proc.returncode}: {log.read_text()[-3000:]}"
        with contextlib.suppress(OSError, ValueError):
            if http(f"{url}/health")[0] == 200:
                return
        assert time.monotonic() < deadline, f"not serving in time: {log.read_text()[-3000:]}"
        time.sleep(pause)  # backoff between polls, not synchronisation: the loop checks the state
        pause = min(pause * 2, 1.0)


@pytest.fixture()
def served_smollm2(smollm2_dir: Path, tmp_path: Path) -> Iterator[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "FLOTILLA_CACHE_DIR": str(smollm2_dir.parent.parent)}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    log = tmp_path / "serve.log"
    flotilla = str(BIN / "flotilla") if (BIN / "flotilla").exists() else (shutil.which("flotilla") or "flotilla")
    with log.open("w") as out:
        proc = psutil.Popen([flotilla, "serve", "--model", "smollm2-135m", "--port", str(port),
                             "--cpu-threads", "1", "--max-model-len", "1024", "--num-kv-pages", "128"],
                            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_serving(url, proc, log)
        yield url
    finally:
        procs = [proc, *proc.children(recursive=True)] if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)  # the CLI shuts Serve and its Ray cluster down
        _, alive = psutil.wait_procs(procs, timeout=60)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _, alive = psutil.wait_procs(alive, timeout=10)
        assert not alive, f"processes still running: {[p.pid for p in alive]}"


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
