"""Typed user errors. Every error a caller can cause names the parameter at fault."""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A configuration or request parameter has an invalid value.

    ``param`` names the offending parameter so that HTTP layers can put it in
    the OpenAI error envelope and users can find it without reading a trace.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
