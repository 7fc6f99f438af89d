"""LoRA through the OpenAI API: two replicas, adapters picked by ``model``, loaded and unloaded at run time.

An app beside the package's default one: 2 replicas (schedulers in the
replica processes), adapter ``a`` from ``lora_modules``. The real ``openai``
client picks the base or an adapter by ``model`` and gets what the offline
engine gives with that adapter; ``/v1/models`` lists the adapters with their
``parent``; ``POST /v1/load_lora_adapter`` adds ``b`` for every replica and
refuses a bad folder (400 naming ``lora_path``); after
``/v1/unload_lora_adapter`` the name is 404; ``/metrics`` counts requests per
adapter; every page is free at the end.
"""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import ray

from apps.llm import LLM
from apps.replica.lora import CATALOG_NAMESPACE
from flotilla.prometheus import parse_prometheus
from scheduling.sampling_params import SamplingParams
from tests.actors.lora_fixtures import PROJECTION_SETS, make_peft_adapter
from tests.serve_harness import ENGINE, TIMEOUT, LiveServer, app_beside, http, poll_until

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

APP = "lora"
PROMPTS = [[40 + i, 7, 99, 3 * i + 5, 12, 200 - i] for i in range(4)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: make_peft_adapter(tiny_model_dir, root / name, targets=PROJECTION_SETS[targets], rank=8,
                                    alpha=16, seed=seed)
            for name, targets, seed in (("a", "all", 1), ("b", "attention", 2))}  # fmt: skip


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, list[str]]:
    """Greedy text of every prompt under the base and each adapter, from the offline engine."""
    llm = LLM(str(tiny_model_dir), **{**ENGINE, "device": "cpu"}, enable_lora=True, max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        llm.load_lora(name, str(path))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {name: [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False, lora=lora)]
            for name, lora in (("tiny", None), ("a", "a"), ("b", "b"))}  # fmt: skip


@pytest.fixture(scope="module")
def lora_app(live: LiveServer, tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[LiveServer]:
    args = {**ENGINE, "model": str(tiny_model_dir), "served_model_name": "tiny", "scheduler_placement": "replica",
            "num_replicas": 2, "max_lora_rank": 8, "max_loras": 2, "lora_modules": {"a": str(adapters["a"])},
            "runtime_lora_updates": True,
            "replica_options": {"num_cpus": 0.5}}  # fmt: skip
    with app_beside(live, args, APP, None) as server:
        yield server
    ray.kill(ray.get_actor(f"lora-catalog:{APP}", namespace=CATALOG_NAMESPACE), no_restart=True)


def test_adapters_by_model_load_unload_and_metrics(
    lora_app: LiveServer, adapters: dict[str, Path], offline: dict[str, list[str]]
) -> None:
    client = openai.OpenAI(base_url=f"{lora_app.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    detok = offline
    assert len({str(v) for v in detok.values()}) == 3  # base and both adapters differ
    assert _texts(client, "tiny") == detok["tiny"]
    assert _texts(client, "a") == detok["a"]
    status, body = http(f"{lora_app.url}/v1/models")
    assert status == 200
    cards = {c["id"]: c for c in body["data"]}
    assert set(cards) == {"tiny", "a"} and cards["a"]["parent"] == "tiny" and "parent" not in cards["tiny"]
    assert str(adapters["a"]) not in str(body)  # names only: folders are the server's
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=2)
    # Load b at run time: refused with a bad folder, then served by every replica.
    status, body = http(f"{lora_app.url}/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/nonexistent"})
    assert status == 400 and body["error"]["param"] == "lora_path", body
    status, body = http(f"{lora_app.url}/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert status == 200 and body["id"] == "b" and body["parent"] == "tiny", body
    status, body = http(f"{lora_app.url}/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert status == 400 and body["error"]["param"] == "lora_name"
    assert _texts(client, "b") == detok["b"]
    # Every replica serves b right (each loads it on its first request). A fresh routing key per request
    # spreads them by load; /metrics answers from one replica at a time, its requests per adapter by its tag.
    served: dict[str, float] = {}
    keys = itertools.count()

    def every_replica_served_b() -> bool:
        n = next(keys)
        got = client.completions.create(model="b", prompt=PROMPTS[n % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True},
                                         extra_headers={"X-Flotilla-Prefix": f"spread-{n}"})
        assert got.choices[0].text == detok["b"][n % len(PROMPTS)], n
        served.update(_requests_by_replica(lora_app.url, "b"))
        return len(served) == 2 and min(served.values()) > 0

    poll_until(every_replica_served_b, TIMEOUT, lambda: f"both replicas to serve b; requests by replica: {served}")
    with urllib.request.urlopen(f"{lora_app.url}/metrics", timeout=TIMEOUT) as resp:  # one replica's figures
        metrics = resp.read().decode()
    assert 'adapter="a"' in metrics or 'adapter="b"' in metrics, metrics[-2000:]
    assert "lora_loads" in metrics and "lora_resident_hits" in metrics
    # Unload b: 404 from then on, on every replica; unloading again is 404 too.
    status, body = http(f"{lora_app.url}/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200 and body["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=2)
    status, body = http(f"{lora_app.url}/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404
    lora_app.assert_pages_free()


def _requests_by_replica(url: str, adapter: str) -> dict[str, float]:
    """``flotilla:lora_requests_total`` for ``adapter`` by replica tag, from the one replica that answers."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT) as resp:
        families = parse_prometheus(resp.read().decode())
    return {s.labels["replica"]: s.value for samples in families.values() for s in samples
            if s.name == "flotilla:lora_requests_total" and s.labels.get("adapter") == adapter}


def _texts(client: openai.OpenAI, model: str) -> list[str]:
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for p in PROMPTS]  # fmt: skip
