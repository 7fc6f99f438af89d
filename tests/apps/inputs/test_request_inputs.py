"""Request inputs off the HTTP path: bodies over the limit are read to the end (so the 413
reaches the client), and long prompts are encoded (many ids decoded) in a worker thread, short ones inline."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.load.loader import load_tokenizer
from apps.inputs.body import MAX_DISCARD_BYTES, read_body
from apps.inputs.prompt_encoder import PromptEncoder
from apps.protocol.errors import APIError


class _Body:
    """A Starlette-like request whose ``stream()`` yields ``chunks`` and counts what was read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.num_read = chunks, 0

    async def stream(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.num_read += 1
            yield chunk


def test_a_body_over_the_limit_is_read_to_its_end_then_refused() -> None:
    body = _Body([b"x" * 1000] * 50)
    with pytest.raises(APIError) as info:
        asyncio.run(read_body(body, max_bytes=4096))
    assert info.value.status == 413 and info.value.code == "payload_too_large"
    assert body.num_read == 50, "unread body bytes make the server reset the connection"
    assert asyncio.run(read_body(_Body([b"ab", b"c"]), max_bytes=3)) == b"abc"


def test_a_flood_past_the_discard_bound_is_cut_off() -> None:
    chunk = b"x" * (1 << 20)
    body = _Body([chunk] * (MAX_DISCARD_BYTES // len(chunk) + 10))
    with pytest.raises(APIError):
        asyncio.run(read_body(body, max_bytes=1024))
    assert body.num_read == MAX_DISCARD_BYTES // len(chunk) + 1


class _ThreadRecorder:
    """Wraps a tokenizer; records the thread of each call."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.threads: list[int] = []

    def __call__(self, text: str) -> object:
        self.threads.append(threading.get_ident())
        return self.inner(text)  # type: ignore[operator]

    def apply_chat_template(self, *args: object, **kwargs: object) -> object:
        self.threads.append(threading.get_ident())
        return self.inner.apply_chat_template(*args, **kwargs)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        self.threads.append(threading.get_ident())
        return str(self.inner.decode(ids))  # type: ignore[attr-defined]


def test_long_prompts_are_encoded_off_the_event_loop(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    recorder = _ThreadRecorder(tokenizer)
    encoder = PromptEncoder(recorder, offload_min_chars=100)
    loop_thread = threading.get_ident()
    short, long = "short prompt", "long prompt " * 20
    chat = [{"role": "user", "content": long}]

    async def scenario() -> list[list[int]]:
        return [await encoder.encode(short), await encoder.encode(long), await encoder.encode_chat(chat),
                await encoder.encode([5, 6])]

    ids = asyncio.run(scenario())
    assert recorder.threads[0] == loop_thread
    assert loop_thread not in recorder.threads[1:]
    assert ids[:2] == [list(tokenizer(short)["input_ids"]), list(tokenizer(long)["input_ids"])]
    assert ids[2] == PromptEncoder(tokenizer).chat_ids(chat) and ids[3] == [5, 6]


def test_many_token_ids_are_decoded_off_the_event_loop(tiny_model_dir: Path) -> None:
    """``/detokenize`` decodes through the encoder: a long id list in a worker thread, a short one inline."""
    tokenizer = load_tokenizer(tiny_model_dir)
    recorder = _ThreadRecorder(tokenizer)
    encoder = PromptEncoder(recorder, offload_min_chars=100)
    loop_thread = threading.get_ident()
    short, long = tokenizer("short text")["input_ids"], tokenizer("long text " * 20)["input_ids"]
    assert len(short) < 100 <= len(long)

    async def scenario() -> list[str]:
        return [await encoder.decode(short), await encoder.decode(long)]

    assert asyncio.run(scenario()) == [tokenizer.decode(short), tokenizer.decode(long)]
    assert recorder.threads[0] == loop_thread and recorder.threads[1] != loop_thread
