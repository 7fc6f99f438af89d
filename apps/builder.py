"""``build_app``: the application builder that ``serve deploy`` and ``flotilla serve`` call.

    # ray_configs/serve.yaml
    applications:
      - name: flotilla
        import_path: apps.builder:build_app
        args:
          model: tiny
          max_model_len: 2048
          autoscaling: {min_replicas: 1, max_replicas: 4, slo_ttft_ms: 2000, slo_tpot_ms: 100,
                        target_queue_per_replica: 4, upscale_delay_s: 10, downscale_delay_s: 60}
          request_router: prefix
          graceful_shutdown_timeout_s: 120

``args`` holds ``model``, any other ``EngineConfig`` field (``max_model_len``,
``max_num_seqs``, ...), and the application options:

- ``num_replicas`` (default 1; ignored when ``autoscaling`` is given),
  ``served_model_name`` (default: ``model``), ``scheduler_options`` (Ray actor
  options of each replica's SchedulerActor, e.g. ``{"num_gpus": 1}``),
  ``max_body_bytes``, ``api_keys`` (a key or a list; default ``$FLOTILLA_API_KEY``),
  ``max_queued_requests`` (per replica beyond ``max_num_seqs``; more get 429),
  ``scheduler_placement`` (``actor``, the default: each replica's scheduler is
  its own actor; ``replica``: it runs in the replica's process, see
  ``actors.scheduler.local``; then resources go in ``replica_options``);
- ``autoscaling``: a dict, see ``cluster.autoscaling.serve_autoscaling_config``
  (``policy: flotilla|default``, min/max replicas, SLOs, queue target, delays);
- ``request_router``: ``prefix`` (the default) | ``default`` (Serve's power of
  two choices; under HAProxy, its least connections) or a dict of the prefix
  router's options (see ``cluster.request_router.router_config``). Under
  HAProxy's direct ingress the prefix router answers HAProxy once per request
  (``cluster.ingress_router``);
- ``graceful_shutdown_timeout_s``: how long a replica being removed may take
  to finish its in-flight requests (it takes no new ones meanwhile; default 120);
- ``replica_options``: Ray actor options of each ``LLMServer`` replica (e.g.
  ``{"num_cpus": 0.1}``); ``max_ongoing_requests``;
- ``max_stored_responses``: finished ``/v1/responses`` kept per replica for
  ``previous_response_id`` (default 1024; docs/responses.md);
  ``max_stored_response_bytes``: the memory they may hold per replica
  (default 256 MiB; ``apps.responses.store``);
- ``lora_modules``: LoRA adapters served by name, ``{name: folder}`` (PEFT
  format; implies ``enable_lora``; ``apps.replica.lora``, docs/lora.md);
  ``runtime_lora_updates``: open ``POST /v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` (default off: both 404; implies ``enable_lora``).

Unknown keys are refused, naming the key.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from ray.serve import Application, Deployment

from actors.config import EngineConfig
from actors.scheduler.placement import DEFAULT_PLACEMENT, check_placement
from apps.inputs.params import served_name
from apps.replica.disaggregation import prefill_app, split_pd, with_pool
from apps.replica.server import DEFAULT_MAX_QUEUED_REQUESTS, LLMServer
from cluster.autoscaling import serve_autoscaling_config
from cluster.ingress_router import direct_ingress, ingress_router_deployment
from cluster.request_router import router_config
from scheduling.errors import InvalidParameterError

# Passed to ``LLMServer``'s constructor.
APP_OPTIONS = ("num_replicas", "served_model_name", "scheduler_options", "max_body_bytes",
               "api_keys", "max_queued_requests", "scheduler_placement", "lora_modules", "max_stored_responses",
               "runtime_lora_updates",
               "max_stored_response_bytes")
# Deployment options (they shape the Serve deployment, not the replica object).
DEPLOYMENT_OPTIONS = ("autoscaling", "request_router", "graceful_shutdown_timeout_s",
                      "replica_options", "max_ongoing_requests")
# Requests beyond a replica's capacity it must still see, to refuse them with 429.
ADMISSION_HEADROOM = 64
# Long enough for a replica being removed to finish streaming its longest request.
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S = 120.0
# How often a replica being removed checks for requests still running. Serve sleeps this long before its
# first check (its default, 2 s), so even an idle replica took that long to stop on every scale-down,
# redeploy or delete; counting a replica's requests is cheap, so it looks often.
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(engine fields, application options)``; an unknown key raises ``InvalidParameterError``."""
    engine_fields = {f.name for f in fields(EngineConfig)}
    engine: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in args.items():
        if key in engine_fields:
            engine[key] = value
        elif key in APP_OPTIONS or key in DEPLOYMENT_OPTIONS:
            options[key] = value
        else:
            known = sorted(engine_fields | set(APP_OPTIONS) | set(DEPLOYMENT_OPTIONS))
            raise InvalidParameterError(key, f"unknown application argument; known: {known}")
    return engine, options


