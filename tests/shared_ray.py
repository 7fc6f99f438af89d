"""The test session's one local Ray cluster in this process, and Serve on it.

Starting a cluster costs seconds on a 2-core machine (``ray.init`` alone took
10-12 s there under a test run's load), so every test that needs Ray but not a
cluster of its own shares this one: ``SHARED.start()`` starts it on first use
(a run of unit tests starts none) and it runs until the session ends, or until
a test that needs this process without Ray, or with a cluster of its own, asks
for ``SHARED.stop()`` (the ``ray_stopped`` fixture); the next user starts it
again. Serve apps deployed on it are kept in ``SHARED.apps`` by name and are
gone with it.

Ray is imported inside the methods: this module loads with ``tests/conftest.py``
for every test, and the SDK's tests and the device check run without Ray.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout the tests import
NUM_CPUS = 4  # logical: tests size their placement groups and apps against it (8 bundles do not fit)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SharedRay:
    """The cluster's state; one instance per session (``SHARED``)."""

    def __init__(self) -> None:
        self._env: pytest.MonkeyPatch | None = None  # set while our cluster runs
        self.serve_port: int | None = None
        self.apps: dict[str, object] = {}  # name -> what the deploying helper returned (a LiveServer)

    @property
    def running(self) -> bool:
        ray = sys.modules.get("ray")
        return self._env is not None and ray is not None and ray.is_initialized()

    def start(self) -> None:
        """Our cluster, on loopback: auth off for it (``RAY_AUTH_MODE=disabled`` while it runs, the caller's
        value back after ``stop``), its workers importing this checkout (``PYTHONPATH``), so a test may run its
        own helpers inside a live actor (``actor.__ray_call__``, as ``tests.actors.step_faults`` does)."""
        if self.running:
            return
        import ray  # see the module docstring

        self.stop()  # a cluster some test started and left in this process: ours replaces it
        env = pytest.MonkeyPatch()
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        try:
            # address="local": never attach to another cluster running on this machine.
            ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False)
        except BaseException:
            env.undo()
            raise
        self._env = env

    def serve_url(self) -> str:
        """Serve's proxy on a free loopback port of the running cluster (started here on first call)."""
        self.start()
        if self.serve_port is None:
            from ray import serve  # see the module docstring

            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            self.serve_port = port
        return f"http://127.0.0.1:{self.serve_port}"

    def stop(self) -> None:
        """Serve and Ray down in this process (whoever started them); nothing to do when Ray never loaded."""
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            if self.serve_port is not None:
                from ray import serve  # loaded already: serve_port is set

                serve.shutdown()
            ray.shutdown()
        self.serve_port = None
        self.apps.clear()
        if self._env is not None:
            self._env.undo()
            self._env = None


SHARED = SharedRay()
