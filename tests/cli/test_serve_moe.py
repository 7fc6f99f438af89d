"""``flotilla serve`` of a mixture-of-experts model as a user runs it, asked by the official openai client.

The model is the tiny seeded Qwen3-MoE of the family tests (layer 0 sparse,
8 experts, top-2; ``tests.actors.checkpoints.qwen3_moe_config``) with the
byte-level tokenizer; the console script serves it in its own process and
Ray cluster (``tests.cli.cli_server``), and its greedy chat answers, plain and
streamed, equal the offline engine's on the same folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import FAMILY_CONFIGS, write_checkpoint
from tests.cli.cli_server import cli_server

# The same engine settings on both sides: the offline LLM's keywords and the CLI's flags.
ENGINE: dict[str, Any] = {"max_model_len": 256, "num_kv_pages": 64, "max_num_seqs": 4, "dtype": "float32",
                          "cpu_threads": 1}
FLAGS = [part for key, value in ENGINE.items() for part in (f"--{key.replace('_', '-')}", str(value))]
CONVERSATIONS: list[list[Any]] = [[{"role": "user", "content": "hi there"}],
                                  [{"role": "user", "content": "Name three ships."}]]
MAX_TOKENS = 12


def test_a_moe_model_answers_chat_through_flotilla_serve_as_the_offline_engine(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "qwen3_moe", FAMILY_CONFIGS["qwen3_moe"](), seed=4)
    build_tokenizer().save_pretrained(folder)
    offline = LLM(str(folder), **ENGINE)
    try:
        assert offline.engine.executor.num_moe_layers == 1  # a MoE model indeed (layer 1 is dense)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        want = [out.outputs[0] for out in offline.chat(CONVERSATIONS, params, use_tqdm=False)]
        assert all(w.token_ids for w in want)
    finally:
        offline.shutdown()
    args = ["--model", str(folder), "--served-model-name", "moe", *FLAGS]
    with cli_server(args, tmp_path / "serve.log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["moe"]
        for messages, expected in zip(CONVERSATIONS, want, strict=True):
            reply = client.chat.completions.create(model="moe", messages=messages, max_tokens=MAX_TOKENS,
                                                   temperature=0)
            choice = reply.choices[0]
            assert choice.message.content == expected.text, messages
            assert choice.finish_reason == expected.finish_reason
            assert reply.usage is not None and reply.usage.completion_tokens == len(expected.token_ids)
            stream = client.chat.completions.create(model="moe", messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
