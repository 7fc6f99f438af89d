"""Generated text -> tool calls, incrementally: one scanner per choice, fed each delta's text.

A scanner turns text into *events*: content text (``str``) and
``ToolCallDelta``s (a call's first delta carries its ``id`` and ``name`` with
empty arguments; later ones extend its ``arguments``). Streams send the events
as they come; a whole response folds the same events (``fold_tool_calls``),
so the two always agree.

Arguments are the generated JSON with whitespace outside strings removed
(compact JSON text, streamable a character at a time); Hermes blocks, which
are parsed whole, are re-serialised compactly.

- ``NamedScanner``: the whole output is one call's arguments (a named tool_choice).
- ``apps.tools.array_scanner.ArrayScanner``: the output is
  ``[{"name": ..., "arguments": ...}, ...]`` (tool_choice "required").
- ``HermesScanner``: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks
  in free text (tool_choice "auto"). A block becomes a call once it closes,
  parses and names an offered tool; otherwise it stays content. Whitespace
  around calls is dropped, and a possible opening tag is held back until it
  is decided.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_WHITESPACE = " \t\n\r"


def new_tool_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Part of tool call ``index`` of one choice; the first has ``id`` and ``name``, the rest add ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    @property
    def opens(self) -> bool:
        return self.id is not None


ToolEvent = str | ToolCallDelta  # a str is content text


class ToolScanner(Protocol):
    """Feed every piece of a choice's text in order, then ``finish`` once."""

    num_calls: int

    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


def fold_tool_calls(events: Iterable[ToolEvent]) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a choice's events, tool calls as OpenAI message objects."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif event.opens:
            assert event.index == len(calls), (event.index, len(calls))
            calls.append({"id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": event.arguments}})
        else:
            calls[event.index]["function"]["arguments"] += event.arguments
    return "".join(content), calls


def opening(index: int, name: str, new_id: Callable[[], str]) -> ToolCallDelta:
    """The first delta of call ``index``: a fresh id, the name, no arguments yet."""
    return ToolCallDelta(index, "", new_id(), name)


class Compactor:
    """JSON text without the whitespace outside strings, a piece at a time."""

    def __init__(self) -> None:
        self.in_string = self.escape = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for c in text:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c in _WHITESPACE:
                continue
            elif c == '"':
                self.in_string = True
            out.append(c)
        return "".join(out)


class NamedScanner:
    """The output is the arguments of one call to ``name``; the call opens before any text."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_tool_call_id) -> None:
        self.name, self._new_id = name, new_id
        self.num_calls = 0
        self._compact = Compactor()

    def _open(self) -> list[ToolEvent]:
        if self.num_calls:
            return []
        self.num_calls = 1
        return [opening(0, self.name, self._new_id)]

    def feed(self, text: str) -> list[ToolEvent]:
        events = self._open()
        arguments = self._compact.feed(text)
        if arguments:
            events.append(ToolCallDelta(0, arguments))
        return events

    def finish(self) -> list[ToolEvent]:
        return self._open()


class HermesScanner:
    """Free text with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks naming ``names``."""

    def __init__(self, names: frozenset[str], new_id: Callable[[], str] = new_tool_call_id) -> None:
        self.names, self._new_id = names, new_id
        self.num_calls = 0
        self._buf = ""
        self._inside = False
        self._held_space = ""  # trailing whitespace of the content so far: dropped if a call follows
        self._strip_next = False  # drop whitespace that follows a call

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[ToolEvent]:
        events = self._drain(final=True)
        if self._held_space and not self.num_calls:
            events.append(self._held_space)
        self._held_space = ""
        return events

    def _drain(self, *, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while True:
            if not self._inside:
                at = self._buf.find(OPEN_TAG)
                if at < 0:
                    keep = 0 if final else _partial_tag(self._buf, OPEN_TAG)
                    self._content(events, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                self._content(events, self._buf[:at])
                self._buf, self._inside = self._buf[at + len(OPEN_TAG):], True
            else:
                at = self._buf.find(CLOSE_TAG)
                if at < 0:
                    if final:
                        self._content(events, OPEN_TAG + self._buf)
                        self._buf = ""
                    return events
                block = self._buf[:at]
                self._buf, self._inside = self._buf[at + len(CLOSE_TAG):], False
                call = self._parse(block)
                if call is None:
                    self._content(events, OPEN_TAG + block + CLOSE_TAG)
                else:
                    self._held_space, self._strip_next = "", True
                    events.append(opening(self.num_calls, call[0], self._new_id))
                    events.append(ToolCallDelta(self.num_calls, call[1]))
                    self.num_calls += 1

    def _content(self, events: list[ToolEvent], text: str) -> None:
        if self._strip_next:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._strip_next = False
        text = self._held_space + text
        kept = text.rstrip(_WHITESPACE)
        self._held_space = text[len(kept):]
        if kept:
            events.append(kept)

    def _parse(self, block: str) -> tuple[str, str] | None:
        """``(name, compact arguments)`` of a block that is a call to an offered tool, else None."""
        try:
            call = json.loads(block)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
