"""``/v1/embeddings`` over live HTTP with the official ``openai`` client (the tiny model).

The vectors are compared with the offline engine's ``LLM.embed`` on the same
model (whose own oracle is transformers' hidden states:
``tests/actors/engine/test_embeddings.py``): batched and one by one, as floats and
as base64 (what openai-python asks for by default). An embedding request
leaves nothing in the prefix cache and every page free.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from apps.llm import LLM
from tests.serve_harness import LiveServer, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

TEXTS = ["Once upon a time", "The sea was calm", "a", "Ships sail at dawn and return at dusk, laden with fish.",
         "1 2 3 4 5 6 7 8", "¿Dónde está la biblioteca?", "tiny models say noise", "the end"]
TOL = 1e-5


def _close(got: list[float], want: list[float]) -> bool:
    return bool((torch.tensor(got) - torch.tensor(want)).abs().max().item() <= TOL)


def test_embeddings_equal_the_offline_engine_batched_and_one_by_one(
        client: openai.OpenAI, tiny_llm: LLM, live: LiveServer) -> None:
    want = tiny_llm.embed(TEXTS, use_tqdm=False)
    evictable = live.stats().num_kv_pages_evictable
    batched = client.embeddings.create(model="tiny", input=TEXTS)  # base64 on the wire (the client's default)
    assert [d.index for d in batched.data] == list(range(len(TEXTS)))
    assert all(_close(d.embedding, w) for d, w in zip(batched.data, want, strict=True))
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert all(_close(f.embedding, b.embedding) for f, b in zip(floats.data, batched.data, strict=True))
    for text, w in zip(TEXTS, want, strict=True):
        assert _close(client.embeddings.create(model="tiny", input=text).data[0].embedding, w), text
    prompt_tokens = sum(len(tiny_llm.engine.tokenize(t)) for t in TEXTS)
    assert (batched.usage.prompt_tokens, batched.usage.total_tokens) == (prompt_tokens, prompt_tokens)
    ids = tiny_llm.engine.tokenize(TEXTS[0])
    by_ids = client.embeddings.create(model="tiny", input=[ids, ids[:2]], encoding_format="float")
    assert _close(by_ids.data[0].embedding, want[0])
    assert _close(by_ids.data[1].embedding, tiny_llm.embed([ids[:2]], use_tqdm=False)[0])
    live.assert_pages_free()
    # Nothing entered the prefix cache (the embeddings' own pages may have evicted cached ones to run).
    assert live.stats().num_kv_pages_evictable <= evictable


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [1, 10**9]}, "input"),
    ({"input": "x " * 3000}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 3}, "dimensions"),
    ({"input": "x", "model": "nope"}, "model"),
])
def test_bad_inputs_are_400s_naming_the_field(live: LiveServer, body: dict[str, Any], param: str) -> None:
    status, reply = http(f"{live.url}/v1/embeddings", body)
    assert status == (404 if param == "model" else 400), reply
    assert reply["error"]["param"] == param, reply
    live.assert_pages_free()


def test_a_wrong_dimensions_is_refused_before_anything_is_computed(live: LiveServer, tiny_llm: LLM) -> None:
    """A 400 naming ``dimensions`` with no engine step run for it; the vectors' own length is accepted."""
    size = len(tiny_llm.embed(["x"], use_tqdm=False)[0])
    steps = live.stats().num_steps
    status, reply = http(f"{live.url}/v1/embeddings", {"input": ["x", "y"], "dimensions": size - 1})
    assert status == 400 and reply["error"]["param"] == "dimensions", reply
    assert str(size) in reply["error"]["message"], reply
    assert live.stats().num_steps == steps  # refused with the body: the engine never ran the inputs
    status, reply = http(f"{live.url}/v1/embeddings", {"input": "x", "dimensions": size, "encoding_format": "float"})
    assert status == 200 and len(reply["data"][0]["embedding"]) == size, reply
    live.assert_pages_free()
