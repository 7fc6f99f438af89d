"""``flotilla bench ray-overhead``: what the Ray path costs over the in-process engine.

Runs one JSONL workload (``../shared/peers/make_workload.py``'s format) twice,
greedily with ignore_eos so both do identical work: through ``LLM`` in this
process, then through a ``SchedulerActor`` on a local Ray cluster (one shard:
``LocalExecutor`` inside the actor, or ``RayExecutor`` with
``tensor_parallel_size=1`` under ``--executor ray``), read the way a replica
reads it: every request submitted, then one ``next_outputs`` long-poll per
step. The two paths alternate ``runs`` times (default 5), so background load
on a shared machine hits both alike; the first pair also fills each side's
prefix cache. Prints one JSON object: each side's median run (output tok/s,
ms per step), the ratio (the median over pairs of Ray tok/s / in-process
tok/s: a pair runs seconds apart, so slow drifts of a shared host cancel;
target >= 0.85), every pair's ratio, and the per-step overhead in ms.

Both sides use ``threads`` torch threads (default 1: tiny matmuls are fastest
on one thread, and it keeps the comparison fair).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import torch

from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerActor
from apps.llm import LLM
from cli.bench.harness import WARMUP_REQUESTS, ray_running
from cli.bench.workload import read_workload
from scheduling.sampling_params import SamplingParams

CONSUMER = "bench"


def _in_process_run(llm: LLM, reqs: list[dict[str, Any]], params: list[SamplingParams]) -> dict[str, float]:
    prompts = [r["prompt_token_ids"] for r in reqs]
    steps0 = llm.engine.policy.stats.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "tokens": tokens, "steps": llm.engine.policy.stats.num_steps - steps0}


def _ray_run(actor: Any, reqs: list[dict[str, Any]], params: list[SamplingParams], tag: str) -> dict[str, float]:
    steps0 = ray.get(actor.stats.remote()).num_steps
    t0 = time.perf_counter()
    ray.get([
        actor.submit.remote(f"{tag}-{i}", r["prompt_token_ids"], p, consumer_id=CONSUMER)
        for i, (r, p) in enumerate(zip(reqs, params, strict=True))
    ])
    left, tokens, polls, messages = len(reqs), 0, 0, 0
    deadline = time.monotonic() + 3600.0  # bound the loop; a stuck run is an error
    while left and time.monotonic() < deadline:
        polls += 1
        for msg in ray.get(actor.next_outputs.remote(CONSUMER, 5.0)):
            messages += 1
            for d in msg.deltas:
                tokens += len(d.token_ids)
                left -= d.finish_reason is not None
    dt = time.perf_counter() - t0
    if left:
        raise RuntimeError(f"{left} requests did not finish through the scheduler actor")
    steps = ray.get(actor.stats.remote()).num_steps - steps0
    return {"seconds": dt, "tokens": tokens, "steps": steps, "polls": polls, "messages": messages}


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def _pair_ratios(local: list[dict[str, float]], remote: list[dict[str, float]]) -> list[float]:
    """Ray tok/s over in-process tok/s, pair by pair."""
    return [
        (r["tokens"] / r["seconds"]) / (lo["tokens"] / lo["seconds"]) for lo, r in zip(local, remote, strict=True)
    ]


def _compare(
    model: str, reqs: list[dict[str, Any]], engine: dict[str, Any], threads: int, executor: str, runs: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Interleave the two paths ``runs`` times (load on a shared box hits both alike)."""
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in reqs]
    llm = LLM(model=model, **engine)
    llm.generate([r["prompt_token_ids"] for r in reqs[:WARMUP_REQUESTS]], params[:WARMUP_REQUESTS], use_tqdm=False)
    config = EngineConfig.from_kwargs(model=model, executor=executor, **engine)
    actor = SchedulerActor.options(
        num_cpus=threads, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    ).remote(config)
    try:
        ray.get([actor.generate.remote(f"warm{i}", reqs[i]["prompt_token_ids"], params[i])
                 for i in range(WARMUP_REQUESTS)])
        local, remote = [], []
        for k in range(runs):
            local.append(_in_process_run(llm, reqs, params))
            remote.append(_ray_run(actor, reqs, params, f"run{k}"))
        return local, remote
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def run(
    model: str, workload: str | Path, *, threads: int = 1, executor: str = "local", runs: int = 5,
    **engine: Any,
) -> dict[str, Any]:
    """Run both paths ``runs`` times on ``workload``; returns the JSON-ready result (medians)."""
    reqs = read_workload(workload)
    torch.set_num_threads(threads)
    with ray_running(max(2, threads + 1)):
        local_runs, remote_runs = _compare(model, reqs, engine, threads, executor, runs)
    ratios = sorted(_pair_ratios(local_runs, remote_runs))
    local, remote = _median_run(local_runs), _median_run(remote_runs)
    tps_local = local["tokens"] / local["seconds"]
    tps_ray = remote["tokens"] / remote["seconds"]
    ms_local = 1000.0 * local["seconds"] / max(local["steps"], 1)
    ms_ray = 1000.0 * remote["seconds"] / max(remote["steps"], 1)
    return {
        "model": model,
        "executor": executor,
        "requests": len(reqs),
        "threads": threads,
        "runs": runs,
        "in_process": {"output_tok_per_s": round(tps_local, 1), "seconds": round(local["seconds"], 3),
                       "steps": int(local["steps"]), "ms_per_step": round(ms_local, 3)},
        "ray": {"output_tok_per_s": round(tps_ray, 1), "seconds": round(remote["seconds"], 3),
                "steps": int(remote["steps"]), "ms_per_step": round(ms_ray, 3),
                "polls": int(remote["polls"]), "messages": int(remote["messages"])},
        "ratio": round(ratios[len(ratios) // 2], 3),
        "pair_ratios": [round(r, 3) for r in _pair_ratios(local_runs, remote_runs)],
        "target_ratio": 0.85,
        "overhead_ms_per_step": round(ms_ray - ms_local, 3),
        "same_output_tokens": all(r["tokens"] == local["tokens"] for r in local_runs + remote_runs),
    }
