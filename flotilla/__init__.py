"""flotilla's Python client SDK.

Importable with only aiohttp installed: no torch, no Ray, no pydantic.

    from flotilla import Client
    with Client() as client:                       # FLOTILLA_BASE_URL or http://127.0.0.1:8000
        print(client.complete("Hello", max_tokens=8).text)
        weather = client.parse("Weather in Oslo?", response_format=Weather).parsed   # a pydantic model
        calls = client.chat("Weather in Oslo?", tools=[WEATHER_TOOL]).tool_calls     # ToolCall list
        first = client.responses("Hi", instructions="Be brief.")                     # /v1/responses
        print(client.responses("And?", previous_response_id=first.id).text)
        vectors = client.embed(["a", "b"]).vectors                                   # /v1/embeddings

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
    MissingDependencyError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServerError,
    StructuredOutputError,
)
from flotilla.params import (
    FunctionSpec,
    JsonSchemaSpec,
    NamedToolChoice,
    ResponseFormat,
    ResponsesFormat,
    ResponsesNamedToolChoice,
    ResponsesText,
    ResponsesTool,
    ResponsesToolChoice,
    StructuredOutputs,
    Tool,
    ToolChoice,
)
from flotilla.prometheus import MetricsParseError, Sample, parse_prometheus
from flotilla.schema import SchemaModel
from flotilla.streaming import AsyncStream
from flotilla.structured import ParsedCompletion
from flotilla.tools import ToolCall, ToolCallDelta
from flotilla.transport import InvalidResponseError
from flotilla.types import (
    BatchResult,
    Choice,
    Completion,
    Embeddings,
    Health,
    Model,
    Response,
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
    "Embeddings",
    "FlotillaError",
    "FunctionSpec",
    "Health",
    "InvalidResponseError",
    "JsonSchemaSpec",
    "MetricsParseError",
    "MissingDependencyError",
    "Model",
    "NamedToolChoice",
    "NotFoundError",
    "ParsedCompletion",
    "PayloadTooLargeError",
    "RateLimitError",
    "Response",
    "ResponseFormat",
    "ResponsesFormat",
    "ResponsesNamedToolChoice",
    "ResponsesText",
    "ResponsesTool",
    "ResponsesToolChoice",
    "Sample",
    "SchemaModel",
    "ServerError",
    "Stream",
    "StreamDelta",
    "StructuredOutputError",
    "StructuredOutputs",
    "Tokens",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "Usage",
    "__version__",
    "parse_prometheus",
]
