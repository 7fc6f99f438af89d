"""A scripted aiohttp server on 127.0.0.1 for SDK tests: each attempt plays the next scripted answer.

It runs on its own event-loop thread, so blocking and async clients can both
call it. ``script(path, *answers)`` queues answers for a path (the last one
repeats); ``attempts[path]`` counts requests; ``requests[path]`` keeps their
headers and JSON bodies.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Seen:
    headers: dict[str, str]
    body: Any


def error(status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> Answer:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status, headers=headers)
    return answer


def ok(body: Any) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body)
    return answer


def completion(text: str, *, prompt_tokens: int = 3) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "fake",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}}


def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return {"id": "cmpl-s", "object": "text_completion", "created": 1, "model": "fake", "choices": choices,
            "usage": None}


def chat_completion(content: str | None, *, tool_calls: list[dict[str, Any]] | None = None,
                    finish: str = "stop") -> dict[str, Any]:
    """A chat reply; ``tool_calls`` in the OpenAI shape (content is then usually None)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_chunk(delta: dict[str, Any] | None, finish: str | None = None, *,
               usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A chat stream chunk with one choice's ``delta`` (None: no choices, e.g. the usage chunk)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "fake",
            "choices": choices, "usage": usage}


def sse(events: list[dict[str, Any]], *, drop: bool = False, done: bool = True) -> Answer:
    """Send ``events`` as SSE; ``drop`` cuts the connection after them (no terminating chunk)."""
    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if drop:
            assert request.transport is not None
            request.transport.close()
            return resp
        if done:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return answer


class FakeServer:
    """Start with ``start()``, stop with ``stop()``; ``url`` is its base URL."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-server", daemon=True)
        self._scripts: dict[str, list[Answer]] = {}
        self.attempts: dict[str, int] = defaultdict(int)
        self.requests: dict[str, list[Seen]] = defaultdict(list)
        self.in_flight = 0
        self.max_in_flight = 0
        self.release = asyncio.Event()  # answers that hang wait on this; stop() sets it
        self._runner: web.AppRunner | None = None
        self.url = ""

    def script(self, path: str, *answers: Answer) -> None:
        self._scripts[path] = list(answers)
        self.attempts[path] = 0
        self.requests[path] = []

    def reset(self) -> None:
        self._scripts.clear()
        self.attempts.clear()
        self.requests.clear()
        self.max_in_flight = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.attempts[path] += 1
        raw = await request.read()
        self.requests[path].append(Seen(dict(request.headers), json.loads(raw) if raw else None))
        answers = self._scripts.get(path)
        if not answers:
            return web.json_response({"error": {"message": f"no script for {path}", "type": "invalid_request_error",
                                                "param": None, "code": None}}, status=404)
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await answer(request)
        finally:
            self.in_flight -= 1

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def start(self) -> FakeServer:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


def hang(server: FakeServer) -> Answer:
    """Never answers until the server stops (for timeout tests)."""
    async def answer(request: web.Request) -> web.StreamResponse:
        await server.release.wait()
        return web.json_response({})
    return answer
