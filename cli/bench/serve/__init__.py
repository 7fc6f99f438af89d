"""``flotilla bench serve``: load an OpenAI-compatible server and measure what clients see (JSON, PNG).

    flotilla bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 \\
        --request-rate 1,2,4,8 --slo ttft:500 tpot:50 --out result.json --plot result.png
    flotilla bench serve --config run.yaml --request-rate 16        # the file, one flag changed
    flotilla bench serve --load new.json --compare base.json        # compare two results, no run

Settings come from the defaults, then the YAML file, then the flags given
(``config``). The JSON (without per-request samples) is printed; ``--out``
writes it with the samples. ``--compare`` prints a regression table on
stderr and exits 1 when TPOT P95 or throughput regressed by more than
``--threshold`` (default 5%). The run is ``run``; the request sets
``datasets``, the arrival schedule ``arrivals``, the server's figures ``server``.
"""

from __future__ import annotations

import argparse

from cli.bench.serve.config import DEFAULTS
from cli.bench.serve.datasets import DATASETS


class ServeBench:
    name = "serve"
    help = "load an OpenAI-compatible server (SSE); latency, throughput"

    def add_arguments(self, sp: argparse.ArgumentParser) -> None:
        s = argparse.SUPPRESS  # only flags actually given override the config file
        sp.add_argument("--config", default=s, help="YAML file of settings (keys: these flags with _)")
        sp.add_argument("--base-url", default=s, help=f"server root (default {DEFAULTS['base_url']})")
        sp.add_argument("--model", default=s, help="model name to send (default: first of /v1/models)")
        sp.add_argument("--dataset", default=s, choices=DATASETS)
        sp.add_argument("--num-prompts", type=int, default=s, help="requests (random, jsonl)")
        sp.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=s)
        sp.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=s)
        sp.add_argument("--vocab", type=int, default=s, help="token ids are drawn from [0, vocab)")
        sp.add_argument("--prompt-format", choices=("ids", "text"), default=s)
        sp.add_argument("--seed", type=int, default=s)
        sp.add_argument("--num-groups", type=int, default=s, help="shared-prefix groups")
        sp.add_argument("--prompts-per-group", type=int, default=s)
        sp.add_argument("--prefix-len", type=int, default=s, help="shared prefix length (tokens)")
        sp.add_argument("--num-conversations", type=int, default=s, help="multi-turn conversations")
        sp.add_argument("--num-turns", type=int, default=s)
        sp.add_argument("--dataset-path", default=s, help="JSONL workload (make_workload.py format)")
        sp.add_argument("--request-rate", default=s, help="requests/s, 'inf', or a sweep '1,2,4'")
        sp.add_argument("--burstiness", type=float, default=s, help="gamma shape of the gaps (1: Poisson)")
        sp.add_argument("--max-concurrency", type=int, default=s, help="requests in flight at most")
        sp.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=s)
        sp.add_argument("--temperature", type=float, default=s)
        sp.add_argument("--slo", nargs="+", default=s, metavar="METRIC:MS", help="goodput SLOs, e.g. ttft:500 tpot:50")
        sp.add_argument("--timeout-s", type=float, default=s, help="per request")
        sp.add_argument("--num-warmups", type=int, default=s, help="untimed requests sent first")
        sp.add_argument("--metrics-interval-s", type=float, default=s, help="server /metrics sampling period")
        sp.add_argument("--cpu-breakdown", action=argparse.BooleanOptionalAction, default=s,
                        help="CPU used by each process of the serving path (the server on this host; Linux)")
        sp.add_argument("--out", default=s, help="write the result JSON (with per-request samples)")
        sp.add_argument("--plot", default=s, help="write a PNG (latency vs rate, CDFs)")
        sp.add_argument("--compare", default=s, help="baseline result JSON: regression table, exit 1 if worse")
        sp.add_argument("--threshold", type=float, default=s, help="relative regression allowed (0.05)")
        sp.add_argument("--load", default=s, help="use this result JSON instead of running")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.serve.run import main  # import cost (cli.bench.registry)

        return main(args)
