"""``flotilla bench kv-tiers``: multi-turn chat on replicas behind round-robin routing, with and without KV tiers.

Two sets of replicas run on one private local Ray cluster, each replica a
``SchedulerActor`` on one CPU thread: ``tiers_off`` (prefix caching only) and
``tiers_on`` (the same, plus ``kv_offload``; by default host memory and the
cluster store). Each set starts ``replicas + 1`` replicas; the last one
joins the rotation only once every conversation has finished its first turn,
so it enters cold, mid-run, as a replica autoscaling adds (its start-up is
not timed).

Phase 1, the chat: ``conversations`` seeded conversations (``conversations``)
run at once, each sending ``turns`` greedy turns one after the other, the
next ``think_s`` after the answer (the user reads it; a turn's pages reach
the cluster store within milliseconds of its end, not within zero); every
request goes to the next replica in the rotation (round robin, which is what
a router without prefix affinity does, and what a replica added mid-run
gets). Measured from the client: time to first token of turns >= 2 (P50,
P95), and from each request's usage the prompt tokens those turns computed
(``num_prompt_tokens - num_cached_tokens``: the prefix cache and the tiers
both count as cached). ``new_replica_cluster_hits``: blocks the late
replica read from the cluster tier. ``same_tokens``: every turn's greedy
tokens equal between the two sets.

Phase 2, no reuse: batches of ``no_reuse_requests`` prompts that share no
page, each batch all at once over the first ``replicas`` replicas, ``runs``
pairs alternating the two sets. The first set of a pair runs fresh batches
until ``no_reuse_min_s`` has passed (a run of a second is all jitter), the
second set the same batches; output tok/s per run, the median of each set,
and the median over pairs of their ratio. The tiers still copy every page
out and store it: this is their cost.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import ray
from ray.actor import ActorHandle
from tqdm.auto import tqdm

from actors.api import EngineStats, percentile
from actors.config import EngineConfig
from actors.load.loader import load_tokenizer, resolve_model_path
from actors.scheduler.actor import SchedulerActor
from cli.bench.harness import ray_running
from cli.bench.kv_tiers.conversations import (
    ChatTokenizer,
    Conversation,
    conversations,
    unique_prompts,
)
from scheduling.sampling_params import SamplingParams

SETS = ("tiers_off", "tiers_on")
POLL_S = 1.0  # one long-poll of a replica's outputs
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 1800.0  # bound on any one phase


@dataclass(frozen=True)
class Settings:
    """What ``bench kv-tiers`` runs (its command line)."""

    model: str = "tiny"
    replicas: int = 2
    conversations: int = 8
    turns: int = 4
    passages: int = 6
    max_tokens: int = 32
    think_s: float = 0.5
    no_reuse_requests: int = 16
    no_reuse_prompt_len: int = 256
    no_reuse_max_tokens: int = 32
    no_reuse_min_s: float = 5.0
    runs: int = 5
    seed: int = 0
    kv_offload: dict[str, Any] | str = field(
        default_factory=lambda: {"host_bytes": 2 << 30, "cluster": True, "cluster_bytes": 4 << 30})
    engine: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        for name in ("replicas", "conversations", "turns", "passages", "max_tokens", "no_reuse_requests",
                     "no_reuse_prompt_len", "no_reuse_max_tokens", "runs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.no_reuse_min_s >= 0:
            raise ValueError(f"no_reuse_min_s must be >= 0, got {self.no_reuse_min_s}")
        if self.turns < 2:
            raise ValueError("turns must be >= 2: the figures are of turns 2 and later")


@dataclass
class Done:
    """One finished request as the client saw it."""

    replica: int
    tokens: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float


class Replica:
    """A ``SchedulerActor`` and the long-poll loop that turns its deltas into finished requests."""

    def __init__(self, index: int, actor: ActorHandle) -> None:
        self.index = index
        self.actor = actor
        self._waiting: dict[str, tuple[float, asyncio.Future[Done]]] = {}
        self._first: dict[str, float] = {}
        self._tokens: dict[str, list[int]] = {}
        self._task: asyncio.Task[None] | None = None

    async def request(self, rid: str, prompt: list[int], params: SamplingParams) -> Done:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())
        fut: asyncio.Future[Done] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (time.perf_counter(), fut)
        self._tokens[rid] = []
        await self.actor.submit.remote(rid, prompt, params, consumer_id="bench")
        return await asyncio.wait_for(fut, REQUEST_TIMEOUT_S)

    async def stats(self) -> EngineStats:
        return await self.actor.stats.remote()

    async def _poll(self) -> None:
        while True:
            for msg in await self.actor.next_outputs.remote("bench", POLL_S):
                now = time.perf_counter()
                for d in msg.deltas:
                    rid = d.request_id
                    if rid not in self._waiting:
                        continue
                    if d.token_ids and rid not in self._first:
                        self._first[rid] = now
                    self._tokens[rid] += d.token_ids
                    if d.finish_reason is None:
                        continue
                    sent, fut = self._waiting.pop(rid)
                    if d.error is not None or not d.finish_reason.completed:
                        fut.set_exception(RuntimeError(f"request {rid} ended {d.finish_reason}: {d.error}"))
                        continue
                    fut.set_result(Done(self.index, self._tokens.pop(rid), d.num_prompt_tokens,
                                        d.num_cached_tokens, self._first.pop(rid, now) - sent))  # fmt: skip

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _start(config: EngineConfig, count: int) -> list[ActorHandle]:
    return [SchedulerActor.options(num_cpus=0).remote(config) for _ in range(count)]


async def _chat(replicas: list[Replica], settings: Settings, tokenizer: ChatTokenizer,
                tag: str) -> tuple[dict[tuple[int, int], Done], int]:  # fmt: skip
    """Every conversation, turn after turn; the late replica joins once each has had its first answer."""
    base, late = replicas[: settings.replicas], replicas[settings.replicas]
    rotation = list(base)
    counter = itertools.count()
    params = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0)
    done: dict[tuple[int, int], Done] = {}
    first_turns = asyncio.Event()
    remaining_first = settings.conversations
    progress = tqdm(total=settings.conversations * settings.turns, desc=f"{tag} chat turns", unit="turn")

    async def talk(conv: Conversation) -> None:
        nonlocal remaining_first
        for turn in range(1, settings.turns + 1):
            if turn == 2:
                await first_turns.wait()  # every turn >= 2 is routed with the late replica in the rotation
            if turn >= 2:
                await asyncio.sleep(settings.think_s)  # the user reads the answer (a workload's pacing, not a sync)
            prompt = conv.next_prompt(tokenizer)
            replica = rotation[next(counter) % len(rotation)]
            out = await replica.request(f"{tag}-c{conv.index}-t{turn}", prompt, params)
            done[(conv.index, turn)] = out
            progress.update()
            conv.answer(tokenizer, out.tokens)
            if turn == 1:
                remaining_first -= 1
                if remaining_first == 0:
                    rotation.append(late)
                    first_turns.set()

    await asyncio.gather(*(talk(c) for c in conversations(settings.conversations, settings.turns,
                                                          settings.passages, settings.seed)))  # fmt: skip
    progress.close()
    return done, late.index


async def _no_reuse(replicas: list[Replica], batches: Iterator[list[list[int]]], settings: Settings, tag: str,
                    min_s: float) -> tuple[float, int]:  # fmt: skip
    """Output tok/s over batches of ``batches`` run one after another until ``min_s`` has passed; and how many."""
    params = SamplingParams(max_tokens=settings.no_reuse_max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    tokens = used = 0
    for prompts in batches:
        outs = await asyncio.gather(*(replicas[i % len(replicas)].request(f"{tag}-b{used}-{i}", p, params)
                                      for i, p in enumerate(prompts)))  # fmt: skip
        tokens += sum(len(o.tokens) for o in outs)
        used += 1
        if time.perf_counter() - start >= min_s:
            break
    return tokens / (time.perf_counter() - start), used


def _tier_counter(stats: EngineStats, tier: str, name: str) -> float:
    for tier_name, counters in stats.kv_tiers:
        if tier_name == tier:
            return dict(counters).get(name, 0.0)
    return 0.0


def _summary(done: dict[tuple[int, int], Done], late: int, late_stats: EngineStats) -> dict[str, Any]:
    later = [d for (_, turn), d in done.items() if turn >= 2]
    ttft = [d.ttft_s * 1000 for d in later]
    return {
        "turn2plus_prefill_tokens": sum(d.num_prompt_tokens - d.num_cached_tokens for d in later),
        "turn2plus_prompt_tokens": sum(d.num_prompt_tokens for d in later),
        "turn2plus_ttft_p50_ms": round(percentile(ttft, 50), 1),
        "turn2plus_ttft_p95_ms": round(percentile(ttft, 95), 1),
        "new_replica_cluster_hits": int(_tier_counter(late_stats, "cluster", "hits")),
        "new_replica_turn2plus_requests": sum(1 for d in later if d.replica == late),
        "new_replica_turn2plus_cached_tokens": sum(d.num_cached_tokens for d in later if d.replica == late),
    }


async def _run(settings: Settings, configs: dict[str, EngineConfig], tokenizer: ChatTokenizer) -> dict[str, Any]:
    n = settings.replicas + 1
    actors = {name: _start(config, n) for name, config in configs.items()}
    try:
        await asyncio.wait_for(asyncio.gather(*(a.stats.remote() for group in actors.values() for a in group)),
                               STARTUP_TIMEOUT_S)  # fmt: skip
        sets = {name: [Replica(i, a) for i, a in enumerate(group)] for name, group in actors.items()}
        results: dict[str, dict[str, Any]] = {}
        chats: dict[str, dict[tuple[int, int], Done]] = {}
        for name in SETS:  # one after the other: each has the machine to itself
            done, late = await _chat(sets[name], settings, tokenizer, name)
            chats[name] = done
            results[name] = _summary(done, late, await sets[name][late].stats())
        tok_per_s: dict[str, list[float]] = {name: [] for name in SETS}
        for run in tqdm(range(settings.runs), desc="no-reuse pairs", unit="pair"):
            made: list[list[list[int]]] = []

            def batches(run: int = run, made: list[list[list[int]]] = made) -> Iterator[list[list[int]]]:
                for b in itertools.count():
                    if b == len(made):
                        made.append(unique_prompts(tokenizer, settings.no_reuse_requests,
                                                   settings.no_reuse_prompt_len, (settings.seed, run, b)))
                    yield made[b]

            first, second = SETS if run % 2 == 0 else SETS[::-1]
            rate, used = await _no_reuse(sets[first][: settings.replicas], batches(), settings, f"{first}-nr{run}",
                                         settings.no_reuse_min_s)  # fmt: skip
            tok_per_s[first].append(rate)
            rate, _ = await _no_reuse(sets[second][: settings.replicas], itertools.islice(batches(), used),
                                      settings, f"{second}-nr{run}", float("inf"))  # fmt: skip
            tok_per_s[second].append(rate)
        for name in SETS:
            results[name]["no_reuse_output_tok_per_s"] = round(median(tok_per_s[name]), 2)
            results[name]["no_reuse_runs_tok_per_s"] = [round(x, 2) for x in tok_per_s[name]]
        # Pair by pair (a pair runs seconds apart, so a shared host's slow drifts cancel), then the median.
        pairs = [on / off for off, on in zip(tok_per_s["tiers_off"], tok_per_s["tiers_on"], strict=True)]
        stats = [await r.stats() for r in sets["tiers_on"]]
        results["tiers_on"]["tiers"] = {
            tier: {k: round(sum(_tier_counter(s, tier, k) for s in stats), 4)
                   for k in ("lookups", "hits", "bytes_read", "bytes_written", "load_seconds", "errors")}
            for tier in ("host", "disk", "cluster")
        }  # fmt: skip
        results["tiers_on"]["engine"] = {k: int(sum(_tier_counter(s, "engine", k) for s in stats))
                                         for k in ("load_timeouts", "dropped_saves", "tier_hit_tokens")}  # fmt: skip
        for replicas in sets.values():
            for r in replicas:
                r.stop()
        off, on = chats["tiers_off"], chats["tiers_on"]
        same = off.keys() == on.keys() and all(off[k].tokens == on[k].tokens for k in off)
        return {**results, "same_tokens": same, "no_reuse_pair_ratios": [round(r, 4) for r in pairs],
                "differing_turns": sorted(
            f"c{c}-t{t}" for (c, t) in off if (c, t) in on and off[(c, t)].tokens != on[(c, t)].tokens)}
    finally:
        for handles in actors.values():
            for a in handles:
                ray.kill(a)


def run(settings: Settings) -> dict[str, Any]:
    """Both sets, both phases; returns the JSON-ready result."""
    settings.check()
    engine = {"cpu_threads": 1, **settings.engine}
    off = EngineConfig.from_kwargs(model=settings.model, **engine)
    on = EngineConfig.from_kwargs(model=settings.model, kv_offload=settings.kv_offload, **engine)
    tokenizer = load_tokenizer(resolve_model_path(settings.model))
    with ray_running(2):
        out = asyncio.run(_run(settings, {"tiers_off": off, "tiers_on": on}, tokenizer))
    off_r, on_r = out["tiers_off"], out["tiers_on"]
    return {
        "model": settings.model,
        "replicas": settings.replicas,
        "added_replica": "joins the rotation after every conversation's first turn",
        "conversations": settings.conversations,
        "turns": settings.turns,
        "kv_offload": on.kv_offload.to_dict() if on.kv_offload is not None else None,
        "tiers_off": off_r,
        "tiers_on": on_r,
        "same_tokens": out["same_tokens"],
        "differing_turns": out["differing_turns"],
        "no_reuse_pair_ratios": out["no_reuse_pair_ratios"],
        "ratios": {
            "turn2plus_prefill_tokens": _ratio(on_r["turn2plus_prefill_tokens"], off_r["turn2plus_prefill_tokens"]),
            "turn2plus_ttft_p50_ms": _ratio(on_r["turn2plus_ttft_p50_ms"], off_r["turn2plus_ttft_p50_ms"]),
            # The median of the pairs' ratios (each pair ran back to back), not the ratio of the medians.
            "no_reuse_output_tok_per_s": round(median(out["no_reuse_pair_ratios"]), 4),
        },
        "targets": {"turn2plus_prefill_tokens": "<= 0.30", "turn2plus_ttft_p50_ms": "<= 0.5",
                    "no_reuse_output_tok_per_s": ">= 0.97", "new_replica_cluster_hits": "> 0 with tiers"},
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None
