"""One request's OpenAI response pieces: whole choices, stream chunks and logprobs (completions or chat).

Pure: plain dicts from ``SequenceDelta`` lists, no HTTP and no Ray. The
Serve deployment (``apps.server``) builds one per request.
"""

from __future__ import annotations

from typing import Any

from actors.outputs import SequenceDelta
from apps import protocol as p
from scheduling.batch import TokenLogprobs


class ResponseBuilder:
    """Builds one request's choices and chunks (completions or chat)."""

    def __init__(self, kind: str, model: str, created: int, want_logprobs: bool, decode: p.Decode) -> None:
        self.kind, self.model, self.created = kind, model, created
        self.want_logprobs = want_logprobs
        self.decode = decode
        self._offsets: dict[int, int] = {}  # sequence index -> text offset of its next token

    def logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return p.chat_logprobs(entries, self.decode)
        lp = p.completion_logprobs(entries, self.decode, text_offset=self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
        return lp

    def choice(self, index: int, text: str, finish: str | None, entries: list[TokenLogprobs]) -> dict[str, Any]:
        build = p.completion_choice if self.kind == "completion" else p.chat_choice
        return build(index, text, finish, self.logprobs(index, entries))

    def chunk(self, request_id: str, deltas: list[SequenceDelta]) -> dict[str, Any] | None:
        """One chunk for ``deltas`` (several steps' worth when the reader fell behind), or None if empty.

        A sequence's deltas merge into one choice: texts and logprobs joined,
        the last finish reason kept.
        """
        merged: dict[int, tuple[str, list[TokenLogprobs], str | None]] = {}
        for d in deltas:
            text, entries, finish = merged.get(d.index, ("", [], None))
            merged[d.index] = (text + d.text, entries + (d.logprobs or []), d.finish_reason or finish)
        choices = []
        for index, (text, entries, finish) in merged.items():
            if not (text or finish or entries):
                continue
            lp = self.logprobs(index, entries)
            build = p.completion_choice if self.kind == "completion" else p.chat_delta_choice
            choices.append(build(index, text, finish, lp))
        if not choices:
            return None
        wrap = p.completion_chunk if self.kind == "completion" else p.chat_completion_chunk
        return wrap(request_id, self.model, self.created, choices)
