"""Chaos soak: steady load on a local flotilla cluster while replicas, schedulers and shards die.

    make soak                                   # 5 minutes, a kill every 20 s
    .venv/bin/python scripts/soak.py --duration-s 60 --kill-every-s 15

Starts its own Ray cluster (two replicas of the tiny model, ``executor: ray`` so every
replica's SchedulerActor drives a ModelShardActor), runs ``--concurrency`` SDK clients
back to back, and after a warm-up kills a random replica, scheduler or shard (of a random
replica) every ``--kill-every-s``. At the end it lets the cluster settle and checks:

- every request completed or ended with an error that says what happened (flotilla's
  generic "The server had an error" 500 counts as ``unclear``); none ran past its timeout
  (``hung``);
- every scheduler has no request left and every KV page free (or evictable);
- no placement group outlived its scheduler (shards' CPUs/GPUs leaked);
- the resident memory of each surviving replica grew < ``--max-rss-growth`` (10%) from its
  own baseline (taken once it had served ``--warmup-s``); replicas that lived less than
  ``--min-rss-window-s`` after their baseline are skipped (reported as such). So that one
  replica survives the whole run, the first one (the "witness") loses only shards, never
  itself or its scheduler (``--no-spare-witness`` turns that off).

Prints one JSON summary and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "soak")]

import soak_cluster as sc  # noqa: E402
from soak_load import LoadStats, run_load  # noqa: E402

KINDS = ("replica", "scheduler", "shard")


@dataclass
class Memory:
    """One process's resident set: first seen, baseline (after warm-up), last."""

    pid: int
    first_seen: float
    baseline: int | None = None
    baseline_at: float = 0.0
    last: int | None = None


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=300.0, help="how long the load runs")
    ap.add_argument("--kill-every-s", type=float, default=20.0, help="seconds between kills")
    ap.add_argument("--warmup-s", type=float, default=None, help="load before the first kill (default: min(30, duration/5))")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--request-timeout-s", type=float, default=90.0)
    ap.add_argument("--settle-timeout-s", type=float, default=240.0, help="bound on the recovery after the load")
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    ap.add_argument("--min-rss-window-s", type=float, default=None,
                    help="a replica's RSS counts if it lived this long after its baseline (default: duration/4)")
    ap.add_argument("--no-spare-witness", dest="spare_witness", action="store_false",
                    help="let the first replica be killed too (by default it loses only shards, so one "
                         "replica survives the whole run for the RSS check)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="what may be killed, comma-separated")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-cpus", type=int, default=16, help="the local cluster's logical CPUs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    return ap.parse_args()


def _sample_memory(memory: dict[str, Memory], now: float, warmup_s: float) -> None:
    for r in sc.replicas():
        for key, pid in ((f"replica {r.key[:8]}", r.pid), (f"scheduler of {r.key[:8]}", r.scheduler_pid)):
            m = memory.setdefault(key, Memory(pid, now))
            m.last = sc.rss_bytes(pid)
            if m.baseline is None and m.last is not None and now - m.first_seen >= warmup_s:
                m.baseline, m.baseline_at = m.last, now


def _kill_one(rng: random.Random, kinds: list[str], kills: Counter[str], log: list[dict[str, Any]],
              t0: float, witness: str | None) -> None:
    """Kill one random thing; the witness replica loses only shards (so it survives to be measured)."""
    kind = rng.choice(kinds)
    everyone = sc.replicas()
    found = everyone if kind == "shard" else [r for r in everyone if r.key != witness]
    entry: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "kind": kind}
    if not found and everyone and "shard" in kinds:  # only the witness answers: it may lose a shard
        kind, found = "shard", everyone
        entry.update(kind=kind, instead_of=entry["kind"])
    if not found:
        entry["skipped"] = "no replica answered"
    else:
        try:
            entry["victim"] = sc.kill(kind, rng.choice(found))
            kills[kind] += 1
        except Exception as exc:  # noqa: BLE001 - a victim that died meanwhile is not the soak's failure
            entry["skipped"] = f"{type(exc).__name__}: {exc}"[:160]
    log.append(entry)


