"""Decode steps at static shapes: replayed CUDA graphs on CUDA, the same buffers run eagerly on the CPU.

A small decode batch on a GPU is bound by kernel launches, not by the
device: every layer's dozen kernels are queued one by one from Python. A
CUDA graph records one forward's kernels once and queues them all again
with one call. The price is static shapes and addresses: a graph always
runs the batch size it was captured at, reads its inputs from the buffers it
was captured with, and writes the same output tensor.

So decode-only steps run at padded batch sizes (``graph_batch_sizes``): a
step of ``n`` sequences copies its token ids and positions into the first
``n`` rows of fixed ``input_ids`` / ``positions`` buffers (the rest are
padding: token 0 at position 0), has the attention backend plan its own
static buffers (``AttentionBackend.plan_static_decode``: padding rows write
to and read from the pool's pad page, which no sequence owns), then replays
the graph of the smallest size ``>= n`` and keeps the first ``n`` rows of its
output. Every other step (prefill, chunks, drafts) runs eagerly as before.

Mixture-of-experts layers count each token's routing choices
(``SparseMoE.expert_tokens``, the expert-load metrics); padding rows must not
count, so ``real_rows`` (1 for the step's rows, 0 for padding, filled on the
device each step) weighs them in every forward here, the captured ones
included (a dense model has no such layer and skips the fill). Their grouped
expert products are capturable only where ``torch._grouped_mm`` runs its
device kernel (bfloat16 on sm90/sm100, 16-byte rows: ``moe_graphs_allowed``);
elsewhere they sync with the host, so graphs asked for are refused by name and
graphs that were only the default are left off.

``capture=False`` (the CPU, where there are no graphs) runs the model
eagerly over exactly those buffers: the path a graph replays is then tested
on the CPU, token for token against the dynamic path, and a CUDA device only
adds the capture. Invariant: the captured forward reads nothing but the
static buffers and the pool (no host values), which the step's sync count
(``tests/actors/runner/test_step_syncs.py``) and the device check's sync-debug mode
hold it to.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from actors.log import get_logger
from actors.models.moe import SparseMoE
from kvcache.attention.backend import AttentionBackend, StepLayout
from kvcache.device_copy import copy_from_host
from scheduling.errors import InvalidParameterError

logger = get_logger(__name__.rsplit(".", 1)[-1])

# Batch sizes double up to this one, then grow by it: padding wastes at most
# half a small batch (where a step costs about the same at any size) and at
# most GRAPH_SIZE_STEP - 1 rows of a large one.
GRAPH_SIZE_STEP = 32


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``GRAPH_SIZE_STEP``, then its multiples, then ``max_num_seqs`` itself; ascending."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes: list[int] = []
    size = 1
    while size < min(max_num_seqs, GRAPH_SIZE_STEP):
        sizes.append(size)
        size *= 2
    size = GRAPH_SIZE_STEP
    while size < max_num_seqs:
        sizes.append(size)
        size += GRAPH_SIZE_STEP
    sizes.append(max_num_seqs)
    return sizes


class StepForward(Protocol):
    """The model's forward over one step: hidden states (num_tokens, hidden) of its tokens."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor: ...


def moe_graphs_allowed(moe_blocks: Sequence[SparseMoE], capability: tuple[int, int], *, asked: bool) -> bool:
    """Whether decode steps may be captured on a GPU of ``capability`` with these MoE layers.

    A layer whose grouped products sync with the host (``SparseMoE.graph_refusal``)
    cannot be captured: where CUDA graphs were asked for (``cuda_graphs=True``)
    that is refused naming ``cuda_graphs``; where they were only the default
    (unset) the steps run eagerly instead (False), with a log line.
    """
    for block in moe_blocks:
        refusal = block.graph_refusal(capability)
        if refusal is None:
            continue
        if asked:
            raise InvalidParameterError("cuda_graphs", f"{refusal}: set cuda_graphs to false or leave it unset")
        logger.warning("decode steps run without CUDA graphs (slower): %s", refusal)
        return False
    return True


class DecodeGraphs:
    """Static-buffer decode for batches of up to ``max_num_seqs`` sequences; one per engine.

    Args:
        model: the step forward (the runner's model).
        attn: its attention backend, which must support static decode.
        max_num_seqs: the largest batch (the scheduler's limit).
        max_pages_per_seq: the most pages one sequence's context needs.
        device: where the buffers live.
        capture: record a CUDA graph per batch size now (CUDA only); else
            every step runs eagerly over the buffers.
        moe_blocks: the model's mixture-of-experts layers, which count only
            the real rows of the forwards here.
    """

    def __init__(
        self,
        model: StepForward,
        attn: AttentionBackend,
        *,
        max_num_seqs: int,
        max_pages_per_seq: int,
        device: torch.device,
        capture: bool,
        moe_blocks: Sequence[SparseMoE] = (),
    ) -> None:
        if not attn.supports_static_decode:
            raise ValueError(f"{type(attn).__name__} has no static-shape decode")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on a CUDA device, not {device}")
        self.model = model
        self.attn = attn
        self.sizes = graph_batch_sizes(max_num_seqs)
        attn.enable_static_decode(self.sizes, max_pages_per_seq)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        # All zero while capturing: the warm-up and captured forwards count no routing choice.
        self.real_rows = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        self._moe_blocks = tuple(moe_blocks)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps run through this path (captured or eager)
        if capture:
            self._capture(device)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def padded_size(self, num_seqs: int) -> int:
        """The smallest batch size ``>= num_seqs`` (at most ``max_batch_size``)."""
        if not 1 <= num_seqs <= self.max_batch_size:
            raise ValueError(f"a static decode step holds 1..{self.max_batch_size} sequences, not {num_seqs}")
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, input_ids: list[int], positions: list[int], layout: StepLayout) -> torch.Tensor:
        """Hidden states (n, hidden) of a decode-only step of n sequences (one token each).

        The result is a view of the graph's output buffer: valid until the
        next ``run``.
        """
        n = len(input_ids)
        assert len(positions) == n == len(layout.query_lens), (n, len(positions), len(layout.query_lens))
        size = self.padded_size(n)
        pad = [0] * (size - n)
        copy_from_host(self.input_ids[:size], input_ids + pad)
        copy_from_host(self.positions[:size], positions + pad)
        if self._moe_blocks:  # two fills queued on the device: no host copy, no wait
            self.real_rows[:n].fill_(1)
            self.real_rows[n:size].fill_(0)
        self.attn.plan_static_decode(size, layout)
        self.replays += 1
        graph = self._graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self._outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` rows of the buffers, its MoE layers counting ``real_rows``."""
        for block in self._moe_blocks:
            block.count_rows = self.real_rows
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.attn)
        finally:
            for block in self._moe_blocks:
                block.count_rows = None  # other steps' forwards count every row

    def _capture(self, device: torch.device) -> None:
        """One graph per size, the largest first (the smaller ones then reuse its memory pool).

        Each is planned with padding rows only, so capturing writes the pad
        page and nothing a sequence owns. A warm-up forward on a side stream
        first does what must not be captured: lazy initialisation (cuBLAS
        handles, FlashInfer's JIT modules) and first-use allocations.
        """
        start = time.perf_counter()
        empty = StepLayout([], [], [])
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.attn.plan_static_decode(size, empty)
                side.wait_stream(torch.cuda.current_stream(device))  # after the plan's copies
                with torch.cuda.stream(side):
                    self._forward(size)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self._graphs), self.sizes, time.perf_counter() - start)  # fmt: skip
