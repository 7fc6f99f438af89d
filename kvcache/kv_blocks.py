"""KV blocks for the tiers below the pool: their keys, and their bytes with a checksum.

A block is one page's KV on every tensor-parallel rank (a ``RankPayloads`` of
one page each). Its key is a hash chain over page-aligned token blocks,
seeded by everything that decides what the KV holds (``block_salt``): the
model, the request's cache namespace (its adapter too), the model dtype, the
KV dtype, the page size and the pool layout. Equal keys therefore mean equal
token prefixes of equal models; the chain makes a block's key depend on
every token before it, as attention does.

On disk and in the cluster store a block travels as bytes (``encode_block``):
a header naming its key and layout, a CRC32 of the body, then the body. A
reader (``decode_block``) checks all three and answers None for a block that
is missing, corrupt, or from another model, dtype or layout: a miss, which
the engine answers by computing the KV again. Never wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict

import numpy as np
import torch

from kvcache.kv_transfer import (
    KVLayout,
    KVPayload,
    KVPayloadMismatchError,
    RankPayloads,
    check_layout,
)

BlockKey = bytes  # KEY_BYTES of a blake2b digest

KEY_BYTES = 16
_MAGIC = b"FLKVB001"
_HEADER = struct.Struct("<8s16sII")  # magic, key, layout JSON length, CRC32 of the body


def block_salt(model_id: str, namespace: str | None, layout: KVLayout, world_size: int) -> bytes:
    """The seed of a key chain: what the KV of a token prefix depends on besides the tokens."""
    text = json.dumps({"model": model_id, "namespace": namespace, "layout": asdict(layout),
                       "world_size": world_size}, sort_keys=True)  # fmt: skip
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def block_keys(salt: bytes, token_ids: Sequence[int], num_blocks: int, page_size: int) -> list[BlockKey]:
    """Keys of the first ``num_blocks`` full pages of ``token_ids``: key i covers tokens ``[0, (i+1)*page_size)``."""
    if num_blocks * page_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {page_size} need {num_blocks * page_size} tokens, "
                         f"got {len(token_ids)}")  # fmt: skip
    data = np.asarray(token_ids[: num_blocks * page_size], dtype=np.int64).tobytes()
    width = page_size * 8
    keys: list[BlockKey] = []
    prev = salt
    for i in range(num_blocks):
        prev = hashlib.blake2b(prev + data[i * width : (i + 1) * width], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def encode_block(key: BlockKey, layout: KVLayout, block: RankPayloads) -> bytes:
    """A one-page block as bytes: header (key, layout), CRC32 of the body, the body."""
    assert len(key) == KEY_BYTES and all(p.num_pages == 1 for p in block), [p.num_pages for p in block]
    meta = json.dumps(asdict(layout), sort_keys=True).encode()
    body = pickle.dumps(block, protocol=5)
    return _HEADER.pack(_MAGIC, key, len(meta), zlib.crc32(body)) + meta + body


def decode_block(data: bytes, key: BlockKey, layout: KVLayout, world_size: int) -> RankPayloads | None:
    """The block in ``data`` if it is whole and is ``key``'s block for ``layout``; else None (a miss)."""
    if len(data) < _HEADER.size:
        return None
    magic, stored_key, meta_len, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC or stored_key != key:
        return None
    start = _HEADER.size + meta_len
    body = memoryview(data)[start:]
    if zlib.crc32(body) != crc:
        return None
    try:
        if json.loads(bytes(data[_HEADER.size : start])) != asdict(layout):
            return None
        block = pickle.loads(body)
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError, AttributeError):
        return None
    if not isinstance(block, tuple) or len(block) != world_size:
        return None
    try:
        for payload in block:
            if not isinstance(payload, KVPayload) or payload.num_pages != 1:
                return None
            check_layout(layout, payload)
    except KVPayloadMismatchError:
        return None
    return block


def split_pages(payloads: RankPayloads) -> list[RankPayloads]:
    """One block per page of ``payloads``, each an owned copy (not a view that keeps the step's buffer alive)."""
    return [tuple(_page(p, i) for p in payloads) for i in range(payloads[0].num_pages)]


def join_blocks(blocks: Sequence[RankPayloads]) -> RankPayloads:
    """The pages of ``blocks`` in order, as one payload per rank (what a pool's ``write_pages`` takes)."""
    assert blocks
    if len(blocks) == 1:
        return blocks[0]
    return tuple(_cat([b[r] for b in blocks]) for r in range(len(blocks[0])))


def slice_pages(payloads: RankPayloads, start: int, stop: int) -> RankPayloads:
    """Pages ``[start, stop)`` of every rank's payload (views)."""
    return tuple(_map(p, lambda t: t[start:stop]) for p in payloads)


def _page(p: KVPayload, i: int) -> KVPayload:
    return _map(p, lambda t: t[i : i + 1].clone())


def _cat(parts: list[KVPayload]) -> KVPayload:
    def cat(seqs: list[tuple[torch.Tensor, ...] | None]) -> tuple[torch.Tensor, ...] | None:
        if seqs[0] is None:
            return None
        return tuple(torch.cat([s[layer] for s in seqs if s is not None]) for layer in range(len(seqs[0])))

    k, v = cat([q.k for q in parts]), cat([q.v for q in parts])
    assert k is not None and v is not None
    return KVPayload(k=k, v=v, k_scales=cat([q.k_scales for q in parts]), v_scales=cat([q.v_scales for q in parts]),
                     kv_dtype=parts[0].kv_dtype, dtype=parts[0].dtype)  # fmt: skip


def _map(p: KVPayload, f: Callable[[torch.Tensor], torch.Tensor]) -> KVPayload:
    return KVPayload(
        k=tuple(f(t) for t in p.k), v=tuple(f(t) for t in p.v),
        k_scales=None if p.k_scales is None else tuple(f(t) for t in p.k_scales),
        v_scales=None if p.v_scales is None else tuple(f(t) for t in p.v_scales),
        kv_dtype=p.kv_dtype, dtype=p.dtype,
    )  # fmt: skip
