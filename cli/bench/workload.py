"""The JSONL workload of the offline benchmarks: ``../shared/peers/make_workload.py``'s format.

One request a line, ``{"prompt_token_ids": [...], "max_tokens": N}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduling.errors import InvalidParameterError


def read_workload(path: str | Path) -> list[dict[str, Any]]:
    """Parse and check a JSONL workload; a bad line is an error naming its number."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError("workload", f"{p} is not a file")
    reqs = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ids, max_tokens = obj["prompt_token_ids"], obj["max_tokens"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InvalidParameterError("workload", f"{p}:{lineno}: {e}") from e
        if not isinstance(ids, list) or not ids or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidParameterError("workload", f"{p}:{lineno}: need a non-empty prompt and max_tokens >= 1")
        reqs.append({"prompt_token_ids": ids, "max_tokens": max_tokens})
    if not reqs:
        raise InvalidParameterError("workload", f"{p} holds no requests")
    return reqs
