"""The two kinds of generation request, and the response shapes that differ between them.

``/v1/completions`` and ``/v1/chat/completions`` share one path through the
replica (``LLMServer._generate``); what differs is the request body, the id
prefix and the OpenAI objects of the response. ``RequestKind`` names the kind
and ``RequestKind.shape`` holds those objects' builders, so the server and
``ResponseBuilder`` never branch on a string.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apps.protocol import models as p


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """The OpenAI objects of one kind: a whole choice, a streamed choice, a chunk, the whole response."""

    id_prefix: str
    choice: Callable[..., dict[str, Any]]
    delta_choice: Callable[..., dict[str, Any]]
    chunk: Callable[..., dict[str, Any]]
    response: Callable[..., dict[str, Any]]
    opens_with_role: bool  # a chat stream first announces the assistant role, one chunk per choice


class RequestKind(enum.Enum):
    """Which endpoint a generation request came through."""

    COMPLETION = "completion"
    CHAT = "chat"

    @property
    def shape(self) -> ResponseShape:
        return _SHAPES[self]


_SHAPES = {
    RequestKind.COMPLETION: ResponseShape("cmpl", p.completion_choice, p.completion_choice, p.completion_chunk,
                                          p.completion_response, opens_with_role=False),
    RequestKind.CHAT: ResponseShape("chatcmpl", p.chat_choice, p.chat_delta_choice, p.chat_completion_chunk,
                                    p.chat_completion_response, opens_with_role=True),
}
