"""RequestStream.next_many: a reader that fell behind catches up in one chunk; errors are not lost."""

from __future__ import annotations

import asyncio

import pytest

from actors.api import FinishReason, SequenceDelta
from apps.outputs.stream_fanout import RequestStream
from apps.protocol.errors import APIError


def _d(index: int, text: str, finish: str | None = None, error: str | None = None) -> SequenceDelta:
    reason = None if finish is None else FinishReason(finish)
    return SequenceDelta(request_id="r", index=index, token_ids=[] if reason is FinishReason.ERROR else [7], text=text,
                         logprobs=None, finish_reason=reason, num_prompt_tokens=3, error=error)


def test_next_many_drains_what_is_queued_and_holds_back_an_error() -> None:
    async def scenario() -> None:
        queue: asyncio.Queue[SequenceDelta] = asyncio.Queue()
        stream = RequestStream("r", queue, n=2, num_prompt_tokens=3)
        for delta in (_d(0, "a"), _d(1, "x"), _d(0, "b")):
            queue.put_nowait(delta)
        assert [d.text for d in await stream.next_many()] == ["a", "x", "b"]
        assert stream.num_completion_tokens == 3
        for delta in (_d(0, "c", "length"), _d(1, "", "error", error="shard died")):
            queue.put_nowait(delta)
        got = await stream.next_many()  # the good delta first ...
        assert [d.text for d in got] == ["c"] and stream.finish_reasons == ["length", None]
        with pytest.raises(APIError) as info:  # ... then the held-back error
            await stream.next_many()
        assert info.value.status == 500 and "shard died" in info.value.message

    asyncio.run(scenario())


def test_next_many_stops_at_the_last_finish() -> None:
    async def scenario() -> None:
        queue: asyncio.Queue[SequenceDelta] = asyncio.Queue()
        stream = RequestStream("r", queue, n=1, num_prompt_tokens=3)
        queue.put_nowait(_d(0, "a", "stop"))
        queue.put_nowait(_d(0, "late"))  # nothing follows a finish; it must not be read
        assert [d.text for d in await stream.next_many()] == ["a"] and stream.done

    asyncio.run(scenario())
