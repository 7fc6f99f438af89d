"""The Ray Serve deployment ``LLMServer``: an OpenAI-compatible API over one SchedulerActor.

Each replica owns one ``SchedulerActor`` (created in ``__init__``, waited on
until healthy) and one ``StreamFanout`` task that long-polls it, so a replica
makes at most one output call per engine step. The replica tokenizes (and
applies the chat template) itself and submits token ids, so usage counts are
exact. Every error goes through ``apps.errors.error_response``.

A client that goes away cancels its handler (Serve cancels the request);
the handler's ``finally`` (JSON) or ``EventStreamResponse``'s ``on_close``
(SSE) then aborts the request in the actor, which frees its KV pages. A
done-callback on the handler's task covers the gap between returning the
SSE response and sending its first byte.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
SSE), ``GET /v1/models``, ``GET /health``, ``POST /tokenize``,
``POST /detokenize``.

No ``from __future__ import annotations`` here: FastAPI reads the route
methods' annotations at runtime (a string ``Request`` became a body field).
"""

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.engine_config import EngineConfig
from actors.loader import load_tokenizer, resolve_model_path
from actors.scheduler_actor import SchedulerActor
from apps import protocol as p
from apps import request_params as rq
from apps.auth import ApiKeyAuth
from apps.detached import detached
from apps.errors import APIError, error_response
from apps.replica_stats import ReplicaStats
from apps.response_builder import ResponseBuilder
from apps.stream_fanout import EventStreamResponse, RequestStream, StreamFanout
from cluster.metrics import CONTENT_TYPE, ReplicaMetrics
from scheduling.batch import TokenLogprobs
from scheduling.errors import InvalidParameterError

