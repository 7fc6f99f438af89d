"""Typed user errors. Every error a caller can cause names the parameter at fault."""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[InvalidParameterError], param: str, message: str) -> InvalidParameterError:
    """Unpickle without calling ``__init__``: subclasses have other signatures."""
    err = cls.__new__(cls)
    InvalidParameterError.__init__(err, param, message)
    return err


class InvalidParameterError(ValueError):
    """A configuration or request parameter has an invalid value.

    ``param`` names the offending parameter so that HTTP layers can put it in
    the OpenAI error envelope and users can find it without reading a trace.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles errors across actor boundaries; keep class, param and message.
        return (_rebuild, (type(self), self.param, self.message))
