"""``flotilla bench kv-tiers``: the command line.

    flotilla bench kv-tiers --model smollm2-135m --json

Multi-turn chat on two replicas behind round-robin routing, a third added
mid-run, with and without KV tiers; then throughput on prompts that share
nothing, with and without (docs/kv_tiers.md). The run is ``run``; the
workload ``conversations``.
"""

from __future__ import annotations

import argparse
import json


class KVTiersBench:
    name = "kv-tiers"
    help = "multi-turn chat over round-robin replicas (one added mid-run) with and without KV tiers"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model",
            default="tiny",
            help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m",
        )
        parser.add_argument(
            "--replicas", type=int, default=2, help="replicas from the start (one more joins later)"
        )
        parser.add_argument(
            "--conversations", type=int, default=8, help="conversations, all at once"
        )
        parser.add_argument(
            "--turns", type=int, default=4, help="turns of each conversation (>= 2)"
        )
        parser.add_argument(
            "--passages", type=int, default=6, help="shipped passages the first turn asks about"
        )
        parser.add_argument(
            "--max-tokens", type=int, default=32, help="greedy answer tokens per turn at most"
        )
        parser.add_argument(
            "--think-s", type=float, default=0.5, help="seconds between an answer and the next turn"
        )
        parser.add_argument("--no-reuse-requests", type=int, default=16)
        parser.add_argument("--no-reuse-prompt-len", type=int, default=256)
        parser.add_argument("--no-reuse-max-tokens", type=int, default=32)
        parser.add_argument(
            "--no-reuse-min-s", type=float, default=5.0,
            help="seconds each no-reuse run lasts at least (batches of --no-reuse-requests, fresh prompts)",
        )
        parser.add_argument(
            "--runs", type=int, default=5, help="alternating no-reuse runs of each set (median of pair ratios)"
        )
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--kv-offload",
            default='{"host_bytes": 2147483648, "cluster": true, "cluster_bytes": 4294967296}',
            metavar="JSON",
            help="the tiers of the tiers_on set (EngineConfig.kv_offload)",
        )
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument(
            "--num-kv-pages",
            type=int,
            default=None,
            help="pages of each replica's pool (default: the engine's)",
        )
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object (the default output)"
        )

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.kv_tiers.run import Settings, run  # import cost (cli.bench.registry)

        engine: dict[str, object] = {"max_model_len": args.max_model_len}
        if args.num_kv_pages is not None:
            engine["num_kv_pages"] = args.num_kv_pages
        settings = Settings(
            model=args.model,
            replicas=args.replicas,
            conversations=args.conversations,
            turns=args.turns,
            passages=args.passages,
            max_tokens=args.max_tokens,
            think_s=args.think_s,
            no_reuse_requests=args.no_reuse_requests,
            no_reuse_prompt_len=args.no_reuse_prompt_len,
            no_reuse_max_tokens=args.no_reuse_max_tokens,
            runs=args.runs,
            no_reuse_min_s=args.no_reuse_min_s,
            seed=args.seed,
            kv_offload=args.kv_offload,
            engine=engine,
        )
        print(json.dumps(run(settings)))
        return 0
