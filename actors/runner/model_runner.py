"""Runs one ``Batch`` through the model on the paged KV cache and samples.

One ``ModelRunner`` is one tensor-parallel rank: it holds its shard of the
weights and its slice of the KV pool. It knows nothing of requests. With
``world_size > 1`` the caller has joined ``torch.distributed`` first (see
``actors.remote.distributed``): every rank runs every step, and only rank 0 samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

import torch
import torch.distributed as dist

from actors.api import LoRAInfo
from actors.commands import AddLoRA, Command, Handlers, PrepareLoRAs, ReadExpertTokens, RemoveLoRA
from actors.config import EngineConfig
from actors.load.loader import load_model
from actors.log import get_logger
from actors.models.layers import ParallelLinear
from actors.runner.decode_graphs import DecodeGraphs, moe_graphs_allowed
from actors.runner.draft_runner import DraftRunner
from actors.runner.lora_manager import LoRAManager
from actors.runner.sampler import SampledRows, Sampler
from actors.runner.spec_verify import count_accepted, expand_sampling, sample_rows
from kvcache import device_copy
from kvcache.attention.backend import AttentionBackend, StepLayout
from kvcache.attention.flashinfer import FlashInferPagedAttention, load_flashinfer
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.device_copy import as_device_tensor
from kvcache.kv_pool import (
    KVCapacity,
    KVPool,
    available_memory_bytes,
    bytes_per_page,
    plan_num_pages,
)
from kvcache.kv_transfer import KVPayloadMismatchError, RankPayloads
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError

logger = get_logger(__name__.rsplit(".", 1)[-1])

R = TypeVar("R")
# What ``ModelRunner.command`` runs, by command type: a new verb is one handler filed here (``actors.commands``).
_HANDLERS: Handlers[ModelRunner] = Handlers("ModelRunner")


def make_attention_backend(
    config: EngineConfig, pool: KVPool, *, num_heads: int, num_kv_heads: int, head_dim: int,
    scale: float | None = None, sliding_windows: Sequence[int | None] | None = None,
) -> AttentionBackend:
    """The backend ``config.resolved_attention_backend()`` names.

    ``flashinfer`` runs ``config.attention_kernels`` when a test gives them
    (the CPU emulator), else the installed flashinfer package, which
    ``EngineConfig`` has checked is there, on CUDA. There is no fallback.
    """
    name = config.resolved_attention_backend()
    if name == "flashinfer":
        kernels = config.attention_kernels if config.attention_kernels is not None else load_flashinfer()
        return FlashInferPagedAttention(
            pool, kernels, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            scale=scale, sliding_windows=sliding_windows,
        )
    assert name == "torch", f"no attention backend {name!r}"
    return TorchPagedAttention(pool, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               scale=scale, sliding_windows=sliding_windows)


def make_drafter(config: EngineConfig, runner: ModelRunner, *, rank: int, world_size: int) -> DraftRunner | None:
    """The drafter ``config.speculative_config`` asks for; None without the ``draft`` method.

    A draft model gets a KV pool of the target's page count (same page ids)
    and a backend of its own; a self-draft uses the target's model and pages.
    """
    spec = config.speculative_config
    if spec is None or not spec.drafts_in_runner:
        return None
    target = runner.model
    if spec.layers is not None:
        if spec.layers >= target.num_layers:
            raise InvalidParameterError(
                "speculative_config",
                f"layers ({spec.layers}) must be below the target's {target.num_layers} layers",
            )
        return DraftRunner(target, runner.attn, num_layers=spec.layers, shares_target_kv=True)
    assert spec.model is not None
    draft = load_model(
        spec.model, dtype=runner.dtype, device=runner.device,
        max_model_len=config.max_model_len, rank=rank, world_size=world_size,
    ).model
    if draft.vocab_size != target.vocab_size:
        raise InvalidParameterError(
            "speculative_config",
            f"the draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.vocab_size}: a draft needs the target's tokenizer",
        )
    if runner.device.type == "cpu":
        _pack_linears(draft)
    pool = KVPool(
        num_layers=draft.num_layers, num_pages=runner.capacity.num_pages, page_size=config.page_size,
        num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim, dtype=runner.dtype, device=runner.device,
        kv_dtype=config.kv_cache_dtype,
    )
    if rank == 0:
        logger.info("draft model %s: KV pool of %d pages, %.1f MiB", spec.model, pool.num_pages,
                    pool.total_bytes / 2**20)
    attn = make_attention_backend(
        config, pool, num_heads=draft.num_heads, num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim,
        scale=draft.scale, sliding_windows=draft.sliding_windows,
    )
    return DraftRunner(draft, attn, num_layers=None, shares_target_kv=False)


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
            quantization=config.quantization, quantization_group_size=config.quantization_group_size,
            expert_parallel=config.expert_parallel,
        )
        self.model = loaded.model
        if self.device.type == "cpu":
            _pack_linears(self.model)
        self.hf_config = loaded.hf_config
        self.model_path = loaded.path
        m = self.model
        self.vocab_size = m.vocab_size
        per_page = bytes_per_page(
            m.num_layers, config.page_size, m.num_kv_heads, m.head_dim, self.dtype, config.kv_cache_dtype
        )
        kv_name = str(self.dtype).removeprefix("torch.") if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        self.lora: LoRAManager | None = None
        if config.enable_lora:  # before the free memory is measured: the KV pool is sized around its slots
            self.lora = LoRAManager(
                m.model.layers, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                max_cpu_loras=config.resolved_max_cpu_loras(), dtype=self.dtype, device=self.device,
            )  # fmt: skip
        available = available_memory_bytes(self.device)
        fraction_pages = int(config.memory_fraction() * available) // per_page

        def plan(num_pages: int | None) -> KVCapacity:
            return plan_num_pages(
                num_pages=num_pages, kv_cache_memory_fraction=config.memory_fraction(),
                available_bytes=available, bytes_per_page=per_page, page_size=config.page_size,
                max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs, kv_dtype=kv_name,
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
            kv_dtype=config.kv_cache_dtype, pad_page=config.resolved_cuda_graphs(),
        )
        if rank == 0:  # one report per engine, not one per shard
            logger.info(self.capacity.describe())
            logger.info("attention backend: %s (asked for %s) on %s",
                        config.resolved_attention_backend(), config.attention_backend, self.device)
        self.attn = make_attention_backend(
            config, self.pool, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            scale=m.scale, sliding_windows=m.sliding_windows,
        )
        self.sampler = Sampler(seed=config.seed)
        self.drafter = make_drafter(config, self, rank=rank, world_size=world_size)
        # The expert-load counters are read on a stream of their own (ReadExpertTokens); None: no MoE layer or no CUDA.
        moe_blocks = m.moe_blocks()
        self.num_moe_layers = len(moe_blocks)
        self._counts_stream = torch.cuda.Stream(self.device) if moe_blocks and self.device.type == "cuda" else None
        # Last: capturing runs the model, which must be complete.
        self.graphs: DecodeGraphs | None = None
        capture = self.device.type == "cuda"  # else the same static buffers run eagerly (tests' emulator)
        if config.resolved_cuda_graphs() and (not capture or moe_graphs_allowed(
                moe_blocks, torch.cuda.get_device_capability(self.device), asked=bool(config.cuda_graphs))):
            self.graphs = DecodeGraphs(
                self.model, self.attn, max_num_seqs=config.max_num_seqs,
                max_pages_per_seq=-(-config.max_model_len // config.page_size), device=self.device,
                capture=capture, moe_blocks=moe_blocks,
            )  # fmt: skip

    @property
    def num_pages(self) -> int:
        return self.capacity.num_pages

    def command(self, cmd: Command[R]) -> R:
        """Run a control command (``actors.commands``) on this rank; one it has no handler for raises
        ``UnhandledCommandError`` naming it."""
        return _HANDLERS.run(self, cmd)

    @_HANDLERS.on(AddLoRA)
    def _add_lora(self, cmd: AddLoRA) -> LoRAInfo:
        """Register a LoRA adapter (read and checked against this shard; ``enable_lora`` only)."""
        if self.lora is None:
            raise InvalidParameterError("enable_lora", "this engine was started without LoRA (enable_lora=False)")
        return self.lora.add(cmd.name, cmd.path)

    @_HANDLERS.on(RemoveLoRA)
    def _remove_lora(self, cmd: RemoveLoRA) -> None:
        if self.lora is not None:
            self.lora.remove(cmd.name)

    @_HANDLERS.on(PrepareLoRAs)
    def _prepare_loras(self, cmd: PrepareLoRAs) -> dict[str, str]:
        """Read the next step's adapter loads now, outside the step (``LoRAManager.prepare``); adapter -> failure."""
        return {} if self.lora is None else self.lora.prepare(list(cmd.names))

    @_HANDLERS.on(ReadExpertTokens)
    def _read_expert_tokens(self, cmd: ReadExpertTokens) -> tuple[tuple[int, ...], ...]:
        """Per MoE layer (in layer order), per expert, the tokens routed to it since load; () for a dense model.

        For the metrics, from any thread, beside a running step and never in
        it (no step waits for this read): on CUDA the read runs on a stream of
        its own, so it waits for no forward queued on the step's stream and
        sees the counts as the device holds them now, perhaps mid-step, as
        on the CPU. Every rank counts every token (``SparseMoE``).
        """
        stream = self._counts_stream
        if stream is None:
            counts = self.model.expert_tokens()
            return () if counts is None else tuple(map(tuple, counts.tolist()))
        with torch.cuda.stream(stream):
            counts = self.model.expert_tokens()
            assert counts is not None  # the stream exists only for a model with MoE layers
            return tuple(map(tuple, counts.tolist()))  # waits for this stream only

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        """Forward the step's tokens, then sample one token per sampled sequence.

        Ranks other than 0 run the same forward (and logits: the collectives
        need every rank) but return an empty ``StepOutput`` (save its
        ``kv_exports``).

        KV transfer (prefill/decode disaggregation, ``kvcache.kv_transfer``):
        ``batch.kv_moves.imports`` are written into this rank's pool before the
        forward (this rank's payload of each); after it, the pages each
        ``batch.kv_moves.exports`` entry names are read back into
        ``StepOutput.kv_exports`` on every rank (rank r's pool holds its share
        of the heads), in the same read as the sampled tokens. Only the
        target model's pool moves: a draft model's own pool
        (``speculative_config`` with a draft model) would get nothing, so
        the engine refuses prefilled requests there
        (``actors.api.check_decode_drafting``); a self-draft shares the
        target's pages and sees them.
        """
        # KV tiers: the pages to save are read first, before the imports and the forward write the pool
        # (a page queued for saving may be among those the step fills again).
        saves = self.pool.gather_pages(batch.kv_moves.saves) if batch.kv_moves.saves else None
        if batch.kv_moves.imports:
            self._import_kv(batch.kv_moves.imports)
        if not batch.num_seqs:  # a step that only saves pages (the engine had nothing else to run)
            assert saves is not None, "a step with no sequence and nothing to save"
            return StepOutput([], [], kv_saves=self.pool.payload(device_copy.to_host(saves)))
        if self.lora is None:
            return self._run(batch, saves)
        self.lora.begin_step(batch)
        try:
            return self._run(batch, saves)
        finally:
            self.lora.end_step()

    def _import_kv(self, imports: list[tuple[list[int], RankPayloads]]) -> None:
        """Write this rank's payload of each import into its pages."""
        for pages, payloads in imports:
            if len(payloads) != self.world_size:
                raise KVPayloadMismatchError(
                    "tensor_parallel_size",
                    f"the KV pages come from {len(payloads)} rank(s), this engine has {self.world_size}: "
                    f"both replicas need the same tensor_parallel_size",
                )
            self.pool.write_pages(pages, payloads[self.rank])

    def _run(self, batch: Batch, saves: list[torch.Tensor] | None) -> StepOutput:
        """The forward, sampling, KV export and drafting of ``execute`` (in its inference mode).

        A decode-only step runs on the static buffers of ``self.graphs``
        (``cuda_graphs``; a replayed CUDA graph on CUDA), every other step
        eagerly. Everything up to the read of the sampled rows and the exported pages
        is queued without waiting for the device; that read
        (``device_copy.to_host``) is the step's one wait (drafting, after it,
        waits again: ``DraftRunner.propose``). The pooled rows of embedding
        requests (``batch.pooling.indices``) join that read, on rank 0 only:
        after the last all-reduce every rank holds the whole hidden states.
        A step whose only tokens are one per sequence is decode-only even when
        one of them is an embedding request's last prompt token (a 1-token
        prompt or chunk): its hidden row is then read from the static decode
        buffers, which hold the same rows the eager path computes.
        """
        dev = self.device
        layout = StepLayout(batch.query_lens, batch.context_lens, batch.page_tables)
        graphs = self.graphs
        if graphs is not None and batch.is_decode_only and 0 < batch.num_seqs <= graphs.max_batch_size:
            hidden = graphs.run(batch.input_ids, batch.positions, layout)
            input_ids, positions = graphs.input_ids[: batch.num_seqs], graphs.positions[: batch.num_seqs]
        else:
            input_ids = as_device_tensor(batch.input_ids, torch.long, dev)
            positions = as_device_tensor(batch.positions, torch.long, dev)
            self.attn.plan(layout)
            hidden = self.model(input_ids, positions, self.attn)
        if self.drafter is not None:
            self.drafter.catch_up(input_ids, positions, layout)
        pooled = _pool_rows(batch, hidden) if batch.pooling.indices is not None and self.rank == 0 else None
        sampled: SampledRows | None = None
        if batch.sample_indices:
            if batch.is_decode_only and len(batch.sample_indices) == batch.num_seqs:
                rows = hidden
            else:
                rows = hidden[as_device_tensor(sample_rows(batch), torch.long, dev)]
            # Every rank computes logits: the vocab-parallel head all-gathers them.
            logits = self.model.compute_logits(rows)
            if self.rank == 0:
                # Only rank 0 samples (its tokens are the step's answer); sampling
                # on every rank would only burn time and advance seeded generators.
                sampled = self._sample(batch, logits)
        # Every rank exports its own share of the heads of each page.
        exports = [self.pool.gather_pages(pages) for _, pages in batch.kv_moves.exports or []]
        reads = ([] if sampled is None else sampled.tensors()) + [t for g in exports for t in g] + (saves or [])
        if pooled is not None:
            reads.append(pooled)
        host = device_copy.to_host(reads) if reads else []
        if pooled is not None:
            pooled = host.pop()
        out = StepOutput([], [])
        if sampled is not None:
            num_sampled = len(sampled.tensors())
            out = sampled.output(host[:num_sampled])
            host = host[num_sampled:]
            if batch.drafts.token_ids is not None:
                out = replace(out, num_accepted=count_accepted(out.token_ids, batch.drafts.token_ids))
        if batch.kv_moves.exports:
            payloads = []
            for gathered in exports:
                payloads.append(self.pool.payload(host[: len(gathered)]))
                host = host[len(gathered):]
            out = replace(out, kv_exports=payloads)
        if saves is not None:
            out = replace(out, kv_saves=self.pool.payload(host[: len(saves)]))
        if pooled is not None:
            out = replace(out, pooled=pooled)
        if batch.drafts.num_propose is None or not batch.sample_indices:
            return out
        return self._propose(batch, out)

    def _sample(self, batch: Batch, logits: torch.Tensor) -> SampledRows:
        """One token per sampled row, on the device (with drafts: a row per drafted position too)."""
        if batch.drafts.token_ids is None:
            return self.sampler.sample_on_device(
                logits, batch.sampling_params, batch.num_output_tokens,
                batch.prompt_token_ids, batch.output_token_ids, batch.token_masks,
            )
        return self.sampler.sample_on_device(logits, *expand_sampling(batch), batch.token_masks)

    def _propose(self, batch: Batch, out: StepOutput) -> StepOutput:
        """Drafts for each sampled sequence's next step, from its new last token (``batch.drafts.num_propose``)."""
        assert self.drafter is not None and batch.drafts.num_propose is not None
        drafts = batch.drafts.token_ids or [[] for _ in batch.sample_indices]
        accepted = out.num_accepted or [0] * len(drafts)
        last: list[int] = []
        if self.rank == 0:
            row = 0
            for j, draft in enumerate(drafts):
                last.append(out.token_ids[row + accepted[j]])
                row += len(draft) + 1
        if self.world_size > 1:
            # Every rank runs the drafter's forward (its collectives need all): rank 0's tokens go to all.
            last, accepted = _broadcast_lists(last, accepted, len(drafts), self.device)
        positions: list[int] = []
        tables: list[list[int]] = []
        for j, i in enumerate(batch.sample_indices):
            # The new last token follows the kept drafts: context - (drafts rejected).
            positions.append(batch.context_lens[i] - len(drafts[j]) + accepted[j])
            tables.append(batch.page_tables[i])
        proposals = self.drafter.propose(last, positions, tables, batch.drafts.num_propose)
        return replace(out, draft_token_ids=proposals) if self.rank == 0 else out


