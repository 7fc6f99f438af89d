"""How an embedding request turns its prompt's final hidden states into one vector.

An embedding request (``SamplingParams.pooling`` set) runs its prompt through
the ordinary prefill path and generates nothing: the model runner reads the
decoder's output after its final norm (what Hugging Face returns as
``hidden_states[-1]`` with ``output_hidden_states=True``) and the engine pools
those rows into one vector, in float32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduling.errors import InvalidParameterError

PoolingMode = Literal["last", "mean"]
POOLING_MODES: tuple[PoolingMode, ...] = ("last", "mean")


@dataclass(frozen=True, slots=True)
class Pooling:
    """One pooling: which rows, and whether the vector is scaled to unit length.

    ``mode``: ``"last"``, the last prompt token's hidden state (the usual
    choice for decoder embedding models such as Qwen3-Embedding: under causal
    attention only the last token has seen the whole prompt); ``"mean"``, the
    mean over every prompt token's hidden state. ``normalize``: the vector is
    L2-normalised (unit length), as embedding models are compared by cosine.
    """

    mode: PoolingMode
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise InvalidParameterError("pooling", f"mode must be one of {', '.join(POOLING_MODES)}, got {self.mode!r}")
        if not isinstance(self.normalize, bool):
            raise InvalidParameterError("pooling", f"normalize must be a boolean, got {self.normalize!r}")


DEFAULT_POOLING = Pooling("last", True)
