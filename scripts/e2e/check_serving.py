"""The e2e's checks against a deployed cluster; exits non-zero on the first that fails.

    RAY_AUTH_MODE=token python scripts/e2e/check_serving.py \
        --dashboard http://127.0.0.1:8265 --serve-config ray_configs/serve.yaml

1. The dashboard refuses a request without the cluster's token (401), and
   `serve status` (which sends the token this client holds) answers.
2. `serve status` reports the application RUNNING (polled until a deadline).
3. A completion through the SDK: ``flotilla.Client(...).complete("Hello", max_tokens=8)``.
4. `serve status` still reports RUNNING.
5. Metrics: the replica's ``/metrics`` has ``flotilla:*`` samples, and they
   reach the node's Prometheus endpoint (cluster.yaml's metrics port) as
   ``ray_flotilla_*``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import yaml

# Ray's metrics agent exports on a timer (about every 10 s): there is no event
# to wait on, so the metrics check looks again at this pace until its deadline.
METRICS_POLL_S = 2.0


def serve_status(dashboard: str) -> dict[str, Any]:
    """`serve status -a DASHBOARD`, parsed; raises if the command fails."""
    done = subprocess.run(["serve", "status", "-a", dashboard], capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"serve status failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    status = yaml.safe_load(done.stdout)
    assert isinstance(status, dict), f"serve status printed {done.stdout!r}"
    return status


def app_status(status: dict[str, Any], app: str) -> tuple[str, str]:
    entry = (status.get("applications") or {}).get(app) or {}
    return str(entry.get("status", "NOT_STARTED")), str(entry.get("message", ""))


def check_token_required(dashboard: str) -> None:
    try:
        with urllib.request.urlopen(f"{dashboard}/api/serve/applications/", timeout=30) as resp:
            raise AssertionError(f"dashboard answered {resp.status} to a request without a token")
    except urllib.error.HTTPError as err:
        assert err.code == 401, f"expected 401 without a token, got {err.code}"
    print("auth: the dashboard refuses a request without the token (401)")


def wait_running(dashboard: str, app: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve_status(dashboard)
        state, message = app_status(status, app)
        if state == "RUNNING":
            return status
        if state == "DEPLOY_FAILED":
            raise AssertionError(f"application {app} DEPLOY_FAILED: {message}")
        if time.monotonic() > deadline:
            raise AssertionError(f"application {app} is {state} after {timeout_s:.0f}s: {message}")
        # No pause needed: each round starts a `serve status` process (about a second).


def check_completion(url: str) -> None:
    from flotilla import Client

    with Client(base_url=url) as client:
        completion = client.complete("Hello", max_tokens=8)
    assert isinstance(completion.text, str), completion
    assert completion.usage is not None and completion.usage.completion_tokens >= 1, completion
    print(f"sdk: complete('Hello', max_tokens=8) -> {completion.text!r} "
          f"({completion.usage.completion_tokens} tokens, finish_reason={completion.finish_reason})")


def serve_url(serve_config: str) -> str:
    """``http://host:port`` of the Serve proxy that ``serve_config`` asks for."""
    with open(serve_config) as f:
        http_options = yaml.safe_load(f).get("http_options") or {}
    host = http_options.get("host", "127.0.0.1")
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http_options.get('port', 8000)}"


def metric_samples(url: str) -> list[str]:
    """The sample lines of a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200, (url, resp.status)
        return [line for line in resp.read().decode().splitlines() if line and not line.startswith("#")]


def check_metrics(serve: str, node: str, timeout_s: float) -> None:
    """The replica's own /metrics has ``flotilla:*``; the node's Ray endpoint gets ``ray_flotilla_*``."""
    own = [line for line in metric_samples(f"{serve}/metrics") if line.startswith("flotilla:")]
    assert own, f"no flotilla:* samples at {serve}/metrics"
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metric_samples(f"{node}/metrics")
        exported = [line for line in samples if line.startswith("ray_flotilla_")]
        if exported:
            break
        assert time.monotonic() < deadline, (
            f"no ray_flotilla_* at {node}/metrics after {timeout_s:.0f}s ({len(samples)} other samples)")
        time.sleep(METRICS_POLL_S)
    print(f"metrics: the replica serves {len(own)} flotilla:* samples; the node's endpoint "
          f"{node}/metrics serves {len(exported)} ray_flotilla_* of {len(samples)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dashboard", default="http://127.0.0.1:8265")
    parser.add_argument("--serve-config", default="ray_configs/serve.yaml",
                        help="the config that was deployed: where its HTTP proxy listens")
    parser.add_argument("--metrics", default="http://127.0.0.1:8080",
                        help="a node's Prometheus endpoint (ray start --metrics-export-port)")
    parser.add_argument("--app", default="flotilla")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for RUNNING")
    args = parser.parse_args()

    check_token_required(args.dashboard)
    started = time.monotonic()
    status = wait_running(args.dashboard, args.app, args.timeout)
    print(f"serve status: {args.app} RUNNING after {time.monotonic() - started:.1f}s")
    check_completion(serve_url(args.serve_config))
    status = serve_status(args.dashboard)
    state, message = app_status(status, args.app)
    assert state == "RUNNING", f"after the completion {args.app} is {state}: {message}"
    print(yaml.safe_dump({"applications": status.get("applications")}, sort_keys=False).rstrip())
    check_metrics(serve_url(args.serve_config), args.metrics, timeout_s=90.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
