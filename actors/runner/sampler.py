"""Turn one step's logits into token ids: penalties, logit bias, temperature, top-k/top-p/min-p, draw.

Rows are processed independently, so a request's tokens do not depend on what
shares its batch. Per-row parameters become tensors and each transform runs
once over all rows that need it.

The random draw is the exponential race: ``argmax(probs / q)`` with
``q ~ Exp(1)`` picks token i with probability ``probs[i]``. A seeded row draws
its ``q`` from a generator seeded by ``(seed, num_output_tokens)``, which makes
its token a function of its own logits, params and position only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.grammar.masks import apply_token_masks
from actors.runner.logit_adjust import apply_logit_bias, apply_penalties
from kvcache import device_copy
from kvcache.device_copy import as_device_tensor
from scheduling.batch import StepOutput, TokenLogprobs, TokenMasks
from scheduling.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny
# Tokens per row that top-p looks at before falling back to a full sort.
_HEAD = 64
# The least double that rounds to 1.0 in float32: top-p is off from here up,
# as it is for the float32 tensor of top-p values the filter computes with.
_P_OFF = 1.0 - 2.0**-25


def _all_plain_greedy(params: list[SamplingParams]) -> bool:
    """True when every row is greedy without penalties or logprobs: the fast path.

    Runs every step over every row, so it is a bare loop over slot reads,
    cheaper than a generator over ``needs_penalties`` (docs/design_costs.md,
    entry ``greedy_check``).
    """
    for p in params:
        if (
            p.temperature
            or p.logprobs is not None
            or p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
            or p.logit_bias
        ):
            return False
    return True


def _mix_seed(seed: int, num_output_tokens: int) -> int:
    """Hash (seed, position) into 63 bits (splitmix64 finaliser): nearby inputs
    give unrelated generator states (step t of seed s never replays step t+1 of s-1)."""
    x = (seed * 0x9E3779B97F4A7C15 + (num_output_tokens + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _reads_are_free(device: torch.device) -> bool:
    """On the CPU a host read of a tensor waits for nothing, so a filter may branch on its values there.

    Elsewhere (CUDA) every branch is decided from the host's lists, never by
    reading a tensor mid-step (``kvcache.device_copy``).
    """
    return device.type == "cpu"


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its nucleus.

    ``top_k`` per row, ``vocab`` (or more) meaning off: exactly k tokens
    survive. ``top_p`` per row, >= 1 meaning off: the nucleus is the smallest
    set of most likely tokens (after top-k) whose mass reaches p, so the best
    token always survives. Rows with neither come back unchanged.
    """
    vocab, device = logits.shape[-1], logits.device
    k_on = [k < vocab for k in top_k]
    p_on = [p < _P_OFF for p in top_p]
    # Sorting whole rows is the slow part (on CPU, far more than a softmax), so sort
    # only the head of each row: the largest top-k, and for nucleus rows at
    # least _HEAD tokens. A nucleus row without top-k may reach past the head:
    # on the CPU those the head cannot settle get a full sort (a read decides
    # which); on a device every such row gets one, decided on the host.
    head = min(max(max((k for k, on in zip(top_k, k_on, strict=True) if on), default=1), _HEAD), vocab)
    whole_rows = [i for i, (k, p) in enumerate(zip(k_on, p_on, strict=True)) if p and not k]
    k_t = as_device_tensor([min(k, vocab) for k in top_k], torch.long, device)
    # Off is inf, not 1.0: rounding could push a mass of 1.0 below the total.
    p_t = as_device_tensor([p if on else float("inf") for p, on in zip(top_p, p_on, strict=True)],
                           torch.float32, device)
    whole_row_mass = not all(k_on)
    out, unresolved = _filter_head(logits, k_t, p_t, head, whole_row_mass=whole_row_mass)
    if whole_rows and head < vocab:
        if _reads_are_free(device):
            rows = unresolved.nonzero().squeeze(1) if bool(unresolved.any()) else None
        else:
            rows = as_device_tensor(whole_rows, torch.long, device)
        if rows is not None:
            out[rows] = _filter_head(logits[rows], k_t[rows], p_t[rows], vocab, whole_row_mass=True)[0]
    if all(k_on[i] or p_on[i] for i in range(len(k_on))):
        return out
    keep = as_device_tensor([k or p for k, p in zip(k_on, p_on, strict=True)], torch.bool, device)
    return torch.where(keep.unsqueeze(1), out, logits)


