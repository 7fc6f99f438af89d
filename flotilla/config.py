"""``ClientConfig``: a client's resolved options (argument, else environment, else default)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from flotilla import defaults
from flotilla.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ClientOptions(TypedDict, total=False):
    """Keyword options of ``Client`` and ``AsyncClient`` (all optional; see ``flotilla.defaults``).

    ``api_key`` (else ``FLOTILLA_API_KEY``) is sent as ``Authorization: Bearer``;
    ``session_id`` as ``X-Flotilla-Session`` on every call; ``timeout`` bounds a
    whole call and ``connect_timeout`` making a connection (seconds);
    ``max_retries``, ``backoff_base`` and ``backoff_cap`` shape retries;
    ``headers`` are added to every request.
    """

    api_key: str | None
    session_id: str | None
    timeout: float | None
    connect_timeout: float | None
    max_retries: int | None
    backoff_base: float | None
    backoff_cap: float | None
    headers: dict[str, str] | None


@dataclass(frozen=True)
class ClientConfig:
    """Everything a client needs to talk to one server; validated when built.

    Build it with :meth:`resolve`, which reads ``FLOTILLA_BASE_URL`` and
    ``FLOTILLA_API_KEY`` for options left as ``None``.
    """

    base_url: str = defaults.BASE_URL
    api_key: str | None = None
    session_id: str | None = None
    timeout_s: float = defaults.TIMEOUT_S
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S
    max_retries: int = defaults.MAX_RETRIES
    backoff_base_s: float = defaults.BACKOFF_BASE_S
    backoff_cap_s: float = defaults.BACKOFF_CAP_S
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"must start with http:// or https://, got {self.base_url!r}", param="base_url")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", param=name)
        if self.max_retries < 0:
            raise ConfigError(f"must be >= 0, got {self.max_retries}", param="max_retries")
        if not 0 <= self.backoff_base_s <= self.backoff_cap_s:
            raise ConfigError(f"backoff_base_s={self.backoff_base_s} must be in [0, backoff_cap_s="
                              f"{self.backoff_cap_s}]", param="backoff_base_s")

    @classmethod
    def resolve(cls, base_url: str | None = None, **options: Unpack[ClientOptions]) -> ClientConfig:
        """Options as given to a client; ``None`` means environment, then ``flotilla.defaults``."""
        unknown = set(options) - set(ClientOptions.__annotations__)
        if unknown:
            raise ConfigError("unknown client option", param=sorted(unknown)[0])
        api_key = options.get("api_key")
        timeout, connect_timeout = options.get("timeout"), options.get("connect_timeout")
        max_retries = options.get("max_retries")
        backoff_base, backoff_cap = options.get("backoff_base"), options.get("backoff_cap")
        return cls(
            base_url=base_url or os.environ.get(defaults.ENV_BASE_URL) or defaults.BASE_URL,
            api_key=api_key if api_key is not None else os.environ.get(defaults.ENV_API_KEY) or None,
            session_id=options.get("session_id"),
            timeout_s=defaults.TIMEOUT_S if timeout is None else timeout,
            connect_timeout_s=defaults.CONNECT_TIMEOUT_S if connect_timeout is None else connect_timeout,
            max_retries=defaults.MAX_RETRIES if max_retries is None else max_retries,
            backoff_base_s=defaults.BACKOFF_BASE_S if backoff_base is None else backoff_base,
            backoff_cap_s=defaults.BACKOFF_CAP_S if backoff_cap is None else backoff_cap,
            headers=dict(options.get("headers") or {}),
        )

    def request_headers(self, session_id: str | None = None) -> dict[str, str]:
        """Headers of one request; a per-call ``session_id`` overrides the client's."""
        out = {"User-Agent": defaults.USER_AGENT, **self.headers}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        sid = session_id if session_id is not None else self.session_id
        if sid:
            out[defaults.SESSION_HEADER] = sid
        return out
