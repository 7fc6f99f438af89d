"""The simulator against reality on this machine (docs/fleet.md, "Against reality on this machine").

    .venv/bin/python scripts/fleet_validate.py --runs 3 --peaks 6,3 --out docs/results/fleet/validation

1. ``flotilla bench profile --served --host-replicas 2,3,4`` measures a served
   ``tiny`` replica's step times with ``bench autoscale``'s engine settings, how
   replicas share this host (``host_cores``, a waiting request's share) and how
   long replicas take to start (``--profile`` reuses such a report instead).
2. For each peak rate, ``runs`` times: ``flotilla bench autoscale`` (real
   replicas, the flotilla policy) writes the trace it sent (``--trace-out``),
   and ``flotilla simulate`` plays that trace with the profile and a config of
   the same autoscaling settings; ``startup_s`` is the measured time to start
   ``max_replicas`` at once (scaling 1 -> 4 starts 3 beside a busy one).
3. Prints one JSON object: per peak, the medians of each side, the
   simulator's relative error against the real median, and the spread of the
   real runs themselves ((max - min) / median: the noise floor a 20% target
   sits on).

Compared like for like: goodput as the fraction of requests meeting both SLOs
(the commands' goodput divide by different durations: the real run's includes
the time to scale back down), replica-seconds as the replicas held (running,
starting or stopping; ``held_replica_seconds``), as the simulator counts them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

# bench autoscale's defaults (cli/bench/autoscale/__init__.py) and its engine settings (run.ENGINE).
AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "slo_ttft_ms": 1500, "slo_tpot_ms": 250,
               "target_queue_per_replica": 2, "upscale_delay_s": 3, "downscale_delay_s": 15}
PROFILE_ARGS = ["--model", "tiny", "--cpu-threads", "1", "--num-kv-pages", "256", "--max-num-seqs", "2",
                "--max-num-batched-tokens", "512", "--max-model-len", "2048", "--steps", "64",
                "--prefill-tokens", "16,64,128,256,512", "--decode-batches", "1,2", "--decode-contexts",
                "64,192,512", "--served", "--host-replicas", "2,3,4"]
METRICS = ("ttft_p50_ms", "ttft_p95_ms", "goodput_fraction", "replica_seconds")


def cli(python: str, args: list[str]) -> dict[str, Any]:
    """``python -m cli.main ARGS``'s JSON (its stderr passes through). Also scripts/pd_validate.py's."""
    out = subprocess.run([python, "-m", "cli.main", *args], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)


def real_figures(run: dict[str, Any]) -> dict[str, float]:
    r = run["runs"]["flotilla"]
    return {"ttft_p50_ms": r["ttft_ms_p50"], "ttft_p95_ms": r["ttft_ms_p95"],
            "goodput_fraction": r["good_requests"] / r["num_requests"],
            "replica_seconds": r["held_replica_seconds"], "tpot_p95_ms": r["tpot_ms_p95"]}


def sim_figures(sim: dict[str, Any]) -> dict[str, float]:
    good = (sim["goodput_fraction"] or 0.0) * sim["finished"] / max(sim["requests"], 1)
    return {"ttft_p50_ms": sim["ttft_p50_ms"], "ttft_p95_ms": sim["ttft_p95_ms"], "goodput_fraction": good,
            "replica_seconds": sim["replica_seconds"], "tpot_p95_ms": sim["tpot_p95_ms"]}


def compare(real: list[dict[str, float]], sim: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Both sides' medians per figure, the simulator's error against the real median, and the real runs' own
    spread ((max - min) / median). Also scripts/pd_validate.py's."""
    r = {k: round(statistics.median(x[k] for x in real), 4) for k in real[0]}
    s = {k: round(statistics.median(x[k] for x in sim), 4) for k in real[0]}
    return {"real": r, "sim": s,
            "sim_rel_error": {k: round((s[k] - r[k]) / r[k], 3) if r[k] else None for k in r},
            "real_spread": {k: round((max(x[k] for x in real) - min(x[k] for x in real)) / r[k], 3) if r[k] else None
                            for k in r}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="real runs (and simulations) per peak")
    ap.add_argument("--peaks", default="6,3", help="bench autoscale --peak-rps values, comma-separated")
    ap.add_argument("--profile", default=None, help="a bench profile --served --host-replicas report to reuse")
    ap.add_argument("--out", required=True, help="folder for the profile, traces and every run's JSON")
    ap.add_argument("--sim-only", action="store_true",
                    help="replay the traces and real runs already in --out through the simulator (after a change "
                         "to it; with --profile or the profile_report.json there)")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile or args.sim_only:
        measured = json.loads(Path(args.profile or out / "profile_report.json").read_text())
    else:
        measured = cli(args.python, ["bench", "profile", *PROFILE_ARGS])
        (out / "profile_report.json").write_text(json.dumps(measured, indent=1) + "\n")
    profile = out / "profile.json"
    profile.write_text(json.dumps(measured["profile"], indent=1) + "\n")
    host = measured["host"]
    startup_s = host["start_s"][host["replicas"].index(AUTOSCALING["max_replicas"])]
    config = out / "fleet.json"  # YAML's superset: simulate --config reads it
    config.write_text(json.dumps({"policy": "flotilla", "startup_s": startup_s, "tick_s": 1,
                                  "autoscaling": AUTOSCALING}, indent=1) + "\n")
    peaks = [float(p) for p in args.peaks.split(",")]
    result: dict[str, Any] = {"host_cores": host["host_cores"],
                              "host_share_per_waiting": host["host_share_per_waiting"], "startup_s": startup_s,
                              "peaks": {}}
    with tqdm(total=len(peaks) * args.runs, desc="fleet validate", unit="run") as bar:
        for peak in peaks:
            real: list[dict[str, float]] = []
            sim: list[dict[str, float]] = []
            for i in range(args.runs):
                tag = f"peak{peak:g}_{i}"
                trace = out / f"trace_{tag}.jsonl"
                if args.sim_only:
                    run = json.loads((out / f"real_{tag}.json").read_text())
                else:
                    run = cli(args.python, ["bench", "autoscale", "--policy", "flotilla", "--json", "--png", "",
                                            "--peak-rps", str(peak), "--trace-out", str(trace)])
                    (out / f"real_{tag}.json").write_text(json.dumps(run) + "\n")
                simulated = cli(args.python, ["simulate", "--trace", str(trace), "--profile", str(profile),
                                              "--config", str(config), "--json"])
                simulated.pop("profile")
                (out / f"sim_{tag}.json").write_text(json.dumps(simulated) + "\n")
                real.append(real_figures(run))
                sim.append(sim_figures(simulated))
                bar.update(1)
            side = compare(real, sim)
            errors = side["sim_rel_error"]
            side["within_20pct"] = all(errors[k] is not None and abs(errors[k]) <= 0.2 for k in METRICS)
            result["peaks"][f"{peak:g}"] = side
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
