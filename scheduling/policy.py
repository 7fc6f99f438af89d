"""Continuous batching: one ``Batch`` per engine step, under a token budget.

Each step the policy first serves running requests in admission order
(decodes and unfinished prompt chunks), reserving KV pages for the tokens
they compute; when pages run out it evicts unlocked prefix-cache pages, then
preempts running requests by recompute, newest first (as vLLM does under
FCFS: the latest admitted has the least work to lose, and the oldest keep
their place). With budget left and no preemption in the step, it admits
waiting requests in order, reusing cached prefixes found at admission. A long
prompt is split across steps (chunked prefill) and mixed with decodes in the
same step.

A waiting request that does not fit blocks the ones behind it (FCFS). Two
exceptions: a request whose prefix the KV tiers are loading is passed over
until its load ends (``scheduling.kv_tiers``; bounded by the engine's
``load_wait_s``), and a request whose LoRA adapter cannot get a slot (every slot pinned
by running requests of other adapters) is passed over by later requests whose
adapters hold slots, in at most ``LORA_MAX_OVERTAKES`` steps; after that it
blocks the queue, so the running adapters drain and free a slot for it. Its
prefix lookup is read-only and its hit is counted only once it is admitted,
so a request blocked for many steps costs one tree walk per step and counts
once in the hit rate.

Page ownership (``scheduling.request_pages``): a request holds a reference on
every page of its page table and a lock on the radix node it matched; when it
ends, its computed pages go into the radix tree.

Embedding requests (``Request.pooling``, ``scheduling.pooling``) take the same
path through the token budget, chunked prefill and preemption, but sample
nothing: they never look up the prefix cache (pooling needs every prompt
row computed), their pages are freed outright when they end (the tree never
holds them: no later request gets a hit from an embedding), and they finish
in the step that computes their prompt's last token. Their pooled rows come
back per step (``PolicyUpdate.pooled``); pooling them is the engine's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from kvcache.errors import CacheConfigError
from kvcache.kv_transfer import RankPayloads
from kvcache.page_allocator import PageAllocator
from kvcache.radix_cache import PrefixMatch, RadixCache
from scheduling.batch import Batch, BatchKVMoves, BatchLoRA, StepOutput
from scheduling.batch_builder import Scheduled, build_batch
from scheduling.errors import InvalidParameterError
from scheduling.finish_reason import FinishReason
from scheduling.kv_handoff import drop_unwritten, imports_written, kv_exports, take_imported
from scheduling.kv_tiers import tier_pages
from scheduling.lora_slots import NO_LORA, LoRASlots
from scheduling.request import Request, RequestStatus
from scheduling.request_pages import RequestPages
from scheduling.scheduler_config import SchedulerConfig
from scheduling.scheduler_stats import SchedulerStats
from scheduling.spec_decode import SpecDecodePolicy

# Steps in which later requests may be admitted past one waiting for a LoRA slot (the starvation bound).
LORA_MAX_OVERTAKES = 32

# The draft tokens of a sequence that has none (shared, never mutated: the per-step hot path).
_NO_DRAFTS: list[int] = []


@dataclass(frozen=True, slots=True)
class PolicyUpdate:
    """What one step changed: the tokens sampled and the requests that ended.

    ``sampled`` holds (request, its new token ids (one, or more when drafts
    were kept), the row of the first in the step's ``StepOutput``, the text
    they make safe to emit: ``StopRule.on_token``'s).
    ``pooled`` holds, per embedding request still running when the step
    ended whose hidden rows the step pooled: (request, its row in
    ``StepOutput.pooled``, the position of the chunk's first token). A first
    position of 0 starts its pooling afresh: a preempted embedding request
    recomputes its prompt from the start. One that ends this step is in
    ``finished`` too (finish reason "stop").
    """

    sampled: list[tuple[Request, list[int], int, str]]
    finished: list[Request]
    pooled: list[tuple[Request, int, int]]


class BatchPolicy:
    """Decides each step's batch; owns the waiting and running queues and every request's KV pages.

    Configured by ``SchedulerConfig``. Not to be confused with the scheduler actor (``actors.scheduler``),
    the Ray actor whose engine loop calls this policy once per step.
    """

    def __init__(
        self, config: SchedulerConfig, allocator: PageAllocator, cache: RadixCache | None = None
    ) -> None:
        if config.enable_prefix_caching and cache is None:
            cache = RadixCache(allocator, config.page_size)
        max_pages = -(-config.max_model_len // config.page_size)
        if max_pages > allocator.num_pages:
            raise CacheConfigError(
                "max_model_len",
                f"max_model_len {config.max_model_len} needs {max_pages} pages of "
                f"{config.page_size} tokens but the pool holds {allocator.num_pages}",
            )
        self.config = config
        self.allocator = allocator
        self.cache = cache if config.enable_prefix_caching else None
        self.kv = RequestPages(allocator, self.cache, config.page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        spec_config = config.speculative_config
        self.spec = (
            SpecDecodePolicy(spec_config, self.stats, config.max_model_len) if spec_config is not None else None
        )
        self.lora = LoRASlots(config.max_loras) if config.max_loras else None
        self._step = 0
        self._in_flight: dict[int, list[Scheduled]] = {}
        # request id -> siblings waiting for its prompt pages (see ``add``)
        self._forks: dict[str, list[Request]] = {}

    # ----------------------------------------------------------------- intake
    def add(self, request: Request, *, share_prompt_with: str | None = None) -> None:
        """Queue a request; invalid sizes raise ``InvalidParameterError``.

        ``share_prompt_with`` names a queued request with the same prompt (a
        sibling of ``n > 1``): this one waits until the sibling has computed
        the prompt, then starts from the sibling's full prompt pages.
        """
        # An embedding request generates nothing: max_tokens does not count against its prompt.
        self.config.check_lengths(request.num_prompt_tokens, 0 if request.pooling is not None else request.params.max_tokens)
        if request.request_id in self.requests:
            raise InvalidParameterError("request_id", f"{request.request_id!r} is already queued")
        self.requests[request.request_id] = request
        src = self.requests.get(share_prompt_with) if share_prompt_with is not None else None
        if (
            src is not None
            and src.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
            and not src.output_token_ids
            and src.prompt_token_ids == request.prompt_token_ids
        ):
            self._forks.setdefault(src.request_id, []).append(request)
        else:
            self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """End a request wherever it is; returns it, or None if unknown or already ended."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.waiting.extend(self._forks.pop(request_id, ()))  # siblings compute for themselves
        if req.status is RequestStatus.WAITING:
            if req in self.waiting:
                self.waiting.remove(req)
            else:
                for siblings in self._forks.values():
                    if req in siblings:
                        siblings.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self._release(req)
        req.finish_reason = FinishReason.ABORT
        req.set_status(RequestStatus.ABORTED)
        return req

    def requests_in_step(self, step: int) -> list[Request]:
        """The requests a step still in flight was planned for (empty once updated)."""
        return [entry.request for entry in self._in_flight.get(step, ())]

    def is_in_flight(self, step: int) -> bool:
        """Whether ``step`` was planned and not yet settled by ``update``."""
        return step in self._in_flight

    @property
    def has_step_in_flight(self) -> bool:
        """True between ``schedule()`` and the ``update`` of its batch: ``schedule()`` may not run."""
        return bool(self._in_flight)

    @property
    def has_work(self) -> bool:
        """Requests to run, or pages queued for the KV tiers (a step copies them out)."""
        return bool(self.waiting or self.running or self.kv.saves)

    # --------------------------------------------------------------- planning
    def schedule(self) -> Batch | None:
        """Pick this step's work; None when there is nothing to do.

        Only here are pages allocated, and only once the previous step is
        settled by ``update``: a request aborted while a step runs frees its
        pages at once, and no page may be handed out again while a forward
        may still write its KV (asserted; ``python -O`` drops the check).
        """
        assert not self._in_flight, f"schedule() with step(s) {list(self._in_flight)} still in flight"
        budget = self.config.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        running = self.running
        spec = self.spec if self.spec is not None and self.spec.start_step(len(running)) else None
        preempted = False
        # (index in ``scheduled``, drafts to verify) of the sampled sequences that may speculate: their
        # pages are reserved only once every request's ordinary pages are (``_reserve_speculation``).
        speculating: list[tuple[int, list[int]]] = []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.reserve(req, req.num_computed_tokens + n):
                # Newest first: ``running`` is in admission order.
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                samples = req.num_computed_tokens + n == req.num_tokens and req.pooling is None
                drafts = _NO_DRAFTS
                if spec is not None and samples:
                    if n == 1:
                        drafts = spec.drafts(req, min(spec.max_drafts(req), budget - 1))
                    speculating.append((len(scheduled), drafts))
                scheduled.append(Scheduled(req, n, samples, _NO_DRAFTS, 0))
                budget -= n + len(drafts)  # the drafts' budget is held; their pages come last
                i += 1
        imports: list[tuple[list[int], RankPayloads]] = []  # P/D: prompt KV that arrived (kv_handoff)
        if not preempted:
            budget = self._admit(scheduled, budget, spec, imports, speculating)
        if spec is not None:
            self._reserve_speculation(spec, scheduled, speculating)
        if not scheduled and not self.kv.saves:
            return None
        batch, exports = build_batch(self._step + 1, scheduled), kv_exports(scheduled, self.kv)
        pages: list[int] | None = None
        keys: list[bytes] | None = None
        if self.kv.saves:  # pages for the KV tiers, read before this step's forward overwrites any page
            pages, keys = self.kv.saves.take()
        if imports or exports or pages:
            batch = replace(batch, kv_moves=BatchKVMoves(exports or None, imports or None, pages, keys))
        if self.lora is not None:
            batch = self._with_lora(batch, scheduled, self.lora)
        # In flight only once the batch exists: a step recorded without one could never be settled.
        self._step += 1
        self._in_flight[self._step] = scheduled
        return batch

    @staticmethod
    def _with_lora(batch: Batch, scheduled: list[Scheduled], lora: LoRASlots) -> Batch:
        slots = [NO_LORA if e.request.lora.slot is None else e.request.lora.slot for e in scheduled]
        loads = lora.take_loads()
        if not loads and all(s == NO_LORA for s in slots):
            return batch
        return replace(batch, lora=BatchLoRA(slots if any(s != NO_LORA for s in slots) else None, loads or None))

    def uses_lora(self, name: str) -> bool:
        """Whether a queued or running request is served by adapter ``name``."""
        return any(req.params.lora == name for req in self.requests.values())

    def _admit(self, scheduled: list[Scheduled], budget: int, spec: SpecDecodePolicy | None,
               imports: list[tuple[list[int], RankPayloads]], speculating: list[tuple[int, list[int]]]) -> int:
        cfg = self.config
        cache = self.cache
        i = 0  # the next candidate in ``waiting``; those before it wait for a LoRA slot
        overtaken: list[Request] = []
        admitted_past = False
        while i < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[i]
            if req.kv_moves.imported is not None:  # its prompt KV came from a prefill replica
                if not take_imported(self.kv, req, imports):
                    break
                self._start_running(i)
                scheduled.append(Scheduled(req, 1, True, _NO_DRAFTS, 0))
                budget -= 1
                admitted_past = bool(overtaken)
                continue
            if req.kv_moves.loading:  # the KV tiers are fetching its prefix (for the engine's load_wait_s at most):
                i += 1  # it keeps its place, and those behind it go on meanwhile
                continue
            if req.params.lora is not None:
                # Its adapter in a slot first (before the tree walk: a request passed over costs none):
                # with every slot pinned by other adapters it waits, passed over by requests of resident
                # adapters until the starvation bound.
                assert self.lora is not None, "the engine refuses adapters when LoRA is off"
                req.lora.slot = self.lora.acquire(req.params.lora)
                if req.lora.slot is None:
                    if req.lora.overtakes >= LORA_MAX_OVERTAKES:
                        break
                    overtaken.append(req)
                    i += 1
                    continue
            match: PrefixMatch | None = None
            # An embedding request computes every prompt row (mean pooling reads them all): no lookup.
            if cache is not None and req.num_computed_tokens == 0 and req.pooling is None:
                match = cache.match_prefix(req.all_token_ids, req.cache_namespace)  # read-only
            # Pages the KV tiers brought, past the match (``scheduling.kv_tiers``): fresh pages filled from them.
            loaded, payload = (0, None) if match is None else tier_pages(req, match.num_tokens // cfg.page_size,
                                                                         cfg.page_size)
            fit = self._fit(req, match, budget, loaded * cfg.page_size)
            if fit is None:
                self._unpin_lora(req)
                break
            match, n = fit
            start = req.num_computed_tokens if match is None else match.num_tokens
            if match is not None:
                self.kv.take_prefix(req, match)
            if not self.kv.reserve(req, start + loaded * cfg.page_size + n):
                # Evicting freed less than counted (pages a running sibling
                # still holds). A failed reserve allocates nothing, so only a
                # prefix taken just now is to give back.
                if match is not None:
                    self.kv.release(req)
                self._unpin_lora(req)
                break
            if payload is not None:
                first = start // cfg.page_size
                imports.append((req.pages[first : first + loaded], payload))
                req.num_computed_tokens = start + loaded * cfg.page_size
                req.kv_moves.tier_unwritten = True
                self.stats.tier_hit_tokens += loaded * cfg.page_size
            req.kv_moves.loaded = None
            if match is not None and req.num_preemptions == 0:
                self._count_prefix_hit(req, match.num_tokens, req.num_computed_tokens)
            self._start_running(i)
            samples = req.num_computed_tokens + n == req.num_tokens and req.pooling is None
            if spec is not None and samples:
                speculating.append((len(scheduled), _NO_DRAFTS))
            scheduled.append(Scheduled(req, n, samples, _NO_DRAFTS, 0))
            budget -= n
            admitted_past = bool(overtaken)
        if admitted_past:
            for req in overtaken:
                req.lora.overtakes += 1
        return budget

    def _reserve_speculation(self, spec: SpecDecodePolicy, scheduled: list[Scheduled],
                             speculating: list[tuple[int, list[int]]]) -> None:
        """Give the speculating sequences their draft and proposal pages, from what is left.

        Runs after every request of the step holds its ordinary pages, so a
        draft never takes a page a request needed (which would evict cached
        prefixes or preempt it). A sequence whose drafts do not fit drops them;
        the step then computes fewer tokens than its budget allowed.
        """
        for k, wanted in speculating:
            req, n, samples, _, _ = scheduled[k]
            drafts, propose = spec.reserve(self.kv, req, n, wanted)
            scheduled[k] = Scheduled(req, n + len(drafts), samples, drafts, propose)

    def _start_running(self, index: int) -> None:
        """Move ``waiting[index]`` into the running batch."""
        req = self.waiting[index]
        del self.waiting[index]
        req.set_status(RequestStatus.RUNNING)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _fit(self, req: Request, match: PrefixMatch | None, budget: int,
             loaded: int = 0) -> tuple[PrefixMatch | None, int] | None:  # fmt: skip
        """The prefix to start ``req`` from (its pages locked) and the tokens to compute this step.

        ``loaded``: tokens past the match whose KV the tiers brought (they need pages, not compute).
        None when the pages could not be had even by evicting every unlocked
        cached page; then nothing is locked or evicted.
        """
        start = (req.num_computed_tokens if match is None else match.num_tokens) + loaded
        remaining = req.num_tokens - start
        n = min(remaining, budget)
        if n < remaining and not self.config.enable_chunked_prefill:
            return None
        have = len(req.pages)
        if match is not None:
            assert self.cache is not None
            # First, so the fit check does not count the matched pages evictable.
            match = self.cache.lock_match(match)
            have = len(match.pages)
        if self.kv.may_fit(self.kv.pages_for(start + n) - have):
            return match, n
        if match is not None:
            assert self.cache is not None
            self.cache.unlock(match.node)
        return None

    def _count_prefix_hit(self, req: Request, num_hit_tokens: int, num_cached_tokens: int) -> None:
        # Once per request, at its first admission (a preempted one re-matches
        # its own pages: not a hit of the cache's making). ``num_cached_tokens``
        # adds what the KV tiers loaded: not computed either.
        req.num_cached_tokens = num_cached_tokens
        self.stats.prefix_queries_tokens += req.num_prompt_tokens
        self.stats.prefix_hit_tokens += num_hit_tokens

    # ---------------------------------------------------------------- results
    def update(self, batch: Batch, output: StepOutput) -> PolicyUpdate:
        """Apply one step's sampled tokens; end the requests their ``StopRule`` stops,
        and the embedding requests whose prompt the step completed."""
        scheduled = self._in_flight.pop(batch.step)
        if batch.kv_moves.imports:
            imports_written(scheduled)
        if batch.kv_moves.saves:
            self.kv.saves.saved(batch.kv_moves.saves)
        now = time.monotonic()
        sampled: list[tuple[Request, list[int], int, str]] = []
        finished: list[Request] = []
        pooled: list[tuple[Request, int, int]] = []
        if batch.pooling.indices is not None:  # before the loop below advances their computed tokens
            for j, idx in enumerate(batch.pooling.indices):
                req = scheduled[idx].request
                if req.status is RequestStatus.RUNNING:  # not aborted while the step ran
                    pooled.append((req, j, req.num_computed_tokens))
        num_accepted = output.num_accepted  # None: no drafts this step, one new token per sequence
        token_ids = output.token_ids
        seq = 0  # index among the step's sampled sequences
        row = 0  # first output row of the next sampled sequence
        for req, n, samples, drafts, propose in scheduled:
            if samples:
                j, first = seq, row
                seq += 1
                row += 1 + len(drafts)
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if not samples:
                req.num_computed_tokens += n
                if req.pooling is not None and req.num_computed_tokens == req.num_prompt_tokens:
                    # No token, so no first-token time (TTFT figures stay the generations'); the last
                    # token's time is when its vector is ready (end-to-end latency counts it).
                    req.last_token_time = now
                    req.finish_reason = FinishReason.STOP
                    finished.append(req)
                continue
            if num_accepted is None:  # ``append_output`` of one token, inlined: the per-step hot path
                token = token_ids[first]
                req.output_token_ids.append(token)
                text, reason = req.stop_rule.on_token(token, len(req.output_token_ids))
                tokens = [token]
                req.num_computed_tokens += n
            else:
                tokens, text, reason = req.append_output(token_ids[first : first + num_accepted[j] + 1])
                # The step computed the tokens before its drafts and the drafts kept
                # (``tokens`` minus the last, which is new); the rest was never valid.
                req.num_computed_tokens += n - len(drafts) + len(tokens) - 1
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if self._forks and req.request_id in self._forks:
                self._fork(req)
            if drafts or propose:
                assert self.spec is not None
                if drafts:
                    assert num_accepted is not None
                    self.spec.record(req, len(drafts), num_accepted[j])
                if output.draft_token_ids is not None:
                    self.spec.set_proposals(req, output.draft_token_ids[j])
                self.kv.trim(req, req.num_tokens)  # rejected drafts' pages go back now
            sampled.append((req, tokens, first, text))
            if reason is None:
                continue
            req.finish_reason = reason
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.finish_reason is None]
            for req in finished:
                self._end(req, req.finish_reason or FinishReason.STOP)
        self.stats.num_steps += 1
        return PolicyUpdate(sampled, finished, pooled)

    def _fork(self, src: Request) -> None:
        """Hand ``src``'s full prompt pages to the siblings that waited for them."""
        ps = self.config.page_size
        num_pages = (src.num_prompt_tokens - 1) // ps  # keep >= 1 token to recompute
        shared = src.pages[:num_pages]
        for child in reversed(self._forks.pop(src.request_id)):
            self.allocator.incref(shared)
            child.pages = list(shared)
            child.num_computed_tokens = child.num_cached_tokens = num_pages * ps
            self.waiting.appendleft(child)

    # ---------------------------------------------------------------- release
    def _release(self, req: Request) -> None:
        """Give back ``req``'s pages and LoRA slot; only KV a step has written goes into the prefix cache."""
        drop_unwritten(req)
        self.kv.release(req)
        self._unpin_lora(req)

    def _unpin_lora(self, req: Request) -> None:
        if req.lora.slot is not None:
            assert self.lora is not None
            self.lora.release(req.lora.slot)
            req.lora.slot = None

    def _end(self, req: Request, reason: FinishReason) -> None:
        self.requests.pop(req.request_id, None)
        self._release(req)
        req.finish_reason = reason
        req.set_status(RequestStatus.FINISHED)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        req.set_status(RequestStatus.PREEMPTED)
        req.set_status(RequestStatus.WAITING)
        self.waiting.appendleft(req)
