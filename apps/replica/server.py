"""The Ray Serve deployment ``LLMServer``: an OpenAI-compatible API over one SchedulerActor.

Each replica owns one ``SchedulerActor`` (created in ``__init__``, waited on
until healthy) and one ``StreamFanout`` task that long-polls it, so a replica
makes at most one output call per engine step. With
``scheduler_placement="replica"`` the scheduler runs in the replica's own
process instead (``actors.scheduler.local``); either is a ``SchedulerHandle``
(``actors.scheduler.handle``). The replica tokenizes (and
applies the chat template) itself and submits token ids, so usage counts are
exact; long prompts are encoded off the event loop (``apps.inputs.prompt_encoder``).
A completions batch (``prompt`` a list of prompts) is one engine request per
prompt sharing one response stream. Every error goes through
``apps.protocol.errors.error_response``.

A client that goes away cancels its handler (Serve cancels the request);
the handler's ``finally`` (JSON) or ``EventStreamResponse``'s ``on_close``
(SSE) then aborts the request in the actor, which frees its KV pages. A
done-callback on the handler's task covers the gap between returning the
SSE response and sending its first byte.

Structured output (``response_format``, ``structured_outputs``) becomes
``SamplingParams.structured_output`` (``apps.inputs.structured``); chat
``tools``/``tool_choice`` shape the prompt, the constraint and a per-choice
output parser (``apps.tools.choice``, ``apps.tools.prompt``, ``apps.tools.scanners``).

LoRA (``enable_lora``, ``lora_modules``): the ``model`` field names the base
model or an adapter of the application's catalog, which this replica loads
on first use (``apps.replica.lora``).

Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``):
a translation over the chat path (``apps.responses.service``). Embeddings
(``POST /v1/embeddings``): engine requests that pool their prompt's hidden
states (``apps.replica.embeddings``). Admission, submission and aborts of every
endpoint are ``apps.replica.requests``'s.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
SSE), ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health``, ``POST /tokenize``,
``POST /detokenize``, ``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter``.

No ``from __future__ import annotations`` here: FastAPI reads the route
methods' annotations at runtime (a string ``Request`` became a body field).
"""

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.config import EngineConfig, scoped_to_app
from actors.load.loader import load_tokenizer, resolve_model_path
from actors.scheduler.handle import ActorScheduler, SchedulerHandle
from actors.scheduler.local import LocalScheduler
from actors.scheduler.placement import DEFAULT_PLACEMENT, check_placement
from apps.inputs import params as rq
from apps.inputs.auth import ApiKeyAuth
from apps.inputs.body import read_body
from apps.inputs.kind import RequestKind
from apps.inputs.prompt_encoder import PromptEncoder
from apps.outputs.http_responses import error_json, sse, whole
from apps.outputs.response_builder import ResponseBuilder
from apps.outputs.stream_fanout import EventStreamResponse, StreamFanout
from apps.outputs.token_text import TokenText
from apps.protocol import models as p
from apps.protocol.errors import APIError, error_response
from apps.replica import embeddings as em
from apps.replica.disaggregation import (
    DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
    DEFAULT_REMOTE_PREFILL_TIMEOUT_S,
    RemotePrefill,
)
from apps.replica.lora import ActorCatalog, ReplicaLoRAs
from apps.replica.requests import ReplicaRequests
from apps.replica.stats import HEALTH_TIMEOUT_S, ReplicaStats
from apps.responses.forward import StoredResponseMethod, at_holder
from apps.responses.output import ResponseAssembler
from apps.responses.service import ResponsesService, rename_error
from apps.responses.store import DEFAULT_MAX_STORED_RESPONSE_BYTES, DEFAULT_MAX_STORED_RESPONSES
from apps.tools.choice import tool_plan
from cluster.metrics import CONTENT_TYPE, ReplicaMetrics
from cluster.pending_requests import RequestArg
from cluster.response_ids import response_id
from scheduling.errors import InvalidParameterError

app = FastAPI(title="flotilla", docs_url=None, redoc_url=None)
DEFAULT_MAX_QUEUED_REQUESTS = 256  # per replica, beyond max_num_seqs; more get 429 + Retry-After


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages (rendered with the chat template)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None


class LoadLoRARequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's name and fields)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods get the OpenAI envelope too."""
    return error_json(APIError(exc.status_code, str(exc.detail)))


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10.0)
@serve.ingress(app)
class LLMServer(ReplicaStats, ReplicaRequests):
    """One replica: its own SchedulerActor, tokenizer and output fan-out.

    ``engine`` holds ``EngineConfig`` fields; ``served_model_name`` is the name
    clients use (default: ``engine["model"]``); ``scheduler_options`` go to
    ``SchedulerActor.options`` (e.g. ``{"num_gpus": 1}`` for a local GPU executor).
    """

    def __init__(self, engine: dict[str, Any], *, served_model_name: str | None = None,
                 scheduler_options: dict[str, Any] | None = None,
                 max_body_bytes: int = rq.DEFAULT_MAX_BODY_BYTES, startup_timeout_s: float = 600.0,
                 api_keys: str | list[str] | None = None,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
                 scheduler_placement: str = DEFAULT_PLACEMENT, prefill: DeploymentHandle | None = None,
                 remote_prefill_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
                 remote_prefill_timeout_s: float = DEFAULT_REMOTE_PREFILL_TIMEOUT_S,
                 lora_modules: dict[str, str] | None = None, runtime_lora_updates: bool = False,
                 max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_stored_response_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
        self.config = scoped_to_app(EngineConfig.from_kwargs(**engine), serve.get_replica_context().app_name)
        if lora_modules and not self.config.enable_lora:
            raise InvalidParameterError("lora_modules", "adapters need enable_lora=True")
        check_placement(scheduler_placement, scheduler_options)
        self.auth = ApiKeyAuth.resolve(api_keys)
        if max_queued_requests < 0:
            raise InvalidParameterError("max_queued_requests", f"must be >= 0, got {max_queued_requests}")
        # Requests this replica holds at once: a full batch running plus a bounded queue behind it.
        self.capacity = self.config.max_num_seqs + max_queued_requests
        # Requests admitted whose streams are not open yet (their body is read and encoded meanwhile): they
        # hold their slot from the capacity check on, so a burst arriving at once cannot all pass it.
        self._admitting = 0
        self.model_name = rq.served_name(served_model_name, self.config.model)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        model_path = resolve_model_path(self.config.model)
        self.tokenizer = load_tokenizer(model_path)
        self.embedding_size = em.embedding_size(model_path)
        self._encoder = PromptEncoder(self.tokenizer)
        self._token_text = TokenText(self.tokenizer)
        self._scheduler: SchedulerHandle
        if scheduler_placement == "replica":
            self._scheduler = LocalScheduler(self.config)  # built (model loaded) when this returns
        else:
            self._scheduler = ActorScheduler.start(self.config, scheduler_options, startup_timeout_s=startup_timeout_s)
        replica_id = f"replica-{uuid.uuid4().hex[:12]}"
        self.metrics = ReplicaMetrics(self.model_name, replica_id)
        # P/D: ``prefill`` is the handle of the app's prefill pool (apps.replica.disaggregation); long prompts go there.
        self._remote = None if prefill is None else RemotePrefill(
            prefill, self._scheduler, min_tokens=remote_prefill_min_tokens, timeout_s=remote_prefill_timeout_s,
            record=self.metrics.record)
        self._fanout = StreamFanout(self._scheduler, replica_id, observer=self.latency_observer(self.metrics.observe))
        catalog = ActorCatalog(serve.get_replica_context().app_name) if self.config.enable_lora else None
        self.loras = ReplicaLoRAs(self._scheduler, catalog, self.model_name, record=self.metrics.record,
                                  runtime_updates=runtime_lora_updates)
        if catalog is not None:
            catalog.register_now(lora_modules or {}, runtime_lora_updates)
        self._tasks: set[asyncio.Task[None]] = set()  # detached aborts still running
        # Responses kept for previous_response_id; their ids carry the tag the router routes them back on.
        self._responses = ResponsesService(serve.get_replica_context().replica_id.unique_id,
                                           max_stored=max_stored_responses,
                                           max_stored_bytes=max_stored_response_bytes)

    async def check_health(self) -> None:
        """Serve's replica check: raising makes Serve replace this replica.

        Fails when the actor is gone or unreachable, and when it reports not ok
        without restarting: its executor restart failed, so every request
        would fail fast (and the replica, looking idle, would draw them all).
        A restart in progress passes: it ends in ok or in a failed restart.
        Also (re)starts the task that keeps Ray's copy of the metrics fresh (idempotent).
        """
        self.metrics.start_reporting(self._scheduler.stats)
        status = await asyncio.wait_for(self._scheduler.health(), HEALTH_TIMEOUT_S)
        if not status.ok and not status.restarting:
            raise RuntimeError(f"the scheduler actor cannot serve: {status.message}")
        await asyncio.wait_for(self.loras.sync(), HEALTH_TIMEOUT_S)  # adapters unloaded through other replicas

    def __del__(self) -> None:
        """Serve's shutdown hook: stop polling, then end the actor (it holds the model and KV pool)."""
        with contextlib.suppress(Exception):
            self._fanout.cancel()
            self.metrics.stop_reporting()
            self._scheduler.close()

    # ----------------------------------------------------------------- routes
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """OpenAI completions, JSON or SSE."""
        return await self._generate(request, RequestKind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI chat completions, JSON or SSE."""
        return await self._generate(request, RequestKind.CHAT)

    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        """The Responses API over the chat path (``apps.responses.service``): JSON or typed SSE events."""
        try:
            # Who sends it (checked again, with capacity, by _inputs): the owner of what it reads and stores.
            owner = self.auth.check(request.headers.get("authorization"))
            call, (_, model, prompts, params) = await self._inputs(
                request, functools.partial(self._parse_response, owner))
        except Exception as exc:
            return error_json(rename_error(exc))
        started = await self._start("resp", prompts, params, errors=rename_error)
        if isinstance(started, Response):
            return started
        stream, release = started
        created = int(time.time())
        out = ResponseBuilder(RequestKind.CHAT, model, created, False, self._token_text.text,
                              self._token_text.bytes_of, 1, tool_plan(call.chat).scanner())
        asm = ResponseAssembler(self._responses.skeleton(call, response_id(self._responses.tag), model, created))
        if call.request.stream:
            return EventStreamResponse(self._responses.sse(call, stream, out, asm, release), release)
        return await self._responses.whole(call, stream, out, asm, release)

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> Response:
        """A stored response, from the replica holding it (``apps.responses.forward``); 404 naming the id when
        it holds none for the caller's key."""
        status, body = await self._stored(response_id, "GET", request.headers.get("authorization"), forward=True)
        return JSONResponse(body, status_code=status)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        """Forget a stored response, on the replica holding it (404 naming the id when it holds none for the
        caller's key)."""
        status, body = await self._stored(response_id, "DELETE", request.headers.get("authorization"), forward=True)
        return JSONResponse(body, status_code=status)

    async def stored_response(self, arg: RequestArg, method: StoredResponseMethod,
                              authorization: str | None) -> tuple[int, dict[str, Any]]:
        """A replica that does not hold a response asks this one (the router sent the call here by its id)."""
        rid = arg.value.get("previous_response_id", "") if isinstance(arg.value, Mapping) else ""
        return await self._stored(str(rid), method, authorization, forward=False)

    async def _stored(self, rid: str, method: StoredResponseMethod, authorization: str | None, *,
                      forward: bool) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)`` of ``method`` on the stored response ``rid``: the holder's, when
        ``forward`` and another replica holds it; else this replica's."""
        try:
            owner = self.auth.check(authorization)  # here too: no unauthenticated call crosses to the holder
            if forward and (held := await at_holder(rid, self._responses.tag, method, authorization)) is not None:
                return held
            if method == "GET":
                return 200, self._responses.lookup(rid, owner).response
            self._responses.delete(rid, owner)
        except Exception as exc:
            return error_response(exc)
        return 200, {"id": rid, "object": "response.deleted", "deleted": True}

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        """OpenAI embeddings: each input pooled by the engine (``apps.replica.embeddings``), float or base64."""
        try:
            req, model, ids, params = await self._inputs(request, self._parse_embeddings)
        except Exception as exc:
            return error_json(exc)
        started = await self._start("embd", ids, params, errors=em.rename_error)  # the engine checks the inputs
        if isinstance(started, Response):
            return started
        stream, release = started
        try:
            vectors = await em.collect(stream)
            return JSONResponse(em.embedding_response(req, model, vectors, stream.num_prompt_tokens))
        except Exception as exc:
            return error_json(exc)
        finally:
            release()

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """The one model this application serves."""
        try:
            self.auth.check(request.headers.get("authorization"))
        except APIError as exc:
            return error_json(exc)
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "flotilla", "max_model_len": self.config.max_model_len}
        try:
            adapters = await self.loras.names()
        except Exception as exc:
            return error_json(exc)
        cards = [card] + [{**card, "id": name, "parent": self.model_name} for name in adapters]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Load a PEFT adapter for the whole application (checked by loading it on this replica; 404 unless
        ``runtime_lora_updates``)."""
        try:
            self.auth.check(request.headers.get("authorization"))
            self.loras.check_runtime_updates()  # before the body: off looks like no such route
            body = await read_body(request, self.max_body_bytes)
            req = rq.parse_request(body, LoadLoRARequest, max_body_bytes=self.max_body_bytes)
            info = await self.loras.load(req.lora_name, req.lora_path)
        except Exception as exc:
            return error_json(exc)
        return JSONResponse({"object": "lora_adapter", "id": info.name, "parent": self.model_name,
                             "rank": info.rank, "target_modules": list(info.targets)})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unload an adapter: refused for new requests at once, gone once its requests end (404 unless
        ``runtime_lora_updates``)."""
        try:
            self.auth.check(request.headers.get("authorization"))
            self.loras.check_runtime_updates()  # before the body: off looks like no such route
            body = await read_body(request, self.max_body_bytes)
            req = rq.parse_request(body, UnloadLoRARequest, max_body_bytes=self.max_body_bytes)
            await self.loras.unload(req.lora_name)
        except Exception as exc:
            return error_json(exc)
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "deleted": True})

    @app.get("/health")
    async def health(self) -> Response:
        """200 when the scheduler actor reports ok, else 503 with its reason."""
        try:
            status = await asyncio.wait_for(self._scheduler.health(), HEALTH_TIMEOUT_S)
        except Exception:
            return error_json(APIError(503, "the scheduler actor is unreachable"))
        if not status.ok:
            return error_json(APIError(503, status.message))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text(self) -> Response:
        """Prometheus text: this replica's request, token, latency, KV and memory figures."""
        with contextlib.suppress(Exception):  # the engine is down: serve the last figures (/health says why)
            self.metrics.update(await asyncio.wait_for(self._scheduler.stats(), HEALTH_TIMEOUT_S))
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """``{"prompt"}`` or ``{"messages"}`` -> ``{"tokens", "count", "max_model_len"}``."""
        try:
            self.auth.check(request.headers.get("authorization"))
            body = await read_body(request, self.max_body_bytes)
            req = rq.parse_request(body, TokenizeRequest, max_body_bytes=self.max_body_bytes)
            await self.loras.check_known(req.model)  # adapters share the base model's tokenizer
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "give exactly one of prompt or messages", param="prompt")
            if req.messages is not None:
                chat = p.ChatCompletionRequest(messages=req.messages)
                ids = await self._encoder.encode_chat(*rq.chat_prompt(chat, template_tools=self._encoder.supports_tools))
            else:
                assert req.prompt is not None  # exactly one of the two, checked above
                ids = await self._encoder.encode(req.prompt)
        except Exception as exc:
            return error_json(exc)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.config.max_model_len})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """``{"tokens"}`` -> ``{"prompt"}``."""
        try:
            self.auth.check(request.headers.get("authorization"))
            body = await read_body(request, self.max_body_bytes)
            req = rq.parse_request(body, DetokenizeRequest, max_body_bytes=self.max_body_bytes)
            await self.loras.check_known(req.model)
            bad = [t for t in req.tokens if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
            text = await self._encoder.decode(req.tokens)
        except Exception as exc:
            return error_json(exc)
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------- generation
    async def _generate(self, request: Request, kind: RequestKind) -> Response:
        try:
            req, model, prompts, params = await self._inputs(request, functools.partial(self._parse_generation, kind))
        except Exception as exc:
            return error_json(exc)
        started = await self._start(kind.shape.id_prefix, prompts, params)
        if isinstance(started, Response):
            return started
        stream, release = started
        scanner = tool_plan(req).scanner() if isinstance(req, p.ChatCompletionRequest) else None
        out = ResponseBuilder(kind, model, int(time.time()), params[0].logprobs is not None,
                              self._token_text.text, self._token_text.bytes_of, stream.n, scanner)
        if req.stream:
            return EventStreamResponse(sse(stream, out, req.include_usage, release), release)
        return await whole(stream, out, release)
