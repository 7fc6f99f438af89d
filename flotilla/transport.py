"""One aiohttp session per client: headers, timeouts, error mapping and retried requests.

Every HTTP exchange of the SDK goes through :class:`Transport`: ``request``
for whole answers (retried per ``RetryPolicy``) and ``open`` for one attempt
at a streamed answer (the stream decides about retries, see
``flotilla.streaming``). aiohttp's exceptions never leave this module: they
become ``APIConnectionError`` / ``APITimeoutError``, and error statuses
become the ``APIStatusError`` subclass for the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from flotilla import defaults
from flotilla.config import ClientConfig
from flotilla.errors import APIConnectionError, APITimeoutError, FlotillaError, from_response
from flotilla.retry import RetryPolicy, parse_retry_after


class InvalidResponseError(FlotillaError):
    """The server's answer is not what the API specifies (e.g. a 200 that is not JSON)."""


@dataclass(frozen=True)
class Reply:
    """A whole answer: status, raw body and content type."""

    status: int
    body: bytes
    content_type: str

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise InvalidResponseError(f"expected JSON, got {self.body[:200]!r}") from None


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn aiohttp and socket failures inside the block into the SDK's connection errors."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:  # before TimeoutError: it is one
        raise APITimeoutError(f"{what}: timed out connecting", during_connect=True) from exc
    except TimeoutError as exc:
        raise APITimeoutError(f"{what}: timed out") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise APIConnectionError(f"{what}: {type(exc).__name__}: {exc}") from exc


async def _raise_for_status(resp: aiohttp.ClientResponse, what: str, accept: frozenset[int]) -> None:
    if resp.status < 400 or resp.status in accept:
        return
    with translate_errors(what):
        raw = await resp.read()
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = None
    raise from_response(resp.status, body, retry_after=parse_retry_after(resp.headers.get("Retry-After")),
                        fallback=raw[:200].decode("utf-8", "replace"))


class Transport:
    """The HTTP side of a client. The session is made on first use, in the running loop."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.retry = RetryPolicy(config.max_retries, config.backoff_base_s, config.backoff_cap_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to one loop; a client reused under a new loop gets a new one.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=defaults.MAX_CONNECTIONS))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    def _timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=timeout_s if timeout_s is not None else self.config.timeout_s,
                                     sock_connect=self.config.connect_timeout_s)

    async def open(self, method: str, path: str, body: Any = None, *, session_id: str | None = None,
                   timeout: float | None = None, accept: frozenset[int] = frozenset()) -> aiohttp.ClientResponse:
        """One attempt: the response, its body unread (the caller closes it).

        An error status raises its typed error, unless it is in ``accept``.
        """
        what = f"{method} {path}"
        headers = self.config.request_headers(session_id)
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
            model = body.get("model") if isinstance(body, dict) else None
            if isinstance(model, str) and model:  # the router cannot read the body (cluster.request_router)
                headers[defaults.MODEL_HEADER] = model
            previous = body.get("previous_response_id") if isinstance(body, dict) else None
            if isinstance(previous, str) and previous:  # only the replica that stored it can continue it
                headers[defaults.PREVIOUS_RESPONSE_HEADER] = previous
        with translate_errors(what):
            resp = await self._http().request(method, self.config.base_url + path, data=data,
                                              headers=headers, timeout=self._timeout(timeout))
        try:
            await _raise_for_status(resp, what, accept)
        except BaseException:
            resp.close()
            raise
        return resp

    async def _once(self, method: str, path: str, body: Any, session_id: str | None, timeout: float | None,
                    ok_statuses: frozenset[int]) -> Reply:
        resp = await self.open(method, path, body, session_id=session_id, timeout=timeout, accept=ok_statuses)
        async with resp:
            with translate_errors(f"{method} {path}"):
                raw = await resp.read()
        return Reply(resp.status, raw, resp.content_type)

    async def request(self, method: str, path: str, body: Any = None, *, session_id: str | None = None,
                      timeout: float | None = None, retry: bool = True,
                      ok_statuses: frozenset[int] = frozenset()) -> Reply:
        """A whole answer, retried per the client's policy unless ``retry`` is false.

        ``ok_statuses`` are error statuses returned as a ``Reply`` (body: the envelope) instead of raised.
        """
        async def attempt() -> Reply:
            return await self._once(method, path, body, session_id, timeout, ok_statuses)

        if not retry:
            return await attempt()
        return await self.retry.call(attempt)
