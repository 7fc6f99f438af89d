"""``flotilla kv drop --app NAME``: end an app's cluster KV stores (``actors.kv_store``), and their blocks.

The stores are detached actors (a replica added later finds them warm), so
``serve delete`` leaves them running, holding up to ``cluster_bytes`` of
memory on every node; this drops them. Replicas of the app still running
start empty ones on their next save.
"""

from __future__ import annotations

import argparse
import json


def add_kv_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kv = sub.add_parser("kv", help="the cluster KV tier's stores")
    kv_sub = kv.add_subparsers(dest="kv", required=True)
    drop = kv_sub.add_parser("drop", help="end every node's cluster KV stores of one Serve app (their blocks are gone)")
    drop.add_argument("--app", required=True, help="the Serve app's name ('-': engines outside Serve)")
    drop.add_argument("--address", default="auto", help="the Ray cluster's address (default: auto)")
    drop.set_defaults(func=run_drop)


def run_drop(args: argparse.Namespace) -> int:
    """Print ``{"app": ..., "dropped": [store names]}``."""
    # Imported here: `flotilla --help` and `flotilla plan` start without Ray (cli.main's rule).
    import ray

    from actors.kv_store import NO_APP, drop_stores

    joined = not ray.is_initialized()
    if joined:
        ray.init(address=args.address, log_to_driver=False)
    try:
        dropped = drop_stores(None if args.app == NO_APP else args.app)
    finally:
        if joined:
            ray.shutdown()
    print(json.dumps({"app": args.app, "dropped": dropped}))
    return 0
