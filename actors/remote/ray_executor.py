"""The tensor-parallel executor: one ``ModelShardActor`` per rank, in a placement group.

Ray places, starts and joins the shards; each engine step then travels over
the group's step channel (``actors.remote.step_channel``): the batch is pickled once
and written to every rank's authenticated socket, and the step ends when
every rank has answered: less than an ordinary actor call a step, and
without the core a Ray compiled graph spin-waits away on each end (the
figures: README, "Ray path overhead"). Any shard that dies or raises turns into an
``ExecutorFailure`` naming its rank; the executor then tears the whole group
down at once (a surviving rank may be blocked in a collective that will never
complete), and ``restart()`` builds a fresh one on a fresh port.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, TypeVar, cast

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.commands import (
    AddLoRA,
    Command,
    PrepareLoRAs,
    ReadExpertTokens,
    RemoveLoRA,
    UnhandledCommandError,
)
from actors.config import EngineConfig
from actors.engine.executor import EXPERT_TOKENS_TIMEOUT_S, Executor, with_rank_exports
from actors.errors import ExecutorFailure
from actors.log import get_logger
from actors.remote.shard_actor import ModelShardActor, ShardConfigError, ShardInfo
from actors.remote.shard_groups import group_name, reap_orphans
from actors.remote.step_channel import StepChannelError, StepClient, new_key
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError

logger = get_logger(__name__.rsplit(".", 1)[-1])

R = TypeVar("R")

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
        self._loras: dict[str, str] = {}  # registered LoRA adapters (name -> folder), replayed on restart
        self._channel: StepClient | None = None  # the per-step data path to every rank
        self.shard_infos: list[ShardInfo] = []
        self._start(config)
        first = self.shard_infos[0]
        self.capacity = first.capacity
        self.kv_layout = first.kv_layout
        self.model_path = first.model_path
        self.vocab_size = first.vocab_size
        self.num_moe_layers = first.num_moe_layers

    # ---------------------------------------------------------------- public
    @property
    def shards(self) -> list[Any]:
        """The live shard actor handles, index = rank (empty after a failure)."""
        return list(self._shards)

    def execute(self, batch: Batch) -> StepOutput:
        """Run one step on every rank; return rank 0's sampled tokens (and every rank's KV exports)."""
        if not self._shards or self._channel is None:
            raise ExecutorFailure("the shard group is down after a failure; call restart() first")
        try:
            outputs = self._channel.run(batch, self.step_timeout_s)
        except StepChannelError as err:
            self.shutdown()
            raise ExecutorFailure(f"step {batch.step}: {err}") from err
        out = outputs[0]
        assert isinstance(out, StepOutput), f"rank 0 returned {type(out).__name__}"
        return with_rank_exports(out, outputs) if batch.kv_moves.exports or batch.kv_moves.saves else out

    def restart(self) -> None:
        """Kill what is left, then build a fresh group (new port, empty KV pools and LoRA slots).

        The pool size is pinned to the first start's: the scheduler's page
        allocator was sized from it and must keep meaning the same pages.
        The registered LoRA adapters are registered again on the new shards.
        """
        self.shutdown()
        self._start(replace(self.config, num_kv_pages=self.capacity.num_pages))
        for name, path in self._loras.items():
            self._on_every_shard(AddLoRA(name, path))

    def command(self, cmd: Command[R]) -> R:
        """One call per rank, rank 0's answer (``_on_every_shard``), save for the two verbs with rules of their own.

        ``ReadExpertTokens`` asks rank 0 alone, and ``PrepareLoRAs`` fails
        adapters rather than the group (their methods say how). The adapters
        registered are kept here too, for ``restart()`` to register again.
        """
        if isinstance(cmd, ReadExpertTokens):
            return cast(R, self._read_expert_tokens())
        if isinstance(cmd, PrepareLoRAs):
            return cast(R, self._prepare_loras(cmd))
        if isinstance(cmd, RemoveLoRA):
            self._loras.pop(cmd.name, None)
            if not self._shards:  # the group is down: restart() registers only what is still listed
                return cast(R, None)
        result = self._on_every_shard(cmd)
        if isinstance(cmd, AddLoRA):
            self._loras[cmd.name] = cmd.path
        return result

    def _prepare_loras(self, cmd: PrepareLoRAs) -> dict[str, str]:
        """Every shard reads what it lacks; an adapter that failed on any shard failed.

        Only a dead shard is an ``ExecutorFailure``: a read that raised, or
        that no shard finished within ``start_timeout_s``, fails ``names``
        alone (their requests end; the group serves on, a late read only
        fills that shard's host cache).
        """
        if not self._shards:
            raise ExecutorFailure("the shard group is down after a failure; call restart() first")
        names = list(cmd.names)
        refs = [s.command.remote(cmd) for s in self._shards]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        failed: dict[str, str] = {}
        if pending:
            logger.error("LoRA adapters %s: shard rank(s) %s did not read them within %.0f s", names,
                         sorted(refs.index(r) for r in pending), self.start_timeout_s)  # fmt: skip
            failed = dict.fromkeys(names, f"its files were not read within {self.start_timeout_s:.0f} s")
        for ref in ready:
            rank = refs.index(ref)
            try:
                result: dict[str, str] = ray.get(ref)
            except ray.exceptions.RayTaskError as err:  # the shard lives: its read raised
                logger.error("LoRA adapters %s: shard rank %d could not read them: %s", names, rank, _first_line(err))
                result = dict.fromkeys(names, "its files could not be read")
            except Exception as err:  # noqa: BLE001 - the shard died (or Ray lost it): the group is down
                self.shutdown()
                raise ExecutorFailure(f"PrepareLoRAs: shard rank {rank} failed: {type(err).__name__}: "
                                      f"{_first_line(err)}") from err  # fmt: skip
            failed = {**result, **failed}  # a rank's own reason, else the first one given
        return failed

    def _read_expert_tokens(self) -> tuple[tuple[int, ...], ...]:
        """Rank 0's counts: every rank routes every token (``SparseMoE``), so they are the model's.

        () while the group is down or rank 0 does not answer in time; a
        failure here leaves the group alone (the step path notices a dead shard).
        """
        shards = self._shards  # restart() swaps in a new list on the engine thread; an unstarted shard answers ()
        if not shards or not self.num_moe_layers:  # a dense model: no call to make
            return ()
        try:
            counts: tuple[tuple[int, ...], ...] = ray.get(shards[0].command.remote(ReadExpertTokens()),
                                                          timeout=EXPERT_TOKENS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead or busy shard: no counts this time
            return ()
        return counts

    def _on_every_shard(self, cmd: Command[R]) -> R:
        """Every rank runs ``cmd``; rank 0's answer. A refusal on any rank is undone on every rank
        (``Command.undo``: an adapter one rank refused is removed from the others) and raised as
        ``InvalidParameterError`` (or ``UnhandledCommandError``, a command no handler knows); the group
        stays up. A rank that fails or is late tears it down (``_gather``)."""
        if not self._shards:
            raise ExecutorFailure("the shard group is down after a failure; call restart() first")
        what = type(cmd).__name__
        results = self._gather([s.command.remote(cmd) for s in self._shards], self.start_timeout_s, what)
        refused = [r for r in results if isinstance(r, (ShardConfigError, UnhandledCommandError))]
        if refused:
            undo = cmd.undo()
            if undo is not None:
                self._gather([s.command.remote(undo) for s in self._shards], self.start_timeout_s, type(undo).__name__)
            first = refused[0]
            raise first if isinstance(first, UnhandledCommandError) else InvalidParameterError(first.param, first.message)
        return cast(R, results[0])

    def shutdown(self) -> None:
        """Kill every shard and remove the placement group (idempotent)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
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
                # serve_steps() holds one thread for the group's life; ping() and command() share another.
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
        self._open_channel()
        logger.info(
            "started %d shards (%s) on nodes %s", self.world_size, self.config.placement_strategy,
            [info.node_id[:8] for info in self.shard_infos],
        )

    def _open_channel(self) -> None:
        """Every rank listens, serves in a long-running call, and the client connects."""
        key = new_key()
        addresses = self._gather([s.open_channel.remote(key) for s in self._shards], self.start_timeout_s, "channel")
        for shard in self._shards:
            shard.serve_steps.remote()  # runs until the client below hangs up (or the shard dies)
        try:
            self._channel = StepClient(addresses, key)
        except StepChannelError as err:
            self.shutdown()
            raise ExecutorFailure(f"step channel: {err}") from err

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
