"""A replica's request machinery: admission, each endpoint's body to engine requests, submission, aborts.

``LLMServer`` (``apps.replica.server``) inherits this: every endpoint that runs
engine requests (completions, chat, responses, embeddings) admits through
``_inputs`` (with the endpoint's ``_parse_*``: body, prompts' token ids,
adapter, params) and submits through ``_start``, so capacity, the admitted-slot
accounting, cancellation and the aborts that free KV pages have one
implementation. The attributes below are ``LLMServer.__init__``'s.

Protocol of one request: ``_inputs`` checks auth and capacity, takes an
admitted slot (a burst arriving at once cannot all pass the check), and
parses the body; ``_start`` opens the streams (which hold the slot from
then on), submits each prompt (shielded from a cancel of the handler) and
returns the stream and its ``release``; the handler's task runs ``release``
when it ends however it ends, aborting in the engine whatever is unfinished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import ray
from fastapi import Request
from fastapi.responses import Response

from actors.config import EngineConfig
from actors.scheduler.handle import SchedulerHandle
from apps.inputs import params as rq
from apps.inputs.auth import ApiKeyAuth, KeyOwner
from apps.inputs.body import read_body
from apps.inputs.kind import RequestKind
from apps.inputs.prompt_encoder import PromptEncoder
from apps.outputs.detached import detached
from apps.outputs.http_responses import RETRY_AFTER_S, error_json
from apps.outputs.stream_fanout import RequestStream, StreamFanout
from apps.protocol import models as p
from apps.protocol.errors import APIError
from apps.replica import embeddings as em
from apps.replica.disaggregation import RemotePrefill
from apps.replica.lora import ReplicaLoRAs
from apps.responses.service import ResponsesCall, ResponsesService
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

T = TypeVar("T")
# A generation request as submitted: ``(request, model, prompts' token ids, their params)``.
Generation = tuple[p.CompletionRequest | p.ChatCompletionRequest, str, list[list[int]], list[SamplingParams]]


class ReplicaRequests:
    """Mixin of ``LLMServer``: admit, submit, release and abort engine requests."""

    auth: ApiKeyAuth
    capacity: int
    max_body_bytes: int
    _admitting: int
    _fanout: StreamFanout
    _scheduler: SchedulerHandle
    _remote: RemotePrefill | None
    _tasks: set[asyncio.Task[None]]
    config: EngineConfig
    model_name: str
    embedding_size: int  # the model's vectors' length (``apps.replica.embeddings.embedding_size``)
    loras: ReplicaLoRAs
    _encoder: PromptEncoder
    _responses: ResponsesService

    async def _inputs(self, request: Request, parse: Callable[[bytes], Awaitable[T]]) -> T:
        """Admit a request (auth, capacity) and ``parse`` its body, holding one admitted slot from the check on.

        ``parse`` reads the body into what the endpoint submits (``_parse_generation`` for completions and
        chat, the Responses translation, the embeddings inputs); ``_start`` releases the slot.
        """
        self.auth.check(request.headers.get("authorization"))
        if self._fanout.num_open + self._admitting >= self.capacity:
            raise APIError(429, f"this replica is at capacity ({self.capacity} requests in flight); "
                                f"retry after {RETRY_AFTER_S} s", code="rate_limit_exceeded")
        self._admitting += 1  # no await since the check: released by _start once the streams open
        try:
            return await parse(await read_body(request, self.max_body_bytes))
        except BaseException:
            self._admitting -= 1
            raise

    # ------------------------------------------------------ bodies to engine requests
    async def _parse_generation(self, kind: RequestKind, body: bytes) -> Generation:
        """A completions or chat body: ``(request, model, prompts' token ids, their params)``."""
        req: p.CompletionRequest | p.ChatCompletionRequest
        if kind is RequestKind.COMPLETION:
            req = rq.parse_request(body, p.CompletionRequest, max_body_bytes=self.max_body_bytes)
            prompts = rq.completion_prompts(req)
            self._check_size(len(prompts), "prompt", "prompts")
            ids = [await self._encoder.encode(one) for one in prompts]
        else:
            req = rq.parse_request(body, p.ChatCompletionRequest, max_body_bytes=self.max_body_bytes)
            ids = [await self._chat_ids(req)]
        return await self._generation(req, ids)

    async def _chat_ids(self, req: p.ChatCompletionRequest) -> list[int]:
        """The token ids of a chat request's conversation (and tools), through the chat template."""
        turns, tools = rq.chat_prompt(req, template_tools=self._encoder.supports_tools)
        return await self._encoder.encode_chat(turns, tools)

    async def _generation(self, req: p.CompletionRequest | p.ChatCompletionRequest,
                          ids: list[list[int]]) -> Generation:
        """The model and each prompt's params of a parsed request (its adapter resolved)."""
        lora = await self.loras.resolve(req.model)  # 404 for a name that is neither the base nor an adapter
        model = req.model or self.model_name
        params = [replace(rq.to_sampling_params(req, max_model_len=self.config.max_model_len,
                                                num_prompt_tokens=len(one)), lora=lora)
                  for one in ids]  # fmt: skip
        self._check_batch(len(ids))
        return req, model, ids, params

    async def _parse_response(self, owner: KeyOwner, body: bytes) -> tuple[ResponsesCall, Generation]:
        call = self._responses.parse(body, self.max_body_bytes, owner)
        return call, await self._generation(call.chat, [await self._chat_ids(call.chat)])

    async def _parse_embeddings(self, body: bytes) -> tuple[em.EmbeddingRequest, str, list[list[int]],
                                                            list[SamplingParams]]:
        req = rq.parse_request(body, em.EmbeddingRequest, max_body_bytes=self.max_body_bytes)
        em.check_dimensions(req, self.embedding_size)
        inputs = em.embedding_inputs(req)
        self._check_size(len(inputs), "input", "inputs")
        ids = [await self._encoder.encode(one) for one in inputs]
        # One params for every input: pooled, never sampled (max_tokens has no meaning for it).
        params = SamplingParams(pooling=self.config.pooling, lora=await self.loras.resolve(req.model))
        self._check_batch(len(ids))
        return req, req.model or self.model_name, ids, [params] * len(ids)

    def _check_size(self, size: int, param: str, noun: str) -> None:
        """A 400 for a list of ``size`` prompts more than this replica ever holds: a 429 would never clear."""
        if size > self.capacity:
            raise InvalidParameterError(param, f"a batch of {size} {noun} is more than this replica holds at "
                                               f"once ({self.capacity})")

    def _check_batch(self, size: int) -> None:
        """A 429 when a batch of ``size`` prompts does not fit beside what is open (the slot held counts once)."""
        if size > 1 and self._fanout.num_open + self._admitting - 1 + size > self.capacity:
            raise APIError(429, f"this replica cannot take a batch of {size} prompts now; "
                                f"retry after {RETRY_AFTER_S} s", code="rate_limit_exceeded")

    async def _start(self, id_prefix: str, prompts: list[list[int]], params: list[SamplingParams], *,
                     errors: Callable[[BaseException], BaseException] = lambda exc: exc,
                     ) -> tuple[RequestStream, Callable[[], None]] | Response:
        """Submit an admitted request's prompts: its stream and the release to run when the response is done
        with it, or the error response (``errors`` renames an engine refusal's field for the endpoint).
        Releases the admitted slot (the open streams hold it from here)."""
        rid = f"{id_prefix}-{uuid.uuid4().hex}"
        engine_ids = [rid] if len(prompts) == 1 else [f"{rid}-{k}" for k in range(len(prompts))]
        queue = self._fanout.open(engine_ids[0])
        for eid in engine_ids[1:]:
            self._fanout.open(eid, queue)
        self._admitting -= 1  # the open streams hold the slots now
        submitted = [self._submit(eid, ids, ps) for eid, ids, ps in zip(engine_ids, prompts, params, strict=True)]
        try:
            # Shielded: a cancel of this handler must not cancel a submit, whose end the abort below awaits.
            num_prompt = sum(await asyncio.gather(*(asyncio.shield(sub) for sub in submitted)))
        except BaseException as exc:
            for eid in engine_ids:
                self._fanout.close(eid)
            # Cancelled mid-submit, or one prompt of a batch refused: abort each once its submit landed.
            for sub, eid in zip(submitted, engine_ids, strict=True):
                self._background(self._abort_after(sub, eid))
            if not isinstance(exc, Exception):
                raise
            if isinstance(exc, ray.exceptions.RayActorError):  # the scheduler died: Serve replaces us soon
                exc = APIError(503, "this replica's engine is down and is being replaced; retry the request",
                               code="engine_unavailable")
            return error_json(errors(exc))
        stream = RequestStream(rid, queue, n=params[0].n, num_prompt_tokens=num_prompt, request_ids=engine_ids)
        # The task that runs this handler also sends the response, so its end is the request's end
        # on every path, including a cancel that lands after we return but before the first byte.
        release = functools.partial(self._release, stream)
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: release())
        return stream, release

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Future[int]:
        """The future of queueing one prompt, here or maybe through the prefill pool (P/D); it runs to its end
        even when the handler is cancelled (the caller awaits it shielded), so an abort can follow it."""
        consumer = self._fanout.consumer_id
        if self._remote is None:
            return asyncio.ensure_future(self._scheduler.submit(request_id, prompt_ids, params, consumer_id=consumer))
        return asyncio.ensure_future(self._submit_routed(request_id, prompt_ids, params, consumer))

    async def _submit_routed(self, request_id: str, prompt_ids: list[int], params: SamplingParams, consumer: str) -> int:
        assert self._remote is not None
        if await self._remote.wants(prompt_ids, params):
            return await self._remote.submit(request_id, prompt_ids, params, consumer)
        return await self._scheduler.submit(request_id, prompt_ids, params, consumer_id=consumer)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` detached from the (cancelled) handler, holding a reference until it ends."""
        task = detached(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_after(self, submitted: asyncio.Future[int], request_id: str) -> None:
        """Abort ``request_id`` after its submit call finished: an abort that overtook it would miss.

        However the submit ended (a result, an error, even a cancel: ``CancelledError`` is no
        ``Exception``), the request may be queued by now, so the abort always follows.
        """
        await asyncio.wait([submitted])  # returns when it is done; raises nothing of its outcome
        await self._abort(request_id)

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):  # the actor is gone: nothing left to free
            await self._scheduler.abort(request_id)

    def _release(self, stream: RequestStream) -> None:
        """Stop routing; abort in the actor what is unfinished (fire-and-forget: we may be cancelled)."""
        for eid in stream.request_ids:
            self._fanout.close(eid)
        if not stream.released:
            stream.released = True
            for eid in stream.unfinished():
                self._background(self._abort(eid))
