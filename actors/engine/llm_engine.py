"""The engine step loop: batch policy + executor + detokenization, in one process.

``LLMEngine.step()`` runs one engine step and returns one delta per sequence
that changed, so a caller (the offline API, the scheduler actor) publishes one
message per step carrying every request's progress. An embedding request
(``SamplingParams.pooling``) rides the same steps as its prompt's prefill and
yields one delta carrying its vector (``actors.engine.embeddings``).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

from xgrammar import CompiledGrammar

from actors.api import FinishReason, SequenceDelta, SequenceTiming
from actors.config import EngineConfig
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.disaggregation import collect_exports
from actors.engine.embeddings import EmbeddingSums
from actors.engine.executor import Executor, LocalExecutor
from actors.engine.kv_tiers import KVTiersLink
from actors.engine.lora_registry import LoRARegistry
from actors.errors import ExecutorFailure
from actors.grammar.compiler import GrammarCompiler
from actors.grammar.states import GrammarStates
from actors.load.loader import load_tokenizer
from actors.log import get_logger
from actors.tokenizing import text_ids
from kvcache.kv_transfer import RankPayloads
from kvcache.page_allocator import PageAllocator
from scheduling.batch import Batch, StepOutput, TokenLogprobs
from scheduling.errors import InvalidParameterError
from scheduling.policy import BatchPolicy
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.stop_rule import StopRule

logger = get_logger(__name__.rsplit(".", 1)[-1])


@dataclass(slots=True)
class _Sequence:
    """Engine-side state of one scheduled sequence (one of a request's n)."""

    request_id: str
    index: int
    want_logprobs: bool


class LLMEngine:
    """Owns the batch policy, the executor and every sequence's text state."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor if executor is not None else LocalExecutor(config)
        self.tokenizer = load_tokenizer(self.executor.model_path)
        self.vocab_size = self.executor.vocab_size
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.allocator = PageAllocator(self.executor.capacity.num_pages)
        self.policy = BatchPolicy(config.scheduler_config(), self.allocator)
        self.loras = LoRARegistry(config, self.executor, self.policy)
        # The KV tiers below the pool (host, disk, cluster), when configured (actors.engine.kv_tiers).
        self.kv_tiers = (None if config.kv_offload is None else
                         KVTiersLink(config, config.kv_offload, self.executor.kv_layout, self.executor.model_path,
                                     self.policy))  # fmt: skip
        self._seqs: dict[str, _Sequence] = {}  # policy request id -> state
        self._groups: dict[str, list[str]] = {}  # client request id -> policy request ids
        # The batch whose step failed between schedule() and the policy's update (its token
        # masks, the forward, or finish_step before the update), until fail_step/fail_all settles
        # it: its policy bookkeeping is still open and its requests' state unknown.
        self._failed_batch: Batch | None = None
        # Adapters the step in flight could not read (adapter -> why), set by execute() on the engine's
        # worker thread; their requests end when the step is settled (finish_step or fail_*), on the loop.
        self._unreadable: dict[str, str] = {}
        # Seconds spent in executor.execute, summed over steps (the forward as the engine waits for it:
        # with shards on other actors, their round trip too). Per step against engine steps, it shows
        # what the serving path around the engine costs the forward (flotilla bench serve / offline).
        self.forward_seconds_total = 0.0
        # Structured output: constraints compiled once each, one matcher per constrained sequence.
        self.grammar = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id,
                                       timeout_s=config.grammar_compile_timeout_s)
        self.grammar_states = GrammarStates(self.vocab_size, self.grammar.closing_path)
        self.constrained_requests = Counter[str]()  # requests added with a constraint, by kind
        # Prefill-only requests' exported prompt KV, by request id, until taken (actors.engine.disaggregation).
        self.exported: dict[str, RankPayloads] = {}
        # Seconds spent on the step's critical path filling token masks and advancing matchers.
        self.grammar_seconds_total = 0.0
        # Mean pooling's float32 running sums of embedding requests whose prompt is part computed.
        self.embeddings = EmbeddingSums()

    # ----------------------------------------------------------------- intake
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt; ids out of the vocabulary are refused."""
        if isinstance(prompt, str):
            return text_ids(self.tokenizer, prompt)
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidParameterError("prompt", "must be a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError(
                "prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        namespace: str | None = None,
        prompt_token_ids: list[int] | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> int:
        """Queue a request (``params.n`` sequences); returns its prompt length.

        ``grammar``: ``params.structured_output`` already compiled (``GrammarCompiler.compile_async``);
        without it the constraint is compiled here, waiting at most the compile timeout.
        With ``params.pooling`` it is an embedding request: one sequence, no prefix-cache or KV-tier
        lookup (every prompt row is computed), one final delta carrying the vector.
        """
        if request_id in self._groups:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        lora_key = self.loras.check(params)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidParameterError(
                "logit_bias", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        constraint = params.structured_output
        if constraint is not None and self.eos_token_id is None:
            raise InvalidParameterError(constraint.param, "this model has no end-of-sequence token to end "
                                                          "a constrained output with")
        if constraint is None:
            grammar = None
        elif grammar is None:
            grammar = self.grammar.compile(constraint)
        children: list[str] = []
        try:
            for i in range(params.n):
                child_params = params
                if params.n > 1 and params.seed is not None:
                    child_params = _with_seed(params, params.seed + i)
                sid = request_id if params.n == 1 else f"{request_id}#{i}"
                stop = StopRule(child_params, self.eos_token_id, IncrementalDetokenizer(self.tokenizer, ids))
                req = Request(sid, ids, child_params, namespace=namespace, stop_rule=stop, lora_key=lora_key)
                # Siblings start from the first one's prompt pages: computed once.
                self.policy.add(req, share_prompt_with=children[0] if children else None)
                children.append(sid)
                self._seqs[sid] = _Sequence(request_id, i, params.logprobs is not None)
                if grammar is not None and constraint is not None:
                    self.grammar_states.add(sid, grammar, child_params.max_tokens)
        except Exception:
            for sid in children:
                self.policy.abort(sid)
                self._seqs.pop(sid, None)
                self.grammar_states.remove(sid)
            raise
        self._groups[request_id] = children
        # Siblings of n > 1 start from the first one's pages; an embedding request reads no cached KV.
        if self.kv_tiers is not None and params.pooling is None:
            self.kv_tiers.start_load(self.policy.requests[children[0]])
        if constraint is not None:
            self.constrained_requests[constraint.kind] += 1
        return len(ids)

    def track(self, req: Request) -> None:
        """Schedule an already built one-sequence request (``actors.engine.disaggregation.add_prefilled``)."""
        if req.request_id in self._groups:
            raise InvalidParameterError("request_id", f"{req.request_id!r} is already running")
        self.policy.add(req)
        self._seqs[req.request_id] = _Sequence(req.request_id, 0, req.params.logprobs is not None)
        self._groups[req.request_id] = [req.request_id]

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Abort every sequence of a request; returns their final deltas."""
        deltas = self._end_group(request_id, FinishReason.ABORT, None)
        # This may be an unloading adapter's last request, and an idle engine runs no step that would finish
        # the unload (the step loop is not woken by an abort).
        self.loras.finish_unloads()
        return deltas

    def fail_step(self, message: str) -> list[SequenceDelta]:
        """After a step failed (``has_failed_step``): end the failed step's requests.

        The requests running in that step end with finish_reason "error" and
        ``message``; their pages are freed (the computed ones stay in the
        prefix cache, whose KV the failed forward did not touch; KV the step
        was to import is not cached). Waiting requests are untouched, so the
        engine keeps serving them. If the step's bookkeeping cannot be
        settled, ``can_schedule`` stays False (the caller reports it).
        """
        batch, self._failed_batch = self._failed_batch, None
        if batch is None:
            return self._end_unreadable()
        groups = dict.fromkeys(
            self._seqs[r.request_id].request_id
            for r in self.policy.requests_in_step(batch.step)
            if r.request_id in self._seqs  # not aborted while the step ran
        )
        deltas = self._end_unreadable() + [d for rid in groups for d in self._end_group(rid, FinishReason.ERROR, message)]
        self._settle(batch)
        self.loras.finish_unloads()  # the step's requests may have been an unloading adapter's last
        return deltas

    def fail_all(self, message: str, *, kv_lost: bool = False) -> list[SequenceDelta]:
        """End every unfinished request with finish_reason "error" and ``message``.

        Every page goes back to the allocator or the prefix cache at once;
        with ``kv_lost`` (the shards that held the KV pool died) the prefix
        cache is emptied too, since its pages no longer hold valid KV.
        """
        deltas = self._end_unreadable()
        deltas += [d for rid in list(self._groups) for d in self._end_group(rid, FinishReason.ERROR, message)]
        batch, self._failed_batch = self._failed_batch, None
        if batch is not None:
            self._settle(batch)
        if kv_lost:
            self.policy.kv.saves.clear()  # pages queued to be copied out hold nothing now
            if self.policy.cache is not None:
                self.policy.cache.reset()
            self.loras.shards_restarted()
        self.loras.finish_unloads()  # every request has ended: unloading adapters go now
        return deltas

    def _end_group(self, request_id: str, reason: FinishReason, error: str | None) -> list[SequenceDelta]:
        deltas = []
        for sid in self._groups.pop(request_id, []):
            req = self.policy.abort(sid)
            seq = self._seqs.pop(sid, None)
            self.grammar_states.remove(sid)
            self.exported.pop(sid, None)
            self.embeddings.drop(sid)
            if req is not None and seq is not None:
                deltas.append(SequenceDelta(
                    request_id=request_id, index=seq.index, token_ids=[], text="", logprobs=None,
                    finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens, error=error, timing=_timing(req),
                ))
        return deltas

    def _settle(self, batch: Batch) -> None:
        """Settle a failed step's policy bookkeeping once its requests are aborted.

        ``BatchPolicy.update`` skips requests that are no longer running, so a
        placeholder output only drops the step's in-flight record. Its
        requests are ended (their deltas made) before this runs; should it
        fail, the batch is kept to settle on the next ``fail_*`` and
        ``can_schedule`` says the engine cannot plan meanwhile.
        """
        n = len(batch.sample_indices)
        try:
            self.policy.update(batch, StepOutput([0] * n, [None] * n))
        except Exception:
            logger.exception("the failed step %d could not be settled; the engine cannot plan another", batch.step)
            self._failed_batch = batch

    @property
    def has_failed_step(self) -> bool:
        """True after a step failed between ``schedule()`` and its update, until ``fail_step``/``fail_all``."""
        return self._failed_batch is not None

    @property
    def can_schedule(self) -> bool:
        """False while a step's bookkeeping is open: between ``schedule()`` and ``finish_step``/``fail_*``,
        or for good if a failed step could not be settled."""
        return not self.policy.has_step_in_flight

    @property
    def has_unfinished(self) -> bool:
        return self.policy.has_work

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------- step
    def step(self) -> list[SequenceDelta]:
        """Run one engine step; return one delta per sequence that gained text or ended."""
        batch = self.schedule()
        if batch is None and self.kv_tiers is not None and self.kv_tiers.has_loads:
            self.kv_tiers.wait_for_loads()  # nothing else to run: the requests wait for their KV loads
            batch = self.schedule()
        if batch is None:
            return []
        return self.finish_step(batch, self.execute(batch))

    # A caller that overlaps intake with the forward (the scheduler actor) runs
    # step() in three phases: schedule() and finish_step() under its engine
    # lock, execute() without it (it reads only the immutable Batch).
    def schedule(self) -> Batch | None:
        """Plan the next step (with its token masks); None when there is nothing to run."""
        if self.kv_tiers is not None:
            self.kv_tiers.deliver()
        batch = self.policy.schedule()
        if batch is None or not (self.loras.enabled or len(self.grammar_states)):
            return batch  # the common step: no per-request walk
        reqs = self.policy.requests_in_step(batch.step)
        if self.loras.enabled:
            self.loras.planned(batch, reqs)
        if not len(self.grammar_states):
            return batch
        start = time.perf_counter()
        try:
            masks = self.grammar_states.masks(batch, [reqs[i].request_id for i in batch.sample_indices])
        except BaseException:
            # The step is planned (pages given, in flight) but will not run: the caller settles it
            # with fail_step() or fail_all(), as a failed forward.
            self._failed_batch = batch
            raise
        finally:
            self.grammar_seconds_total += time.perf_counter() - start
        return batch if masks is None else replace(batch, token_masks=masks)

    def execute(self, batch: Batch) -> StepOutput:
        """Run a planned step on the executor; touches no request state.

        The step's adapter loads are read first, here: a caller runs this off
        its event loop (``actors.scheduler.step_loop``), and reading an adapter
        evicted from the shards' host cache may take long. One that cannot be
        read is not loaded; its requests end when the step is settled.
        """
        start = time.perf_counter()
        self._unreadable = {}
        try:
            return self.executor.execute(self._prepare_loras(batch) if batch.lora.loads else batch)
        except BaseException:
            # The caller settles it with fail_step() or fail_all().
            self._failed_batch = batch
            raise
        finally:
            self.forward_seconds_total += time.perf_counter() - start

    def _prepare_loras(self, batch: Batch) -> Batch:
        """The step without the loads of adapters that could not be read (``_unreadable``: they are not in any
        slot, so their requests' rows computed garbage, which ``_end_unreadable`` never lets out)."""
        try:
            self._unreadable = self.loras.prepare(batch)
        except ExecutorFailure:
            raise  # a shard is down: the executor restarts, every request ends
        except Exception as exc:  # noqa: BLE001 - a read that failed oddly is still only those adapters' failure
            logger.exception("the step's LoRA adapters could not be read")
            assert batch.lora.loads is not None
            self._unreadable = dict.fromkeys((n for _, n in batch.lora.loads),
                                             f"its files could not be read ({type(exc).__name__})")
        if not self._unreadable:
            return batch
        assert batch.lora.loads is not None
        loads = [(s, n) for s, n in batch.lora.loads if n not in self._unreadable]
        return replace(batch, lora=replace(batch.lora, loads=loads or None))

    def _end_unreadable(self) -> list[SequenceDelta]:
        """End the requests of the adapters the step could not read (before ``BatchPolicy.update``, so none of
        their KV computed without the adapter is kept) and free their slots, never written."""
        unreadable, self._unreadable = self._unreadable, {}
        deltas: list[SequenceDelta] = []
        requests = self.policy.requests
        for name, why in unreadable.items():
            ended = [rid for rid, sids in self._groups.items()
                     if any(requests[s].params.lora == name for s in sids if s in requests)]  # fmt: skip
            for rid in ended:
                deltas += self._end_group(rid, FinishReason.ERROR, f"LoRA adapter {name!r} could not be loaded: {why}")
            self.loras.unassign(name)
        return deltas

    def finish_step(self, batch: Batch, output: StepOutput) -> list[SequenceDelta]:
        """Apply a step's sampled tokens (the policy detokenizes and stops them) and pooled rows; emit deltas.

        Requests aborted while the step ran are skipped (the policy drops them).
        """
        deltas = self._end_unreadable()  # first: update must not take their rows
        try:
            collect_exports(self, batch, output)  # before update: it ends the prefill-only requests
            if batch.kv_moves.saves and self.kv_tiers is not None:
                assert batch.kv_moves.save_keys is not None and isinstance(output.kv_saves, tuple)
                self.kv_tiers.store(batch.kv_moves.save_keys, output.kv_saves)
            update = self.policy.update(batch, output)
        except BaseException:
            if self.policy.is_in_flight(batch.step):  # failed before update took it: fail_* settles it
                self._failed_batch = batch
            raise
        deltas += self._pool(batch, output, update.pooled) if update.pooled else []
        refused: list[str] = []
        for req, tokens, row, text in update.sampled:
            seq = self._seqs[req.request_id]
            if batch.token_masks is not None and not self._accept(req.request_id, tokens):
                refused.append(seq.request_id)
            reason = req.finish_reason  # set by the policy's StopRule when this token ended it
            if reason is FinishReason.STOP and self.grammar_states.forced(req.request_id):
                reason = req.finish_reason = FinishReason.LENGTH  # complete, but the budget (not the model) ended it
            done = reason is not None
            logprobs: list[TokenLogprobs] | None = None
            if seq.want_logprobs:
                logprobs = [lp for lp in output.logprobs[row : row + len(tokens)] if lp is not None]
            deltas.append(SequenceDelta(
                request_id=seq.request_id, index=seq.index, token_ids=tokens, text=text, logprobs=logprobs,
                finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens, timing=_timing(req) if done else None,
            ))
            if done:
                self._forget(req)
        assert all(r.pooling is None or r.request_id not in self._seqs for r in update.finished), (
            "an embedding request ended without its pooled row"
        )
        for rid in dict.fromkeys(refused):  # a masked token the grammar then refused: a bug, never quiet
            logger.error("request %s: a sampled token broke its output constraint; ending it", rid)
            deltas += self._end_group(rid, FinishReason.ERROR, "the output constraint refused a sampled token")
        self.loras.finish_unloads()
        return deltas

    def _pool(self, batch: Batch, output: StepOutput, pooled: list[tuple[Request, int, int]]) -> list[SequenceDelta]:
        """Fold the step's pooled rows into their requests' sums; one final delta per embedding finished.

        The scheduler ends an embedding request in the step that computes its
        prompt's last token, which always pools it (``Batch.pooling.indices``).
        """
        assert output.pooled is not None and batch.pooling.indices is not None, f"step {batch.step}: no pooled rows"
        deltas: list[SequenceDelta] = []
        for req, j, first in pooled:
            pooling = req.pooling
            assert pooling is not None
            row = output.pooled[j]
            if pooling.mode == "mean":
                self.embeddings.add(req.request_id, first, batch.query_lens[batch.pooling.indices[j]], row)
            if req.finish_reason is None:
                continue
            seq = self._seqs[req.request_id]
            vector = self.embeddings.finish(req.request_id, pooling, req.num_prompt_tokens, row)
            deltas.append(SequenceDelta(
                request_id=seq.request_id, index=seq.index, token_ids=[], text="", logprobs=None,
                finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens, timing=_timing(req), embedding=vector,
            ))
            self._forget(req)
        return deltas

    def _accept(self, seq_id: str, tokens: list[int]) -> bool:
        start = time.perf_counter()
        ok = self.grammar_states.accept(seq_id, tokens)
        self.grammar_seconds_total += time.perf_counter() - start
        return ok

    def _forget(self, req: Request) -> None:
        self.grammar_states.remove(req.request_id)
        seq = self._seqs.pop(req.request_id)
        group = self._groups.get(seq.request_id)
        if group is not None and all(sid not in self._seqs for sid in group):
            del self._groups[seq.request_id]

    def shutdown(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.shutdown()
        self.grammar.shutdown()
        self.executor.shutdown()


def _timing(req: Request) -> SequenceTiming:
    return SequenceTiming(
        req.arrival_time, req.first_token_time, req.last_token_time, len(req.output_token_ids),
        req.first_scheduled_time,
    )


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
