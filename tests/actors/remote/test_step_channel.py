"""The scheduler-to-shard step channel, on loopback sockets with servers on threads."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.remote.step_channel import KEY_BYTES, StepChannelError, StepClient, StepServer, new_key

JOIN_S = 10.0


class _Served:
    """A ``StepServer`` running ``handler`` on a thread; ``join`` returns what ``serve`` returned."""

    def __init__(self, key: bytes, handler: Callable[[Any], Any]) -> None:
        self.server = StepServer("127.0.0.1", key)
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(handler,), daemon=True)
        self.thread.start()

    def _run(self, handler: Callable[[Any], Any]) -> None:
        try:
            self.result = self.server.serve(handler, accept_timeout_s=JOIN_S)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            self.result = err

    def join(self) -> Any:
        self.thread.join(JOIN_S)
        assert not self.thread.is_alive(), "the server did not stop"
        return self.result


@pytest.fixture
def key() -> bytes:
    return new_key()


@pytest.fixture
def pair(key: bytes) -> Iterator[tuple[StepClient, list[_Served]]]:
    """Two ranks: rank 0 answers ``("r0", msg)``, rank 1 answers None unless told to fail."""

    def rank1(msg: Any) -> None:
        if msg == "boom":
            raise ValueError("rank 1 cannot do that")
        return None

    servers = [_Served(key, lambda msg: ("r0", msg)), _Served(key, rank1)]
    client = StepClient([s.server.address for s in servers], key)
    try:
        yield client, servers
    finally:
        client.close()
        for s in servers:
            s.join()


def test_every_rank_answers_in_rank_order(pair: tuple[StepClient, list[_Served]]) -> None:
    client, servers = pair
    for step in range(5):
        assert client.run({"step": step}, timeout_s=JOIN_S) == [("r0", {"step": step}), None]
    client.close()
    assert [s.join() for s in servers] == [5, 5]  # both loops ended when the client hung up


def test_a_rank_error_names_the_rank_and_the_channel_goes_on(pair: tuple[StepClient, list[_Served]]) -> None:
    client, _ = pair
    with pytest.raises(StepChannelError, match="shard rank 1 failed: ValueError: rank 1 cannot do that") as err:
        client.run("boom", timeout_s=JOIN_S)
    assert err.value.rank == 1
    assert client.run("next", timeout_s=JOIN_S) == [("r0", "next"), None]


def test_a_rank_that_hangs_up_is_reported_as_gone(key: bytes) -> None:
    stop = threading.Event()

    def quits(msg: Any) -> None:
        stop.set()
        raise SystemExit  # leaves serve() at once: the socket closes like a dead process's

    servers = [_Served(key, lambda msg: msg), _Served(key, quits)]
    client = StepClient([s.server.address for s in servers], key)
    try:
        with pytest.raises(StepChannelError, match="shard rank 1 failed: its process is gone"):
            client.run("x", timeout_s=JOIN_S)
        assert stop.is_set()
    finally:
        client.close()
        for s in servers:
            s.join()


def test_a_rank_that_does_not_answer_times_out(key: bytes) -> None:
    release = threading.Event()
    server = _Served(key, lambda msg: release.wait(JOIN_S))
    client = StepClient([server.server.address], key)
    try:
        with pytest.raises(StepChannelError, match=r"rank\(s\) \[0\] did not answer within 0 s"):
            client.run("x", timeout_s=0.2)
    finally:
        release.set()
        client.close()
        server.join()


def test_a_wrong_key_is_refused_before_anything_is_unpickled(key: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    # A client with another key: the connection is refused on both sides.
    server = _Served(key, lambda msg: msg)
    with pytest.raises(StepChannelError, match="shard rank 0 failed: could not connect"):
        StepClient([server.server.address], new_key())
    assert isinstance(server.join(), Exception)

    # A raw client that answers the challenge with a pickle: dropped, never unpickled.
    server = _Served(key, lambda msg: msg)
    with socket.create_connection((server.server.address.host, server.server.address.port), timeout=JOIN_S) as sock:
        sock.recv(1024)  # the challenge
        payload = pickle.dumps(Bomb())
        sock.sendall(len(payload).to_bytes(4, "big") + payload)
        sock.settimeout(JOIN_S)
        with contextlib.suppress(OSError):  # a reset while reading the verdict is fine
            sock.recv(1024)  # the server's verdict, then it hangs up
    assert isinstance(server.join(), Exception)
    assert not marker.exists()


def test_keys_are_random_and_checked(key: bytes) -> None:
    assert len(key) == KEY_BYTES and key != new_key()
    with pytest.raises(ValueError, match="32 bytes"):
        StepServer("127.0.0.1", os.urandom(8))


def test_after_a_timeout_the_channel_refuses_to_run_out_of_step(key: bytes) -> None:
    release = threading.Event()
    server = _Served(key, lambda msg: (release.wait(JOIN_S), msg)[1])
    client = StepClient([server.server.address], key)
    try:
        with pytest.raises(StepChannelError, match="did not answer"):
            client.run("slow", timeout_s=0.1)
        release.set()  # its late reply would otherwise be read as the next step's
        with pytest.raises(StepChannelError, match="did not answer"):
            client.run("next", timeout_s=JOIN_S)
    finally:
        release.set()
        client.close()
        server.join()
