"""The per-step data path between the scheduler and its shards: one authenticated socket per rank.

Why not a Ray call or a Ray compiled graph per step: an ordinary actor call
costs more than a socket round trip, and a compiled graph's shared-memory
channels wait by spinning (``sched_yield``) on both ends, so an idle reader
holds a whole core. On a CPU host that core is the one the forward or the
replica's output polling needs (README, "Ray path overhead", has the
figures from ``flotilla bench ray-overhead``). A blocking socket waits in
the kernel and wakes at once.

Setup goes through Ray (authenticated, placed): each shard opens a
``StepServer`` on its node's IP and returns its address; the executor starts
``serve`` as a long-running actor call and connects a ``StepClient``. Both
ends then prove they hold a per-group random key (``multiprocessing``'s
HMAC challenge, both ways) before a byte is unpickled; the key travels only
in Ray calls.

Per step the client pickles the ``Batch`` once, writes it to every rank,
then waits for every rank's reply: ``("ok", value)`` or ``("error", text)``.
A rank whose socket closes (its process died) or that does not answer in
time fails the step as ``StepChannelError`` naming the rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

KEY_BYTES = 32
# Replies that name a dead rank win over error replies: when one rank dies,
# the others fail in their collectives a moment later, and the dead one is the cause.
_SETTLE_S = 0.2


class StepChannelError(RuntimeError):
    """A step could not complete on ``rank``: it died, raised, or did not answer."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"shard rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """Where one rank's ``StepServer`` listens."""

    host: str
    port: int


def new_key() -> bytes:
    """A fresh random key for one shard group."""
    return os.urandom(KEY_BYTES)


def _connection(sock: socket.socket) -> Connection:
    """A blocking, no-delay ``Connection`` owning ``sock``'s descriptor."""
    sock.setblocking(True)
    with contextlib.suppress(OSError):  # not a TCP socket (never here): no Nagle to turn off
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Connection(sock.detach())


class StepServer:
    """The shard's end: listens on ``host`` (an ephemeral port) for its one client."""

    def __init__(self, host: str, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(1)
        self.address = ChannelAddress(host, int(self._listener.getsockname()[1]))

    def serve(self, handler: Callable[[Any], Any], accept_timeout_s: float = 120.0) -> int:
        """Accept the client, then answer each message with ``handler(message)`` until it hangs up.

        Returns the number of messages served. A handler exception is sent back
        as an error reply (the loop goes on); a client that fails the key
        check is dropped before anything it sent is unpickled.
        """
        self._listener.settimeout(accept_timeout_s)
        try:
            sock, _ = self._listener.accept()
        finally:
            self._listener.close()
        conn = _connection(sock)
        served = 0
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            while True:
                try:
                    payload = conn.recv_bytes()
                except EOFError:
                    return served
                try:
                    reply: tuple[str, Any] = ("ok", handler(pickle.loads(payload)))
                except Exception as err:  # noqa: BLE001 - every failure goes back to the caller
                    reply = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}")
                conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                served += 1
        finally:
            conn.close()


class StepClient:
    """The scheduler's end: one connection per rank, index = rank."""

    def __init__(self, addresses: list[ChannelAddress], key: bytes, connect_timeout_s: float = 60.0) -> None:
        self._conns: list[Connection] = []
        self._broken: StepChannelError | None = None  # set when replies may still be in flight
        try:
            for rank, addr in enumerate(addresses):
                try:
                    sock = socket.create_connection((addr.host, addr.port), timeout=connect_timeout_s)
                    conn = _connection(sock)
                    self._conns.append(conn)
                    answer_challenge(conn, key)
                    deliver_challenge(conn, key)
                except (OSError, EOFError, AuthenticationError) as err:
                    raise StepChannelError(
                        rank, f"could not connect to {addr.host}:{addr.port}: {type(err).__name__}: {err}"
                    ) from err
        except BaseException:
            self.close()
            raise

    def run(self, message: Any, timeout_s: float) -> list[Any]:
        """Send ``message`` to every rank; return every rank's reply value, index = rank.

        After a failed step whose other replies did not all arrive, the
        channel is out of step with the ranks and every later call fails too.
        """
        if self._broken is not None:
            raise self._broken
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        rank_of = {id(c): r for r, c in enumerate(self._conns)}
        dead: dict[int, str] = {}
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError as err:
                dead[rank] = f"connection lost ({type(err).__name__})"
        results: list[Any] = [None] * len(self._conns)
        errors: dict[int, str] = {}
        pending = [c for r, c in enumerate(self._conns) if r not in dead]
        deadline = time.monotonic() + timeout_s
        failure: StepChannelError | None = None
        while pending:
            if dead or errors:
                # Collect the other replies for a moment: a dead rank's hang-up is the cause
                # (the others' errors its effect), and a drained channel stays usable.
                deadline = min(deadline, time.monotonic() + _SETTLE_S)
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                if not (dead or errors):
                    ranks = sorted(rank_of[id(c)] for c in pending)
                    failure = StepChannelError(ranks[0], f"rank(s) {ranks} did not answer within {timeout_s:.0f} s")
                break
            for got in ready:
                assert isinstance(got, Connection)
                self._settle(got, rank_of[id(got)], results, errors, dead)
                pending.remove(got)
        if failure is None and (dead or errors):
            rank, reason = min(dead.items()) if dead else min(errors.items())
            failure = StepChannelError(rank, reason)
        if failure is not None:
            if pending or dead:
                self._broken = failure
            raise failure
        return results

    @staticmethod
    def _settle(
        conn: Connection, rank: int, results: list[Any], errors: dict[int, str], dead: dict[int, str]
    ) -> None:
        try:
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as err:
            dead[rank] = f"its process is gone (connection closed: {type(err).__name__})"
            return
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = str(value)

    def close(self) -> None:
        """Hang up on every rank (their ``serve`` calls return)."""
        conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()

