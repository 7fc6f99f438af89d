"""Medians of ``scripts/bench_step31.sh``'s rounds, and Step 31's ratios against vLLM-CPU, as JSON.

    python scripts/bench_step31_summary.py .bench/s31

Reads ``<out>/<model>_<round>/<server>_<config>.json`` (``flotilla bench serve`` results) and prints,
per model, config and server, the median and the per-round values of output tok/s, TTFT P50 and ITL
P90; then the targets: flotilla's defaults over vLLM's output tok/s at 32 streams on each model, and
on ``smollm2`` the lone TTFT P50 and the 32-stream ITL P90 against vLLM's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Any

SERVERS = ("flotilla_default", "flotilla_before", "vllm")
METRICS = {"output_tok_per_s": "output_tok_per_s", "ttft_ms_p50": "ttft_p50_ms", "itl_ms_p90": "itl_ms_p90"}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def headline(path: Path) -> dict[str, float]:
    runs = json.loads(path.read_text())["runs"]
    (run,) = runs
    return {key: float(run["headline"][source]) for key, source in METRICS.items()}


def summarize(out: Path) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        model, _, _round = folder.name.rpartition("_")
        for result in sorted(folder.glob("*.json")):
            server = next((s for s in SERVERS if result.stem.startswith(s + "_")), None)
            if server is None:
                continue
            config = result.stem[len(server) + 1:]
            values = table.setdefault(model, {}).setdefault(config, {}).setdefault(server, {})
            for key, value in headline(result).items():
                values.setdefault(key, []).append(value)
    medians = {model: {config: {server: {key: {"median": round(statistics.median(v), 2), "runs": v}
                                         for key, v in metrics.items()}
                                for server, metrics in servers.items()}
                       for config, servers in configs.items()}
               for model, configs in table.items()}

    def med(model: str, config: str, server: str, key: str) -> float | None:
        try:
            return float(medians[model][config][server][key]["median"])
        except KeyError:
            return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    targets = {
        f"{m}_streams_tok_s_vs_vllm": ratio(med(m, f"{m}_streams", "flotilla_default", "output_tok_per_s"),
                                            med(m, f"{m}_streams", "vllm", "output_tok_per_s"))
        for m in ("tiny", "smollm2")
    }
    targets["smollm2_lone_ttft_p50_ms_vs_vllm"] = ratio(med("smollm2", "smollm2_lone", "flotilla_default",
                                                            "ttft_ms_p50"),
                                                        med("smollm2", "smollm2_lone", "vllm", "ttft_ms_p50"))
    targets["smollm2_streams_itl_p90_vs_vllm"] = ratio(med("smollm2", "smollm2_streams", "flotilla_default",
                                                           "itl_ms_p90"),
                                                       med("smollm2", "smollm2_streams", "vllm", "itl_ms_p90"))
    return {"cpu": cpu_model(), "medians": medians, "targets": targets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?", default=Path(".bench/s31"))
    args = ap.parse_args()
    print(json.dumps(summarize(args.out), indent=1))


if __name__ == "__main__":
    main()
