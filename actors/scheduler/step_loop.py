"""The scheduler's step loop: engine steps while there is work, and what a failed step does.

A background asyncio task runs engine steps while there is work and
otherwise awaits an ``asyncio.Event`` that ``wake`` sets (the service calls it
on each submit), or, while requests wait for KV tier loads, until the first
one's ``load_wait_s`` runs out. Each step is ``engine.schedule()`` -> ``engine.execute(batch)``
on one dedicated thread -> ``engine.finish_step()``, so the service's other
calls are served while the model runs, and while ``execute`` reads the step's
LoRA adapters evicted from the shards' host cache (one that cannot be read
ends only its own requests, in ``finish_step``).

Invariant (why there are no data races): the engine's request state
(scheduler queues, pages, sequences) is touched only on the event loop while
holding ``lock``. The forward runs without the lock because it reads only the
immutable ``Batch``; a request aborted meanwhile frees its pages at once (no
page is reallocated before the next ``schedule()``, and ``finish_step`` skips
it). The executor is touched only by this loop (``execute`` or ``restart``,
never both at once).

Faults: ``ExecutorFailure`` from a step ends every unfinished request with
finish_reason "error", frees every page (the prefix cache too: the KV pool
died with the shards), reports not-ok ``health`` while ``executor.restart()``
runs, then serves again. Any other exception from the executor, or from
building the step's token masks, fails only that step's requests. A failure
that leaves a step's bookkeeping unsettled (the engine cannot plan another
step) ends every request, turns health not ok for good (the replica is to be
replaced) and ends each request that arrives after with an error. Every pass
of the loop yields to the event loop, so no failure can starve the service's
other calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from actors.api import HealthStatus, SequenceDelta
from actors.engine.llm_engine import LLMEngine
from actors.errors import ExecutorFailure
from actors.log import get_logger
from scheduling.batch import Batch, StepOutput

logger = get_logger(__name__.rsplit(".", 1)[-1])


class StepLoop:
    """Steps ``engine`` on the running event loop, each forward on ``thread``; holds the engine's lock.

    ``publish`` routes deltas (always called under ``lock``); ``before_step``
    runs under ``lock`` at the start of every pass that may plan a step (the
    service drops silent consumers there). ``health`` is what the service reports.
    """

    def __init__(self, engine: LLMEngine, thread: ThreadPoolExecutor,
                 publish: Callable[[list[SequenceDelta]], None], before_step: Callable[[], None]) -> None:
        self.engine = engine
        self.lock = asyncio.Lock()
        self.health = HealthStatus(True, "ok")
        self._thread = thread
        self._publish = publish
        self._before_step = before_step
        self._wake = asyncio.Event()
        self._restart_reason: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Run the loop on the running event loop unless it runs (idempotent; restarts a task that ended)."""
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            if self.engine.kv_tiers is not None:  # a KV tier load that ends wakes a loop waiting for it
                self.engine.kv_tiers.wake = lambda: _call_soon(loop, self.wake)
            self._task = loop.create_task(self._run())

    def wake(self) -> None:
        """There is new work: a loop asleep for want of it plans a step."""
        self._wake.set()

    def stop(self) -> None:
        """End the loop after its current pass; from any thread (a flag each pass reads)."""
        self._closed = True

    async def wait_stopped(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the loop task to end (after ``stop`` and ``wake``)."""
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout_s)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                await self._iterate(loop)
            except Exception as exc:
                # A bug outside the executor: end every request rather than hang them.
                logger.exception("step loop error; failing every request")
                async with self.lock:
                    self._publish(self.engine.fail_all(
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
        wait_s: float | None = None
        async with self.lock:
            self._before_step()
            if not self.engine.can_schedule:
                # Wedged: what arrived since ends at once, saying why, then wait for more.
                self._check_can_schedule()
                self._publish(self.engine.fail_all(self.health.message))
                batch = None
            else:
                try:
                    batch = self.engine.schedule()
                except Exception as exc:
                    if not self.engine.has_failed_step:
                        raise  # not a planned step: _run ends every request
                    # Planned but it cannot run (its token masks failed): end its requests.
                    self._publish(self._fail(exc))
                    return
            if batch is None:
                self._wake.clear()
                # Requests waiting for KV tier loads: woken when one ends, or when the first one's
                # load_wait_s runs out (a load that never ends must not hold its request for ever).
                wait_s = None if self.engine.kv_tiers is None else self.engine.kv_tiers.seconds_to_deadline()
        if batch is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            return
        # The forward runs without the lock: submit/abort stay served meanwhile.
        result: StepOutput | Exception
        try:
            result = await loop.run_in_executor(self._thread, self.engine.execute, batch)
        except Exception as exc:
            result = exc
        async with self.lock:
            if isinstance(result, Exception):
                self._publish(self._fail(result))
            else:
                self._publish(self._finish(batch, result))

    def _finish(self, batch: Batch, output: StepOutput) -> list[SequenceDelta]:
        try:
            return self.engine.finish_step(batch, output)
        except Exception as exc:
            # Not the executor: the engine's own state is suspect, so end everything.
            logger.exception("engine step failed")
            deltas = self.engine.fail_all(f"the engine step failed: {type(exc).__name__}: {exc}")
            self._check_can_schedule()
            return deltas

    def _check_can_schedule(self) -> None:
        """After a failure is handled: if the engine still cannot plan a step, health goes not ok for good."""
        if not self.engine.can_schedule and self.health.ok:
            logger.error("a failed step could not be settled: the engine cannot plan another step")
            self.health = HealthStatus(False, "a failed step could not be settled: the engine cannot plan "
                                              "another step; this replica must be replaced")

    def _fail(self, exc: Exception) -> list[SequenceDelta]:
        """Turn a failed step's error into "error" deltas; ``ExecutorFailure`` also schedules a restart."""
        if isinstance(exc, ExecutorFailure):
            logger.error("executor failed: %s; failing every request and restarting", exc)
            self._restart_reason = str(exc)
            self.health = HealthStatus(False, f"executor failed, restarting: {exc}", restarting=True)
            return self.engine.fail_all(
                f"the model executor failed ({exc}); the request was ended and the executor is restarting",
                kv_lost=True,
            )
        logger.error("step failed: %r; failing that step's requests", exc)
        deltas = self.engine.fail_step(f"the engine step failed: {type(exc).__name__}: {exc}")
        self._check_can_schedule()
        return deltas

    async def _restart(self, loop: asyncio.AbstractEventLoop) -> None:
        """Rebuild the executor with health not-ok; a failed restart is retried on the next submit."""
        reason = self._restart_reason
        self.health = HealthStatus(False, f"executor restarting after: {reason}", restarting=True)
        try:
            await loop.run_in_executor(self._thread, self.engine.executor.restart)
        except Exception as exc:
            logger.exception("executor restart failed")
            self.health = HealthStatus(False, f"executor restart failed: {exc}")
            async with self.lock:
                self._wake.clear()
                self._publish(self.engine.fail_all(f"the model executor is down: restart failed: {exc}"))
            await self._wake.wait()
            return
        self._restart_reason = None
        self.health = HealthStatus(True, "ok")
        async with self.lock:
            self._check_can_schedule()  # a new executor does not settle the engine's own bookkeeping
        logger.info("executor restarted")


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """``fn`` on ``loop`` from any thread; nothing once the loop has closed (the service stopped)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn)
