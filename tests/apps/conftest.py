"""One offline engine on the embedded tiny model, shared by the module's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.llm import LLM


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_model_dir), max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
              num_kv_pages=256)
    yield llm
    llm.engine.shutdown()
