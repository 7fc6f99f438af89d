"""``flotilla simulate``: build the profile and the fleet from the command line, play the trace, report."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import yaml

from cli.bench.stats import parse_slo
from cli.simulate.fleet import Disaggregation, Fleet, FleetConfig
from cli.simulate.profile import StepProfile, load_profile, roofline_profile
from cli.simulate.report import plot, report
from cli.simulate.trace import load_trace
from cluster.autoscaling_pools import AutoscalingConfig
from scheduling.errors import InvalidParameterError

_FLEET_KEYS = {f.name for f in dataclasses.fields(FleetConfig)}


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``5e10`` as a string (a float needs a dot there); figures like link bandwidths are
    written that way, so exponents without a dot are floats here too."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
_AUTOSCALING_KEYS = {f.name for f in dataclasses.fields(AutoscalingConfig)}
_PD_KEYS = {f.name for f in dataclasses.fields(Disaggregation)}


def read_config(path: Path | None, overrides: dict[str, Any]) -> FleetConfig:
    """A YAML/JSON fleet config (``FleetConfig`` fields; ``autoscaling``: ``AutoscalingConfig`` fields;
    ``disaggregation``: ``Disaggregation`` fields, its ``prefill`` the prefill pool's ``AutoscalingConfig``, and
    then ``autoscaling`` is the decode pool's, ``pool: decode`` unless given), then the command line's
    ``overrides`` (``policy``, ``startup_s``, and autoscaling fields such as ``max_replicas``)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidParameterError("config", f"cannot read {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise InvalidParameterError("config", f"{path} must hold a mapping")
        data = loaded
    unknown = sorted(set(data) - _FLEET_KEYS)
    if unknown:
        raise InvalidParameterError("config", f"unknown keys {unknown}; known: {sorted(_FLEET_KEYS)}")
    scaling = dict(data.pop("autoscaling", None) or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key in _AUTOSCALING_KEYS:
            scaling[key] = value
        else:
            data[key] = value
    _check_keys(scaling, _AUTOSCALING_KEYS, "autoscaling")
    pd = data.pop("disaggregation", None)
    if pd is not None:
        if not isinstance(pd, dict):
            raise InvalidParameterError("config", "disaggregation must be a mapping")
        _check_keys(pd, _PD_KEYS, "disaggregation")
        prefill = dict(pd.pop("prefill", None) or {})
        _check_keys(prefill, _AUTOSCALING_KEYS, "disaggregation.prefill")
        data["disaggregation"] = Disaggregation(prefill=AutoscalingConfig(**{**prefill, "pool": "prefill"}), **pd)
        scaling.setdefault("pool", "decode")
    return FleetConfig(**data, autoscaling=AutoscalingConfig(**scaling))


def _check_keys(mapping: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise InvalidParameterError("config", f"unknown {where} keys {unknown}; known: {sorted(known)}")


def build_profile(profile: str | None, gpu: str | None, model: str | None, tp: int) -> StepProfile:
    """``--profile`` (a JSON file), or ``--gpu`` with ``--model`` (a roofline preset)."""
    if profile is not None:
        if gpu is not None or model is not None:
            raise InvalidParameterError("profile", "give --profile, or --gpu with --model, not both")
        return load_profile(Path(profile))
    if gpu is None or model is None:
        raise InvalidParameterError("profile", "needs --profile P, or --gpu G with --model PRESET (a roofline)")
    return roofline_profile(model, gpu, tp=tp)


def simulate(trace: str, profile: StepProfile, config: FleetConfig, *, slo: list[str] | None = None,
             png: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """Play ``trace`` through a fleet of ``profile`` replicas under ``config``; the report (``report``).

    SLOs default to the autoscaling config's TTFT and TPOT targets.
    """
    arrivals = load_trace(trace)
    slo_ms = parse_slo(slo) or {"ttft": config.autoscaling.slo_ttft_ms, "tpot": config.autoscaling.slo_tpot_ms}
    t0 = time.perf_counter()
    run = Fleet(profile, config, seed=seed).run(arrivals)
    wall = time.perf_counter() - t0
    if png is not None:
        plot(run, png, slo_ms=slo_ms)
    return report(run, slo_ms=slo_ms, wall_s=wall, profile=profile.to_dict(), policy=config.policy)
