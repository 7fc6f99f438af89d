"""The operator path, as a test: ``ray start --head``, ``serve deploy ray_configs/serve.yaml``, ``serve status``.

The cluster is this test's own (its own temp dir and ports, token auth off for
it); the shipped serve.yaml is deployed as is, except for the HTTP port, which
is rewritten to a free one so that a server already on 8000 cannot interfere.
Every Ray process the test started is gone at the end (checked by pid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.serve_harness import http, poll_until, wait_healthy
from tests.shared_ray import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"
DEPLOY_TIMEOUT_S = 240.0


def _tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


@pytest.fixture()
def ray_head(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A ``ray start --head --block`` process; yields (dashboard address, env for CLI calls)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    temp_dir = Path("/tmp") / f"ray-deploy-{os.getpid()}"  # short: Ray's socket paths must fit 107 bytes
    head = psutil.Popen(
        [_tool("ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{dash}", {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}
    finally:
        procs = [head, *psutil.Process(head.pid).children(recursive=True)] if head.poll() is None else []
        for proc in procs:  # every process this cluster started, by pid: TERM, then KILL stragglers
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, alive = psutil.wait_procs(procs, timeout=5)  # the test is over: stragglers are killed below
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _, alive = psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not alive, f"Ray processes still running: {[p.pid for p in alive]}"


def _serve(args: list[str], env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("serve"), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_ray_start_serve_deploy_serve_status(ray_head: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    dashboard, env = ray_head
    config = yaml.safe_load((ROOT / "ray_configs" / "serve.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    deploy_file = tmp_path / "serve.yaml"
    deploy_file.write_text(yaml.safe_dump(config))

    deadline = time.monotonic() + DEPLOY_TIMEOUT_S

    def dashboard_up() -> bool:
        with contextlib.suppress(OSError, ValueError):
            return http(f"{dashboard}/api/serve/applications/")[0] == 200
        return False

    # The dashboard's REST API comes up a little after the GCS: polled over HTTP, not by CLI runs (each a
    # Python start that competes with the cluster's own start for the two cores).
    poll_until(dashboard_up, DEPLOY_TIMEOUT_S, "the dashboard's REST API")
    while True:
        done = _serve(["deploy", str(deploy_file), "-a", dashboard], env)
        if done.returncode == 0:
            break
        assert time.monotonic() < deadline, f"serve deploy failed: {done.stderr[-2000:]}"

    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, DEPLOY_TIMEOUT_S)  # then `serve status` says RUNNING within a call or two
    while True:  # each poll is a CLI round trip: no sleep needed
        out = _serve(["status", "-a", dashboard], env)
        status = yaml.safe_load(out.stdout or "{}") or {}
        app = (status.get("applications") or {}).get("flotilla") or {}
        if app.get("status") == "RUNNING":
            break
        assert app.get("status") != "DEPLOY_FAILED", out.stdout[-3000:]
        assert time.monotonic() < deadline, f"not RUNNING in time: {out.stdout[-2000:]}"

    status_code, body = http(f"{url}/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert status_code == 200, body
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
