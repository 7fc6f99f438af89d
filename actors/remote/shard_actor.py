"""One tensor-parallel rank of an engine, as a Ray actor.

``RayExecutor`` starts one ``ModelShardActor`` per rank inside that rank's
placement-group bundle, then drives it in three calls:

1. ``rendezvous()`` on rank 0 only: rank 0's node IP and a port free there;
2. ``start(rendezvous)`` on every rank at once: join ``torch.distributed``
   (the join blocks until all ranks arrive), build the ``ModelRunner``
   (which loads only this rank's weight shard and agrees on the KV pool size
   with the other ranks), and report a ``ShardInfo``;
3. ``open_channel(key)`` then ``serve_steps()`` on every rank: a socket
   on this node (see ``actors.remote.step_channel``) over which every step's batch
   arrives; ``serve_steps`` holds one of the actor's two threads until the
   executor hangs up, running ``execute(batch)`` for each step: all ranks run
   the forward (the collectives need them all); rank 0 samples and returns
   the ``StepOutput``, the others return None (or only their KV pages, when
   the step exports some).

The class is plain Python; ``ray.remote`` is applied by the executor, so this
module needs no Ray cluster to import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from actors.commands import Command, UnhandledCommandError
from actors.config import EngineConfig
from actors.remote.cpu_threads import call_on_new_thread, ray_reserved_cpus, set_cpu_threads
from actors.remote.distributed import (
    Rendezvous,
    destroy_distributed,
    init_distributed,
    new_rendezvous,
    node_ip,
)
from actors.remote.step_channel import ChannelAddress, StepServer
from actors.runner.model_runner import ModelRunner
from kvcache.kv_pool import KVCapacity
from kvcache.kv_transfer import KVLayout
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError

R = TypeVar("R")


class ShardConfigError(Exception):
    """A user error (``InvalidParameterError``) raised while a shard started, or ran a command.

    It crosses the Ray boundary in this form because ``InvalidParameterError``
    does not unpickle (its ``__init__`` takes two arguments, ``args`` holds
    one); the executor raises it again as ``InvalidParameterError``.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, message)
        self.param = param
        self.message = message

    def __str__(self) -> str:
        return f"{self.param}: {self.message}"


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What a started shard reports: where it runs and what it holds."""

    rank: int
    world_size: int
    node_id: str
    pid: int
    capacity: KVCapacity
    kv_layout: KVLayout
    model_path: Path
    vocab_size: int
    num_moe_layers: int


class ModelShardActor:
    """Holds one rank's ``ModelRunner``; see the module docstring for the call order."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._runner: ModelRunner | None = None  # built by start(), once the process group exists
        self._info: ShardInfo | None = None
        self._channel: StepServer | None = None
        # The node's shards share its cores: each uses the CPUs Ray gave it, unless configured.
        # Set where torch runs: the loading thread (start) and serve_steps' thread.
        self._threads = config.cpu_threads or max(1, int(ray_reserved_cpus()))

    def rendezvous(self) -> Rendezvous:
        """Rank 0's node IP and a free port there, for every rank's ``start``."""
        return new_rendezvous()

    def start(self, rendezvous: Rendezvous) -> ShardInfo:
        """Join the process group, load this rank's shard, size the KV pool."""
        device = self.config.resolved_device()
        if self.world_size > 1:
            init_distributed(rendezvous, rank=self.rank, world_size=self.world_size, device=device)
        try:
            # Loaded on a thread that then ends: the forward runs on serve_steps' thread,
            # and one OpenMP team per process keeps its workers spinning (actors.remote.cpu_threads).
            runner = call_on_new_thread(
                lambda: ModelRunner(self.config, rank=self.rank, world_size=self.world_size), self._threads
            )
        except InvalidParameterError as err:
            raise ShardConfigError(err.param, err.message) from None
        self._runner = runner
        self._info = ShardInfo(
            rank=self.rank, world_size=self.world_size, node_id=_node_id(), pid=os.getpid(),
            capacity=runner.capacity, kv_layout=KVLayout.of(runner.pool), model_path=runner.model_path, vocab_size=runner.vocab_size,
            num_moe_layers=runner.num_moe_layers,
        )
        return self._info

    def execute(self, batch: Batch) -> StepOutput | None:
        """Run one step on this rank; rank 0's return value is the step's output.

        Other ranks return None, or, when the batch exports or saves KV pages, their
        output carrying only this rank's ``kv_exports`` / ``kv_saves`` (the executor zips them).
        """
        runner = self._runner
        if runner is None:
            raise RuntimeError(f"shard rank {self.rank} executed before start()")
        out = runner.execute(batch)
        return out if self.rank == 0 or batch.kv_moves.exports or batch.kv_moves.saves else None

    def command(self, cmd: Command[R]) -> R | ShardConfigError | UnhandledCommandError:
        """Run a control command on this rank (``ModelRunner.command``); a refusal (``InvalidParameterError``)
        or a command the runner has no handler for comes back as a value, so the group stays up.

        ``ReadExpertTokens`` arrives on the actor's second thread, beside
        ``serve_steps``; before start() a command gets ``Command.unserved``.
        """
        runner = self._runner
        try:
            return cmd.unserved(f"shard rank {self.rank} (not started)") if runner is None else runner.command(cmd)
        except InvalidParameterError as err:
            return ShardConfigError(err.param, err.message)
        except UnhandledCommandError as err:
            return err

    def open_channel(self, key: bytes) -> ChannelAddress:
        """Listen for the executor's step channel on this node; ``key`` authenticates it."""
        self._channel = StepServer(node_ip(), key)
        return self._channel.address

    def serve_steps(self) -> int:
        """Run every step that arrives on the channel until the executor hangs up; returns the count."""
        channel, self._channel = self._channel, None
        if channel is None:
            raise RuntimeError(f"shard rank {self.rank}: serve_steps() before open_channel()")
        set_cpu_threads(self._threads)  # Ray runs this call on whichever of the actor's threads is free
        return channel.serve(self.execute)

    def ping(self) -> ShardInfo:
        """Health check: answers while the actor lives and has started."""
        if self._info is None:
            raise RuntimeError(f"shard rank {self.rank} has not started")
        return self._info

    def shutdown(self) -> None:
        """Leave the process group (the executor kills the actor afterwards)."""
        self._runner = None
        destroy_distributed()


def _node_id() -> str:
    """The Ray node this process runs on ("" outside Ray)."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
    except ImportError:  # pragma: no cover - Ray is a dependency
        return ""
