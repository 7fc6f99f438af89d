"""A disaggregated app (``pd``) on a real local Serve: long prompts prefill on the prefill pool and decode on the
decode replica with the same greedy output as in process; short ones stay local; a dead or hung prefill pool is a
clear 503 and leaves no page behind."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import pytest
import ray
from openai import APIStatusError, OpenAI

from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.apps.pd_harness import PDServer, pd_app, shared_pd
from tests.serve_harness import ACTOR_NAMESPACE, TIMEOUT, LiveServer

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

LONG = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i) for i in range(4)]
SHORT = "hi"


@pytest.fixture
def pd(live: LiveServer, tiny_model_dir: Path) -> PDServer:
    """The session's shared pd app beside the package's app (``shared_pd``): this test only sends requests."""
    return shared_pd(live, tiny_model_dir)


def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=TIMEOUT)


def test_long_prompts_prefill_remotely_with_the_colocated_output(pd: PDServer, tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, dtype="float32",
              device="cpu")
    expected = [o.outputs[0].text for o in llm.generate(
        LONG, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    llm.shutdown()
    before = pd.prefill.stats().num_steps
    server = pd.decode
    remote_before = _remote_prefills(server)  # the app is shared: its counter is read as a change
    api = client(server)
    got = [api.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0.0,
                                  extra_body={"ignore_eos": True}).choices[0].text for p in LONG]
    assert got == expected
    after = pd.prefill.stats().num_steps
    assert after > before  # the prompts were computed on the prefill pool
    # A short prompt stays on the decode replica.
    api.completions.create(model="tiny", prompt=SHORT, max_tokens=4, temperature=0.0)
    assert pd.prefill.stats().num_steps == after
    # Streaming through the remote path: the first token arrives as a delta like any other.
    chunks = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG[0]}],
                                              max_tokens=8, temperature=0.0, stream=True))
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
    pd.assert_pages_free()
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=TIMEOUT) as resp:
        metrics = resp.read().decode()
    assert "flotilla:pd_remote_prefills_total" in metrics and "flotilla:pd_kv_transfer_seconds_bucket" in metrics
    remote = next(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("flotilla:pd_remote_prefills_total"))
    assert remote - remote_before == len(LONG) + 1  # the completions and the streamed chat


def _remote_prefills(server: LiveServer) -> float:
    """The decode replica's ``flotilla:pd_remote_prefills_total`` (0 before its first)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=TIMEOUT) as resp:
        metrics = resp.read().decode()
    return next((float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("flotilla:pd_remote_prefills_total")), 0.0)


def test_a_dead_prefill_pool_is_a_clear_503_and_frees_everything(live: LiveServer, tiny_model_dir: Path) -> None:
    # Its own app: the prefill actor it kills is no other test's.
    with pd_app(live, tiny_model_dir, "pd-dead") as dead:
        assert dead.prefill.actor_name is not None
        ray.kill(ray.get_actor(dead.prefill.actor_name, namespace=ACTOR_NAMESPACE), no_restart=True)
        api = client(dead.decode)
        with pytest.raises(APIStatusError) as info:
            api.completions.create(model="tiny", prompt=LONG[0], max_tokens=8, temperature=0.0)
        assert info.value.status_code == 503 and "prefill pool" in str(info.value)
        # Short prompts still decode here.
        out = api.completions.create(model="tiny", prompt=SHORT, max_tokens=4, temperature=0.0)
        assert out.choices[0].finish_reason in ("stop", "length")
        dead.decode.assert_pages_free()


def test_a_hung_prefill_replica_times_out_to_a_503_and_frees_everything(live: LiveServer, tiny_model_dir: Path) -> None:
    """The prefill scheduler stopped (SIGSTOP: alive, answering nothing): each attempt ends after
    ``remote_prefill_timeout_s`` and is cancelled; once the process wakes, both replicas end with every page free."""
    with pd_app(live, tiny_model_dir, "pd-hung", remote_prefill_timeout_s=1.0) as hung:
        assert hung.prefill.actor_name is not None
        actor = ray.get_actor(hung.prefill.actor_name, namespace=ACTOR_NAMESPACE)
        pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=TIMEOUT)
        api = client(hung.decode)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(APIStatusError) as info:
                api.completions.create(model="tiny", prompt=LONG[0], max_tokens=8, temperature=0.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert info.value.status_code == 503 and "no prefill result within 1.0 s" in str(info.value), info.value
        hung.assert_pages_free()
        # Awake again, it serves: the next long prompt prefills there.
        steps = hung.prefill.stats().num_steps
        api.completions.create(model="tiny", prompt=LONG[1], max_tokens=4, temperature=0.0)
        assert hung.prefill.stats().num_steps > steps
        hung.assert_pages_free()
