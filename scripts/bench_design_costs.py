"""The small costs behind design choices the code comments explain, measured on this machine.

Each entry times two ways of doing one thing, interleaved round by round, and
keeps each way's fastest round (other processes on a shared host only add
time). docs/design_costs.md sets the figures beside the choice they back.

    .venv/bin/python scripts/bench_design_costs.py [--rounds 7] [--threads 1]

Prints one JSON object, an entry per choice, times in microseconds:
- ``greedy_pick``: ``max().indices`` vs ``argmax()`` over 16 rows of a
  49,152-token vocabulary (``actors/runner/sampler.py``).
- ``token_masks``: the byte-table mask (``actors/grammar/masks.py``) vs
  xgrammar's CPU ``apply_token_bitmask_inplace``, per row.
- ``prompt_encode``: the tiny model's tokenizer, per character and fixed,
  against a hop to a worker thread and back (``apps/inputs/prompt_encoder.py``).
- ``onednn_linear``: a 1024x6144 float32 product through the prepacked
  oneDNN weight vs ``F.linear``, at 4 and 150 rows
  (``actors/models/cpu_linear.py``).
- ``int8_large_batch``: an int8 linear of 128 rows through the native loop vs
  dequantize + float32 GEMM (``actors/models/quant_linear.py``).
- ``gather_buffer``: a 64 MiB gather into a fresh tensor vs into a reused
  one (``kvcache/attention/torch_paged.py``).
- ``kv_pickle``: 32 MiB of bfloat16 KV (a 2,048-token prompt of ``small``)
  pickled and unpickled as a torch tensor vs as a numpy view of plain
  integers, the form ``kvcache/kv_transfer.py`` gives a payload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from actors.grammar.masks import apply_token_masks
from actors.load.embedded import build_tokenizer
from actors.models import cpu_linear, quant_linear
from scheduling.batch import TokenMasks

VOCAB = 49_152


def fastest_us(ways: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    """Each way's fastest round (microseconds a call), the ways interleaved round by round."""
    best = dict.fromkeys(ways, float("inf"))
    for fn in ways.values():
        fn()  # warm-up: first-call allocations and kernel set-up
    for _ in range(rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps * 1e6)
    return {name: round(us, 1) for name, us in best.items()}


def greedy_pick(rounds: int) -> dict[str, float]:
    logits = torch.randn(16, VOCAB)
    t = fastest_us({"max_indices_us": lambda: logits.max(dim=-1).indices,
                    "argmax_us": lambda: logits.argmax(dim=-1)}, rounds, 50)
    return {**t, "argmax_over_max": round(t["argmax_us"] / t["max_indices_us"], 2)}


def token_masks(rounds: int) -> dict[str, float | str]:
    rows = 16
    logits = torch.randn(rows, VOCAB)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, -(-VOCAB // 32)), dtype=torch.int32)
    masks = TokenMasks(list(range(rows)), bitmask)
    ways: dict[str, Callable[[], object]] = {"byte_table_us_per_row": lambda: apply_token_masks(logits, masks)}
    try:
        # Optional: xgrammar is the comparison, not a dependency of the measured path.
        import xgrammar
    except ImportError:
        xgrammar = None
    if xgrammar is not None:
        work = logits.clone()
        ways["xgrammar_cpu_us_per_row"] = lambda: xgrammar.apply_token_bitmask_inplace(work, bitmask)
    t = fastest_us(ways, rounds, 20)
    return {name: round(us / rows, 1) for name, us in t.items()}


def prompt_encode(rounds: int) -> dict[str, float]:
    tokenizer = build_tokenizer()
    short, long = "hello world " * 10, "hello world " * 2000

    async def hop() -> None:
        await asyncio.to_thread(int)

    loop = asyncio.new_event_loop()
    try:
        t = fastest_us({"short": lambda: tokenizer.encode(short, verbose=False),
                        "long": lambda: tokenizer.encode(long, verbose=False),
                        "hop": lambda: loop.run_until_complete(hop())}, rounds, 20)
    finally:
        loop.close()
    per_char = (t["long"] - t["short"]) / (len(long) - len(short))
    return {"encode_us_per_char": round(per_char, 3), "encode_fixed_us": round(t["short"] - per_char * len(short), 1),
            "thread_hop_us": t["hop"]}


def onednn_linear(rounds: int) -> dict[str, float | None]:
    weight = torch.randn(6144, 1024) / 32
    packed = cpu_linear.pack(weight, None)
    out: dict[str, float | None] = {}
    for rows in (4, 150):
        x = torch.randn(rows, 1024)
        ways: dict[str, Callable[[], object]] = {"torch": lambda x=x: F.linear(x, weight)}
        if packed is not None:
            ways["onednn"] = lambda x=x: cpu_linear.linear(x, packed, None)
        t = fastest_us(ways, rounds, 20)
        out[f"torch_us_{rows}_rows"] = t["torch"]
        out[f"onednn_us_{rows}_rows"] = t.get("onednn")
    return out


def int8_large_batch(rounds: int) -> dict[str, float | str]:
    layer = quant_linear.Int8Linear.from_float(torch.randn(2048, 1024) / 32)
    x = torch.randn(128, 1024)
    # The layer picks dequantize + GEMM at this size; the native loop is timed by lowering the threshold.
    dequant = fastest_us({"dequant_gemm_us": lambda: layer(x)}, rounds, 5)
    saved = quant_linear.DEQUANT_MIN_ROWS
    quant_linear.DEQUANT_MIN_ROWS = 10**9
    try:
        native = fastest_us({"native_loop_us": lambda: layer(x)}, rounds, 5)
    finally:
        quant_linear.DEQUANT_MIN_ROWS = saved
    return {**dequant, **native, "native_over_dequant": round(native["native_loop_us"] / dequant["dequant_gemm_us"], 2)}


def gather_buffer(rounds: int) -> dict[str, float]:
    source = torch.randn(40_000, 8, 64)  # pool slots x kv heads x head dim
    index = torch.randint(0, 40_000, (32_768,))  # 32,768 x 8 x 64 float32 = 64 MiB, past glibc's mmap threshold
    reused = torch.empty(32_768, 8, 64)
    t = fastest_us({"fresh_us": lambda: source.index_select(0, index),
                    "reused_us": lambda: torch.index_select(source, 0, index, out=reused)}, rounds, 3)
    return {**t, "fresh_over_reused": round(t["fresh_us"] / t["reused_us"], 2)}


def kv_pickle(rounds: int) -> dict[str, float]:
    kv = torch.randn(16 * 2**20).to(torch.bfloat16)  # 32 MiB
    as_numpy = kv.view(torch.int16).numpy()
    torch_blob, numpy_blob = pickle.dumps(kv), pickle.dumps(as_numpy)
    t = fastest_us({"torch_dumps": lambda: pickle.dumps(kv), "numpy_dumps": lambda: pickle.dumps(as_numpy),
                    "torch_loads": lambda: pickle.loads(torch_blob), "numpy_loads": lambda: pickle.loads(numpy_blob)},
                   rounds, 3)
    return {f"{name}_ms": round(us / 1000, 2) for name, us in t.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "rounds": args.rounds,
              "greedy_pick": greedy_pick(args.rounds), "token_masks": token_masks(args.rounds),
              "prompt_encode": prompt_encode(args.rounds), "onednn_linear": onednn_linear(args.rounds),
              "int8_large_batch": int8_large_batch(args.rounds), "gather_buffer": gather_buffer(args.rounds),
              "kv_pickle": kv_pickle(args.rounds)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
