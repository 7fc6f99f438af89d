"""Move one prompt's KV between two processes both ways P/D could: Ray's object store, and a socket like the
step channel's (``multiprocessing.connection``, HMAC-authenticated); print JSON with the medians.

    .venv/bin/python scripts/bench_kv_transfer_paths.py --mib 32 --runs 9

Each run: a KV-shaped payload (``kvcache.kv_transfer.KVPayload``, bfloat16 pages) goes from one Ray actor to
another and is rebuilt there. ``object_store``: the sender returns it from a call (pickled: numpy arrays,
which the store hands out without a copy); ``socket``: the sender pickles it onto an authenticated socket
that the receiver reads whole. Both include pickling and rebuilding the tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import secrets
import statistics
import time
from multiprocessing.connection import Client, Listener
from typing import Any

import ray
import torch

from kvcache.kv_transfer import KVPayload

LAYERS, PAGE, HEADS, DIM = 30, 16, 3, 64  # the embedded small model's KV shape per page


def payload(mib: int) -> KVPayload:
    per_page = LAYERS * 2 * PAGE * HEADS * DIM * 2  # k and v, bfloat16
    pages = max(1, mib * 2**20 // per_page)
    shape = (pages, PAGE, HEADS, DIM)
    k = tuple(torch.randn(shape, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.randn(shape, dtype=torch.bfloat16) for _ in range(LAYERS))
    return KVPayload(k=k, v=v, k_scales=None, v_scales=None, kv_dtype="auto", dtype="bfloat16")


@ray.remote(num_cpus=0)
class Sender:
    def __init__(self, mib: int) -> None:
        self.data = payload(mib)

    def nbytes(self) -> int:
        return self.data.nbytes

    def get(self) -> KVPayload:
        return self.data

    def send(self, port: int, key: bytes) -> None:
        with Client(("127.0.0.1", port), authkey=key) as conn:
            conn.send_bytes(pickle.dumps(self.data, protocol=5))


@ray.remote(num_cpus=0)
class Receiver:
    def pull(self, sender: Any) -> float:
        start = time.perf_counter()
        data = ray.get(sender.get.remote())
        assert isinstance(data, KVPayload)
        return time.perf_counter() - start

    def listen(self, key: bytes) -> int:
        self.listener = Listener(("127.0.0.1", 0), authkey=key)
        port: int = self.listener.address[1]
        return port

    def accept(self) -> float:
        with self.listener.accept() as conn:
            start = time.perf_counter()
            data = pickle.loads(conn.recv_bytes())
        assert isinstance(data, KVPayload)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=32, help="payload size (32 MiB: a 2,048-token prompt of small)")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster for the measurement
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sender, receiver = Sender.remote(args.mib), Receiver.remote()  # type: ignore[attr-defined]
        nbytes = ray.get(sender.nbytes.remote())
        store, sock = [], []
        for _ in range(args.runs):  # interleaved, so both see the same machine
            store.append(ray.get(receiver.pull.remote(sender)))
            key = secrets.token_bytes(32)
            port = ray.get(receiver.listen.remote(key))
            accepted = receiver.accept.remote()
            start = time.perf_counter()
            ray.get(sender.send.remote(port, key))
            ray.get(accepted)
            sock.append(time.perf_counter() - start)
        report = {"bytes": nbytes, "runs": args.runs}
        for name, times in (("object_store", store), ("socket", sock)):
            median = statistics.median(times)
            report[f"{name}_ms_p50"] = round(median * 1e3, 2)
            report[f"{name}_gb_per_s"] = round(nbytes / median / 1e9, 3)
        print(json.dumps(report))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
