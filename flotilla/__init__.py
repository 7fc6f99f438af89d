"""flotilla's Python client SDK.

Importable with only aiohttp installed: no torch, no Ray, no pydantic.

    from flotilla import Client
    with Client() as client:                       # FLOTILLA_BASE_URL or http://127.0.0.1:8000
        print(client.complete("Hello", max_tokens=8).text)

See docs/sdk.md.
"""

from __future__ import annotations

from flotilla.async_client import AsyncClient
from flotilla.client import Client, Stream
from flotilla.config import ClientConfig
from flotilla.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConfigError,
    FlotillaError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServerError,
)
from flotilla.prometheus import MetricsParseError, Sample, parse_prometheus
from flotilla.streaming import AsyncStream
from flotilla.transport import InvalidResponseError
from flotilla.types import (
    BatchResult,
    Choice,
    Completion,
    Health,
    Model,
    StreamDelta,
    Tokens,
    Usage,
)

__version__ = "0.1.0"
__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "BatchResult",
    "Choice",
    "Client",
    "ClientConfig",
    "Completion",
    "ConfigError",
    "FlotillaError",
    "Health",
    "InvalidResponseError",
    "MetricsParseError",
    "Model",
    "NotFoundError",
    "PayloadTooLargeError",
    "RateLimitError",
    "Sample",
    "ServerError",
    "Stream",
    "StreamDelta",
    "Tokens",
    "Usage",
    "__version__",
    "parse_prometheus",
]
