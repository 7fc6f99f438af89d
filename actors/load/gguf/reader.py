"""Read a GGUF file: its metadata and its tensors' raw (possibly quantized) blocks.

A thin, typed layer over the ``gguf`` package's memory-mapped ``GGUFReader``.
Nothing is dequantized here: ``GGUFTensor.raw`` holds the bytes as stored, so
the quantization step can consume blocks directly; ``actors.load.gguf.dequant``
turns them into floats. Every failure to read is a ``GGUFError`` naming the
file (``param="model"``), never a numpy reshape error from deep inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from scheduling.errors import InvalidParameterError

GGUF_MAGIC = b"GGUF"


class GGUFError(InvalidParameterError):
    """A GGUF file that flotilla cannot use: unreadable, truncated, or of an unsupported kind."""

    def __init__(self, message: str, *, param: str = "model") -> None:
        super().__init__(param, message)


@dataclass(frozen=True)
class GGUFTensor:
    """One stored tensor.

    ``shape`` is in torch order (rows first: ``(out_features, in_features)``
    for a linear weight), the reverse of GGUF's ``ne``. ``raw`` is a read-only
    view of the file: float types come as their numpy dtype in ``shape``;
    block-quantized types (and BF16) as ``uint8`` of shape
    ``(*shape[:-1], bytes_per_row)``.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def type_name(self) -> str:
        return self.qtype.name


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: ``metadata`` maps keys to plain Python values."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path} lacks the GGUF metadata key {key!r}")
        return self.metadata[key]


def read_gguf(path: Path | str) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor index (tensor data stays memory-mapped)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e}") from e
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path, "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):  # a type id newer than this gguf package (or garbage)
            raise GGUFError(f"{path} holds a tensor of an unknown GGML type ({e})") from e
        raise _truncated(path, e) from e
    except (IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise _truncated(path, e) from e

    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {
        t.name: GGUFTensor(t.name, GGMLQuantizationType(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), t.data)
        for t in reader.tensors
    }
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def _truncated(path: Path, e: Exception) -> GGUFError:
    return GGUFError(
        f"{path} is not a complete GGUF file (truncated or corrupt, {path.stat().st_size} bytes): "
        f"{type(e).__name__}: {e}"
    )


def block_layout(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """``(elements_per_block, bytes_per_block)`` of a GGML type."""
    return GGML_QUANT_SIZES[qtype]
