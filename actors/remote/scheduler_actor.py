"""The central scheduler of one replica: an async Ray actor around an ``LLMEngine``.

Step loop: a background asyncio task runs engine steps while there is work
and otherwise awaits an ``asyncio.Event`` that ``submit`` sets. Each step is
``engine.schedule()`` -> ``engine.execute(batch)`` on one dedicated thread ->
``engine.finish_step()``, so ``submit``/``abort``/``stats``/``health`` are
served while the model runs.

Invariant (why there are no data races): the engine's request state
(scheduler queues, pages, sequences) is touched only on the event loop while
holding ``self._lock``. The forward runs without the lock because it reads
only the immutable ``Batch``; a request aborted meanwhile frees its pages at
once (no page is reallocated before the next ``schedule()``, and
``finish_step`` skips it). The executor is touched only by the step loop
(``execute`` or ``restart``, never both at once). Consumer queues and
waiters are touched only on the event loop.

Output channel: one ``StepMessage`` per engine step per consumer, holding all
of that consumer's deltas; ``next_outputs`` long-polls a bounded queue of
them (see ``actors.remote.step_messages``).

Faults: ``ExecutorFailure`` from a step ends every unfinished request with
finish_reason "error", frees every page (the prefix cache too: the KV pool
died with the shards), reports not-ok health while ``executor.restart()``
runs, then serves again. Any other exception from the executor, or from
building the step's token masks, fails only that step's requests. A failure
that leaves a step's bookkeeping unsettled (the engine cannot plan another
step) ends every request, turns health not ok for good (the replica is to be
replaced) and ends each request that arrives after with an error. Every pass
of the loop yields to the event loop, so no failure can starve ``submit``,
``abort`` or ``health``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import ray
import torch

from actors.engine.config import EngineConfig
from actors.engine.disaggregation import (
    PrefillResult,
    RankPayloadsOrRef,
    add_prefilled,
    start_prefill,
)
from actors.engine.executor import Executor, LocalExecutor
from actors.engine.llm_engine import LLMEngine
from actors.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta
from actors.engine.stats import EngineStats, LatencyWindow, snapshot
from actors.errors import ExecutorFailure
from actors.log import get_logger
from actors.remote.cpu_threads import engine_cpu_threads, engine_thread_init
from actors.remote.step_messages import HealthStatus, OutputRouter, StepMessage
from scheduling.batch import Batch, StepOutput
from scheduling.sampling_params import SamplingParams

logger = get_logger(__name__.rsplit(".", 1)[-1])

ExecutorFactory = Callable[[EngineConfig], Executor]


def default_executor(config: EngineConfig) -> Executor:
    """``LocalExecutor``, or the tensor-parallel ``RayExecutor`` when ``config.executor == "ray"``."""
    if config.executor == "ray":
        from actors.remote.ray_executor import RayExecutor  # type: ignore[import-not-found,unused-ignore]

        executor: Executor = RayExecutor(config)
        return executor
    return LocalExecutor(config)


class SchedulerService:
    """The scheduler actor's logic (``SchedulerActor`` is this class as a Ray actor).

    ``max_messages`` bounds each consumer's queue; a consumer that has not
    polled for ``consumer_timeout_s`` is presumed dead: its requests are
    aborted (their pages freed) and its queue dropped.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        executor_factory: ExecutorFactory | None = None,
        max_messages: int = 256,
        consumer_timeout_s: float = 300.0,
        latency_window: int = 1024,
    ) -> None:
        self.config = config
        # One thread for every executor call, so device state stays on one thread. An
        # in-process forward gets the node's cores (Ray would leave it one; actors.remote.cpu_threads).
        threads = engine_cpu_threads(config.cpu_threads) if config.executor == "local" else torch.get_num_threads()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step",
                                          initializer=engine_thread_init, initargs=(threads, "engine-step"))
        # The engine is built on that thread too: loading runs torch's parallel code, and
        # on any other thread it would leave a second OpenMP team (actors.remote.cpu_threads).
        factory = executor_factory or default_executor
        self._engine = self._thread.submit(lambda: LLMEngine(config, factory(config))).result()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._latency = LatencyWindow(latency_window)
        self._router = OutputRouter(max_messages)
        self._consumer_timeout_s = consumer_timeout_s
        self._health = HealthStatus(True, "ok")
        self._restart_reason: str | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    # ----------------------------------------------------------------- intake
    async def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        namespace: str | None = None,
        *,
        consumer_id: str = "default",
    ) -> int:
        """Queue a request whose deltas go to ``consumer_id``; returns its prompt length.

        Invalid input raises ``InvalidParameterError`` (with ``.param``).
        """
        return len(await self._submit(request_id, prompt, params, namespace, consumer_id))

    async def _submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        namespace: str | None, consumer_id: str | None,
    ) -> list[int]:
        self._ensure_loop()
        grammar = None
        if params.structured_output is not None:
            # Compiled on the grammar worker while steps go on, and handed to add_request: looked up
            # again, it could have left the compiler's LRU meanwhile and be compiled under the lock.
            grammar = await self._engine.grammar.compile_async(params.structured_output)
        async with self._lock:
            # An InvalidParameterError reaches the caller whole, param included:
            # it pickles through its own __reduce__ (scheduling.errors).
            ids = self._engine.tokenize(prompt)
            self._engine.add_request(request_id, prompt, params, namespace=namespace, prompt_token_ids=ids,
                                     grammar=grammar)
            self._router.register(request_id, consumer_id, params.n)
        self._wake.set()
        return ids

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, namespace: str | None = None
    ) -> RequestOutput:
        """Submit and wait for the finished output (tests, the offline path)."""
        ids = await self._submit(request_id, prompt, params, namespace, None)
        # No await since the request was added, so no delta can have been routed yet.
        out = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids,
                            [CompletionOutput(i) for i in range(params.n)])
        fut = self._router.wait_for(out)
        try:
            return await fut
        except BaseException:
            self._router.forget_waiter(request_id)
            if _unfinished(fut):  # the caller cancelled: free its pages
                await self.abort(request_id)
            raise

    # ------------------------------------------ prefill/decode disaggregation (actors.engine.disaggregation)
    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> PrefillResult:
        """Compute a prompt and its first token here; return them with the prompt's KV (prefill replicas)."""
        self._ensure_loop()
        start = time.monotonic()
        async with self._lock:
            start_prefill(self._engine, request_id, prompt_ids, params)
            self._router.register(request_id, None, 1)
        self._wake.set()
        out = RequestOutput(request_id, None, prompt_ids, [CompletionOutput(0)])
        fut = self._router.wait_for(out)
        try:
            done = await fut
        except BaseException:
            self._router.forget_waiter(request_id)
            if _unfinished(fut):  # the caller cancelled: free its pages, export nothing for it
                await self.abort(request_id)
            raise
        finally:
            kv = self._engine.exported.pop(request_id, None)
        seq = done.outputs[0]
        if kv is None or not seq.token_ids:
            raise RuntimeError(f"prefill of {request_id} ended without its KV: {seq.finish_reason} {seq.error or ''}")
        first_logprobs = seq.logprobs[0] if seq.logprobs else None
        nbytes = sum(p.nbytes for p in kv)
        # On Ray: one copy into the object store here; the replicas between pass only the ref.
        moved: RankPayloadsOrRef = await asyncio.get_running_loop().run_in_executor(None, ray.put, kv) if ray.is_initialized() else kv
        return PrefillResult(request_id, seq.token_ids[0], first_logprobs, moved, len(prompt_ids),
                             done.num_cached_tokens, nbytes, time.monotonic() - start)

    async def submit_prefilled(self, result: PrefillResult, prompt_ids: list[int], params: SamplingParams,
                               waited_s: float, *, consumer_id: str = "default") -> int:
        """Go on decoding a request prefilled elsewhere ``waited_s`` ago; its deltas go to ``consumer_id``."""
        self._ensure_loop()
        if isinstance(result.kv, ray.ObjectRef):  # fetched before the lock: steps go on meanwhile
            result = replace(result, kv=await result.kv)
        async with self._lock:
            arrival = time.monotonic() - waited_s  # on this process's clock, as every timing here
            deltas = add_prefilled(self._engine, result, prompt_ids, params, arrival_time=arrival)
            self._router.register(result.request_id, consumer_id, 1)
            self._publish(deltas)
        self._wake.set()
        return len(prompt_ids)

    async def cached_prefix_tokens(self, prompt_ids: list[int], namespace: str | None = None) -> int:
        """Prompt tokens this replica's prefix cache holds now (read-only; 0 without a cache)."""
        cache = self._engine.scheduler.cache
        return 0 if cache is None else cache.match_prefix(prompt_ids, namespace).num_tokens

    async def abort(self, request_id: str) -> bool:
        """End a request now and free its pages; False if unknown or already finished."""
        async with self._lock:
            deltas = self._engine.abort(request_id)
            self._publish(deltas)
        return bool(deltas)

    # ----------------------------------------------------------------- output
    async def next_outputs(self, consumer_id: str = "default", timeout_s: float = 1.0) -> list[StepMessage]:
        """Every step message for ``consumer_id`` since its last call; waits up to ``timeout_s``.

        Returns an empty list on timeout. One call drains the queue, so a
        consumer that polls in a loop makes at most one call per step.
        """
        return await self._router.poll(consumer_id, timeout_s)

    def _publish(self, deltas: list[SequenceDelta]) -> None:
        """Route deltas under the step number last run; feed the latency window."""
        if deltas:
            self._latency.observe(deltas)
            self._router.publish(self._engine.scheduler.stats.num_steps, deltas)

    # -------------------------------------------------------------- step loop
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                await self._iterate(loop)
            except Exception as exc:
                # A bug outside the executor: end every request rather than hang them.
                logger.exception("step loop error; failing every request")
                async with self._lock:
                    self._publish(self._engine.fail_all(
                        f"internal engine error: {type(exc).__name__}: {exc} (see the replica log)"))
                    self._check_can_schedule()
            # An uncontended asyncio.Lock does not yield: a pass that fails at once, again and
            # again, would otherwise hold the event loop and starve submit, abort and health.
            await asyncio.sleep(0)

    async def _iterate(self, loop: asyncio.AbstractEventLoop) -> None:
        """One pass: restart if needed, else one step, else sleep until woken."""
        if self._restart_reason is not None:
            await self._restart(loop)
            return
        async with self._lock:
            self._reap_consumers()
            if not self._engine.can_schedule:
                # Wedged: what arrived since ends at once, saying why, then wait for more.
                self._check_can_schedule()
                self._publish(self._engine.fail_all(self._health.message))
                batch = None
            else:
                try:
                    batch = self._engine.schedule()
                except Exception as exc:
                    if not self._engine.has_failed_step:
                        raise  # not a planned step: _run ends every request
                    # Planned but it cannot run (its token masks failed): end its requests.
                    self._publish(self._fail(exc))
                    return
            if batch is None:
                self._wake.clear()
        if batch is None:
            await self._wake.wait()
            return
        # The forward runs without the lock: submit/abort stay served meanwhile.
        result: StepOutput | Exception
        try:
            result = await loop.run_in_executor(self._thread, self._engine.execute, batch)
        except Exception as exc:
            result = exc
        async with self._lock:
            if isinstance(result, Exception):
                self._publish(self._fail(result))
            else:
                self._publish(self._finish(batch, result))

    def _finish(self, batch: Batch, output: StepOutput) -> list[SequenceDelta]:
        try:
            return self._engine.finish_step(batch, output)
        except Exception as exc:
            # Not the executor: the engine's own state is suspect, so end everything.
            logger.exception("engine step failed")
            deltas = self._engine.fail_all(f"the engine step failed: {type(exc).__name__}: {exc}")
            self._check_can_schedule()
            return deltas

    def _check_can_schedule(self) -> None:
        """After a failure is handled: if the engine still cannot plan a step, health goes not ok for good."""
        if not self._engine.can_schedule and self._health.ok:
            logger.error("a failed step could not be settled: the engine cannot plan another step")
            self._health = HealthStatus(False, "a failed step could not be settled: the engine cannot plan "
                                               "another step; this replica must be replaced")

    def _fail(self, exc: Exception) -> list[SequenceDelta]:
        """Turn a failed step's error into "error" deltas; ``ExecutorFailure`` also schedules a restart."""
        if isinstance(exc, ExecutorFailure):
            logger.error("executor failed: %s; failing every request and restarting", exc)
            self._restart_reason = str(exc)
            self._health = HealthStatus(False, f"executor failed, restarting: {exc}", restarting=True)
            return self._engine.fail_all(
                f"the model executor failed ({exc}); the request was ended and the executor is restarting",
                kv_lost=True,
            )
        logger.error("step failed: %r; failing that step's requests", exc)
        deltas = self._engine.fail_step(f"the engine step failed: {type(exc).__name__}: {exc}")
        self._check_can_schedule()
        return deltas

    async def _restart(self, loop: asyncio.AbstractEventLoop) -> None:
        """Rebuild the executor with health not-ok; a failed restart is retried on the next submit."""
        reason = self._restart_reason
        self._health = HealthStatus(False, f"executor restarting after: {reason}", restarting=True)
        try:
            await loop.run_in_executor(self._thread, self._engine.executor.restart)
        except Exception as exc:
            logger.exception("executor restart failed")
            self._health = HealthStatus(False, f"executor restart failed: {exc}")
            async with self._lock:
                self._wake.clear()
                self._publish(self._engine.fail_all(f"the model executor is down: restart failed: {exc}"))
            await self._wake.wait()
            return
        self._restart_reason = None
        self._health = HealthStatus(True, "ok")
        async with self._lock:
            self._check_can_schedule()  # a new executor does not settle the engine's own bookkeeping
        logger.info("executor restarted")

    def _reap_consumers(self) -> None:
        """Abort the requests of consumers that stopped polling (their replica is gone)."""
        for rid in self._router.drop_silent(self._consumer_timeout_s):
            logger.warning("request %s: its consumer stopped polling; aborting it", rid)
            self._publish(self._engine.abort(rid))

    # ------------------------------------------------------------------ state
    async def stats(self) -> EngineStats:
        """A snapshot between steps (engine state only changes on this event loop)."""
        return snapshot(self._engine, self._latency)

    async def health(self) -> HealthStatus:
        """Not ok while the executor is being restarted (or could not be)."""
        return self._health

    async def shutdown(self) -> None:
        """Fail what is left, stop the loop and release the executor."""
        self._closed = True
        self._wake.set()
        async with self._lock:
            self._publish(self._engine.fail_all("the replica is shutting down"))
        if self._loop_task is not None:
            await asyncio.wait({self._loop_task}, timeout=10.0)
        self._engine.shutdown()
        self._thread.shutdown(wait=False)

    def close(self) -> None:
        """Synchronous teardown from any thread, for an owner being destroyed (the replica's ``__del__``).

        Stops the step loop after its current pass and the engine thread after
        its current forward; the executor is shut down with it (a tensor-parallel
        executor's shards are killed). ``shutdown`` is the orderly, awaited path.
        """
        self._closed = True
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._engine.shutdown()


def _unfinished(fut: asyncio.Future[RequestOutput]) -> bool:
    """Whether the request ``fut`` waits for may still be running.

    Cancelling the task that awaits ``fut`` cancels ``fut`` too, so a
    cancelled ``fut`` means the caller left, not that the request ended.
    """
    return not fut.done() or fut.cancelled()


# max_concurrency bounds concurrent coroutines: many consumers long-poll at once.
SchedulerActor = ray.remote(max_concurrency=1024)(SchedulerService)  # type: ignore[call-overload]
