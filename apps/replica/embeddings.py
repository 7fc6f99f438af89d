"""``POST /v1/embeddings``: the request model, its engine inputs and the OpenAI ``list`` of embeddings.

Each input is one engine request whose ``SamplingParams.pooling`` is the
model's (``EngineConfig.pooling``: last token by default, or mean;
L2-normalised unless configured otherwise; docs/embeddings.md): the engine
runs it as a prefill, pools the final hidden states and frees its pages
(nothing enters the prefix cache). A list of inputs is one batch, like a
completions batch: the engine schedules its prompts together. The engine
checks each input (its ids against the vocabulary, its length against
``max_model_len``) when it is submitted; ``rename_error`` names the field
``input`` where the engine says ``prompt``.

``encoding_format``: ``float`` (a JSON array) or ``base64`` (the vector's
float32 little-endian bytes, what openai-python asks for by default and
decodes). ``dimensions``: the model's vectors (its final hidden states, of
``hidden_size`` entries: ``embedding_size``) cannot be shortened, so any value
but their own length is refused with the body, before anything is computed.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from apps.inputs.params import prompt_batch
from apps.outputs.stream_fanout import RequestStream
from apps.protocol.errors import renamed
from scheduling.errors import InvalidParameterError

Vector = list[float]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (unknown fields ignored, as on the other endpoints)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None  # None: float, as OpenAI's default
    dimensions: int | None = None
    user: str | None = None


def embedding_size(model_path: Path) -> int:
    """The length of the model's vectors: they pool its final hidden states, of ``hidden_size`` entries."""
    return int(json.loads((model_path / "config.json").read_text())["hidden_size"])


def check_dimensions(req: EmbeddingRequest, size: int) -> None:
    """Refuse a ``dimensions`` other than ``size``, the model's vectors' own length (they cannot be shortened)."""
    if req.dimensions is not None and req.dimensions != size:
        raise InvalidParameterError("dimensions", f"this model's embeddings have {size} dimensions and cannot "
                                                  f"be shortened to {req.dimensions}; leave dimensions unset")


def embedding_inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    """The inputs in order, each a string or token ids (``[1, 2]`` is one input; ``[[1], [2]]`` two)."""
    return prompt_batch(req.input, "input")


# The engine names a prompt "prompt" when it refuses one (an id outside the vocabulary, over max_model_len).
ENGINE_TO_EMBEDDINGS = {"prompt": "input"}


def rename_error(exc: BaseException) -> BaseException:
    """``exc`` naming ``input`` where the engine named ``prompt``."""
    return renamed(exc, ENGINE_TO_EMBEDDINGS)


async def collect(stream: RequestStream) -> list[Vector]:
    """Each input's vector, in input order (an engine failure raises ``APIError``, as for generation)."""
    vectors: dict[int, Vector] = {}
    while not stream.done:
        delta = await stream.next()
        if delta.embedding is not None:
            vectors[delta.index] = delta.embedding
    missing = [i for i in range(stream.n) if i not in vectors]
    assert not missing, f"inputs {missing} finished without an embedding"
    return [vectors[i] for i in range(stream.n)]


def encode(vector: Vector, encoding_format: str | None) -> Vector | str:
    """A vector as the response carries it: floats, or base64 of float32 little-endian."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_response(req: EmbeddingRequest, model: str, vectors: list[Vector],
                       num_prompt_tokens: int) -> dict[str, object]:
    """The OpenAI ``list`` object (``dimensions`` was checked with the body: ``check_dimensions``)."""
    data = [{"object": "embedding", "index": i, "embedding": encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}
