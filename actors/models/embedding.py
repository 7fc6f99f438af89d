"""Vocabulary-parallel embedding and LM head, optionally int8 per row.

With weight quantization the LM head is stored int8 with one scale per vocab
row (``quant_linear.Int8Linear``): for SmolLM2-135M the tied (49152, 576)
head is 113 MB in float32 and is read whole for every decoded token, the
largest single read of a batch-1 step. When the head is tied, the embedding
reads the same int8 rows times their scale, so the float table is freed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from actors.models import cpu_linear
from actors.models.quant_linear import Int8Blocks, Int8Linear

REFINE_TOP_K = 32  # logits per row an int8 head recomputes in float32


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in equal contiguous ranges across ranks.

    The vocab is padded up to a multiple of ``tp_size``; padding rows stay zero.
    After ``set_quant`` the float ``weight`` is empty and rows come from the int8 table.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings, self.tp_rank, self.tp_size = num_embeddings, tp_rank, tp_size
        self.num_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, embedding_dim), requires_grad=False)
        self.quant: Int8Linear | None = None
        self.dtype = self.weight.dtype  # of the rows an int8 lookup returns

    def load_weight(self, param_name: str, loaded: torch.Tensor | Int8Blocks, shard_id: str | int | None = None) -> None:
        """Keep this rank's vocab rows of the full (vocab, dim) tensor, or of int8 blocks read from a file."""
        n = max(0, min(self.num_per_rank, self.num_embeddings - self.vocab_start))
        if isinstance(loaded, Int8Blocks):
            codes = torch.zeros(self.num_per_rank, loaded.codes.shape[1], dtype=torch.int8)  # padding rows: 0
            scales = torch.zeros(self.num_per_rank, loaded.scales.shape[1], dtype=torch.float32)
            rows = loaded.rows(self.vocab_start, n)
            codes[:n], scales[:n] = rows.codes, rows.scales
            self.set_quant(Int8Linear(codes, scales, loaded.group_size))
            return
        self.weight.data.narrow(0, 0, n).copy_(loaded.narrow(0, self.vocab_start, n))

    def set_quant(self, quant: Int8Linear) -> None:
        """Read rows from ``quant`` from now on and free the float table."""
        assert quant.qweight.shape == self.weight.shape, (quant.qweight.shape, self.weight.shape)
        self.dtype = self.weight.dtype
        self.quant = quant
        self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.num_per_rank)
        rows = self._rows(local.masked_fill(~mask, 0))
        y = rows * mask.unsqueeze(-1).to(rows.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocab; each rank computes its range, then all-gather.

    Quantized (``set_quant``), the native int8 kernel returns float32 logits
    (``Int8Linear.float32_products``). Torch's int8 kernel (no native kernel)
    returns bfloat16 logits: 8
    significant bits, steps of 0.125 around a logit of 25, where SmolLM2's
    top two candidates are often closer than that (0.08 apart on the first
    answer token of "What is the capital of France?"), so rounding would tie
    or swap them. In a float32 model the top ``REFINE_TOP_K`` logits of each
    row are therefore recomputed in float32 from the same int8 rows (a dot
    product per kept logit, against one per vocabulary entry): greedy choices and the head
    of the sampling distribution are those of the int8 weights, the other
    logits keep bfloat16 precision. A bfloat16 model keeps bfloat16 logits,
    as its float head does.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._int8_logits(hidden) if self.quant is not None else cpu_linear.dense(hidden, self.weight, None)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]

    def _int8_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.quant is not None
        logits = self.quant(hidden)
        if hidden.dtype != torch.float32 or self.quant.float32_products:
            return logits
        top = logits.topk(min(REFINE_TOP_K, logits.shape[-1]), dim=-1, sorted=False).indices  # (T, k)
        rows = self.quant.qweight[top].float()  # (T, k, hidden)
        exact = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1) * self.quant.scales[top].float()
        return logits.scatter_(-1, top, exact)
