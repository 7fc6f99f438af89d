"""Decide, before any weight is read, how ``load_model`` quantizes a checkpoint.

``quantization`` (the engine setting) and the checkpoint together give one
``QuantPlan``:

* ``None`` on a plain checkpoint: float weights, nothing to do.
* ``None`` or ``"compressed-tensors"`` on a compressed-tensors checkpoint: its
  int4 codes load as they are (``source="compressed-tensors"``), as vLLM does;
  ``"int8"``/``"int4"`` on it are refused (it is quantized already), and
  ``"compressed-tensors"`` on a plain checkpoint is refused.
* ``"int8"``: every linear and the LM head quantized per output channel from
  the float weights after loading.
* ``"int4"``: linears in groups of ``group_size`` (default 128) from the float
  weights; from a folder converted from a GGUF file whose linears are
  Q4_0/Q4_1, those blocks load directly (``source="gguf"``, groups of 32; any
  other group size is refused). The LM head is int8 either way.

Every refusal is an ``InvalidParameterError`` naming the setting at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.load.gguf import q4_blocks
from actors.load.gguf.archs import gguf_architecture
from actors.load.gguf.convert import gguf_source
from actors.load.gguf.reader import GGUFTensor, read_gguf
from actors.load.quant import compressed_tensors as ct
from actors.models.layers import ParallelLinear
from scheduling.errors import InvalidParameterError

METHODS = ("int8", "int4", "compressed-tensors")
DEFAULT_INT4_GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantPlan:
    """``method`` (``int8``, ``int4`` or None for float), its ``group_size`` (int4), and
    ``source``: ``float`` (quantized at load), ``gguf`` (Q4 blocks, and Q8_0 vocab
    blocks, in ``gguf_tensors``, by Hugging Face name, the rest from floats) or ``compressed-tensors`` (``ct_scheme``)."""

    method: str | None = None
    group_size: int | None = None
    source: str = "float"
    gguf_path: Path | None = None
    gguf_tensors: dict[str, GGUFTensor] = field(default_factory=dict)
    gguf_permuted_qk: bool = False  # the GGUF file's Q/K rows are llama.cpp-permuted (q4_blocks undoes it)
    ct_scheme: ct.CompressedTensorsScheme | None = None

    def describe(self, dtype: torch.dtype) -> str:
        """E.g. ``int4, group 32, 210 linears from Q4 blocks``; the float dtype when not quantized."""
        if self.ct_scheme is not None:
            return self.ct_scheme.describe()
        if self.method is None:
            return str(dtype).removeprefix("torch.")
        if self.method == "int8":
            return "int8 per channel"
        vocab = sum(t.qtype in q4_blocks.DIRECT_VOCAB_TYPES for t in self.gguf_tensors.values())
        blocks = f", {len(self.gguf_tensors) - vocab} linears from GGUF Q4 blocks" if self.source == "gguf" else ""
        head = "lm_head from GGUF Q8_0 blocks" if vocab else "lm_head int8"
        return f"int4, group {self.group_size}{blocks}, {head}"

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse (by name) a model whose linear shapes the int4 kernel cannot take, before loading."""
        if self.method == "int4":
            assert self.group_size is not None
            for module in model.modules():
                if isinstance(module, ParallelLinear):
                    module.check_int4(self.group_size)


def resolve_plan(
    path: Path, raw_config: dict[str, Any], quantization: str | None, group_size: int | None,
    device: torch.device | str,
) -> QuantPlan:
    """The plan for checkpoint folder ``path`` (its ``config.json`` as ``raw_config``)."""
    if quantization is not None and quantization not in METHODS:
        raise InvalidParameterError("quantization", f"must be one of {', '.join(METHODS)} or None, got {quantization!r}")
    if group_size is not None and quantization != "int4":
        raise InvalidParameterError("quantization_group_size", f"applies to quantization='int4' only, not {quantization!r}")
    plan = _resolve(path, raw_config, quantization, group_size)
    if plan.method is not None and torch.device(device).type != "cpu":
        param = "quantization" if quantization is not None else "device"
        raise InvalidParameterError(param, f"weight-only {plan.describe(torch.float32)} runs on the CPU only, "
                                           f"not on {torch.device(device).type}")
    return plan


def _resolve(path: Path, raw: dict[str, Any], quantization: str | None, group_size: int | None) -> QuantPlan:
    qconfig = raw.get("quantization_config")
    if qconfig is not None:
        method = qconfig.get("quant_method")
        if method != ct.QUANT_METHOD:
            raise InvalidParameterError(
                "model", f"{path} is quantized with {method!r}; flotilla loads {ct.QUANT_METHOD!r} checkpoints only"
            )
        if quantization in ("int8", "int4"):
            raise InvalidParameterError(
                "quantization", f"{path} is already quantized ({ct.QUANT_METHOD}); use quantization=None or "
                f"{ct.QUANT_METHOD!r}, not {quantization!r}",
            )
        scheme = ct.read_scheme(qconfig)
        return QuantPlan(method="int4", group_size=scheme.group_size, source=ct.QUANT_METHOD, ct_scheme=scheme)
    if quantization == ct.QUANT_METHOD:
        raise InvalidParameterError(
            "quantization", f"{path} is not a {ct.QUANT_METHOD} checkpoint (its config.json has no quantization_config)"
        )
    if quantization is None or quantization == "int8":
        return QuantPlan(method=quantization)
    direct = _gguf_q4_tensors(path)
    if direct is None:
        return QuantPlan(method="int4", group_size=group_size or DEFAULT_INT4_GROUP_SIZE)
    if group_size is not None and group_size != q4_blocks.GROUP_SIZE:
        raise InvalidParameterError(
            "quantization_group_size",
            f"{path} comes from a GGUF file whose Q4 blocks are groups of {q4_blocks.GROUP_SIZE}, which load "
            f"directly; got {group_size} (leave it unset or use {q4_blocks.GROUP_SIZE})",
        )
    gguf_path, tensors, permuted_qk = direct
    return QuantPlan(method="int4", group_size=q4_blocks.GROUP_SIZE, source="gguf", gguf_path=gguf_path,
                     gguf_tensors=tensors, gguf_permuted_qk=permuted_qk)


def _gguf_q4_tensors(path: Path) -> tuple[Path, dict[str, GGUFTensor], bool] | None:
    """The GGUF file a converted folder came from, its directly loadable linears and whether its
    architecture permutes Q/K rows; None when no linear loads directly."""
    source = gguf_source(path)
    if source is None:
        return None
    gguf_path = Path(source["gguf"])
    if not gguf_path.is_file():
        raise InvalidParameterError(
            "model", f"{path} was converted from {gguf_path}, which is gone; quantization='int4' reads its Q4 blocks"
        )
    g = read_gguf(gguf_path)
    tensors = q4_blocks.direct_int4_tensors(g)
    if not tensors:
        return None
    return gguf_path, {**tensors, **q4_blocks.direct_vocab_tensors(g)}, gguf_architecture(g).permuted_qk
