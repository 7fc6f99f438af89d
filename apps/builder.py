"""``build_app``: the application builder that ``serve deploy`` and ``flotilla serve`` call.

    # ray_configs/serve.yaml
    applications:
      - name: flotilla
        import_path: apps.builder:build_app
        args: {model: tiny, max_model_len: 2048, num_replicas: 1}

``args`` holds ``model``, any other ``EngineConfig`` field (``max_model_len``,
``max_num_seqs``, ...), and the application options ``num_replicas`` (default
1), ``served_model_name`` (default: ``model``), ``scheduler_options`` (Ray
actor options of each replica's SchedulerActor, e.g. ``{"num_gpus": 1}``) and
``max_body_bytes``, ``api_keys`` (a key or a list; default ``$FLOTILLA_API_KEY``) and
``max_queued_requests`` (per replica beyond ``max_num_seqs``; more get 429). Unknown keys are refused, naming the key.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from ray.serve import Application, Deployment

from actors.engine_config import EngineConfig
from apps.server import DEFAULT_MAX_QUEUED_REQUESTS, LLMServer
from scheduling.errors import InvalidParameterError

APP_OPTIONS = ("num_replicas", "served_model_name", "scheduler_options", "max_body_bytes",
               "api_keys", "max_queued_requests")
# Requests beyond a replica's capacity it must still see, to refuse them with 429.
ADMISSION_HEADROOM = 64


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(engine fields, application options)``; an unknown key raises ``InvalidParameterError``."""
    engine_fields = {f.name for f in fields(EngineConfig)}
    engine: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in args.items():
        if key in engine_fields:
            engine[key] = value
        elif key in APP_OPTIONS:
            options[key] = value
        else:
            known = sorted(engine_fields | set(APP_OPTIONS))
            raise InvalidParameterError(key, f"unknown application argument; known: {known}")
    return engine, options


def build_app(args: dict[str, Any]) -> Application:
    """The OpenAI-compatible application for ``args`` (see the module docstring)."""
    engine, options = split_args(dict(args))
    config = EngineConfig.from_kwargs(**engine)  # fail at deploy time, naming the field, not in a replica
    num_replicas = int(options.pop("num_replicas", 1))
    if num_replicas < 1:
        raise InvalidParameterError("num_replicas", f"must be >= 1, got {num_replicas}")
    deployment = cast(Deployment, LLMServer)  # @serve.deployment made the class a Deployment
    # Let a replica see every request it may hold, so it answers the excess with 429 itself
    # rather than Serve queueing it without bound in front of the replica.
    queued = int(options.get("max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS))
    max_ongoing = config.max_num_seqs + queued + ADMISSION_HEADROOM
    return deployment.options(num_replicas=num_replicas, max_ongoing_requests=max_ongoing).bind(engine, **options)
