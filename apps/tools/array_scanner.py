"""The scanner of a "required" tool_choice: ``[{"name": ..., "arguments": ...}, ...]`` -> tool-call events.

The grammar fixes the layout, so one pass over the characters suffices: a
call opens when its ``name`` string closes, and its ``arguments`` stream as
they arrive, whitespace outside strings dropped (a call whose arguments come
before its name holds them until the name). Whitespace anywhere and either
key order are fine; text after the closing ``]`` is ignored. A call object
that never names itself (output cut by max_tokens) makes no call.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from apps.tools.scanners import ToolCallDelta, ToolEvent, new_tool_call_id, opening

_WHITESPACE = " \t\n\r"


class ArrayScanner:
    """``[{"name": ..., "arguments": ...}, ...]``: each call opens at its name and streams its arguments."""

    def __init__(self, new_id: Callable[[], str] = new_tool_call_id) -> None:
        self._new_id = new_id
        self.num_calls = 0
        self._depth = 0  # 0: before "[", 1: in the array, 2: in a call object, >2: inside one of its values
        self._in_string = self._escape = False
        self._capture: str | None = None  # "key" or "name": a string at depth 2 being read
        self._buf: list[str] = []
        self._key: str | None = None  # the last key read in the current call object
        self._field: str | None = None  # the key whose value is being read
        self._expect_key = False
        self._in_args = False  # characters are the current call's arguments
        self._named = False  # the current call object has opened its call
        self._pending: list[str] = []  # arguments read before the name
        self._run: list[str] = []  # arguments read in this feed, not yet an event
        self._done = False
        self._events: list[ToolEvent] = []

    def feed(self, text: str) -> list[ToolEvent]:
        for c in text:
            if not self._done:
                self._char(c)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        return self._take()

    def _take(self) -> list[ToolEvent]:
        self._flush()
        events, self._events = self._events, []
        return events

    def _flush(self) -> None:
        if self._run:
            self._events.append(ToolCallDelta(self.num_calls - 1, "".join(self._run)))
            self._run = []

    def _arg(self, c: str) -> None:
        (self._run if self._named else self._pending).append(c)

    def _char(self, c: str) -> None:
        if self._in_string:
            self._string_char(c)
        elif c in _WHITESPACE:
            return
        elif self._depth == 0:
            self._depth = 1 if c == "[" else 0
        elif self._depth == 1:
            if c == "{":
                self._flush()
                self._depth, self._expect_key, self._named = 2, True, False
                self._key = self._field = None
                self._pending = []
            elif c == "]":
                self._done = True
        elif self._depth == 2:
            self._member_char(c)
        else:
            self._nested_char(c)

    def _string_char(self, c: str) -> None:
        if self._in_args:
            self._arg(c)
        elif self._capture is not None:
            self._buf.append(c)
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
            if self._capture is not None:
                self._end_capture()

    def _member_char(self, c: str) -> None:
        """A character directly inside a call object: keys, separators and the start of values."""
        if c == ",":
            self._in_args, self._expect_key, self._field = False, True, None
        elif c == "}":
            self._in_args, self._depth = False, 1
            self._flush()
        elif c == ":":
            self._field, self._expect_key = self._key, False
        elif c == '"' and (self._expect_key or self._field == "name"):
            self._in_string, self._capture, self._buf = True, "key" if self._expect_key else "name", [c]
        else:
            if self._field == "arguments":
                self._in_args = True
                self._arg(c)
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1

    def _nested_char(self, c: str) -> None:
        if self._in_args:
            self._arg(c)
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1

    def _end_capture(self) -> None:
        try:
            value = json.loads("".join(self._buf))
        except json.JSONDecodeError:
            value = ""
        kind, self._capture = self._capture, None
        if kind == "key":
            self._key = value
        elif not self._named:
            self._named = True
            self.num_calls += 1
            self._events.append(opening(self.num_calls - 1, value, self._new_id))
            if self._pending:
                self._events.append(ToolCallDelta(self.num_calls - 1, "".join(self._pending)))
                self._pending = []
