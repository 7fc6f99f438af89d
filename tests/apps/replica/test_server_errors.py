"""Every row of the error list, over live HTTP: status, OpenAI envelope, ``param``; the server answers after each."""

from __future__ import annotations

from typing import Any

import pytest

from tests.serve_harness import ENGINE, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

MAX_LEN = int(ENGINE["max_model_len"])
VOCAB_OVERFLOW = 10**7
TOO_BIG = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (endpoint, body, status, param); bytes bodies are sent verbatim.
ROWS: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    (C, b"[1, 2, 3]", 400, None),                                   # not a JSON object
    (C, b'"prompt"', 400, None),
    (C, b"{not json", 400, None),
    (C, {"model": "tiny"}, 400, "prompt"),                          # missing prompt
    (C, {"prompt": ""}, 400, "prompt"),                             # empty prompt
    (C, {"prompt": []}, 400, "prompt"),
    (CHAT, {"model": "tiny"}, 400, "messages"),                     # missing messages
    (CHAT, {"messages": []}, 400, "messages"),                      # empty messages
    (C, {"prompt": 5}, 400, "prompt"),                              # wrong types
    (C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": [1] * MAX_LEN}, 400, "prompt"),                  # prompt >= max_model_len
    (C, {"prompt": [1] * 100, "max_tokens": MAX_LEN}, 400, "max_tokens"),  # prompt + max_tokens > len
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),      # max_tokens < 1
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "hi", "min_p": -0.1}, 400, "min_p"),
    (C, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (CHAT, {"messages": MSG, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 1000}, 400, "n"),
    (C, {"prompt": "hi", "stop": ""}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ["ok", ""]}, 400, "stop"),
    (C, {"prompt": [1, VOCAB_OVERFLOW]}, 400, "prompt"),           # token id outside the vocabulary
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"model": "nope", "prompt": "hi"}, 404, "model"),           # unknown model
    (CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    (C, TOO_BIG, 413, None),                                        # body over the limit
    (CHAT, TOO_BIG, 413, None),
]


def _id(row: tuple[str, bytes | dict[str, Any], int, str | None]) -> str:
    path, body, status, param = row
    return f"{path.rsplit('/', 1)[-1]}-{status}-{param}-{ROWS.index(row)}"


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_error_row_then_success(server: str, row: tuple[str, bytes | dict[str, Any], int, str | None]) -> None:
    path, body, status, param = row
    got, err = http(f"{server}{path}", body)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    ok, resp = http(f"{server}{C}", {"prompt": "hi", "max_tokens": 1})
    assert ok == 200 and resp["usage"]["completion_tokens"] == 1


def test_budget_error_gives_both_numbers(server: str) -> None:
    _, err = http(f"{server}{C}", {"prompt": [1] * 100, "max_tokens": MAX_LEN})
    message = err["error"]["message"]
    assert "100" in message and str(MAX_LEN) in message and str(100 + MAX_LEN) in message


def test_errors_also_arrive_for_streaming_requests(server: str) -> None:
    got, err = http(f"{server}{C}", {"prompt": "hi", "stream": True, "top_k": -5})
    assert got == 400 and err["error"]["param"] == "top_k"
