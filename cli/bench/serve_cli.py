"""``flotilla bench serve``: command line and YAML config of the serving benchmark.

    flotilla bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 \\
        --request-rate 1,2,4,8 --slo ttft:500 tpot:50 --out result.json --plot result.png
    flotilla bench serve --config run.yaml --request-rate 16        # the file, one flag changed
    flotilla bench serve --load new.json --compare base.json        # compare two results, no run

Settings come from the defaults, then the YAML file (keys are the long flag
names with ``_``), then the flags given. The resolved settings are stored in
the result's ``config`` so a run can be repeated. The JSON (without
per-request samples) is printed; ``--out`` writes it with the samples.
``--compare`` prints a regression table on stderr and exits 1 when TPOT P95
or throughput regressed by more than ``--threshold`` (default 5%).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from cli.bench.serve import ServeBenchConfig, run, without_samples
from cli.bench.serve_arrivals import ArrivalConfig, parse_rates
from cli.bench.serve_datasets import DATASETS, DatasetConfig
from cli.bench.serve_plot import plot
from cli.bench.serve_report import compare, format_table, parse_slo
from scheduling.errors import InvalidParameterError

DEFAULTS: dict[str, Any] = {
    "base_url": "http://127.0.0.1:8000", "model": None, "dataset": "random", "num_prompts": 64,
    "input_len": [32, 256], "output_len": [32, 128], "vocab": 256, "prompt_format": "ids", "seed": 0,
    "num_groups": 4, "prompts_per_group": 8, "prefix_len": 128, "num_conversations": 8, "num_turns": 4,
    "dataset_path": None, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
    "ignore_eos": True, "temperature": 0.0, "slo": None, "timeout_s": 600.0, "num_warmups": 1,
    "metrics_interval_s": 1.0, "cpu_breakdown": False, "out": None, "plot": None, "compare": None, "threshold": 0.05, "load": None,
}


def add_bench_serve_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``flotilla bench`` subparsers."""
    sp = bench_subparsers.add_parser("serve", help="load an OpenAI-compatible server (SSE); latency, throughput")
    s = argparse.SUPPRESS  # only flags actually given override the config file
    sp.add_argument("--config", default=s, help="YAML file of settings (keys: these flags with _)")
    sp.add_argument("--base-url", default=s, help=f"server root (default {DEFAULTS['base_url']})")
    sp.add_argument("--model", default=s, help="model name to send (default: first of /v1/models)")
    sp.add_argument("--dataset", default=s, choices=DATASETS)
    sp.add_argument("--num-prompts", type=int, default=s, help="requests (random, jsonl)")
    sp.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=s)
    sp.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=s)
    sp.add_argument("--vocab", type=int, default=s, help="token ids are drawn from [0, vocab)")
    sp.add_argument("--prompt-format", choices=("ids", "text"), default=s)
    sp.add_argument("--seed", type=int, default=s)
    sp.add_argument("--num-groups", type=int, default=s, help="shared-prefix groups")
    sp.add_argument("--prompts-per-group", type=int, default=s)
    sp.add_argument("--prefix-len", type=int, default=s, help="shared prefix length (tokens)")
    sp.add_argument("--num-conversations", type=int, default=s, help="multi-turn conversations")
    sp.add_argument("--num-turns", type=int, default=s)
    sp.add_argument("--dataset-path", default=s, help="JSONL workload (make_workload.py format)")
    sp.add_argument("--request-rate", default=s, help="requests/s, 'inf', or a sweep '1,2,4'")
    sp.add_argument("--burstiness", type=float, default=s, help="gamma shape of the gaps (1: Poisson)")
    sp.add_argument("--max-concurrency", type=int, default=s, help="requests in flight at most")
    sp.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=s)
    sp.add_argument("--temperature", type=float, default=s)
    sp.add_argument("--slo", nargs="+", default=s, metavar="METRIC:MS", help="goodput SLOs, e.g. ttft:500 tpot:50")
    sp.add_argument("--timeout-s", type=float, default=s, help="per request")
    sp.add_argument("--num-warmups", type=int, default=s, help="untimed requests sent first")
    sp.add_argument("--metrics-interval-s", type=float, default=s, help="server /metrics sampling period")
    sp.add_argument("--cpu-breakdown", action=argparse.BooleanOptionalAction, default=s,
                    help="CPU used by each process of the serving path (the server on this host; Linux)")
    sp.add_argument("--out", default=s, help="write the result JSON (with per-request samples)")
    sp.add_argument("--plot", default=s, help="write a PNG (latency vs rate, CDFs)")
    sp.add_argument("--compare", default=s, help="baseline result JSON: regression table, exit 1 if worse")
    sp.add_argument("--threshold", type=float, default=s, help="relative regression allowed (0.05)")
    sp.add_argument("--load", default=s, help="use this result JSON instead of running")
    sp.set_defaults(func=_bench_serve)
    return sp


