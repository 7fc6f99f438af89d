"""Optional API keys: ``Authorization: Bearer <key>`` checked in constant time.

Keys come from the application's ``api_keys`` argument (serve.yaml or
``flotilla serve --api-key``) or, when that is unset, from the environment
variable ``FLOTILLA_API_KEY`` (several keys separated by commas). With no key
configured, every request is let in. ``/health`` and ``/metrics`` stay open
for load balancers and Prometheus; everything under ``/v1`` and the
tokenizer endpoints need a key.

Each presented key is compared with every configured key through
``hmac.compare_digest`` on SHA-256 digests, so neither the position of the
first differing byte nor the key's length shows in the timing.

``check`` returns who is calling (``KeyOwner``): the hex digest of the key,
or ``None`` when no key is configured. What a key makes and the server keeps
(stored Responses, ``apps.responses.store``) belongs to it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import TypeAlias

from apps.protocol.errors import APIError

API_KEY_ENV = "FLOTILLA_API_KEY"
# The caller a request's key identifies: the SHA-256 hex digest of the key (never the key itself), or None
# on a server without keys (then every caller is the same one).
KeyOwner: TypeAlias = str | None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyAuth:
    """The keys a replica accepts (none: open)."""

    def __init__(self, keys: Sequence[str]) -> None:
        cleaned = [k.strip() for k in keys if k.strip()]
        self._digests = [_digest(k) for k in cleaned]

    @classmethod
    def resolve(cls, keys: str | Sequence[str] | None) -> ApiKeyAuth:
        """From the app argument (a key or a list), else ``$FLOTILLA_API_KEY`` (comma-separated)."""
        if keys is None:
            keys = os.environ.get(API_KEY_ENV, "")
        if isinstance(keys, str):
            keys = keys.split(",")
        return cls(list(keys))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> KeyOwner:
        """The caller's ``KeyOwner``; raise 401 (OpenAI envelope) unless ``authorization`` is
        ``Bearer <a configured key>``."""
        if not self._digests:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        presented = _digest(token.strip())
        ok = False
        for digest in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(presented, digest)
        if scheme.lower() != "bearer" or not ok:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        return presented.hex()