app = FastAPI(title="flotilla", docs_url=None, redoc_url=None)
HEALTH_TIMEOUT_S = 10.0
DEFAULT_MAX_QUEUED_REQUESTS = 256  # per replica, beyond max_num_seqs; more get 429 + Retry-After
RETRY_AFTER_S = 1


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages (rendered with the chat template)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def _error(exc: BaseException) -> JSONResponse:
    status, body = error_response(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods get the OpenAI envelope too."""
    return _error(APIError(exc.status_code, str(exc.detail)))


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10.0)
@serve.ingress(app)
class LLMServer(ReplicaStats):
    """One replica: its own SchedulerActor, tokenizer and output fan-out.

    ``engine`` holds ``EngineConfig`` fields; ``served_model_name`` is the name
    clients use (default: ``engine["model"]``); ``scheduler_options`` go to
    ``SchedulerActor.options`` (e.g. ``{"num_gpus": 1}`` for a local GPU executor).
    """

    def __init__(self, engine: dict[str, Any], *, served_model_name: str | None = None,
                 scheduler_options: dict[str, Any] | None = None,
                 max_body_bytes: int = rq.DEFAULT_MAX_BODY_BYTES, startup_timeout_s: float = 600.0,
                 api_keys: str | list[str] | None = None,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        self.config = EngineConfig.from_kwargs(**engine)
        self.auth = ApiKeyAuth.resolve(api_keys)
        if max_queued_requests < 0:
            raise InvalidParameterError("max_queued_requests", f"must be >= 0, got {max_queued_requests}")
        # Requests this replica holds at once: a full batch running plus a bounded queue behind it.
        self.capacity = self.config.max_num_seqs + max_queued_requests
        self.model_name = served_model_name or self.config.model
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.tokenizer = load_tokenizer(resolve_model_path(self.config.model))
        self._actor = SchedulerActor.options(**(scheduler_options or {})).remote(self.config)
        status = ray.get(self._actor.health.remote(), timeout=startup_timeout_s)
        if not status.ok:
            raise RuntimeError(f"the scheduler actor is not healthy: {status.message}")
        replica_id = f"replica-{uuid.uuid4().hex[:12]}"
        self.metrics = ReplicaMetrics(self.model_name, replica_id)
        self._fanout = StreamFanout(self._actor, replica_id, observer=self.latency_observer(self.metrics.observe))
        self._tasks: set[asyncio.Task[None]] = set()  # detached aborts still running

    async def check_health(self) -> None:
        """Serve's replica check: fails (and the replica is replaced) only if the actor is gone.

        Also (re)starts the task that keeps Ray's copy of the metrics fresh (idempotent).
        """
        self.metrics.start_reporting(self._actor.stats.remote)
        await asyncio.wait_for(self._actor.health.remote(), HEALTH_TIMEOUT_S)

    def __del__(self) -> None:
        """Serve's shutdown hook: stop polling, then end the actor (it holds the model and KV pool)."""
        with contextlib.suppress(Exception):
            self._fanout.cancel()
            self.metrics.stop_reporting()
            ray.kill(self._actor, no_restart=True)

    # ----------------------------------------------------------------- routes
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """OpenAI completions, JSON or SSE."""
        return await self._generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI chat completions, JSON or SSE."""
        return await self._generate(request, "chat")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """The one model this application serves."""
        try:
            self.auth.check(request.headers.get("authorization"))
        except APIError as exc:
            return _error(exc)
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "flotilla", "max_model_len": self.config.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(self) -> Response:
        """200 when the scheduler actor reports ok, else 503 with its reason."""
        try:
            status = await asyncio.wait_for(self._actor.health.remote(), HEALTH_TIMEOUT_S)
        except Exception:
            return _error(APIError(503, "the scheduler actor is unreachable"))
        if not status.ok:
            return _error(APIError(503, status.message))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text(self) -> Response:
        """Prometheus text: this replica's request, token, latency, KV and memory figures."""
        with contextlib.suppress(Exception):  # the engine is down: serve the last figures (/health says why)
            self.metrics.update(await asyncio.wait_for(self._actor.stats.remote(), HEALTH_TIMEOUT_S))
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """``{"prompt"}`` or ``{"messages"}`` -> ``{"tokens", "count", "max_model_len"}``."""
        try:
            self.auth.check(request.headers.get("authorization"))
            req = rq.parse_request(await self._body(request), TokenizeRequest, max_body_bytes=self.max_body_bytes)
            rq.check_model(req.model, self.model_name)
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "give exactly one of prompt or messages", param="prompt")
            if req.messages is not None:
                conv = rq.chat_messages(p.ChatCompletionRequest(messages=req.messages))
                ids = self._chat_ids(conv)
            else:
                ids = list(self.tokenizer(req.prompt)["input_ids"])
        except Exception as exc:
            return _error(exc)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.config.max_model_len})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """``{"tokens"}`` -> ``{"prompt"}``."""
        try:
            self.auth.check(request.headers.get("authorization"))
            req = rq.parse_request(await self._body(request), DetokenizeRequest, max_body_bytes=self.max_body_bytes)
            rq.check_model(req.model, self.model_name)
            bad = [t for t in req.tokens if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
            text = self.tokenizer.decode(req.tokens)
        except Exception as exc:
            return _error(exc)
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------- generation
    async def _body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (never read whole)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                               code="payload_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _chat_ids(self, conversation: list[dict[str, str]]) -> list[int]:
        ids: Any = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    async def _generate(self, request: Request, kind: str) -> Response:
        req: p.CompletionRequest | p.ChatCompletionRequest
        try:
            self.auth.check(request.headers.get("authorization"))
            if self._fanout.num_open >= self.capacity:
                raise APIError(429, f"this replica is at capacity ({self.capacity} requests in flight); "
                                    f"retry after {RETRY_AFTER_S} s", code="rate_limit_exceeded")
            body = await self._body(request)
            if kind == "completion":
                req = rq.parse_request(body, p.CompletionRequest, max_body_bytes=self.max_body_bytes)
                prompt = rq.completion_prompt(req)
                ids = prompt if isinstance(prompt, list) else list(self.tokenizer(prompt)["input_ids"])
            else:
                req = rq.parse_request(body, p.ChatCompletionRequest, max_body_bytes=self.max_body_bytes)
                ids = self._chat_ids(rq.chat_messages(req))
            model = rq.check_model(req.model, self.model_name)
            params = rq.to_sampling_params(req, max_model_len=self.config.max_model_len,
                                        num_prompt_tokens=len(ids))
        except Exception as exc:
            return _error(exc)
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        queue = self._fanout.open(rid)
        submitted = self._actor.submit.remote(rid, ids, params, consumer_id=self._fanout.consumer_id)
        try:
            num_prompt = await submitted
        except BaseException as exc:
            self._fanout.close(rid)
            if not isinstance(exc, Exception):  # cancelled mid-submit: abort once the submit has landed
                self._background(self._abort_after(submitted, rid))
                raise
            if isinstance(exc, ray.exceptions.RayActorError):  # the scheduler died: Serve replaces us soon
                exc = APIError(503, "this replica's engine is down and is being replaced; retry the request",
                               code="engine_unavailable")
            return _error(exc)
        stream = RequestStream(rid, queue, n=params.n, num_prompt_tokens=num_prompt)
        # The task that runs this handler also sends the response, so its end is the request's end
        # on every path, including a cancel that lands after we return but before the first byte.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._release(stream))
        out = ResponseBuilder(kind, model, int(time.time()), params.logprobs is not None, self._decode)
        if req.stream:
            return EventStreamResponse(self._sse(stream, out, req.include_usage), lambda: self._release(stream))
        return await self._whole(stream, out)

    def _background(self, coro: Any) -> None:
        """Run ``coro`` detached from the (cancelled) handler, holding a reference until it ends."""
        task = detached(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_after(self, submitted: Any, request_id: str) -> None:
        """Abort ``request_id`` after its submit call finished: an abort that overtook it would miss."""
        with contextlib.suppress(Exception):
            await submitted
        await self._abort(request_id)

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):  # the actor is gone: nothing left to free
            await self._actor.abort.remote(request_id)

    def _decode(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))  # one token's text, for logprobs

    def _release(self, stream: RequestStream) -> None:
        """Stop routing; abort in the actor if unfinished (fire-and-forget: we may be cancelled)."""
        self._fanout.close(stream.request_id)
        if not stream.done and not stream.released:
            stream.released = True
            self._background(self._abort(stream.request_id))

    async def _whole(self, stream: RequestStream, out: ResponseBuilder) -> Response:
        texts = [""] * stream.n
        entries: list[list[TokenLogprobs]] = [[] for _ in range(stream.n)]
        try:
            while not stream.done:
                delta = await stream.next()
                texts[delta.index] += delta.text
                entries[delta.index].extend(delta.logprobs or [])
        except Exception as exc:
            return _error(exc)
        finally:
            self._release(stream)
        usage = p.usage(stream.num_prompt_tokens, stream.num_completion_tokens, stream.num_cached_tokens)
        choices = [out.choice(i, texts[i], stream.finish_reasons[i], entries[i]) for i in range(stream.n)]
        build = p.completion_response if out.kind == "completion" else p.chat_completion_response
        return JSONResponse(build(stream.request_id, out.model, out.created, choices, usage))

    async def _sse(self, stream: RequestStream, out: ResponseBuilder, include_usage: bool) -> AsyncIterator[bytes]:
        rid = stream.request_id
        try:
            if out.kind == "chat":
                first = [p.chat_delta_choice(i, "", role=True) for i in range(stream.n)]
                yield p.sse_event(p.chat_completion_chunk(rid, out.model, out.created, first))
            while not stream.done:
                chunk = out.chunk(rid, await stream.next_many())
                if chunk is not None:
                    yield p.sse_event(chunk)
            if include_usage:
                usage = p.usage(stream.num_prompt_tokens, stream.num_completion_tokens, stream.num_cached_tokens)
                yield p.sse_event(p.usage_chunk(out.kind, rid, out.model, out.created, usage))  # type: ignore[arg-type]
        except Exception as exc:
            yield p.sse_error_event(exc)
        finally:
            self._release(stream)
        yield p.SSE_DONE
