"""Control commands (``actors.commands``): one method per hop, one dispatch, and a refusal that names the command.

A verb none of the handlers knows (``Drain`` here, declared as a new verb
would be: one dataclass) is refused by name by the runner, the local executor,
a stand-in executor and the scheduler service. The Ray executor is driven with
stand-in shards (no cluster): one call per rank, rank 0's answer, and a refusal
on one rank undone on every rank.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.api import LoRAInfo
from actors.commands import (
    AddLoRA,
    Command,
    PrepareLoRAs,
    ReadExpertTokens,
    RemoveLoRA,
    UnhandledCommandError,
)
from actors.config import EngineConfig
from actors.engine.executor import Executor, LocalExecutor
from actors.remote.ray_executor import RayExecutor
from actors.remote.shard_actor import ShardConfigError
from actors.scheduler.actor import SchedulerService
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError

ENGINE: dict[str, Any] = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 64,
                          "num_kv_pages": 16, "dtype": "float32", "device": "cpu"}


@dataclass(frozen=True, slots=True)
class Drain(Command[int]):
    """A verb no handler knows yet."""

    deadline_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Sleep(Command[None]):
    """A verb the stand-in shards' runner lacks."""


class NoShards(Executor):
    """An executor holding no model, as a test's stand-in is."""

    def execute(self, batch: Batch) -> StepOutput:
        raise AssertionError("no step runs here")

    def restart(self) -> None:
        """Nothing to rebuild."""

    def shutdown(self) -> None:
        """Nothing to release."""


def test_an_unknown_command_is_refused_by_name_by_the_runner_and_the_local_executor(tiny_dir: Path) -> None:
    executor = LocalExecutor(EngineConfig(model=str(tiny_dir), **ENGINE))
    try:
        for target in (executor, executor.runner):
            with pytest.raises(UnhandledCommandError, match="ModelRunner does not handle the command Drain") as err:
                target.command(Drain())
            assert err.value.command == "Drain" and err.value.where == "ModelRunner"
        # The verbs it knows run through the same method: a dense model without LoRA.
        assert executor.command(ReadExpertTokens()) == ()
        assert executor.command(PrepareLoRAs(("a",))) == {} and executor.command(RemoveLoRA("a")) is None
        with pytest.raises(InvalidParameterError) as refused:
            executor.command(AddLoRA("a", "/nowhere"))
        assert refused.value.param == "enable_lora"
    finally:
        executor.shutdown()


def test_an_executor_without_a_model_answers_the_empty_reads_and_refuses_the_rest() -> None:
    executor = NoShards()
    assert executor.command(ReadExpertTokens()) == ()
    assert executor.command(PrepareLoRAs(("a",))) == {} and executor.command(RemoveLoRA("a")) is None
    with pytest.raises(InvalidParameterError, match="NoShards serves no LoRA adapters") as refused:
        executor.command(AddLoRA("a", "/x"))
    assert refused.value.param == "enable_lora"
    with pytest.raises(UnhandledCommandError, match="NoShards does not handle the command Drain"):
        executor.command(Drain())


def test_the_scheduler_service_refuses_a_command_it_does_not_send_on_by_name(tiny_dir: Path) -> None:
    async def scenario() -> None:
        svc = SchedulerService(EngineConfig(model=str(tiny_dir), **ENGINE))
        try:
            with pytest.raises(UnhandledCommandError, match="SchedulerService does not handle the command Drain"):
                await svc.command(Drain())
            with pytest.raises(UnhandledCommandError, match="ReadExpertTokens"):  # the engine's own read, not a replica's
                await svc.command(ReadExpertTokens())
        finally:
            await svc.shutdown()

    asyncio.run(scenario())


