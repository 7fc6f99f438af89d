"""``flotilla bench pd`` reproduced by the simulator (docs/fleet.md, "Against reality on this machine").

    .venv/bin/python scripts/pd_validate.py --runs 3 --out docs/results/fleet/pd_validation

1. ``flotilla bench profile --served`` measures a served ``small`` replica
   with ``bench pd``'s engine settings twice: with both cores (the colocated
   replica) and with one (each of the prefill and decode replicas).
2. ``runs`` times: ``flotilla bench pd --trace-out`` (the colocated app, then
   the prefill/decode one, on the same cores), and ``flotilla simulate`` plays
   each mode's requests as they were sent: colocated, one replica of the
   two-core profile; disaggregated, a prefill and a decode replica of the
   one-core profile (each its own core), prompts from
   ``remote_prefill_min_tokens`` prefilled remotely, the KV moving at the
   object-store bandwidth ``bench pd`` measured, ``kv_bytes_per_token`` as it
   counted.
3. Prints one JSON object: per mode, the medians of the real and simulated
   TPOT P95 (and TPOT P50, TTFT P50/P95), the simulator's relative error and
   the real runs' own spread. The real TPOTs are the streams'; the
   simulator's count the long prompts' few decode steps too.

The real streams are closed loop (a stream sends its next request when the
last ends); the simulator replays the send times open loop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fleet_validate import cli, compare  # scripts/: this script's folder is on sys.path
from tqdm.auto import tqdm

# bench pd's defaults (cli/bench/pd/__init__.py): the apps' engine settings.
ENGINE = ["--max-num-seqs", "16", "--num-kv-pages", "1024", "--max-num-batched-tokens", "2048",
          "--max-model-len", "4608"]
SHAPES = ["--steps", "64", "--prefill-tokens", "32,256,1024,2048", "--decode-batches", "1,2,4,5",
          "--decode-contexts", "64,160"]
METRICS = ("tpot_p95_ms", "tpot_p50_ms", "ttft_p50_ms", "ttft_p95_ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="bench pd runs (each simulated)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--out", required=True, help="folder for the profiles, traces and every run's JSON")
    ap.add_argument("--sim-only", action="store_true",
                    help="replay the profiles, traces and real runs already in --out through the simulator")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles: dict[int, Path] = {}
    for threads in (2, 1):
        report = out / f"profile_{threads}core_report.json"
        if not args.sim_only:
            measured = cli(args.python, ["bench", "profile", "--model", args.model, "--served", "--cpu-threads",
                                         str(threads), *ENGINE, *SHAPES])
            report.write_text(json.dumps(measured, indent=1) + "\n")
        profiles[threads] = out / f"profile_{threads}core.json"
        profiles[threads].write_text(json.dumps(json.loads(report.read_text())["profile"], indent=1) + "\n")
    rows: dict[str, dict[str, list[dict[str, float]]]] = {m: {"real": [], "sim": []}
                                                          for m in ("colocated", "disaggregated")}
    for i in tqdm(range(args.runs), desc="pd validate", unit="run"):
        prefix = out / f"trace_{i}"
        real_path = out / f"real_{i}.json"
        if not args.sim_only:
            real_path.write_text(json.dumps(cli(args.python, ["bench", "pd", "--model", args.model, "--json",
                                                              "--trace-out", str(prefix)])) + "\n")
        real = json.loads(real_path.read_text())
        d = real["disaggregated"]
        configs = {
            "colocated": ({"startup_s": 0, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}, profiles[2]),
            "disaggregated": ({"startup_s": 0, "autoscaling": {"min_replicas": 1, "max_replicas": 1},
                               "disaggregation": {"prefill": {"min_replicas": 1, "max_replicas": 1},
                                                  "remote_prefill_min_tokens":
                                                      real["config"]["remote_prefill_min_tokens"],
                                                  "kv_transfer_bytes_per_s": d["bandwidth_gb_s"] * 1e9,
                                                  "kv_bytes_per_token": d["kv_bytes_per_token"]}}, profiles[1]),
        }
        slo = [f"{k}:{v:g}" for k, v in real["config"]["slo_ms"].items()]
        for mode, (config, profile) in configs.items():
            config_path = out / f"fleet_{mode}_{i}.json"
            config_path.write_text(json.dumps(config, indent=1) + "\n")
            sim = cli(args.python, ["simulate", "--trace", f"{prefix}_{mode}.jsonl", "--profile", str(profile),
                                    "--config", str(config_path), "--slo", *slo, "--json"])
            sim.pop("profile")
            (out / f"sim_{mode}_{i}.json").write_text(json.dumps(sim) + "\n")
            rows[mode]["real"].append({k: real[mode][k] for k in METRICS})
            rows[mode]["sim"].append({**{k: sim[k] for k in METRICS if k in sim}, "tpot_p50_ms": sim["tpot_ms"]["p50"]})
    result: dict[str, Any] = {}
    for mode, sides in rows.items():
        result[mode] = compare(sides["real"], sides["sim"])
        error = result[mode]["sim_rel_error"]["tpot_p95_ms"]
        result[mode]["tpot_p95_within_20pct"] = error is not None and abs(error) <= 0.2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