def deployment_options(options: dict[str, Any], lora_base_model: str | None = None) -> dict[str, Any]:
    """``Deployment.options`` keywords; pops the deployment options (and ``num_replicas``) from ``options``.

    ``lora_base_model``: the served name of the base model when the app serves
    LoRA adapters (the router then treats any other requested model as an
    adapter from the first request, before replicas report their adapters).
    """
    num_replicas = int(options.pop("num_replicas", 1))
    if num_replicas < 1:
        raise InvalidParameterError("num_replicas", f"must be >= 1, got {num_replicas}")
    grace = float(options.pop("graceful_shutdown_timeout_s", DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S))
    if not grace > 0:
        raise InvalidParameterError("graceful_shutdown_timeout_s", f"must be > 0, got {grace}")
    out: dict[str, Any] = {"graceful_shutdown_timeout_s": grace,
                           "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S}
    autoscaling = options.pop("autoscaling", None)
    if autoscaling is not None:
        if not isinstance(autoscaling, dict):
            raise InvalidParameterError("autoscaling", "must be a mapping of autoscaling options")
        out["autoscaling_config"] = serve_autoscaling_config(autoscaling)
    else:
        out["num_replicas"] = num_replicas
    router = router_config(options.pop("request_router", None), lora_base_model=lora_base_model)
    if router is not None:
        out["request_router_config"] = router
    replica_options = options.pop("replica_options", None)
    if replica_options is not None:
        out["ray_actor_options"] = dict(replica_options)
    if "max_ongoing_requests" in options:
        out["max_ongoing_requests"] = int(options.pop("max_ongoing_requests"))
    return out


def build_app(args: dict[str, Any]) -> Application:
    """The OpenAI-compatible application for ``args`` (see the module docstring; ``pd``: ``apps.replica.disaggregation``)."""
    args = dict(args)
    pd = split_pd(args) if "pd" in args else None
    engine, options = split_args(args)
    if options.get("lora_modules"):
        if not isinstance(options["lora_modules"], dict):
            raise InvalidParameterError("lora_modules", "must map adapter names to their folders")
        if engine.setdefault("enable_lora", True) is not True:
            raise InvalidParameterError("lora_modules", "adapters need enable_lora=True")
    if not isinstance(options.get("runtime_lora_updates", False), bool):  # YAML's "false" would open the admin routes
        raise InvalidParameterError("runtime_lora_updates", f"must be true or false, got "
                                                            f"{options['runtime_lora_updates']!r}")  # fmt: skip
    if options.get("runtime_lora_updates") and engine.setdefault("enable_lora", True) is not True:
        raise InvalidParameterError("runtime_lora_updates", "loading adapters needs enable_lora=True")
    if pd is not None and (engine.get("enable_lora") or options.get("lora_modules")):
        raise InvalidParameterError("pd", "LoRA adapters are not served with prefill/decode pools: the prefill "
                                          "pool would compute prompts without the request's adapter")
    if pd is not None:
        if "autoscaling" in options:
            raise InvalidParameterError("autoscaling", "with pd each pool scales on its own signals: set "
                                                       "pd.prefill.autoscaling and pd.decode.autoscaling")
        prefill_pool, decode_pool, remote = pd
        prefill_engine, prefill_options = split_args(prefill_pool)
        prefill_engine = {**engine, **prefill_engine}
        EngineConfig.from_kwargs(**prefill_engine)
        if "autoscaling" in prefill_options:
            prefill_options["autoscaling"] = with_pool(prefill_options["autoscaling"], "prefill")
        prefill_deploy = deployment_options(prefill_options)  # pops the deployment's keys
        prefill = prefill_app(prefill_engine, prefill_options, prefill_deploy)
        decode_engine, decode_options = split_args(decode_pool)
        engine = {**engine, **decode_engine}
        options = {**options, **decode_options}
        if "autoscaling" in options:
            options["autoscaling"] = with_pool(options["autoscaling"], "decode")
        options.update(prefill=prefill, **remote)
    config = EngineConfig.from_kwargs(**engine)  # fail at deploy time, naming the field, not in a replica
    check_placement(options.get("scheduler_placement", DEFAULT_PLACEMENT), options.get("scheduler_options"))
    deployment = cast(Deployment, LLMServer)  # @serve.deployment made the class a Deployment
    lora_base = served_name(options.get("served_model_name"), config.model) if config.enable_lora else None
    deploy = deployment_options(options, lora_base_model=lora_base)
    # Let a replica see every request it may hold, so it answers the excess with 429 itself
    # rather than Serve queueing it without bound in front of the replica.
    queued = int(options.get("max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS))
    deploy.setdefault("max_ongoing_requests", config.max_num_seqs + queued + ADMISSION_HEADROOM)
    app = deployment.options(**deploy).bind(engine, **options)
    if direct_ingress() and "request_router_config" in deploy:
        # HAProxy sends each request straight to a replica; it asks this router which one (one call per
        # request, none per chunk), so the deployment's request router still decides (cluster.ingress_router).
        app = app._with_ingress_request_router(ingress_router_deployment().bind(app))
    return app
