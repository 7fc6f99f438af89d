"""``flotilla serve`` run as a user runs it: the console script in its own process and its own Ray cluster.

``cli_server`` starts it on a free loopback port (token auth off for its
private cluster), waits until ``/health`` answers 200 and yields the URL and
the process. On exit it sends SIGTERM (the CLI shuts Serve and Ray down) and
asserts that every process it started, by pid, is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from tests.serve_harness import http
from tests.shared_ray import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"
START_TIMEOUT_S = 240.0
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")


def wait_serving(url: str, proc: psutil.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until ``/health`` answers 200; fails at once if the server process exits. Polls with backoff."""
    deadline, pause = time.monotonic() + timeout_s, 0.05
    while True:
        assert proc.poll() is None, f"flotilla serve exited {proc.returncode}: {log.read_text()[-3000:]}"
        with contextlib.suppress(OSError, ValueError):
            if http(f"{url}/health")[0] == 200:
                return
        assert time.monotonic() < deadline, f"not serving in time: {log.read_text()[-3000:]}"
        time.sleep(pause)  # backoff between polls, not synchronisation: the loop checks the state
        pause = min(pause * 2, 1.0)


@contextlib.contextmanager
def cli_server(args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Iterator[tuple[str, psutil.Popen]]:
    """``flotilla serve ARGS --port <free>``; yields ``(url, process)``."""
    # HAProxy (the default ingress) and Serve's fallback proxy listen on fixed ports (9101, 8404, 8500): free
    # ones here, so a test's server can run beside another's.
    ports = {name: str(free_port()) for name in HAPROXY_PORT_ENV}
    full_env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **ports, **(env or {})}
    full_env.pop("RAY_ADDRESS", None)
    port = free_port()
    flotilla = str(BIN / "flotilla") if (BIN / "flotilla").exists() else (shutil.which("flotilla") or "flotilla")
    with log.open("w") as out:
        proc = psutil.Popen([flotilla, "serve", *args, "--port", str(port)], env=full_env, cwd=ROOT,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, proc, log)
        yield url, proc
    finally:
        procs = [proc, *proc.children(recursive=True)] if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=60)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _, alive = psutil.wait_procs(alive, timeout=10)
        assert not alive, f"processes still running: {[p.pid for p in alive]}"
