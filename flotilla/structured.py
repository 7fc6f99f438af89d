"""``ParsedCompletion``: a chat completion whose reply was checked against the schema ``parse`` sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from flotilla.errors import StructuredOutputError
from flotilla.schema import OutputSchema
from flotilla.tools import ToolCall
from flotilla.transport import InvalidResponseError
from flotilla.types import Completion, Usage

T = TypeVar("T")


@dataclass(frozen=True)
class ParsedCompletion(Generic[T]):
    """``parsed`` is the first choice's validated object (the model instance, or JSON for a dict schema).

    ``parsed_choices`` has one per choice (``n`` > 1); ``completion`` is the
    reply as the server sent it.
    """

    completion: Completion
    parsed_choices: list[T]

    @property
    def parsed(self) -> T:
        return self.parsed_choices[0]

    @property
    def text(self) -> str:
        """The first choice's raw JSON text."""
        return self.completion.text

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason

    @property
    def usage(self) -> Usage | None:
        return self.completion.usage

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.completion.tool_calls

    @classmethod
    def of(cls, completion: Completion, schema: OutputSchema[T]) -> ParsedCompletion[T]:
        """Check every choice of ``completion`` against ``schema``.

        Raises ``StructuredOutputError`` (with the choice's text, finish_reason
        and the completion) for the first choice that does not match; a reply
        that called a tool instead of answering is one.
        """
        if not completion.choices:
            raise InvalidResponseError("the chat completion has no choices to parse")
        values = []
        for choice in completion.choices:
            what = f"choice {choice.index}" if len(completion.choices) > 1 else "the reply"
            if choice.tool_calls and not choice.text:
                names = ", ".join(repr(c.name) for c in choice.tool_calls)
                raise StructuredOutputError(f"{what} called tools ({names}) instead of answering in the schema",
                                            text=choice.text, finish_reason=choice.finish_reason,
                                            completion=completion)
            try:
                values.append(schema.validate(choice.text, finish_reason=choice.finish_reason, what=what))
            except StructuredOutputError as exc:
                exc.completion = completion
                raise
        return cls(completion, values)
