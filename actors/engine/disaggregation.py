"""The engine's side of prefill/decode disaggregation: prefill-only requests, and requests that arrive prefilled.

Prefill replica: ``start_prefill`` queues a request that computes its prompt
and samples its first token only; the step that samples it copies the
prompt's pages out (``Batch.kv_moves.exports``), and ``collect_exports`` keeps them,
by request, until the caller takes them as a ``PrefillResult``. Its pages
then end like any request's: their KV stays in the prefix cache.

Decode replica: ``add_prefilled`` starts a request from a ``PrefillResult``:
its first token goes through the request's own stop rule (it may end the
request at once), and its prompt KV is written into fresh pages by the step
that admits it (``scheduling.kv_handoff``). Every field of the payload is
checked against this engine's pool first, and the prefill engine's weight
quantization against this engine's (KV computed by int8 weights differs from
KV computed by bfloat16 ones, and would be cached here as if it were this
model's), so a mismatch is refused by name before any page is given. A decode replica with a separate draft model is
refused (``check_decode_drafting``): only the target's KV moves, so the draft
model's own pool would hold nothing for the prompt.

The functions take the engine as a ``PDEngine``: what they use of it, which
``LLMEngine`` has. So this module imports nothing of the engine's module,
which imports this one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from actors.api import (
    WEIGHT_QUANTIZATION_FIELDS,
    PrefillResult,
    SequenceDelta,
    SequenceTiming,
    WeightQuantization,
    check_decode_drafting,
)
from actors.config import EngineConfig
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.executor import Executor
from actors.engine.lora_registry import LoRARegistry
from kvcache.kv_transfer import KVPayloadMismatchError, RankPayloads, check_layout
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError
from scheduling.policy import BatchPolicy
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.stop_rule import StopRule


class PDEngine(Protocol):
    """What this module's functions use of an engine (``actors.engine.llm_engine.LLMEngine`` has each)."""

    config: EngineConfig
    executor: Executor
    policy: BatchPolicy
    tokenizer: PreTrainedTokenizerBase
    eos_token_id: int | None
    loras: LoRARegistry
    # Prefill-only requests' exported prompt KV, by request id, until the prefill's caller takes it.
    exported: dict[str, RankPayloads]

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    prompt_token_ids: list[int] | None = None) -> int: ...

    def track(self, req: Request) -> None: ...


def weight_quantization(config: EngineConfig) -> WeightQuantization:
    """What of ``config`` besides the model decides the weights that compute its KV; both pools must agree."""
    quantization, group_size = (getattr(config, name) for name in WEIGHT_QUANTIZATION_FIELDS)
    return quantization, group_size


def check_remote_prefill(params: SamplingParams) -> None:
    """Refuse what a remote prefill cannot carry (the decode replica then prefills locally)."""
    if params.pooling is not None:
        raise InvalidParameterError("pooling", "an embedding request has nothing to decode: it runs on one replica")
    if params.n != 1:
        raise InvalidParameterError("n", "a remotely prefilled request has one sequence")
    if params.structured_output is not None:
        raise InvalidParameterError(params.structured_output.param, "constrained requests prefill locally")


