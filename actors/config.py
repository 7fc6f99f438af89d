"""The one configuration object of an engine, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, cast

import torch

from actors.quant_methods import INT4_GROUP_SIZES, QUANTIZATION_METHODS
from kvcache.attention.flashinfer import FlashInferKernels, check_flashinfer_settings
from kvcache.attention.names import ATTENTION_BACKENDS
from kvcache.errors import CacheConfigError
from kvcache.kv_dtypes import canonical_kv_dtype
from kvcache.kv_tiers_config import KVTiersConfig
from scheduling.errors import InvalidParameterError
from scheduling.pooling import POOLING_MODES, Pooling, PoolingMode
from scheduling.scheduler_config import SchedulerConfig
from scheduling.spec_config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

MAX_LORA_RANK = 256
# Ray placement-group strategies for the tensor-parallel shards of one engine.
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")

# What attention_kernels must offer (the flashinfer module's two wrapper classes).
_KERNEL_CLASSES = ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine (one replica).

    ``kv_cache_memory_fraction`` is the share of free device memory (free RAM
    on CPU) the KV pool may take, like vLLM's gpu_memory_utilization;
    ``num_kv_pages`` overrides it. ``dtype="auto"`` is float32 on CPU and
    bfloat16 on CUDA. ``executor="ray"`` runs one ``ModelShardActor`` per
    tensor-parallel rank in a placement group built with
    ``placement_strategy`` (PACK by default: ranks share a node when they fit,
    which keeps the all-reduce off the network). ``cpu_threads`` is the
    number of torch intra-op threads a scheduler actor's in-process forward
    uses on CPU; None: the whole CPUs Ray reserved for that actor, or, when
    it reserved none, every core the process may run on (set it when several
    replicas share a node). With the Ray executor each shard uses
    ``cpu_threads`` too, else the CPUs reserved for it (one).
    ``attention_backend``: ``torch`` (the paged-attention reference, on CPU
    and CUDA; what ``auto`` resolves to) or ``flashinfer`` (FlashInfer's
    kernels: CUDA with the ``cuda`` extra installed, float16/bfloat16, KV in
    the model dtype (its fp8 path waits, like all quantized KV on CUDA, for a
    device check); refused by name otherwise).
    ``attention_kernels``, for tests only: a module standing in for
    ``flashinfer`` (the CPU emulator in tests/kvcache), with
    ``attention_backend="flashinfer"`` and the local executor; None in the
    product, which imports flashinfer itself. ``kv_cache_dtype``:
    ``auto`` (the model dtype), ``int8`` or ``fp8_e4m3`` (alias ``fp8``), one
    byte per element plus a bfloat16 scale per token and kv head
    (``kvcache.kv_dtypes``). ``quantization``: weight-only ``int8``, ``int4``
    or ``compressed-tensors`` (``QUANTIZATION_METHODS``), with
    ``quantization_group_size`` for int4 (None: 32 from GGUF blocks, else
    128). ``grammar_compile_timeout_s``: how long a request waits for its
    structured-output constraint to compile before it is refused (400).
    ``cuda_graphs``: run decode-only steps as CUDA graphs replayed at padded
    batch sizes (``actors.runner.decode_graphs``). None (the default): on
    wherever they can run (CUDA, ``attention_backend="flashinfer"``, one
    shard), off elsewhere; True elsewhere is refused by name. With
    ``attention_kernels`` (the tests' emulator) on the CPU, True runs the
    same static-buffer path eagerly, without capturing.
    ``enable_lora``: serve LoRA adapters (``actors.runner.lora_manager``),
    up to ``max_loras`` of them in one step (device slots), each of rank at
    most ``max_lora_rank``, with ``max_cpu_loras`` (default ``max_loras``)
    kept read on the host. LoRA runs eagerly (its segment shapes change
    every step: no CUDA graphs) and with n-gram speculation only (a draft
    model or self-draft would propose without the adapter).
    ``kv_offload``: the KV tiers below the pool (``kvcache.kv_tiers_config.KVTiersConfig``:
    host memory, local disk, the cluster store; a dict or its JSON text),
    with prefix caching only; None: off.
    ``expert_parallel``: in a mixture-of-experts model, each of the
    ``tensor_parallel_size`` shards holds a slice of the experts whole
    (``actors.models.moe``) instead of a slice of every expert (the
    default); attention stays tensor-parallel either way. Refused for a
    dense model when the model loads.
    ``embedding_pooling`` (``POOLING_MODES``: ``last``, the usual choice for
    decoder embedding models such as Qwen3-Embedding, or ``mean``) and
    ``embedding_normalize`` (L2-normalised vectors): how this model's
    embedding requests are pooled unless a request says otherwise
    (``EngineConfig.pooling``, ``scheduling.pooling``).
    Errors name the parameter and, where two settings disagree, both values.
    """

    model: str = "tiny"
    dtype: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    kv_cache_memory_fraction: float | None = None
    num_kv_pages: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"
    executor: str = "local"
    placement_strategy: str = "PACK"
    device: str = "auto"
    seed: int = 0
    cpu_threads: int | None = None
    speculative_config: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quantization_group_size: int | None = None
    grammar_compile_timeout_s: float = 10.0
    attention_kernels: FlashInferKernels | None = None
    cuda_graphs: bool | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_offload: KVTiersConfig | None = None
    expert_parallel: bool = False
    embedding_pooling: str = "last"
    embedding_normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidParameterError("model", "must be a model folder, hub id or embedded name")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidParameterError("dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_memory_fraction is not None and not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise InvalidParameterError(
                "kv_cache_memory_fraction", f"must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise InvalidParameterError("num_kv_pages", f"must be >= 1, got {self.num_kv_pages}")
        if self.tensor_parallel_size < 1:
            raise InvalidParameterError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidParameterError(
                "attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.executor not in ("local", "ray"):
            raise InvalidParameterError("executor", f"must be 'local' or 'ray', got {self.executor!r}")
        if self.tensor_parallel_size > 1 and self.executor != "ray":
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"tensor_parallel_size {self.tensor_parallel_size} needs several shards; "
                f"the in-process executor ({self.executor!r}) runs one: use executor='ray'",
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise InvalidParameterError(
                "placement_strategy",
                f"must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}",
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise InvalidParameterError("device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.cpu_threads is not None and (
            not isinstance(self.cpu_threads, int) or isinstance(self.cpu_threads, bool) or self.cpu_threads < 1
        ):
            raise InvalidParameterError("cpu_threads", f"must be >= 1, got {self.cpu_threads!r}")
        try:
            object.__setattr__(self, "kv_cache_dtype", canonical_kv_dtype(self.kv_cache_dtype))
        except CacheConfigError as e:
            raise InvalidParameterError(e.param, e.message) from None
        self._check_quantization()
        self._check_attention_backend()
        self._check_cuda_graphs()
        if isinstance(self.grammar_compile_timeout_s, bool) or not (
            isinstance(self.grammar_compile_timeout_s, (int, float)) and self.grammar_compile_timeout_s > 0
        ):
            raise InvalidParameterError(
                "grammar_compile_timeout_s", f"must be a number > 0, got {self.grammar_compile_timeout_s!r}"
            )
        # Accepts the dict / JSON text forms (``LLM(speculative_config={...})``, the CLI).
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.embedding_pooling not in POOLING_MODES:
            raise InvalidParameterError(
                "embedding_pooling", f"must be one of {', '.join(POOLING_MODES)}, got {self.embedding_pooling!r}"
            )
        if not isinstance(self.embedding_normalize, bool):
            raise InvalidParameterError("embedding_normalize", f"must be true or false, got {self.embedding_normalize!r}")
        self._check_lora()  # after the parse: it reads speculative_config
        self._check_kv_offload()  # likewise
        self.scheduler_config()  # validates the scheduling limits, naming both values

    def _check_quantization(self) -> None:
        q, group = self.quantization, self.quantization_group_size
        if q is not None and q not in QUANTIZATION_METHODS:
            raise InvalidParameterError(
                "quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)} or None, got {q!r}"
            )
        if group is not None and q != "int4":
            raise InvalidParameterError(
                "quantization_group_size", f"applies to quantization='int4' only, not {q!r}"
            )
        if group is not None and group not in INT4_GROUP_SIZES:
            raise InvalidParameterError(
                "quantization_group_size", f"must be one of {INT4_GROUP_SIZES}, got {group!r}"
            )
        if self.resolved_device().type == "cuda" and (q in ("int8", "int4") or self.kv_cache_dtype != "auto"):
            # The weight-only kernels are torch's CPU ones and the quantized
            # pages are read by the CPU kernel and the torch path; nothing
            # on CUDA has been checked, so it is refused rather than tried.
            param = "quantization" if q in ("int8", "int4") else "kv_cache_dtype"
            value = q if param == "quantization" else self.kv_cache_dtype
            raise InvalidParameterError(param, f"{value!r} is supported on the CPU only, not on CUDA")

    def _check_attention_backend(self) -> None:
        kernels = self.attention_kernels
        if kernels is not None:
            if self.attention_backend != "flashinfer":
                raise InvalidParameterError(
                    "attention_kernels", f"applies to attention_backend='flashinfer' only, not {self.attention_backend!r}"
                )
            if not all(hasattr(kernels, name) for name in _KERNEL_CLASSES):
                raise InvalidParameterError(
                    "attention_kernels", f"must be a module offering {' and '.join(_KERNEL_CLASSES)}, got {kernels!r}"
                )
            if self.executor != "local":
                raise InvalidParameterError(
                    "attention_kernels", "works with executor='local' only: a module does not travel to Ray actors"
                )
        if self.attention_backend != "flashinfer":
            return
        try:
            check_flashinfer_settings(
                device=self.resolved_device(), dtype=self.torch_dtype(), kv_dtype=self.kv_cache_dtype,
                kernels_given=kernels is not None,
            )
        except CacheConfigError as e:
            raise InvalidParameterError(e.param, e.message) from None

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise InvalidParameterError("max_lora_rank", f"must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise InvalidParameterError(
                "max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras}), got {cpu!r}"
            )
        if not self.enable_lora:
            return
        spec = self.speculative_config
        if spec is not None and spec.drafts_in_runner:
            raise InvalidParameterError(
                "speculative_config", "a draft model or self-draft proposes without the request's LoRA adapter: "
                "with enable_lora use the ngram method",
            )  # fmt: skip

    def _check_kv_offload(self) -> None:
        try:
            offload = KVTiersConfig.parse(self.kv_offload)
        except (CacheConfigError, TypeError) as e:
            raise InvalidParameterError("kv_offload", str(e).removeprefix("kv_offload: ")) from None
        object.__setattr__(self, "kv_offload", offload)
        if offload is None:
            return
        if not self.enable_prefix_caching:
            raise InvalidParameterError(
                "kv_offload", "the KV tiers keep and find prefix-cache pages: they need enable_prefix_caching")
        spec = self.speculative_config
        if spec is not None and spec.model is not None:
            raise InvalidParameterError(
                "kv_offload", f"the draft model {spec.model!r} drafts from a KV pool of its own, which pages "
                f"loaded from the KV tiers never fill: draft with method 'ngram' or a self-draft ('layers')",
            )  # fmt: skip

    @property
    def pooling(self) -> Pooling:
        """This model's default pooling for embedding requests (``embedding_pooling``, ``embedding_normalize``)."""
        return Pooling(cast(PoolingMode, self.embedding_pooling), self.embedding_normalize)  # validated when built

    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def _check_cuda_graphs(self) -> None:
        graphs = self.cuda_graphs
        if graphs is not None and not isinstance(graphs, bool):
            raise InvalidParameterError("cuda_graphs", f"must be true, false or None (auto), got {graphs!r}")
        if not graphs:
            return
        device = self.resolved_device()
        if device.type != "cuda" and self.attention_kernels is None:
            raise InvalidParameterError(
                "cuda_graphs", f"CUDA graphs need a CUDA device, and the device is {device.type}: "
                f"set cuda_graphs to false or leave it unset",
            )  # fmt: skip
        if self.resolved_attention_backend() != "flashinfer":
            raise InvalidParameterError(
                "cuda_graphs", f"CUDA graphs need attention_backend='flashinfer', not {self.attention_backend!r}: "
                f"the torch backend's gathers change shape with every step",
            )  # fmt: skip
        if self.enable_lora:
            raise InvalidParameterError(
                "cuda_graphs", "CUDA graphs cannot replay LoRA steps (their adapter segments change shape every "
                "step): set cuda_graphs to false or leave it unset with enable_lora",
            )  # fmt: skip
        if self.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "cuda_graphs", f"CUDA graphs run with one shard for now, not tensor_parallel_size "
                f"{self.tensor_parallel_size} (all-reduces inside a graph have not been checked on a device)",
            )  # fmt: skip

    def resolved_cuda_graphs(self) -> bool:
        """Whether decode steps run on static buffers (as CUDA graphs on CUDA): ``cuda_graphs``, or where it can."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return (
            self.resolved_device().type == "cuda" and self.attention_kernels is None
            and self.resolved_attention_backend() == "flashinfer" and self.tensor_parallel_size == 1
            and not self.enable_lora
        )  # fmt: skip

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments; an unknown one is an error that names it."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise InvalidParameterError(name, f"unknown engine option; known: {sorted(known)}")
        return cls(**kwargs)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            page_size=self.page_size,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            speculative_config=self.speculative_config,
            max_loras=self.max_loras if self.enable_lora else 0,
        )

    def resolved_attention_backend(self) -> str:
        """The backend that runs: ``flashinfer`` when asked for, else ``torch`` (``auto`` too)."""
        return "flashinfer" if self.attention_backend == "flashinfer" else "torch"

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def memory_fraction(self) -> float:
        """The KV share of free memory: 0.9 of a GPU, 0.1 of host RAM by default."""
        if self.kv_cache_memory_fraction is not None:
            return self.kv_cache_memory_fraction
        return 0.9 if self.resolved_device().type == "cuda" else 0.1


def scoped_to_app(config: EngineConfig, app: str) -> EngineConfig:
    """``config`` with its cluster KV tier in ``app``'s stores (a Serve replica's; ``flotilla kv drop`` drops
    them); unchanged without a cluster tier or where ``cluster_app`` is set already."""
    offload = config.kv_offload
    if offload is None or not offload.cluster or offload.cluster_app is not None:
        return config
    return replace(config, kv_offload=replace(offload, cluster_app=app))
