"""The small costs behind design choices the code comments explain, measured on this machine.

Each entry times two ways of doing one thing, interleaved round by round, and
keeps each way's fastest round (other processes on a shared host only add
time). docs/design_costs.md sets the figures beside the choice they back.

    .venv/bin/python scripts/bench_design_costs.py [--rounds 7] [--threads 1]

Prints one JSON object, an entry per choice, times in microseconds:
- ``greedy_pick``: ``max().indices`` vs ``argmax()`` over 16 rows of a
  49,152-token vocabulary (``actors/runner/sampler.py``).
- ``greedy_check``: the sampler's all-plain-greedy test over 64 greedy rows,
  its bare loop vs a generator over ``needs_penalties``, per row
  (``actors/runner/sampler.py``).
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
- ``moe_grouped``: a whole ``SparseMoE`` layer (8 experts, top-2, hidden 512,
  expert width 1024) with its two ``torch._grouped_mm`` calls vs the Python
  loop of one ``mm`` per expert that ``grouped_linear`` falls back to, at 32
  and 512 tokens, float32 and bfloat16; and one grouped product with the
  weights as the transposed view the layer passes vs stored transposed
  (``actors/models/moe.py``).
- ``int8pack_dtype``: torch's ``_weight_int8pack_mm`` for a 1x576 @ 960x576
  product with float32 vs bfloat16 activations and scales
  (``actors/models/quant_linear.py``, the fallback kernel).
- ``quant_batch1``: one SmolLM2-135M layer's seven linears (hidden 576,
  MLP 1536, q 576, k and v 192) at one float32 row, int8 per row and int4 in
  groups of 32, through the native kernels vs torch's packed ones
  (``actors/models/quant_linear.py``, ``kvcache/csrc/quant_gemm.cpp``).
- ``attention_groups``: the units of the torch attention backend's grouping
  cost model (``kvcache/attention/metadata.py``): masked SDPA per query-key
  pair, the k and v gather per key row, and one more group's fixed cost
  (gathers, SDPA, scatter of one decode), for 8 heads / 4 kv heads /
  head_dim 32, float32, page 16; and those costs in pairs, beside the
  constants ``KEY_ROW_COST`` and ``MIN_WASTE``.

``--entries`` runs only the named entries (comma-separated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import time
from collections.abc import Callable
from functools import partial
from unittest import mock

import torch
import torch.nn.functional as F

from actors.grammar.masks import apply_token_masks
from actors.load.embedded import build_tokenizer
from actors.models import cpu_linear, moe, quant_linear
from actors.runner import sampler
from kvcache.attention import metadata
from scheduling.batch import TokenMasks
from scheduling.sampling_params import SamplingParams

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


def greedy_check(rounds: int) -> dict[str, float]:
    rows = 64
    params = [SamplingParams(temperature=0.0) for _ in range(rows)]

    def generator() -> bool:
        return all(not p.temperature and p.logprobs is None and not p.needs_penalties and not p.logit_bias
                   for p in params)

    assert sampler._all_plain_greedy(params) and generator()
    t = fastest_us({"loop": lambda: sampler._all_plain_greedy(params), "generator": generator}, rounds, 2000)
    loop_ns, gen_ns = t["loop"] * 1000 / rows, t["generator"] * 1000 / rows
    return {"loop_ns_per_row": round(loop_ns, 1), "generator_ns_per_row": round(gen_ns, 1),
            "generator_over_loop": round(gen_ns / loop_ns, 2)}


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


def moe_grouped(rounds: int) -> dict[str, float]:
    args = moe.MoEArgs(num_experts=8, top_k=2, intermediate_size=1024, renormalize=True)
    out: dict[str, float] = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        layer = moe.SparseMoE(512, args).to(dtype)
        for p in layer.parameters():
            p.normal_(0, 0.02)
        for tokens in (32, 512):
            x = torch.randn(tokens, 512).to(dtype)
            grouped = fastest_us({"grouped": partial(layer, x)}, rounds, 5)["grouped"]
            # The loop is the path grouped_linear takes for shapes _grouped_mm refuses.
            with mock.patch.object(moe, "_grouped_mm_fits", return_value=False):
                loop = fastest_us({"loop": partial(layer, x)}, rounds, 5)["loop"]
            out[f"{name}_{tokens}_grouped_us"], out[f"{name}_{tokens}_loop_us"] = grouped, loop
    w13 = torch.randn(8, 2048, 512) / 32  # (E, 2I, H), the checkpoint's (out, in) layout
    a = torch.randn(1024, 512)  # 512 tokens x top-2 pairs
    offs = torch.arange(1, 9, dtype=torch.int32) * 128
    stored_t = w13.transpose(1, 2).contiguous()
    t = fastest_us({"view_us": lambda: moe.grouped_linear(a, w13.transpose(1, 2), offs),
                    "stored_transposed_us": lambda: moe.grouped_linear(a, stored_t, offs)}, rounds, 5)
    return {**out, **{f"fp32_gate_up_1024_rows_{k}": v for k, v in t.items()}}


def int8pack_dtype(rounds: int) -> dict[str, float]:
    q = torch.randint(-128, 128, (960, 576), dtype=torch.int8)
    scales = torch.rand(960) / 100
    x = torch.randn(1, 576)
    x16, scales16 = x.to(torch.bfloat16), scales.to(torch.bfloat16)
    t = fastest_us({"float32_us": lambda: torch.ops.aten._weight_int8pack_mm(x, q, scales),
                    "bfloat16_us": lambda: torch.ops.aten._weight_int8pack_mm(x16, q, scales16)}, rounds, 50)
    return {**t, "float32_over_bfloat16": round(t["float32_us"] / t["bfloat16_us"], 2)}


def quant_batch1(rounds: int) -> dict[str, float]:
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in)
    weights = [torch.randn(n, k) / 32 for n, k in shapes]
    x = {k: torch.randn(1, k) for k in (576, 1536)}

    def layers() -> list[quant_linear.Int8Linear | quant_linear.Int4Linear]:
        return [quant_linear.Int8Linear.from_float(w) for w in weights] + [
            quant_linear.Int4Linear.from_float(w, 32) for w in weights]

    native = layers()
    # torch's kernels, as where the extension cannot build
    with mock.patch.object(quant_linear, "_native_gemm", return_value=None):
        packed = layers()
    assert all(m.float32_products for m in native[7:]), "the native kernels did not build here"
    assert not any(m.float32_products for m in packed[7:])

    def run(mods: list[quant_linear.Int8Linear | quant_linear.Int4Linear]) -> Callable[[], object]:
        return lambda: [m(x[m.in_features]) for m in mods]

    t = fastest_us({"int8_native_us": run(native[:7]), "int8_torch_us": run(packed[:7]),
                    "int4_native_us": run(native[7:]), "int4_torch_us": run(packed[7:])}, rounds, 20)
    return {**t, "int8_torch_over_native": round(t["int8_torch_us"] / t["int8_native_us"], 2),
            "int4_torch_over_native": round(t["int4_torch_us"] / t["int4_native_us"], 2)}


def attention_groups(rounds: int) -> dict[str, float]:
    heads, kv_heads, head_dim, page = 8, 4, 32, 16
    gs = heads // kv_heads
    cache = torch.randn(4096, page, kv_heads, head_dim)  # pool pages, as the torch backend holds them
    buf_k, buf_v = torch.empty_like(cache), torch.empty_like(cache)

    def group(q_len: int, ctx: int, gather_only: bool = False) -> Callable[[], object]:
        pages = torch.randint(0, 4096, (-(-ctx // page),))
        q = torch.randn(q_len, heads, head_dim)
        mask = torch.ones(1, 1, q_len * gs, ctx, dtype=torch.bool)
        out = torch.empty(q_len, heads, head_dim)
        rows = torch.arange(q_len)

        def run() -> object:  # TorchPagedAttention._attend for one sequence, then forward's scatter
            kg = torch.index_select(cache, 0, pages, out=buf_k[: pages.numel()])
            vg = torch.index_select(cache, 0, pages, out=buf_v[: pages.numel()])
            if gather_only:
                return vg
            kg = kg.view(1, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2)
            vg = vg.view(1, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2)
            qg = q.view(1, q_len, kv_heads, gs, head_dim).transpose(1, 2).reshape(1, kv_heads, q_len * gs, head_dim)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
            o = o.view(1, kv_heads, q_len, gs, head_dim).transpose(1, 2).reshape(q_len, heads, head_dim)
            return out.index_copy_(0, rows, o)

        return run

    # Large shapes, so each unit is a quotient of one long time (a slope between two noisy times is not).
    t = fastest_us({"group_64x4096": group(64, 4096), "gather_4096": group(1, 4096, True),
                    "decode_group_16": group(1, 16)}, rounds, 10)
    gather_ns = t["gather_4096"] * 1000 / 4096
    pair_ns = (t["group_64x4096"] - t["gather_4096"]) * 1000 / (64 * 4096)
    fixed_us = t["decode_group_16"] - (16 * pair_ns + 16 * gather_ns) / 1000
    return {"pair_ns": round(pair_ns, 2), "key_row_ns": round(gather_ns, 1), "group_fixed_us": round(fixed_us, 1),
            "key_row_in_pairs": round(gather_ns / pair_ns, 1), "group_fixed_in_pairs": round(fixed_us * 1000 / pair_ns),
            "KEY_ROW_COST": metadata.KEY_ROW_COST, "MIN_WASTE": metadata.MIN_WASTE}


ENTRIES: dict[str, Callable[[int], object]] = {
    "greedy_pick": greedy_pick, "greedy_check": greedy_check, "token_masks": token_masks, "prompt_encode": prompt_encode,
    "onednn_linear": onednn_linear, "int8_large_batch": int8_large_batch, "gather_buffer": gather_buffer,
    "kv_pickle": kv_pickle, "moe_grouped": moe_grouped, "int8pack_dtype": int8pack_dtype,
    "quant_batch1": quant_batch1, "attention_groups": attention_groups,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated entries to run (default: all)")
    args = parser.parse_args()
    names = [n for n in args.entries.split(",") if n]
    unknown = [n for n in names if n not in ENTRIES]
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {', '.join(ENTRIES)}")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report: dict[str, object] = {"threads": args.threads, "rounds": args.rounds}
    for name in names:
        report[name] = ENTRIES[name](args.rounds)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
