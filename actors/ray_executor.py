"""The tensor-parallel executor: one ``ModelShardActor`` per rank, in a placement group.

One engine step is ONE execution of a Ray compiled graph that feeds the
batch to every rank's ``execute`` over shared-memory channels (about 0.15 ms
a step here, against 1-2 ms for ordinary actor calls); where the graph
cannot be compiled, or FLOTILLA_COMPILED_GRAPH=0, it is one ordinary Ray call
per shard, awaited together with a timeout. Any shard that dies or raises turns into an
``ExecutorFailure`` naming its rank; the executor then tears the whole group
down at once (a surviving rank may be blocked in a collective that will never
complete), and ``restart()`` builds a fresh one on a fresh port.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine_config import EngineConfig
from actors.errors import ExecutorFailure
from actors.executor import Executor
from actors.log import get_logger
from actors.shard_actor import ModelShardActor, ShardConfigError, ShardInfo
from actors.shard_groups import group_name, reap_orphans
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError

logger = get_logger(__name__.rsplit(".", 1)[-1])

# Ray actors are created from the plain class here, so shard_actor.py stays
# importable (and testable) without a cluster.
_RemoteShard = ray.remote(ModelShardActor)


class PlacementError(ExecutorFailure):
    """The placement group could not be placed: the cluster lacks the resources."""


class RayExecutor(Executor):
    """``tensor_parallel_size`` shards on a Ray cluster, driven one call per shard per step.

    Args:
        config: the engine config; ``tensor_parallel_size`` ranks are placed
            with ``placement_strategy``, one bundle each (``{"CPU": 1}`` on
            CPU, ``{"GPU": 1}`` on CUDA). ``device="auto"`` means CUDA when
            the cluster has GPUs, whatever this process sees.
        placement_timeout_s: how long to wait for the placement group.
        start_timeout_s: how long loading the shards may take.
        step_timeout_s: how long one step may take before it counts as failed.

    ``ray.init()`` is called when Ray is not initialised yet (authentication
    and the address come from the environment, as ``ray.init`` reads them).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        placement_timeout_s: float = 60.0,
        start_timeout_s: float = 600.0,
        step_timeout_s: float = 300.0,
    ) -> None:
        if not ray.is_initialized():
            ray.init()
        config = _pin_device(config)
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.placement_timeout_s = placement_timeout_s
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s
        self._on_cuda = config.resolved_device().type == "cuda"
        self._pg: PlacementGroup | None = None
        self._shards: list[Any] = []  # Ray actor handles, index = rank
        self._dag: Any | None = None  # the compiled step graph, when it compiled
        self.shard_infos: list[ShardInfo] = []
        self._start(config)
        first = self.shard_infos[0]
        self.capacity = first.capacity
        self.model_path = first.model_path
        self.vocab_size = first.vocab_size

    # ---------------------------------------------------------------- public
    @property
    def shards(self) -> list[Any]:
        """The live shard actor handles, index = rank (empty after a failure)."""
        return list(self._shards)

    def execute(self, batch: Batch) -> StepOutput:
        """Run one step on every rank; return rank 0's sampled tokens."""
        if not self._shards:
            raise ExecutorFailure("the shard group is down after a failure; call restart() first")
        if self._dag is not None:
            outputs = self._execute_compiled(batch)
        else:
            ref = ray.put(batch)  # serialised once; Ray resolves the ref for every shard
            refs = [shard.execute.remote(ref) for shard in self._shards]
            outputs = self._gather(refs, self.step_timeout_s, f"step {batch.step}")
        out = outputs[0]
        assert isinstance(out, StepOutput), f"rank 0 returned {type(out).__name__}"
        return out

    def restart(self) -> None:
        """Kill what is left, then build a fresh group (new port, empty KV pools).

        The pool size is pinned to the first start's: the scheduler's page
        allocator was sized from it and must keep meaning the same pages.
        """
        self.shutdown()
        self._start(replace(self.config, num_kv_pages=self.capacity.num_pages))

    def shutdown(self) -> None:
        """Kill every shard and remove the placement group (idempotent)."""
        dag, self._dag = self._dag, None
        if dag is not None:
            with contextlib.suppress(Exception):  # a dead shard makes teardown complain
                dag.teardown(kill_actors=True)
        shards, self._shards = self._shards, []
        for shard in shards:
            with contextlib.suppress(Exception):  # already dead is fine
                ray.kill(shard, no_restart=True)
        if self._pg is not None:
            pg, self._pg = self._pg, None
            with contextlib.suppress(Exception):  # already removed (e.g. Ray shut down) is fine
                remove_placement_group(pg)

    # --------------------------------------------------------------- helpers
    def _start(self, config: EngineConfig) -> None:
        """Place the group, start the shards, join them into one process group."""
        self._pg = self._place()
        for rank in range(self.world_size):
            options: dict[str, Any] = {
                # The compiled graph's loop holds one thread; ping() needs another.
                "max_concurrency": 2,
                "num_cpus": 0 if self._on_cuda else 1,
                "num_gpus": 1 if self._on_cuda else 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank
                ),
            }
            self._shards.append(_RemoteShard.options(**options).remote(config, rank, self.world_size))
        try:
            rendezvous = self._gather([self._shards[0].rendezvous.remote()], self.start_timeout_s, "rendezvous")[0]
            refs = [shard.start.remote(rendezvous) for shard in self._shards]
            infos = self._gather(refs, self.start_timeout_s, "start")
        except ExecutorFailure as failure:
            # A user error (bad model folder, TP size not dividing the heads)
            # surfaces as itself, not as a shard crash.
            cause = failure.__cause__
            if isinstance(cause, ShardConfigError):
                raise InvalidParameterError(cause.param, cause.message) from None
            raise
        self.shard_infos = [info for info in infos if isinstance(info, ShardInfo)]
        pages = {info.capacity.num_pages for info in self.shard_infos}
        assert len(self.shard_infos) == self.world_size and len(pages) == 1, pages  # the runners agreed
        self._dag = self._compile()
        logger.info(
            "started %d shards (%s) on nodes %s", self.world_size, self.config.placement_strategy,
            [info.node_id[:8] for info in self.shard_infos],
        )

    def _compile(self) -> Any | None:
        """The step as a compiled graph: input -> every rank's execute -> all outputs."""
        if os.environ.get("FLOTILLA_COMPILED_GRAPH", "1") == "0":
            return None
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as batch:
                graph = MultiOutputNode([shard.execute.bind(batch) for shard in self._shards])
            return graph.experimental_compile()
        except Exception as err:  # noqa: BLE001 - any failure keeps the plain-call path
            logger.warning("compiled graph unavailable (%s); one Ray call per shard per step", _first_line(err))
            return None

    def _execute_compiled(self, batch: Batch) -> list[Any]:
        assert self._dag is not None
        try:
            return list(ray.get(self._dag.execute(batch), timeout=self.step_timeout_s))
        except Exception as err:  # noqa: BLE001 - any shard error fails the step
            dead = self._dead_ranks()
            self.shutdown()
            who = f"shard rank {dead[0]} failed" if dead else "the shard group failed"
            raise ExecutorFailure(
                f"step {batch.step}: {who}: {type(err).__name__}: {_first_line(err)}"
            ) from err

    def _dead_ranks(self) -> list[int]:
        """Ranks whose actor no longer answers (probed once, after a failed step)."""
        refs = [shard.ping.remote() for shard in self._shards]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        dead = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                continue  # alive but busy (blocked in a collective)
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead actor raises here
                dead.append(rank)
        return dead

    def _place(self) -> PlacementGroup:
        bundle = {"GPU": 1.0} if self._on_cuda else {"CPU": 1.0}
        strategy = self.config.placement_strategy
        reaped = reap_orphans()  # groups of dead schedulers would otherwise hold their CPUs/GPUs forever
        if reaped:
            logger.warning("removed %d placement group(s) left by dead schedulers", reaped)
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy, name=group_name())
        ready, _ = ray.wait([pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise PlacementError(
                f"could not place {self.world_size} bundles of {bundle} with strategy {strategy} "
                f"within {self.placement_timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}, "
                f"available: {ray.available_resources()}"
            )
        return pg

    def _gather(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Wait for one result per rank; the first failure (or the deadline) tears the group down.

        Results are checked as they arrive, not in rank order: when one rank
        dies the others block in a collective, so waiting on rank 0 first
        would hang until the step timeout.
        """
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        for _ in range(len(refs)):  # each pass settles at least one ref, or fails
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(rank_of[r] for r in pending)
                self.shutdown()
                raise ExecutorFailure(f"{what}: shard rank(s) {ranks} did not answer within {timeout_s:.0f} s")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except Exception as err:  # noqa: BLE001 - any shard error fails the step
                self.shutdown()
                cause = getattr(err, "cause", None)
                raise ExecutorFailure(
                    f"{what}: shard rank {rank} failed: {type(err).__name__}: {_first_line(err)}"
                ) from (cause if isinstance(cause, BaseException) else err)
        return results


def _pin_device(config: EngineConfig) -> EngineConfig:
    """Resolve ``device="auto"`` from the cluster, not from this process.

    The caller (a scheduler actor holding no GPU, a CPU-only head node) may
    see no CUDA device while the shards' nodes have GPUs; every rank must
    also agree on the device (and so on the "auto" dtype).
    """
    if config.device != "auto":
        return config
    has_gpus = ray.cluster_resources().get("GPU", 0.0) >= 1.0
    return replace(config, device="cuda" if has_gpus else "cpu")


def _first_line(err: BaseException) -> str:
    """A one-line reason: Ray's errors carry whole remote tracebacks."""
    cause = getattr(err, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else err).strip()
    return text.splitlines()[0] if text else type(err).__name__