def _filter_head(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, head: int, *, whole_row_mass: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p over the ``head`` best tokens of each row (all others masked).

    ``top_p`` is inf where off. ``whole_row_mass``: some row has no top-k (so
    its nucleus is measured against the whole row). Returns the masked
    logits and which rows have a nucleus reaching past the head (their
    result is wrong). Every quantity a row's mask depends on is a prefix sum
    along that row or a reduction over the whole row, never over the head, so
    the mask does not depend on ``head`` (set by other rows).
    """
    values, ids = logits.topk(head, dim=-1)
    inf = float("-inf")
    values.masked_fill_(torch.arange(head, device=logits.device) >= top_k.unsqueeze(1), inf)
    # Unnormalised probabilities, relative to the row's best token (values[:, 0]).
    weights = (values - values[:, :1]).exp()
    cumulative = weights.cumsum(dim=-1)
    # Mass the nucleus is measured against: the top-k set (head >= k; the
    # masked tail adds exact zeros), else the whole row, whatever the head.
    k_on = top_k < logits.shape[-1]
    total = cumulative[:, -1]
    if whole_row_mass:
        whole_row = (logits - values[:, :1]).exp().sum(dim=-1)
        total = torch.where(k_on, total, whole_row)
    # The best token has mass 0 before it, below any p > 0: it always stays.
    outside = cumulative - weights >= (top_p * total).unsqueeze(1)
    values.masked_fill_(outside, inf)
    unresolved = (top_p < 1.0) & ~k_on & (cumulative[:, -1] < top_p * total)
    return torch.full_like(logits, inf).scatter_(-1, ids, values), unresolved


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    Done in logit space: ``p_i / p_max < m`` is ``x_i - x_max < log(m)``, which
    needs no softmax and leaves rows with ``m == 0`` (log = -inf) untouched.
    """
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


@dataclass(frozen=True, slots=True)
class SampledRows:
    """One step's sampling, still on the device: what ``StepOutput`` is read from.

    ``token_ids`` (rows,) int64. With logprobs: ``logprob_rows`` (host list)
    are the rows that asked, ``num_top[j]`` how many alternatives row
    ``logprob_rows[j]`` wants; ``chosen`` (len(logprob_rows),) float32, and
    ``top_values`` / ``top_ids`` (len(logprob_rows), max(num_top)).
    """

    token_ids: torch.Tensor
    logprob_rows: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What the host must read, in the order ``output`` takes it."""
        if self.chosen is None or self.top_values is None or self.top_ids is None:
            return [self.token_ids]
        return [self.token_ids, self.chosen, self.top_values, self.top_ids]

    def output(self, host: list[torch.Tensor]) -> StepOutput:
        """The ``StepOutput`` from ``host``: CPU copies of ``tensors()`` (``device_copy.to_host``)."""
        ids: list[int] = host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(ids)
        if len(host) > 1:
            chosen: list[float] = host[1].tolist()
            top_values: list[list[float]] = host[2].tolist()
            top_ids: list[list[int]] = host[3].tolist()
            for j, (i, n) in enumerate(zip(self.logprob_rows, self.num_top, strict=True)):
                logprobs[i] = TokenLogprobs(
                    token_id=ids[i],
                    logprob=chosen[j],
                    top_token_ids=top_ids[j][:n],
                    top_logprobs=top_values[j][:n],
                )
        return StepOutput(token_ids=ids, logprobs=logprobs)


class Sampler:
    """Picks one token per row of a step's logits.

    ``seed`` seeds the generator used by rows without their own seed; ``None``
    seeds it from the OS. The input logits are never modified.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        # One generator per device (CUDA draws need a CUDA generator); the
        # seeded-row generator is reused and reseeded per row.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(_mix_seed(self._seed, -1))
        return gen

    def _row_generator(self, device: torch.device, seed: int, position: int) -> torch.Generator:
        gen = self._row_generators.get(device)
        if gen is None:
            gen = self._row_generators[device] = torch.Generator(device=device)
        return gen.manual_seed(_mix_seed(seed, position))

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        prompt_token_ids: list[list[int] | None],
        output_token_ids: list[list[int] | None],
        token_masks: TokenMasks | None = None,
    ) -> StepOutput:
        """``sample_on_device``, then its one read (``device_copy.to_host``)."""
        rows = self.sample_on_device(
            logits, params, num_output_tokens, prompt_token_ids, output_token_ids, token_masks
        )
        return rows.output(device_copy.to_host(rows.tensors()))

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        prompt_token_ids: list[list[int] | None],
        output_token_ids: list[list[int] | None],
        token_masks: TokenMasks | None = None,
    ) -> SampledRows:
        """Sample one token per row of ``logits`` (N, vocab); lists are aligned with rows.

        Nothing here reads a tensor on the host (on CUDA, nothing waits for
        the device); ``SampledRows.output`` turns the read into a
        ``StepOutput``. Token histories are needed (non-None) exactly for
        rows whose ``params.needs_penalties``. ``token_masks`` (structured
        output) rule tokens out before anything else, so logprobs are those
        of the constrained distribution.
        """
        num_rows = logits.shape[0]
        assert len(params) == num_rows, (len(params), num_rows)
        if num_rows == 0:
            return SampledRows(torch.empty(0, dtype=torch.long, device=logits.device))
        if token_masks is not None:
            logits = apply_token_masks(logits, token_masks)
        if _all_plain_greedy(params):
            # max().indices is faster than argmax() on CPU (docs/design_costs.md); same tie rule.
            return SampledRows(logits.max(dim=-1).indices)

        vocab, device = logits.shape[1], logits.device
        raw_logits, logits = logits, logits.float()
        penalty_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalty_rows:
            prompts = [h for i in penalty_rows if (h := prompt_token_ids[i]) is not None]
            outputs = [h for i in penalty_rows if (h := output_token_ids[i]) is not None]
            assert len(prompts) == len(outputs) == len(penalty_rows), "penalties need histories"
            index = as_device_tensor(penalty_rows, torch.long, device)
            penalty_params = [params[i] for i in penalty_rows]
            penalised = apply_penalties(logits[index], penalty_params, prompts, outputs)
            logits = logits.index_copy(0, index, penalised)
        if any(p.logit_bias for p in params):  # after penalties, before temperature (OpenAI: on the logits)
            logits = apply_logit_bias(logits, params)

        # Greedy rows take the argmax of the penalised logits.
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == num_rows:
            token_ids = self._draw(logits, params, sample_rows, num_output_tokens)
        else:
            token_ids = logits.max(dim=-1).indices
            if sample_rows:
                sampled = self._draw(logits, params, sample_rows, num_output_tokens)
                token_ids[as_device_tensor(sample_rows, torch.long, device)] = sampled

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not logprob_rows:
            return SampledRows(token_ids)
        index = as_device_tensor(logprob_rows, torch.long, device)
        # Raw logprobs (vLLM's default): the model's distribution before
        # penalties, temperature and filtering.
        raw = raw_logits[index].float().log_softmax(dim=-1)
        chosen = raw.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
        num_top = [min(params[i].logprobs or 0, vocab) for i in logprob_rows]
        top_values, top_ids = raw.topk(max(num_top), dim=-1)
        return SampledRows(token_ids, logprob_rows, num_top, chosen, top_values, top_ids)

    def _draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        rows: list[int],
        num_output_tokens: list[int],
    ) -> torch.Tensor:
        """Random tokens for ``rows`` (all with temperature > 0), shape (len(rows),)."""
        num_rows, vocab = logits.shape
        device = logits.device
        row_params = [params[i] for i in rows]
        x = logits if len(rows) == num_rows else logits[as_device_tensor(rows, torch.long, device)]
        temperature = as_device_tensor([p.temperature for p in row_params], torch.float32, device)
        x = x / temperature.unsqueeze(1)

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in row_params]
        top_p = [p.top_p for p in row_params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            x = apply_top_k_top_p(x, top_k, top_p)
        if any(p.min_p > 0.0 for p in row_params):
            x = apply_min_p(x, as_device_tensor([p.min_p for p in row_params], torch.float32, device))
        probs = x.softmax(dim=-1)

        # Exp(1) noise as -log(U): uniform draws are several times cheaper
        # than exponential_ on CPU. U is clamped away from 0 so q is finite
        # and every kept token scores > 0, above the masked ones (0 / q = 0).
        noise = torch.empty_like(probs)
        seeded = [(j, p.seed) for j, p in enumerate(row_params) if p.seed is not None]
        if len(seeded) < len(rows):
            noise.uniform_(generator=self._generator(device))
        for j, seed in seeded:
            assert seed is not None
            gen = self._row_generator(device, seed, num_output_tokens[rows[j]])
            noise[j].uniform_(generator=gen)
        noise.clamp_(min=_TINY).log_().neg_()
        return probs.div_(noise).max(dim=-1).indices
