"""``flotilla bench profile``: the command line.

    flotilla bench profile --model tiny --out profiles/tiny_cpu.json

Times engine steps of known shapes on this machine and fits the linear
step-time model ``flotilla simulate`` and ``flotilla plan`` read (``run``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from scheduling.errors import InvalidParameterError


def _ints(text: str) -> tuple[int, ...]:
    """``16,64,256`` -> (16, 64, 256): positive integers."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


class ProfileBench:
    name = "profile"
    help = "this machine's step-time model of a model (prefill by tokens, decode by batch and context), for simulate"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny",
                            help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        parser.add_argument("--runs", type=int, default=3, help="passes over every shape (medians)")
        parser.add_argument("--steps", type=int, default=None,
                            help="decode steps timed per decode shape and pass (default 8 offline, 64 --served)")
        parser.add_argument("--seed", type=int, default=0, help="of the prompts")
        parser.add_argument("--dtype", default=None)
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="torch threads of the forward (default: every core)")
        parser.add_argument("--num-kv-pages", type=int, default=None,
                            help="the replica's KV pool the profile records (default: the engine's)")
        parser.add_argument("--max-num-seqs", type=int, default=None,
                            help="the replica's max_num_seqs (default: the largest decode batch)")
        parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="the replica's step budget (default: the largest prefill)")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="the replica's max_model_len (default: what the shapes need)")
        parser.add_argument("--prefill-tokens", type=_ints, default=None, metavar="N,N,...",
                            help="prompt lengths timed as one prefill step (default 16,64,256,1024,2048)")
        parser.add_argument("--decode-batches", type=_ints, default=None, metavar="B,B,...",
                            help="decode batch sizes (default 1,4,16,32,64)")
        parser.add_argument("--decode-contexts", type=_ints, default=None, metavar="C,C,...",
                            help="decode context lengths (default 64,512,1536)")
        parser.add_argument("--served", action="store_true",
                            help="time the shapes as a client of one served replica (local Ray, HTTP on "
                                 "loopback): what a replica of the app costs, for simulating the app (embedded "
                                 "models' vocabulary)")
        parser.add_argument("--host-replicas", type=_ints, default=None, metavar="K,K,...",
                            help="with --served: also time K replicas busy at once for each K and fit how many "
                                 "replicas' steps this host runs at full speed (the profile's host_cores)")
        parser.add_argument("--out", default=None, help="also write the profile JSON here (simulate --profile)")
        parser.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
        parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is one JSON object")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.profile.run import (  # import cost
            DECODE_BATCHES,
            DECODE_CONTEXTS,
            OFFLINE_STEPS,
            PREFILL_TOKENS,
            run,
        )
        from cli.bench.profile.served import SERVED_STEPS, run_served  # (cli.bench.registry)

        engine = {k: v for k, v in (("dtype", args.dtype), ("cpu_threads", args.cpu_threads),
                                    ("num_kv_pages", args.num_kv_pages), ("max_num_seqs", args.max_num_seqs),
                                    ("max_num_batched_tokens", args.max_num_batched_tokens),
                                    ("max_model_len", args.max_model_len)) if v is not None}
        shapes = {k: v for k, v in (("prefill_tokens", args.prefill_tokens), ("decode_batches", args.decode_batches),
                                    ("decode_contexts", args.decode_contexts)) if v is not None}
        if args.host_replicas and not args.served:
            raise InvalidParameterError("host_replicas", "needs --served (replicas of the app share the host)")
        if args.served:
            # stdout carries the JSON alone: what Ray prints meanwhile (its teardown included) goes to stderr.
            with contextlib.redirect_stdout(sys.stderr):
                steps = SERVED_STEPS if args.steps is None else args.steps
                out = run_served(args.model, runs=args.runs, steps=steps, seed=args.seed,
                                 prefill_tokens=args.prefill_tokens or PREFILL_TOKENS,
                                 decode_batches=args.decode_batches or DECODE_BATCHES,
                                 decode_contexts=args.decode_contexts or DECODE_CONTEXTS,
                                 host_replicas=args.host_replicas or (), **engine)
        else:
            steps = OFFLINE_STEPS if args.steps is None else args.steps
            out = run(args.model, runs=args.runs, steps=steps, seed=args.seed, progress=args.progress,
                      **shapes, **engine)
        if args.out:
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out["profile"], indent=1) + "\n")
        print(json.dumps(out))
        return 0
