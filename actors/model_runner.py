"""Runs one ``Batch`` through the model on the paged KV cache and samples.

One ``ModelRunner`` is one tensor-parallel rank: it holds its shard of the
weights and its slice of the KV pool. It knows nothing of requests. With
``world_size > 1`` the caller has joined ``torch.distributed`` first (see
``actors.distributed``): every rank runs every step, and only rank 0 samples.
"""

from __future__ import annotations

import torch

from actors.engine_config import EngineConfig
from actors.loader import load_model
from actors.log import get_logger
from actors.models.layers import ParallelLinear
from actors.sampler import Sampler
from kvcache.attention_backend import AttentionBackend, StepLayout
from kvcache.kv_pool import (
    KVCapacity,
    KVPool,
    available_memory_bytes,
    bytes_per_page,
    plan_num_pages,
)
from kvcache.torch_attention import TorchPagedAttention
from scheduling.batch import Batch, StepOutput

logger = get_logger(__name__.rsplit(".", 1)[-1])


def make_attention_backend(
    config: EngineConfig, pool: KVPool, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """The backend ``config.resolved_attention_backend()`` names: torch paged attention.

    It is the only backend (CPU and CUDA alike); ``EngineConfig`` refuses
    ``flashinfer`` until a FlashInfer backend exists.
    """
    name = config.resolved_attention_backend()
    assert name == "torch", f"no attention backend {name!r}"
    return TorchPagedAttention(pool, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def _default_cpu_pages(config: EngineConfig, device: torch.device, fraction_pages: int) -> int | None:
    """On CPU with no explicit size, hold twice what max_num_seqs full sequences need.

    Host RAM is shared with everything else and zero-filling gigabytes costs
    seconds at start-up; past this size extra pages only feed the prefix
    cache. ``fraction_pages`` (the default share of free RAM) still caps it.
    """
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if config.kv_cache_memory_fraction is not None or device.type != "cpu":
        return None
    wanted = 2 * config.max_num_seqs * -(-config.max_model_len // config.page_size)
    return min(wanted, fraction_pages) if fraction_pages > 0 else None


def _min_across_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the process group (a collective: every rank calls it)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class ModelRunner:
    """Model shard + KV pool + attention backend + sampler for one rank."""

    def __init__(self, config: EngineConfig, *, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = config.resolved_device()
        self.dtype = config.torch_dtype()
        torch.manual_seed(config.seed)
        loaded = load_model(
            config.model, dtype=self.dtype, device=self.device,
            max_model_len=config.max_model_len, rank=rank, world_size=world_size,
        )
        self.model = loaded.model
        if self.device.type == "cpu":
            _pack_linears(self.model)
        self.hf_config = loaded.hf_config
        self.model_path = loaded.path
        m = self.model
        self.vocab_size = m.vocab_size
        per_page = bytes_per_page(m.num_layers, config.page_size, m.num_kv_heads, m.head_dim, self.dtype)
        available = available_memory_bytes(self.device)
        fraction_pages = int(config.memory_fraction() * available) // per_page

        def plan(num_pages: int | None) -> KVCapacity:
            return plan_num_pages(
                num_pages=num_pages, kv_cache_memory_fraction=config.memory_fraction(),
                available_bytes=available, bytes_per_page=per_page, page_size=config.page_size,
                max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            )

        self.capacity: KVCapacity = plan(_default_cpu_pages(config, self.device, fraction_pages))
        if world_size > 1:
            # Page ids are global: page p of every rank holds that page's slice
            # of the KV heads, so every rank must hold the same number of pages.
            # Free memory differs per rank; the smallest pool fits everywhere.
            agreed = _min_across_ranks(self.capacity.num_pages, self.device)
            if agreed != self.capacity.num_pages:
                self.capacity = plan(agreed)
        self.pool = KVPool(
            num_layers=m.num_layers, num_pages=self.capacity.num_pages, page_size=config.page_size,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=self.dtype, device=self.device,
        )
        if rank == 0:  # one report per engine, not one per shard
            logger.info(self.capacity.describe())
            logger.info("attention backend: %s (asked for %s) on %s",
                        config.resolved_attention_backend(), config.attention_backend, self.device)
        self.attn = make_attention_backend(
            config, self.pool, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim
        )
        self.sampler = Sampler(seed=config.seed)

    @property
    def num_pages(self) -> int:
        return self.capacity.num_pages

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        """Forward the step's tokens, then sample one token per sampled sequence.

        Ranks other than 0 run the same forward (and logits: the collectives
        need every rank) but return an empty ``StepOutput``.
        """
        dev = self.device
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=dev)
        self.attn.plan(StepLayout(batch.query_lens, batch.context_lens, batch.page_tables))
        hidden = self.model(input_ids, positions, self.attn)
        if not batch.sample_indices:
            return StepOutput([], [])
        if batch.is_decode_only and len(batch.sample_indices) == batch.num_seqs:
            rows = hidden
        else:
            ends: list[int] = []
            total = 0
            for n in batch.query_lens:
                total += n
                ends.append(total - 1)
            rows = hidden[torch.tensor([ends[i] for i in batch.sample_indices], device=dev)]
        # Every rank computes logits: the vocab-parallel head all-gathers them.
        logits = self.model.compute_logits(rows)
        if self.rank != 0:
            # Only rank 0 samples (its tokens are the step's answer); sampling
            # on every rank would only burn time and advance seeded generators.
            return StepOutput([], [])
        return self.sampler.sample(
            logits, batch.sampling_params, batch.num_output_tokens,
            batch.prompt_token_ids, batch.output_token_ids,
        )


def _pack_linears(model: torch.nn.Module) -> None:
    """Move every linear layer's weight to oneDNN's packed layout (see ``actors.models.cpu_linear``)."""
    layers = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    packed = [layer for layer in layers if layer.pack_for_cpu()]
    extra = sum(layer.weight.numel() * layer.weight.element_size() for layer in packed)
    logger.info("oneDNN-packed %d of %d linear layers; their dense weights stay for 1-2 row products "
                "(+%.1f MiB)", len(packed), len(layers), extra / 2**20)
