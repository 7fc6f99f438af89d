"""One request's OpenAI response pieces: whole choices, stream chunks and logprobs (completions or chat).

Pure: plain dicts from ``SequenceDelta`` lists, no HTTP and no Ray. The
Serve deployment (``apps.replica.server``) builds one per request. Deltas carry
*choice* indices (``RequestStream`` maps a batch's prompts onto them).

Streams send one choice per chunk, as OpenAI does with ``n > 1``: a client
that reads ``choices[0]`` of every chunk still sees every choice.

Completion ``text_offset``: where each token starts in the text this
response carries, not the sum of per-token decodes (a piece of a character
decodes to U+FFFD alone; special tokens are not in the text). A delta's
text ends with its tokens' text, after whatever the detokenizer held back
before, so offsets are found from the delta's end: a token whose text ends
the rest starts that much earlier; a piece of a character starts in the
character before; a token with no text of its own (special, or still held
back) starts where the next text will. Offsets never pass the text.

Tool calls (chat with a ``ToolPlan`` that parses the output): each choice's
text goes through its own ``ToolScanner`` (``apps.tools.scanners``), whose
events become the message's content and ``tool_calls``, or the chunks'
deltas. A call's opening delta (id, name, empty arguments) is a chunk of its
own; argument pieces follow in later chunks, as OpenAI streams them. A choice
that called a tool and stopped normally finishes with "tool_calls".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.api import FinishReason, SequenceDelta
from apps.inputs.kind import RequestKind
from apps.protocol import models as p
from apps.tools.deltas import chunk_deltas, finish_reason
from apps.tools.scanners import ToolEvent, ToolScanner, fold_tool_calls
from scheduling.batch import TokenLogprobs


@dataclass(slots=True)
class _Piece:
    """Part of one choice: its text, its tokens' logprobs and their offsets in the choice's text."""

    text: str = ""
    entries: list[TokenLogprobs] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    events: list[ToolEvent] = field(default_factory=list)  # with a tool scanner: its events (text is content)


class ResponseBuilder:
    """Builds one request's choices (``add`` then ``choices``) or chunks (``chunks``)."""

    def __init__(self, kind: RequestKind, model: str, created: int, want_logprobs: bool, decode: p.Decode,
                 token_bytes: p.TokenBytes, num_choices: int,
                 tool_scanner: Callable[[], ToolScanner] | None = None) -> None:
        self.kind, self.model, self.created = kind, model, created
        self.shape = kind.shape
        self.want_logprobs = want_logprobs
        self.decode, self.token_bytes = decode, token_bytes
        self._emitted = [0] * num_choices  # characters of each choice's text so far
        self._whole = [_Piece() for _ in range(num_choices)]  # filled by ``add`` (non-streaming)
        assert tool_scanner is None or kind is RequestKind.CHAT, "tool calls are chat's"
        self._scanners = [tool_scanner() for _ in range(num_choices)] if tool_scanner else None

    def _take(self, piece: _Piece, delta: SequenceDelta) -> None:
        """Append ``delta`` to ``piece``, with the text offsets of its tokens."""
        entries = delta.logprobs or []
        base, position = self._emitted[delta.index], len(delta.text)
        offsets = [0] * len(entries)
        for k in range(len(entries) - 1, -1, -1):
            token = self.decode(entries[k].token_id)
            if token and delta.text.endswith(token, 0, position):
                position -= len(token)
            elif "\ufffd" in token and position > 0:
                position -= 1
            offsets[k] = base + position
        piece.offsets.extend(offsets)
        piece.entries.extend(entries)
        piece.finish = delta.finish_reason or piece.finish
        self._emitted[delta.index] += len(delta.text)
        if self._scanners is None:
            piece.text += delta.text
            return
        scanner = self._scanners[delta.index]
        events = scanner.feed(delta.text)
        if delta.finish_reason is not None:
            events += scanner.finish()
        piece.events.extend(events)
        piece.text += "".join(e for e in events if isinstance(e, str))

    def _logprobs(self, piece: _Piece) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.kind is RequestKind.CHAT:  # chat logprobs carry bytes; completions', text offsets
            return p.chat_logprobs(piece.entries, self.decode, self.token_bytes)
        return p.completion_logprobs(piece.entries, self.decode, piece.offsets)

    # ------------------------------------------------------------- whole
    def add(self, delta: SequenceDelta) -> None:
        """Record one delta of a non-streaming response."""
        self._take(self._whole[delta.index], delta)

    def choices(self, finish_reasons: list[FinishReason | None]) -> list[dict[str, Any]]:
        """Every choice of a non-streaming response, in index order."""
        if self._scanners is None:
            return [self.shape.choice(i, piece.text, finish_reason(finish_reasons[i], False), self._logprobs(piece))
                    for i, piece in enumerate(self._whole)]
        out = []
        for i, piece in enumerate(self._whole):
            content, calls = fold_tool_calls(piece.events)
            finish = finish_reason(finish_reasons[i], bool(calls))
            out.append(p.chat_choice(i, content if content or not calls else None, finish,
                                     self._logprobs(piece), calls))
        return out

    # ------------------------------------------------------------ stream
    def opening_chunks(self, request_id: str) -> list[dict[str, Any]]:
        """A stream's first chunks: for chat, one per choice announcing the assistant role; else none."""
        if not self.shape.opens_with_role:
            return []
        return [self.shape.chunk(request_id, self.model, self.created, [self.shape.delta_choice(i, "", role=True)])
                for i in range(len(self._emitted))]

    def usage_chunk(self, request_id: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: empty ``choices``, the usage."""
        return self.shape.chunk(request_id, self.model, self.created, [], usage)

    def chunks(self, request_id: str, deltas: list[SequenceDelta]) -> list[dict[str, Any]]:
        """One chunk per choice with news in ``deltas`` (several steps' worth when the reader fell behind).

        A choice's deltas merge into its chunk: texts and logprobs joined, the
        last finish reason kept. Choices come in the order they first appear.
        """
        pieces: dict[int, _Piece] = {}
        for d in deltas:
            self._take(pieces.setdefault(d.index, _Piece()), d)
        build, wrap = self.shape.delta_choice, self.shape.chunk
        if self._scanners is None:
            return [wrap(request_id, self.model, self.created, [build(i, pc.text, finish_reason(pc.finish, False), self._logprobs(pc))])
                    for i, pc in pieces.items() if pc.text or pc.finish or pc.entries]
        chunks: list[dict[str, Any]] = []
        for i, pc in pieces.items():
            called = self._scanners[i].num_calls > 0
            choices = chunk_deltas(i, pc.events, finish_reason(pc.finish, called), self._logprobs(pc),
                                   has_tokens=bool(pc.entries))
            chunks.extend(wrap(request_id, self.model, self.created, [choice]) for choice in choices)
        return chunks
