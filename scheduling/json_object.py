"""Options given as a JSON object on a command line (or already as a dict): one parser."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from scheduling.errors import InvalidParameterError


def parse_json_object(value: str | dict[str, Any], param: str, known: Iterable[str], what: str) -> dict[str, Any]:
    """``value`` (JSON text or a dict) as a dict whose keys are all in ``known``.

    Every failure is an ``InvalidParameterError`` naming ``param``; ``what``
    names the keys in the message (``field``, ``engine option``).
    """
    names = set(known)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(param, f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParameterError(param, f"must be a JSON object of {what}s, got {type(value).__name__}")
    unknown = sorted(set(value) - names)
    if unknown:
        raise InvalidParameterError(param, f"unknown {what}(s) {unknown}; known: {sorted(names)}")
    return dict(value)