def resolve_settings(given: dict[str, Any]) -> dict[str, Any]:
    """Defaults, then ``given["config"]``'s YAML, then the other ``given`` keys."""
    settings = dict(DEFAULTS)
    path = given.get("config")
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise InvalidParameterError("config", f"{path} must hold a mapping of settings")
        unknown = sorted(set(loaded) - set(DEFAULTS))
        if unknown:
            raise InvalidParameterError("config", f"{path}: unknown setting(s) {', '.join(unknown)}")
        settings.update(loaded)
    settings.update({k: v for k, v in given.items() if k not in ("config", "func", "command", "bench")})
    return settings


def bench_config(settings: dict[str, Any]) -> ServeBenchConfig:
    """The ``ServeBenchConfig`` the settings describe (validated)."""
    st = settings
    dataset = DatasetConfig(
        name=st["dataset"], num_prompts=int(st["num_prompts"]), input_len=tuple(st["input_len"]),
        output_len=tuple(st["output_len"]), vocab=int(st["vocab"]), prompt_format=st["prompt_format"],
        seed=int(st["seed"]), num_groups=int(st["num_groups"]), prompts_per_group=int(st["prompts_per_group"]),
        prefix_len=int(st["prefix_len"]), num_conversations=int(st["num_conversations"]),
        num_turns=int(st["num_turns"]), path=st["dataset_path"])
    rates = tuple(parse_rates(st["request_rate"]))
    for rate in rates:  # validates burstiness and concurrency too
        ArrivalConfig(rate, float(st["burstiness"]), st["max_concurrency"], dataset.seed)
    return ServeBenchConfig(
        base_url=str(st["base_url"]).rstrip("/"), model=st["model"], dataset=dataset, request_rates=rates,
        burstiness=float(st["burstiness"]), max_concurrency=st["max_concurrency"],
        ignore_eos=bool(st["ignore_eos"]), temperature=float(st["temperature"]), slo_ms=parse_slo(st["slo"]),
        timeout_s=float(st["timeout_s"]), num_warmups=int(st["num_warmups"]),
        metrics_interval_s=float(st["metrics_interval_s"]), cpu_breakdown=bool(st["cpu_breakdown"]))


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda v: "inf" if v == math.inf else str(v))


def _bench_serve(args: argparse.Namespace) -> int:
    try:
        settings = resolve_settings(vars(args))
        if settings["load"]:
            result = json.loads(Path(settings["load"]).read_text())
        else:
            result = run(bench_config(settings))
    except (InvalidParameterError, OSError, ValueError) as exc:
        print(f"flotilla bench serve: {exc}", file=sys.stderr)
        return 2
    if settings["out"]:
        Path(settings["out"]).write_text(_dump(result) + "\n")
    print(_dump(without_samples(result)), flush=True)
    if settings["plot"]:
        print(f"flotilla bench serve: wrote {plot(result, settings['plot'])}", file=sys.stderr)
    if settings["compare"]:
        base = json.loads(Path(settings["compare"]).read_text())
        rows, regressed = compare(base, result, float(settings["threshold"]))
        print(format_table(rows), file=sys.stderr)
        if regressed:
            print("flotilla bench serve: REGRESSION beyond the threshold", file=sys.stderr)
            return 1
    return 0
