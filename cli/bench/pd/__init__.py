"""``flotilla bench pd``: decode interference, colocated against prefill/decode disaggregated, on equal cores.

    flotilla bench pd --model small --json
    flotilla bench pd --model small --long-tokens 4096 --duration-s 120 --slo ttft:2000 tpot:100

It starts its own local Ray cluster and Serve on a free loopback port (token
auth off for this private cluster: ``RAY_AUTH_MODE=disabled``), deploys the
colocated app (one replica whose forward uses ``--cores`` threads), runs the
workload (``workload``: steady decode streams plus periodic long
prompts), tears the app down, deploys the disaggregated one (one prefill and
one decode replica splitting the same cores), runs the identical workload,
measures the object-store bandwidth, stops everything and prints one JSON
object: ``colocated`` and ``disaggregated`` figures, ``tpot_p95_ratio`` and
``goodput_ratio`` (disaggregated / colocated). docs/disaggregation.md lists
the keys. The run is ``run``; the figures ``report`` (``figures``: what
``/metrics`` says moved), the object-store bandwidth ``bandwidth``.
"""

from __future__ import annotations

import argparse

DEFAULT_SLO = ["ttft:2000", "tpot:100"]


class PDBench:
    name = "pd"
    help = "decode streams + long prompts, colocated vs disaggregated on equal cores (JSON)"

    def add_arguments(self, sp: argparse.ArgumentParser) -> None:
        sp.description = ("Starts a private local Ray cluster and Serve (RAY_AUTH_MODE=disabled, loopback only), "
                          "runs the same workload on a colocated app and on a prefill/decode-disaggregated one, "
                          "and prints both as JSON.")
        sp.add_argument("--model", default="small", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        sp.add_argument("--json", action="store_true", help="print only the JSON (one line); Ray's output goes to stderr")
        w = sp.add_argument_group("workload (identical in both modes)")
        w.add_argument("--streams", type=int, default=4, help="concurrent decode streams (closed loop)")
        w.add_argument("--short-tokens", type=int, default=32, help="prompt tokens of a stream request")
        w.add_argument("--output-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=[64, 128],
                       help="max_tokens of a stream request (ignore_eos), drawn in this range")
        w.add_argument("--long-tokens", type=int, default=2048, help="tokens of each long prompt (2-4k)")
        w.add_argument("--long-max-tokens", type=int, default=8, help="max_tokens of a long prompt")
        w.add_argument("--long-every-s", type=float, default=10.0, help="a long prompt every this many seconds")
        w.add_argument("--duration-s", type=float, default=60.0, help="streams send until then (per mode)")
        w.add_argument("--vocab", type=int, default=256, help="token ids are drawn from [0, vocab)")
        w.add_argument("--seed", type=int, default=0)
        w.add_argument("--slo", nargs="+", default=DEFAULT_SLO, metavar="SLO",
                       help="goodput SLOs: ttft:MS tpot:MS (as bench serve) or ttft_ms=MS,tpot_ms=MS "
                            f"(default {' '.join(DEFAULT_SLO)})")
        w.add_argument("--timeout-s", type=float, default=300.0, help="per request")
        w.add_argument("--trace-out", default=None, metavar="PREFIX",
                       help="also write each mode's requests as sent to PREFIX_colocated.jsonl and "
                            "PREFIX_disaggregated.jsonl (flotilla simulate --trace)")
        e = sp.add_argument_group("apps")
        e.add_argument("--cores", type=int, default=None,
                       help="forward threads: all to the colocated replica, split between the prefill (half, "
                            "rounded down) and decode replicas (default: every usable core)")
        e.add_argument("--remote-prefill-min-tokens", type=int, default=512,
                       help="uncached prompt tokens from which the decode replica prefills on the prefill pool")
        e.add_argument("--max-model-len", type=int, default=4608)
        e.add_argument("--num-kv-pages", type=int, default=1024, help="KV pages per replica")
        e.add_argument("--max-num-seqs", type=int, default=16)
        e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's default: chunk size")
        e.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default: the engine's (auto)")
        e.add_argument("--num-cpus", type=int, default=8,
                       help="logical CPUs of the private Ray cluster (reservations only; threads are --cores)")
        e.add_argument("--bandwidth-runs", type=int, default=5, help="object-store trips timed (median)")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.pd.run import main  # import cost (cli.bench.registry)

        return main(args)