def test_commands_and_their_refusal_cross_a_process_boundary_intact() -> None:
    """Ray pickles them to every shard (and a shard's refusal back)."""
    for cmd in (AddLoRA("a", "/x"), RemoveLoRA("a"), PrepareLoRAs(("a", "b")), ReadExpertTokens(), Drain(2.0)):
        assert pickle.loads(pickle.dumps(cmd)) == cmd
    err = pickle.loads(pickle.dumps(UnhandledCommandError("Drain", "ModelRunner")))
    assert (err.command, err.where, str(err)) == ("Drain", "ModelRunner", "ModelRunner does not handle the command Drain")
    assert AddLoRA("a", "/x").undo() == RemoveLoRA("a") and RemoveLoRA("a").undo() is None


class _Ref:
    """A stand-in ObjectRef, answered at once."""

    def __init__(self, answer: object) -> None:
        self.answer = answer


class _Shard:
    """A stand-in shard actor: records each command; refuses ``AddLoRA`` when told to, and answers a verb its
    runner lacks as ``ModelShardActor.command`` does."""

    def __init__(self, rank: int, refuses: bool = False) -> None:
        self.rank, self.refuses = rank, refuses
        self.seen: list[Command[object]] = []
        self.command = self  # ``shard.command.remote(cmd)``, as on a Ray actor handle

    def remote(self, cmd: Command[object]) -> _Ref:
        self.seen.append(cmd)
        if isinstance(cmd, AddLoRA):
            if self.refuses:
                return _Ref(ShardConfigError("lora_path", f"adapter {cmd.path!r}: no such folder"))
            return _Ref(LoRAInfo(cmd.name, cmd.path, 8, ("q_proj",), f"digest-{self.rank}"))
        if isinstance(cmd, Sleep):  # a verb its runner lacks
            return _Ref(UnhandledCommandError(type(cmd).__name__, "ModelRunner"))
        return _Ref(10 + self.rank if isinstance(cmd, Drain) else None)


def test_the_ray_executor_sends_a_command_once_per_rank_and_undoes_a_refusal_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ray_was_up = ray.is_initialized()  # the session's shared cluster may be up; the stand-ins must not touch it
    def wait(refs: list[_Ref], num_returns: int, timeout: float) -> tuple[list[_Ref], list[_Ref]]:
        return refs[:num_returns], refs[num_returns:]  # every stand-in answered at once

    killed: list[object] = []
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda ref: ref.answer)
    # The real ray.kill would start a local Ray (its API auto-initialises) and leave it to the next module.
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))

    def executor(*shards: _Shard) -> RayExecutor:
        ex = RayExecutor.__new__(RayExecutor)  # no cluster: the shards are stand-ins
        ex._shards, ex._loras = list(shards), {}
        ex._channel, ex._pg, ex.start_timeout_s = None, None, 5.0
        return ex

    shards = [_Shard(0), _Shard(1, refuses=True)]
    ex = executor(*shards)
    with pytest.raises(InvalidParameterError) as refused:
        ex.command(AddLoRA("a", "/gone"))
    assert refused.value.param == "lora_path" and ex._loras == {}
    assert [s.seen for s in shards] == [[AddLoRA("a", "/gone"), RemoveLoRA("a")]] * 2  # undone on every rank
    assert ex.shards == shards and killed == []  # a refusal leaves the group up

    shards = [_Shard(0), _Shard(1)]
    ex = executor(*shards)
    info = ex.command(AddLoRA("a", "/x"))
    assert info.key == "digest-0" and ex._loras == {"a": "/x"}  # rank 0's answer; kept for restart()
    assert ex.command(Drain()) == 10  # a new verb needs no line here: once per rank, rank 0's answer
    assert [s.seen for s in shards] == [[AddLoRA("a", "/x"), Drain()]] * 2
    with pytest.raises(UnhandledCommandError, match="ModelRunner does not handle the command Sleep"):
        ex.command(Sleep())  # a verb the shards' runner lacks: named, and the group stays up
    assert ex.shards == shards and killed == []
    ex._shards = []  # the group is down: an unload reaches no shard, and restart() will not register it
    assert ex.command(RemoveLoRA("a")) is None and ex._loras == {}
    assert [len(s.seen) for s in shards] == [3, 3]
    # A real Ray call on a stand-in would have started Ray here (or, with it up, failed on the stand-in).
    assert ray.is_initialized() == ray_was_up