async def _soak(url: str, a: argparse.Namespace, warmup_s: float) -> dict[str, Any]:
    rng = random.Random(a.seed)
    kinds = [k for k in a.kinds.split(",") if k]
    stats, stop = LoadStats(), asyncio.Event()
    kills: Counter[str] = Counter()
    kill_log: list[dict[str, Any]] = []
    memory: dict[str, Memory] = {}
    first = await asyncio.to_thread(sc.replicas)
    witness = first[0].key if a.spare_witness and first else None
    t0 = time.monotonic()
    load = asyncio.create_task(run_load(url, concurrency=a.concurrency, seed=a.seed,
                                        timeout_s=a.request_timeout_s, stop=stop, stats=stats))
    next_kill, next_sample = t0 + warmup_s, t0
    end = t0 + a.duration_s
    while (now := time.monotonic()) < end:
        if now >= next_sample:
            await asyncio.to_thread(_sample_memory, memory, now, warmup_s)
            next_sample = now + 5.0
        if now >= next_kill:
            await asyncio.to_thread(_kill_one, rng, kinds, kills, kill_log, t0, witness)
            # A slow kill (a busy cluster) must not make the next ones come in a burst.
            next_kill = max(next_kill + a.kill_every_s, time.monotonic() + a.kill_every_s / 2)
        await asyncio.sleep(0.5)  # pacing of the chaos loop itself, not a synchronisation
    stop.set()
    drain_s = a.request_timeout_s + 30.0
    try:
        await asyncio.wait_for(load, drain_s)
        drained = True
    except (TimeoutError, asyncio.TimeoutError):  # noqa: UP041
        drained = False
    return {"stats": stats, "kills": kills, "kill_log": kill_log, "memory": memory, "drained": drained,
            "witness": witness[:8] if witness else None,
            "load_s": round(time.monotonic() - t0, 1)}


def _rss_report(memory: dict[str, Memory], alive: set[int], end: float, a: argparse.Namespace) -> dict[str, Any]:
    window = a.min_rss_window_s if a.min_rss_window_s is not None else a.duration_s / 4
    checked, skipped = {}, []
    for key, m in memory.items():
        if m.pid not in alive:
            continue
        m.last = sc.rss_bytes(m.pid)
        if m.baseline is None or m.last is None or end - m.baseline_at < window:
            skipped.append(key)
            continue
        checked[key] = {"baseline_mib": round(m.baseline / 2**20, 1), "final_mib": round(m.last / 2**20, 1),
                        "growth": round(m.last / m.baseline - 1.0, 4), "window_s": round(end - m.baseline_at, 1)}
    replicas = {k: v for k, v in checked.items() if k.startswith("replica")}
    worst = max((v["growth"] for v in replicas.values()), default=None)
    return {"checked": checked, "skipped_short_lived": skipped, "max_replica_growth": worst,
            "ok": worst is None or worst < a.max_rss_growth}


def main() -> int:
    a = _args()
    warmup_s = a.warmup_s if a.warmup_s is not None else min(30.0, a.duration_s / 5)
    engine = {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 512, "num_kv_pages": 64,
              "dtype": "float32", "device": "cpu"}
    summary: dict[str, Any] = {"duration_s": a.duration_s, "kill_every_s": a.kill_every_s, "warmup_s": warmup_s,
                               "replicas": a.replicas, "concurrency": a.concurrency,
                               "request_timeout_s": a.request_timeout_s}
    failures: list[str] = []
    model = a.model
    if model == "tiny":
        from actors.load.embedded import ensure_embedded_model

        model = str(ensure_embedded_model("tiny"))
    with sc.cluster(model, num_replicas=a.replicas, num_cpus=a.num_cpus, engine=engine) as url:
        sc.settle(url, a.replicas, a.settle_timeout_s)
        run = asyncio.run(_soak(url, a, warmup_s))
        stats: LoadStats = run["stats"]
        summary["requests"] = stats.summary()
        summary["kills"] = dict(run["kills"])
        summary["kill_log"] = run["kill_log"]
        summary["witness_replica"] = run["witness"]
        summary["load_s"] = run["load_s"]
        try:
            found = sc.settle(url, a.replicas, a.settle_timeout_s)
            summary["recovered"] = True
        except TimeoutError as exc:
            found, summary["recovered"] = sc.replicas(), False
            failures.append(str(exc))
        summary["pages"] = sc.page_report(found, 30.0)
        summary["placement_groups"] = {"live": sc.live_placement_groups(), "expected": len(found)}
        end = time.monotonic()
        summary["rss"] = _rss_report(run["memory"], {r.pid for r in found} | {r.scheduler_pid for r in found},
                                     end, a)
        with contextlib.suppress(Exception):
            summary["after"] = "ok" if sc.healthy(url) else "unhealthy"
    if not run["drained"]:
        failures.append("the load did not stop within its bound")
    if stats.hung:
        failures.append(f"{stats.hung} request(s) ran past their timeout")
    if stats.unclear:
        failures.append(f"{stats.unclear} error(s) without a reason (no message, or the generic 500)")
    if stats.ok == 0:
        failures.append("no request succeeded")
    if not summary["pages"]["ok"]:
        failures.append("KV pages not free at the end")
    pgs = summary["placement_groups"]
    if pgs["live"] > pgs["expected"]:
        failures.append(f"{pgs['live'] - pgs['expected']} placement group(s) outlived their scheduler")
    if not summary["rss"]["ok"]:
        failures.append(f"replica RSS grew {summary['rss']['max_replica_growth']:.1%} (limit {a.max_rss_growth:.0%})")
    summary["failures"] = failures
    summary["ok"] = not failures
    text = json.dumps(summary, indent=2)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
