"""``flotilla serve --kv-offload`` as a user runs it: a prompt whose pages the pool evicted comes back from the
host tier, seen in ``/metrics`` (``kv_tier_hits``) and in the answer's cached tokens, with the same text."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.cli.cli_server import cli_server
from tests.kernel_cache import link_built_kernels
from tests.serve_harness import http, poll_until

# A pool of 32 pages of 16 tokens: four 200-token prompts cannot all stay cached, so the first is evicted.
ARGS = ["--model", "tiny", "--cpu-threads", "1", "--max-model-len", "256", "--num-kv-pages", "32",
        "--max-num-seqs", "2", "--dtype", "float32", "--kv-offload", json.dumps({"host_bytes": 1 << 26})]
PROMPTS = [[1 + (i * 31 + j * 7) % 250 for j in range(200)] for i in range(4)]


def _tier_hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "flotilla:kv_tier_hits_total" and s.labels.get("tier") == "host")  # fmt: skip


def _complete(url: str, prompt: list[int]) -> tuple[str, int]:
    status, body = http(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0.0})  # fmt: skip
    assert status == 200, body
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["text"], details.get("cached_tokens", 0)


def test_an_evicted_prompt_comes_back_from_the_host_tier(tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # the server's own: its KV tier folders are nobody else's
    link_built_kernels(cache)  # but the CPU kernels this machine has built (else most of a minute to build them)
    with cli_server(ARGS, tmp_path / "serve.log", env={"FLOTILLA_CACHE_DIR": str(cache)}) as (url, _):
        first, cached = _complete(url, PROMPTS[0])
        assert cached == 0
        for prompt in PROMPTS[1:]:  # push the first prompt's pages out of the pool
            _complete(url, prompt)
        again, cached = _complete(url, PROMPTS[0])
        assert again == first
        assert cached == 192  # every full page but the one holding the last prompt token
        # The pool evicts leaves first: its head may still be cached, the rest came from host memory.
        poll_until(lambda: _tier_hits(url) >= 1, 60.0, lambda: f"kv_tier_hits(host) = {_tier_hits(url)}")