def start_prefill(engine: PDEngine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
    """Queue a prefill-only request: its prompt, and its first token sampled with ``params``."""
    check_remote_prefill(params)
    first_only = replace(params, max_tokens=1, stop=(), stop_token_ids=(), ignore_eos=True)
    engine.add_request(request_id, prompt_ids, first_only, prompt_token_ids=prompt_ids)
    engine.policy.requests[request_id].kv_moves.export = True


def collect_exports(engine: PDEngine, batch: Batch, output: StepOutput) -> None:
    """Keep the KV that ``batch`` exported, by request id, until the prefill's caller takes it.

    Only for requests still live: one aborted while the step ran (its caller
    cancelled, and took nothing) would leave its prompt's KV here for good.
    """
    if batch.kv_moves.exports is None:
        return
    assert output.kv_exports is not None and len(output.kv_exports) == len(batch.kv_moves.exports)
    reqs = engine.policy.requests_in_step(batch.step)
    live = engine.policy.requests
    for (j, _), payloads in zip(batch.kv_moves.exports, output.kv_exports, strict=True):
        req = reqs[batch.sample_indices[j]]
        if live.get(req.request_id) is req:
            assert isinstance(payloads, tuple), "an executor's output holds every rank's payloads of each export"
            engine.exported[req.request_id] = payloads


def add_prefilled(
    engine: PDEngine, result: PrefillResult, prompt_ids: list[int], params: SamplingParams, *,
    arrival_time: float, namespace: str | None = None,
) -> list[SequenceDelta]:
    """Start ``result``'s request here; returns the delta of its first token (final if that token ends it)."""
    check_remote_prefill(params)
    check_decode_drafting(engine.config.speculative_config)
    kv = result.kv
    assert isinstance(kv, tuple), "fetch a ray ObjectRef's payloads before add_prefilled"
    _check_kv(engine, kv, result.quantization, len(prompt_ids))
    rid = result.request_id
    stop = StopRule(params, engine.eos_token_id, IncrementalDetokenizer(engine.tokenizer, prompt_ids))
    lora_key = engine.loras.check(params)  # its adapter must be loaded here too; its KV is keyed by its weights
    req = Request(rid, prompt_ids, params, namespace=namespace, stop_rule=stop, arrival_time=arrival_time,
                  lora_key=lora_key)
    tokens, text, reason = req.append_output([result.first_token])
    req.first_scheduled_time = req.first_token_time = req.last_token_time = time.monotonic()
    req.num_cached_tokens = result.num_cached_tokens
    logprobs = [result.first_logprobs] if params.logprobs is not None and result.first_logprobs else None
    timing = None
    if reason is None:
        req.kv_moves.imported = kv
        engine.track(req)
    else:  # ended by its first token: nothing to decode, no page taken
        timing = SequenceTiming(arrival_time, req.first_token_time, req.last_token_time, 1, req.first_scheduled_time)
    return [SequenceDelta(request_id=rid, index=0, token_ids=tokens, text=text, logprobs=logprobs,
                          finish_reason=reason, num_prompt_tokens=len(prompt_ids),
                          num_cached_tokens=result.num_cached_tokens, timing=timing)]


def _check_kv(engine: PDEngine, kv: RankPayloads, quantization: WeightQuantization, num_prompt_tokens: int) -> None:
    """Refuse KV this engine's pool cannot take here, before any page is given for it.

    Every field the runner checks as it writes (``kvcache.kv_transfer``) is
    checked here first: caught there, a mismatch would fail a whole step
    (with shards on Ray, the shard group) after pages were given for it.
    """
    config = engine.config
    theirs, ours = quantization, weight_quantization(config)
    if theirs != ours:
        # Same layout, other numbers: KV from other weights fits the pool and would be cached as ours.
        param = WEIGHT_QUANTIZATION_FIELDS[0] if theirs[0] != ours[0] else WEIGHT_QUANTIZATION_FIELDS[1]
        raise InvalidParameterError(param, f"the KV was computed with weight quantization {theirs[0]!r} (group size "
                                           f"{theirs[1]!r}), this engine runs {ours[0]!r} (group size {ours[1]!r}): "
                                           f"both pools need the same {param}")
    if len(kv) != config.tensor_parallel_size:
        raise InvalidParameterError("tensor_parallel_size", f"the KV comes from {len(kv)} ranks, this engine has "
                                                            f"{config.tensor_parallel_size}: both pools need the same")
    layout = engine.executor.kv_layout
    num_pages = -(-num_prompt_tokens // layout.page_size)
    for payload in kv:
        try:
            check_layout(layout, payload)
        except KVPayloadMismatchError as err:
            raise InvalidParameterError(err.param, err.message) from None
        if payload.num_pages != num_pages:
            raise InvalidParameterError("prompt", f"the KV holds {payload.num_pages} pages, the prompt of "
                                                  f"{num_prompt_tokens} tokens fills {num_pages}")
