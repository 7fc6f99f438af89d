"""``flotilla bench moe``: the command line.

    flotilla bench moe --json

Offline throughput at batch 32 of a Qwen3-MoE model against a dense Qwen3 of
the same active parameters, both seeded (``models``), with the arithmetic
that explains the ratio (``run``; docs/models.md).
"""

from __future__ import annotations

import argparse
import json


class MoEBench:
    name = "moe"
    help = "offline throughput at batch 32: a MoE model against a dense model of the same active parameters"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--batch", type=int, default=32, help="requests at once (and max_num_seqs)")
        parser.add_argument("--prompt-len", type=int, default=64, help="random token ids per prompt")
        parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
        parser.add_argument("--steps", type=int, default=16, help="decode steps of the full batch timed per run")
        parser.add_argument("--runs", type=int, default=3, help="alternating runs of both models (medians)")
        parser.add_argument("--seed", type=int, default=0, help="of the weights and the prompts")
        shape = parser.add_argument_group("the pair's shape (dense MLP width = top-k x expert width)")
        shape.add_argument("--hidden", type=int, default=1024)
        shape.add_argument("--layers", type=int, default=8)
        shape.add_argument("--heads", type=int, default=16)
        shape.add_argument("--kv-heads", type=int, default=4)
        shape.add_argument("--head-dim", type=int, default=64)
        shape.add_argument("--experts", type=int, default=32, help="routed experts per layer")
        shape.add_argument("--top-k", type=int, default=4, help="experts each token runs")
        shape.add_argument("--moe-intermediate", type=int, default=256, help="width of one expert's MLP")
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="torch threads of the forward (default: every core)")
        parser.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
        parser.add_argument("--json", action="store_true", help="accepted for symmetry with the other benches: the output is always one JSON object")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.moe.models import PairShape  # import cost (cli.bench.registry)
        from cli.bench.moe.run import run

        shape = PairShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, experts=args.experts, top_k=args.top_k,
                          moe_intermediate=args.moe_intermediate)
        engine = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens), ("dtype", args.dtype),
                                    ("cpu_threads", args.cpu_threads)) if v is not None}
        print(json.dumps(run(shape=shape, batch=args.batch, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                             steps=args.steps, runs=args.runs, seed=args.seed, progress=args.progress, **engine)))
        return 0
