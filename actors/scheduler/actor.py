"""The central scheduler of one replica: an async Ray actor around an ``LLMEngine``.

Its ``StepLoop`` (``actors.scheduler.step_loop``) runs the engine's steps on the
actor's event loop and each forward on one dedicated thread, so ``submit``,
``abort``, ``stats`` and ``health`` are served while the model runs. Every
call here touches the engine's state only on the event loop, holding the
loop's ``lock`` (that module says why this suffices, and what a failed step
does); consumer queues and waiters are touched only on the event loop.

Output channel: one ``StepMessage`` per engine step per consumer, holding all
of that consumer's deltas; ``next_outputs`` long-polls a bounded queue of
them (see ``actors.scheduler.output_router``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar, cast

import ray
import torch

from actors.api import (
    CompletionOutput,
    EngineStats,
    HealthStatus,
    LatencyWindow,
    PrefillResult,
    RankPayloadsOrRef,
    RequestOutput,
    SequenceDelta,
    StepMessage,
)
from actors.commands import AddLoRA, Command, ReadExpertTokens, RemoveLoRA, UnhandledCommandError
from actors.config import EngineConfig
from actors.engine.disaggregation import add_prefilled, start_prefill, weight_quantization
from actors.engine.executor import EXPERT_TOKENS_TIMEOUT_S, Executor, LocalExecutor
from actors.engine.llm_engine import LLMEngine
from actors.engine.stats import snapshot
from actors.log import get_logger
from actors.remote.cpu_threads import engine_cpu_threads, engine_thread_init
from actors.scheduler.output_router import OutputRouter
from actors.scheduler.step_loop import StepLoop
from scheduling.sampling_params import SamplingParams

logger = get_logger(__name__.rsplit(".", 1)[-1])

ExecutorFactory = Callable[[EngineConfig], Executor]
R = TypeVar("R")


def default_executor(config: EngineConfig) -> Executor:
    """``LocalExecutor``, or the tensor-parallel ``RayExecutor`` when ``config.executor == "ray"``."""
    if config.executor == "ray":
        # Here, not at the top: only a tensor-parallel engine loads the shard actors' modules.
        from actors.remote.ray_executor import RayExecutor

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
        self._latency = LatencyWindow(latency_window)
        self._router = OutputRouter(max_messages)
        self._consumer_timeout_s = consumer_timeout_s
        self._steps = StepLoop(self._engine, self._thread, self._publish, self._reap_consumers)

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
        self._steps.start()
        grammar = None
        if params.structured_output is not None:
            # Compiled on the grammar worker while steps go on, and handed to add_request: looked up
            # again, it could have left the compiler's LRU meanwhile and be compiled under the lock.
            grammar = await self._engine.grammar.compile_async(params.structured_output)
        async with self._steps.lock:
            # An InvalidParameterError reaches the caller whole, param included:
            # it pickles through its own __reduce__ (scheduling.errors).
            ids = self._engine.tokenize(prompt)
            self._engine.add_request(request_id, prompt, params, namespace=namespace, prompt_token_ids=ids,
                                     grammar=grammar)
            self._router.register(request_id, consumer_id, params.n)
        self._steps.wake()
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
        self._steps.start()
        start = time.monotonic()
        async with self._steps.lock:
            start_prefill(self._engine, request_id, prompt_ids, params)
            self._router.register(request_id, None, 1)
        self._steps.wake()
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
                             done.num_cached_tokens, nbytes, time.monotonic() - start,
                             weight_quantization(self._engine.config))

    async def submit_prefilled(self, result: PrefillResult, prompt_ids: list[int], params: SamplingParams,
                               waited_s: float, *, consumer_id: str = "default") -> int:
        """Go on decoding a request prefilled elsewhere ``waited_s`` ago; its deltas go to ``consumer_id``."""
        self._steps.start()
        if isinstance(result.kv, ray.ObjectRef):  # fetched before the lock: steps go on meanwhile
            result = replace(result, kv=await result.kv)
        async with self._steps.lock:
            arrival = time.monotonic() - waited_s  # on this process's clock, as every timing here
            deltas = add_prefilled(self._engine, result, prompt_ids, params, arrival_time=arrival)
            self._router.register(result.request_id, consumer_id, 1)
            self._publish(deltas)
        self._steps.wake()
        return len(prompt_ids)

    async def cached_prefix_tokens(self, prompt_ids: list[int], namespace: str | None = None) -> int:
        """Prompt tokens this replica's prefix cache holds now (read-only; 0 without a cache)."""
        cache = self._engine.policy.cache
        return 0 if cache is None else cache.match_prefix(prompt_ids, namespace).num_tokens

    async def command(self, cmd: Command[R]) -> R:
        """Run a control command a replica sends (``actors.commands``); the engine's bookkeeping decides what
        reaches the executor, and any other command raises ``UnhandledCommandError`` naming it.

        ``AddLoRA`` loads an adapter (``LoRARegistry.add``: read on the engine
        thread, between forwards; refusals raise ``InvalidParameterError``);
        ``RemoveLoRA`` unloads one once its requests have ended (``LoRARegistry.remove``).
        """
        if isinstance(cmd, AddLoRA):
            async with self._steps.lock:
                loop = asyncio.get_running_loop()
                return cast(R, await loop.run_in_executor(self._thread, self._engine.loras.add, cmd.name, cmd.path))
        if isinstance(cmd, RemoveLoRA):
            async with self._steps.lock:
                self._engine.loras.remove(cmd.name)
            return cast(R, None)
        raise UnhandledCommandError(type(cmd).__name__, type(self).__name__)

    async def loras(self) -> list[str]:
        """The adapters this engine serves now."""
        return self._engine.loras.serving()

    async def abort(self, request_id: str) -> bool:
        """End a request now and free its pages; False if unknown or already finished."""
        async with self._steps.lock:
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
            self._router.publish(self._engine.policy.stats.num_steps, deltas)

    # ------------------------------------------------------------ consumers
    def _reap_consumers(self) -> None:
        """Abort the requests of consumers that stopped polling (their replica is gone)."""
        for rid in self._router.drop_silent(self._consumer_timeout_s):
            logger.warning("request %s: its consumer stopped polling; aborting it", rid)
            self._publish(self._engine.abort(rid))

    # ------------------------------------------------------------------ state
    async def stats(self) -> EngineStats:
        """A snapshot between steps (engine state only changes on this event loop).

        The expert counts are read first on a worker thread, beside any step
        (not on the engine thread: a stats call must not wait for a forward or
        an executor restart); a read that fails or takes longer than
        ``EXPERT_TOKENS_TIMEOUT_S`` leaves them out of this snapshot.
        """
        executor = self._engine.executor
        experts: tuple[tuple[int, ...], ...] = ()
        if executor.num_moe_layers:  # a dense model has none to read: no thread hop, no call
            try:
                experts = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    None, executor.command, ReadExpertTokens()), EXPERT_TOKENS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - metrics only: the rest of the snapshot still answers
                logger.debug("expert counts unavailable", exc_info=True)
        return snapshot(self._engine, self._latency, experts)

    async def health(self) -> HealthStatus:
        """Not ok while the executor is being restarted (or could not be)."""
        return self._steps.health

    async def shutdown(self) -> None:
        """Fail what is left, stop the loop and release the executor."""
        self._steps.stop()
        self._steps.wake()
        async with self._steps.lock:
            self._publish(self._engine.fail_all("the replica is shutting down"))
        await self._steps.wait_stopped(10.0)
        self._engine.shutdown()
        self._thread.shutdown(wait=False)

    def close(self) -> None:
        """Synchronous teardown from any thread, for an owner being destroyed (the replica's ``__del__``).

        Stops the step loop after its current pass and the engine thread after
        its current forward; the executor is shut down with it (a tensor-parallel
        executor's shards are killed). ``shutdown`` is the orderly, awaited path.
        """
        self._steps.stop()
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
