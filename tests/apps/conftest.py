"""Fixtures of the apps tests: one offline engine and one live server of the tiny model.

Both are package-scoped; the live app is the session's shared one (starting a
cluster and an app costs seconds on a 2-core machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from apps.llm import LLM
from tests.serve_harness import TIMEOUT, LiveServer, shared_tiny


@pytest.fixture(scope="package")
def tiny_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_model_dir), max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
              num_kv_pages=256)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="package")
def live(tiny_model_dir: Path) -> LiveServer:
    """The session's tiny app on the shared cluster (``tests.serve_harness.shared_tiny``)."""
    return shared_tiny(tiny_model_dir)


@pytest.fixture(scope="package")
def server(live: LiveServer) -> str:
    return live.url


@pytest.fixture(scope="package")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
