"""Control commands: what an engine is told besides running steps, as typed values.

A command is a frozen dataclass whose base, ``Command[R]``, names what running
it returns, so ``command(cmd: Command[R]) -> R`` type-checks at every hop. One
method carries every verb down the same path: ``SchedulerHandle.command`` (the
verbs a replica sends) -> ``SchedulerService.command`` -> ``Executor.command`` ->
``ModelShardActor.command`` on every rank -> ``ModelRunner.command``, which runs
the handler its ``Handlers`` table names for the command's type.

Adding a verb is one dataclass here and one handler in ``ModelRunner``: the
executors carry it to every rank as they are (the Ray one once per rank, a
refusal undone on every rank through ``Command.undo``). Only a verb with its own
delivery rule (``ReadExpertTokens``: rank 0 alone, beside a running step) or its
own failure rule (``PrepareLoRAs``) has a line in ``RayExecutor.command``, and
only a verb a replica sends has one in ``SchedulerService.command``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from actors.api import LoRAInfo
from scheduling.errors import InvalidParameterError

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)  # a command answering a LoRAInfo is a command answering an object
S = TypeVar("S")
C = TypeVar("C", bound="Command[Any]")
T = TypeVar("T")


class UnhandledCommandError(Exception):
    """``where`` has no handler for a command of type ``command`` (named, not held: it crosses Ray as text)."""

    def __init__(self, command: str, where: str) -> None:
        super().__init__(command, where)  # both, in ``args``: how an exception unpickles on the other side of Ray
        self.command = command
        self.where = where

    def __str__(self) -> str:
        return f"{self.where} does not handle the command {self.command}"


class Command(Generic[R_co]):
    """A control verb; running it returns ``R_co``."""

    __slots__ = ()

    def undo(self) -> Command[object] | None:
        """The command that reverses this one on a rank that ran it, when another rank refused it (None: none)."""
        return None

    def unserved(self, where: str) -> R_co:
        """What ``where``, which holds no model to run the command on, answers: it refuses, naming the command.

        A read whose empty answer is the truth without a model overrides this.
        """
        raise UnhandledCommandError(type(self).__name__, where)


@dataclass(frozen=True, slots=True)
class AddLoRA(Command[LoRAInfo]):
    """Register the PEFT adapter in folder ``path`` as ``name`` on every shard; a refusal
    (``InvalidParameterError``) registers it on none."""

    name: str
    path: str

    def undo(self) -> RemoveLoRA:
        return RemoveLoRA(self.name)

    def unserved(self, where: str) -> LoRAInfo:
        raise InvalidParameterError("enable_lora", f"{where} serves no LoRA adapters")


@dataclass(frozen=True, slots=True)
class RemoveLoRA(Command[None]):
    """Forget adapter ``name`` on every shard (no step uses it any more)."""

    name: str

    def unserved(self, where: str) -> None:
        return None  # nothing held, nothing to forget


@dataclass(frozen=True, slots=True)
class PrepareLoRAs(Command[dict[str, str]]):
    """Read the next step's adapter loads (``Batch.lora_loads``) on every shard, before the step;
    the answer maps each adapter that failed to why."""

    names: tuple[str, ...]

    def unserved(self, where: str) -> dict[str, str]:
        return {}


@dataclass(frozen=True, slots=True)
class ReadExpertTokens(Command[tuple[tuple[int, ...], ...]]):
    """Per MoE layer, per expert, the tokens routed to it since the shards loaded; () for a dense model,
    or when the counts cannot be read now.

    Unlike every other command, sent from any thread while a step runs (it
    reads counters and waits for no step), within ``EXPERT_TOKENS_TIMEOUT_S``
    (``actors.engine.executor``).
    """

    def unserved(self, where: str) -> tuple[tuple[int, ...], ...]:
        return ()


class Handlers(Generic[S]):
    """One table from command type to the method of ``S`` that runs it: the single dispatch of a command."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # named in the refusal of a command the table lacks
        # Any: each handler takes its own command type, the key it is filed under (``on`` ties the two).
        self._table: dict[type[Command[Any]], Callable[[S, Any], object]] = {}

    def on(self, kind: type[C]) -> Callable[[Callable[[S, C], T]], Callable[[S, C], T]]:
        """Decorate the method that runs commands of type ``kind``."""

        def register(handler: Callable[[S, C], T]) -> Callable[[S, C], T]:
            assert kind not in self._table, f"{self.owner}: two handlers for {kind.__name__}"
            self._table[kind] = handler
            return handler

        return register

    def run(self, target: S, cmd: Command[R]) -> R:
        """Run ``cmd`` on ``target``; a command the table lacks raises ``UnhandledCommandError`` naming it."""
        handler = self._table.get(type(cmd))
        if handler is None:
            raise UnhandledCommandError(type(cmd).__name__, self.owner)
        return cast(R, handler(target, cmd))  # the handler filed under type(cmd) returns its R