def _pool_rows(batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
    """Per pooled sequence (``batch.pooling.indices``), on the device: the float32 sum of its hidden rows of
    this step (``batch.pooling.means``) or its last row (a chunk that ends its prompt), as one (k, hidden) tensor.

    Summed in float32 whatever the model dtype (``sum(dtype=)`` casts as it reduces, with no float32 copy
    of the chunk); one reduction per sequence keeps the result independent of what else shares the step.
    """
    assert batch.pooling.indices is not None and batch.pooling.means is not None
    starts = [0]
    for q in batch.query_lens:
        starts.append(starts[-1] + q)
    rows: list[torch.Tensor] = []
    for i, mean in zip(batch.pooling.indices, batch.pooling.means, strict=True):
        start, end = starts[i], starts[i + 1]
        rows.append(hidden[start:end].sum(0, dtype=torch.float32) if mean else hidden[end - 1].float())
    return torch.stack(rows)


def _broadcast_lists(
    first: list[int], second: list[int], n: int, device: torch.device
) -> tuple[list[int], list[int]]:
    """Rank 0's two length-``n`` int lists on every rank (a collective: every rank calls it)."""
    t = torch.tensor(first + second if first else [0] * (2 * n), dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    values: list[int] = t.tolist()
    return values[:n], values[n:]


def _pack_linears(model: torch.nn.Module) -> None:
    """Move every linear layer's weight to oneDNN's packed layout (see ``actors.models.cpu_linear``)."""
    layers = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    packed = [layer for layer in layers if layer.pack_for_cpu()]
    extra = sum(layer.weight.numel() * layer.weight.element_size() for layer in packed)
    logger.info("oneDNN-packed %d of %d linear layers; their dense weights stay for 1-2 row products "
                "(+%.1f MiB)", len(packed), len(layers), extra / 2**20)
