"""The replica's side of ``/v1/responses``: parse and continue a conversation, run the stream, keep the result.

``LLMServer`` (``apps.replica.server``) admits a Responses request like a chat one:
``ResponsesService.parse`` turns the body into the chat request that serves
it (``apps.responses.protocol``), with the conversation of
``previous_response_id`` in front; the chat stream's chunks then go through a
``ResponseAssembler`` (``apps.responses.output``) into the whole response
(``whole``) or its server-sent events (``sse``). A finished response is kept
in the replica's ``ResponseStore`` (``apps.responses.store``) unless ``store``
is false, together with its conversation (its turns and its output, without
instructions) for a later ``previous_response_id``, and the key that made it:
only that key reads, deletes or continues it.

An id this replica does not hold for the caller's key is a 404 naming it; one
that names another replica says which, and how to reach it
(``X-Flotilla-Previous-Response``, which the SDK sends and
``cluster.request_router`` routes on).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from apps.inputs import params as rq
from apps.inputs.auth import KeyOwner
from apps.outputs.http_responses import error_json
from apps.outputs.response_builder import ResponseBuilder
from apps.outputs.stream_fanout import RequestStream
from apps.protocol import models as p
from apps.protocol.errors import APIError, error_response, renamed
from apps.protocol.models import ChatCompletionRequest, ChatMessage
from apps.responses.output import ResponseAssembler, output_messages, responses_usage
from apps.responses.protocol import CHAT_TO_RESPONSES, ResponsesRequest, input_messages, to_chat
from apps.responses.store import (
    DEFAULT_MAX_STORED_RESPONSE_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    ResponseStore,
    StoredResponse,
)
from cluster.response_ids import PREVIOUS_RESPONSE_HEADER, replica_tag


@dataclass(slots=True)
class ResponsesCall:
    """One parsed Responses request: the request, its chat translation, the response it continues (if any),
    its own input turns and the key that sent it."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    parent: StoredResponse | None = None
    turns: list[ChatMessage] = field(default_factory=list)
    owner: KeyOwner = None


def rename_error(exc: BaseException) -> BaseException:
    """``exc`` naming the Responses field where it names the chat field it became."""
    return renamed(exc, CHAT_TO_RESPONSES)


class ResponsesService:
    """One replica's Responses state: its tag (in every id it makes) and its store."""

    def __init__(self, tag: str, *, max_stored: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_stored_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
        self.tag = tag
        self.store = ResponseStore(max_stored, max_stored_bytes)

    def lookup(self, rid: str, owner: KeyOwner, *, param: str | None = None) -> StoredResponse:
        """The response ``rid`` stored for ``owner``; a 404 naming it (and its replica, if another) when not
        here (another key's response is not here for this one: the 404 is the same as for an unknown id)."""
        entry = self.store.get(rid, owner)
        if entry is not None:
            return entry
        holder = replica_tag(rid)
        if holder is not None and holder != self.tag:
            raise APIError(404, f"response '{rid}' is held by replica {holder}, not this one ({self.tag}), which "
                                f"may have left the fleet; behind Serve's proxy, send the request with the header "
                                f"{PREVIOUS_RESPONSE_HEADER}: {rid} so it is routed there (the flotilla SDK does)",
                           param=param, code="response_on_other_replica")
        raise APIError(404, f"no response with id '{rid}' is stored on this replica for this API key (it was never "
                            "made, was made with store=false or another key, was deleted, or was evicted from "
                            "the bounded store)",
                       param=param, code="response_not_found")

    def parse(self, body: bytes, max_body_bytes: int, owner: KeyOwner) -> ResponsesCall:
        """The body ``owner`` sent as a ``ResponsesCall`` (the caller maps chat field names in errors:
        ``rename_error``)."""
        req = rq.parse_request(body, ResponsesRequest, max_body_bytes=max_body_bytes)
        parent = None
        if req.previous_response_id is not None:
            parent = self.lookup(req.previous_response_id, owner, param="previous_response_id")
        chat = to_chat(req, [] if parent is None else parent.conversation())
        return ResponsesCall(req, chat, parent, input_messages(req), owner)

    def delete(self, rid: str, owner: KeyOwner) -> None:
        """Forget ``rid`` (a 404 as ``lookup``'s when ``owner`` holds no such response here)."""
        self.lookup(rid, owner)
        self.store.delete(rid, owner)

    def skeleton(self, call: ResponsesCall, rid: str, model: str, created: int) -> dict[str, Any]:
        """The fixed fields of the response object: its id, model and the request's options, echoed."""
        req = call.request
        fmt: dict[str, Any] = {"type": "text"}
        if req.text is not None and req.text.format is not None:
            fmt = req.text.format.model_dump(by_alias=True, exclude_none=True)
        choice: Any = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if not isinstance(choice, str):
            choice = choice.model_dump()
        return {
            "id": rid, "object": "response", "created_at": created, "model": model, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": True,
            "previous_response_id": req.previous_response_id, "temperature": req.temperature,
            "top_p": req.top_p, "text": {"format": fmt}, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "store": req.store is not False, "user": req.user,
        }

    def _keep(self, call: ResponsesCall, asm: ResponseAssembler) -> None:
        if call.request.store is not False and asm.status in ("completed", "incomplete"):
            self.store.put(StoredResponse(asm.response(), call.turns + output_messages(asm.output), call.parent,
                                          call.owner))

    async def whole(self, call: ResponsesCall, stream: RequestStream, out: ResponseBuilder, asm: ResponseAssembler,
                    release: Callable[[], None]) -> JSONResponse:
        """Read ``stream`` to its end; the whole ``response`` object."""
        try:
            while not stream.done:
                for chunk in out.chunks(stream.request_id, await stream.next_many()):
                    asm.feed(chunk)
        except Exception as exc:
            return error_json(exc)
        finally:
            release()
        asm.finish(_usage(stream))
        self._keep(call, asm)
        return JSONResponse(asm.response())

    async def sse(self, call: ResponsesCall, stream: RequestStream, out: ResponseBuilder, asm: ResponseAssembler,
                  release: Callable[[], None]) -> AsyncIterator[bytes]:
        """The typed events of ``stream`` (``event: <type>`` lines, as OpenAI sends them)."""
        try:
            for event in asm.start():
                yield _sse(event)
            while not stream.done:
                for chunk in out.chunks(stream.request_id, await stream.next_many()):
                    for event in asm.feed(chunk):
                        yield _sse(event)
            release()
            for event in asm.finish(_usage(stream)):
                yield _sse(event)
            self._keep(call, asm)
        except Exception as exc:
            _, body = error_response(exc)
            for event in asm.fail(body["error"]):
                yield _sse(event)
        finally:
            release()


def _usage(stream: RequestStream) -> dict[str, Any]:
    return responses_usage(stream.num_prompt_tokens, stream.num_completion_tokens, stream.num_cached_tokens)


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\n".encode() + p.sse_event(event)
