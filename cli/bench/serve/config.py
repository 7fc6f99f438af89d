"""The settings of ``flotilla bench serve``: defaults, then the YAML file, then the flags given.

Keys are the long flag names with ``_``. The resolved settings become a
``ServeBenchConfig`` (validated) and are stored in the result's ``config``,
so a run can be repeated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cli.bench.serve.arrivals import ArrivalConfig, parse_rates
from cli.bench.serve.datasets import DatasetConfig
from cli.bench.stats import parse_slo
from scheduling.errors import InvalidParameterError

DEFAULTS: dict[str, Any] = {
    "base_url": "http://127.0.0.1:8000", "model": None, "dataset": "random", "num_prompts": 64,
    "input_len": [32, 256], "output_len": [32, 128], "vocab": 256, "prompt_format": "ids", "seed": 0,
    "num_groups": 4, "prompts_per_group": 8, "prefix_len": 128, "num_conversations": 8, "num_turns": 4,
    "dataset_path": None, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
    "ignore_eos": True, "temperature": 0.0, "slo": None, "timeout_s": 600.0, "num_warmups": 1,
    "metrics_interval_s": 1.0, "cpu_breakdown": False, "out": None, "plot": None, "compare": None, "threshold": 0.05, "load": None,
}


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """One benchmark: where, what, how fast (a list of rates is a sweep)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first of /v1/models
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    slo_ms: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 600.0
    num_warmups: int = 1
    metrics_interval_s: float = 1.0
    cpu_breakdown: bool = False  # per-process CPU of the serving path (the server on this host)

    def arrivals(self, rate: float) -> ArrivalConfig:
        return ArrivalConfig(rate, self.burstiness, self.max_concurrency, self.dataset.seed)


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
