"""KV blocks for the tiers below the pool: their keys, their tensors, and their bytes with a checksum.

A block is one page's KV on every tensor-parallel rank: per rank one
contiguous tensor of every layer's k then v (``Block``; with quantized KV a
second one of their scales), so that splitting a step's pages into blocks,
writing one to bytes, reading it back and joining blocks into pages are a
few large copies each, not one per layer. Its key is a hash chain over
page-aligned token blocks, seeded by everything that decides what the KV holds (``block_salt``): the
model's weights (a digest of its files, never its name), the request's cache namespace (with the digest
of its adapter's files: ``scheduling.lora_slots.cache_namespace``), the model dtype, the
KV dtype, the page size and the pool layout. Equal keys therefore mean equal
token prefixes of equal models; the chain makes a block's key depend on
every token before it, as attention does.

On disk and in the cluster store a block travels as bytes (``encode_pages``):
a header naming its key and layout, a CRC32 of the body, then the raw
tensors (their sizes follow from the layout). A reader (``decode_block``)
checks all three and answers None for a block that
is missing, corrupt, or from another model, dtype or layout: a miss, which
the engine answers by computing the KV again. Never wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvcache.kv_quant import SCALE_DTYPE
from kvcache.kv_transfer import INT_OF_WIDTH, KVLayout, KVPayload, RankPayloads

BlockKey = bytes  # KEY_BYTES of a blake2b digest
BlockBytes = bytes | memoryview | np.ndarray  # an encoded block: read from a file, or a uint8 array

KEY_BYTES = 16
_MAGIC = b"FLKVB002"
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


@dataclass(frozen=True, slots=True)
class Block:
    """One page's KV on every rank: ``kv[r]`` is rank r's ``(2 * num_layers, page_size, kv_heads, head_dim)``
    (every layer's k, then every layer's v) in the pool's storage dtype; ``scales[r]`` likewise
    ``(2 * num_layers, page_size, kv_heads)`` bfloat16 for quantized KV, else None."""

    kv: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...] | None
    kv_dtype: str
    dtype: str


def page_block(payloads: RankPayloads, page: int) -> Block:
    """Page ``page`` of ``payloads`` as a block (for one page: ``blocks_of`` copies them all)."""
    first = payloads[0]
    kv = tuple(torch.stack([t[page] for t in (*p.k, *p.v)]) for p in payloads)
    scales = None
    if first.k_scales is not None:
        scales = tuple(torch.stack([t[page] for t in (*(p.k_scales or ()), *(p.v_scales or ()))]) for p in payloads)
    return Block(kv, scales, first.kv_dtype, first.dtype)


def payloads_of(blocks: Sequence[Block]) -> RankPayloads:
    """The pages of ``blocks`` in order, one payload per rank (what a pool's ``write_pages`` takes)."""
    assert blocks
    first = blocks[0]
    out = []
    for r in range(len(first.kv)):
        kv = torch.stack([b.kv[r] for b in blocks])  # (pages, 2L, ...)
        layers = kv.shape[1] // 2
        k_scales = v_scales = None
        if first.scales is not None:
            sc = torch.stack([b.scales[r] for b in blocks if b.scales is not None])
            k_scales = tuple(sc[:, i] for i in range(layers))
            v_scales = tuple(sc[:, layers + i] for i in range(layers))
        out.append(KVPayload(
            k=tuple(kv[:, i] for i in range(layers)), v=tuple(kv[:, layers + i] for i in range(layers)),
            k_scales=k_scales, v_scales=v_scales, kv_dtype=first.kv_dtype, dtype=first.dtype,
        ))  # fmt: skip
    return tuple(out)


def slice_pages(payloads: RankPayloads, start: int, stop: int) -> RankPayloads:
    """Pages ``[start, stop)`` of every rank's payload (views)."""
    return tuple(
        KVPayload(
            k=tuple(t[start:stop] for t in p.k), v=tuple(t[start:stop] for t in p.v),
            k_scales=None if p.k_scales is None else tuple(t[start:stop] for t in p.k_scales),
            v_scales=None if p.v_scales is None else tuple(t[start:stop] for t in p.v_scales),
            kv_dtype=p.kv_dtype, dtype=p.dtype,
        )
        for p in payloads
    )  # fmt: skip


def encode_pages(keys: Sequence[BlockKey], layout: KVLayout, payloads: RankPayloads) -> list[np.ndarray]:
    """Each page of ``payloads`` encoded as ``keys``' block, copied once: from each layer's page into it.

    The tiers keep blocks encoded (host memory too), so the array a save makes is the one host memory
    holds, that spills to disk and that goes to the cluster store. Arrays rather than ``bytes``: their
    copies run without the GIL (so does the CRC), which the engine's step thread needs meanwhile, and
    Ray moves them without pickling their bytes.
    """
    first = payloads[0]
    assert first.num_pages == len(keys), (first.num_pages, len(keys))
    per_rank = [(*p.k, *p.v, *(p.k_scales or ()), *(p.v_scales or ())) for p in payloads]
    meta = _meta(layout)
    return [_encode(key, meta, [t[i] for tensors in per_rank for t in tensors]) for i, key in enumerate(keys)]


def _meta(layout: KVLayout) -> bytes:
    return json.dumps(asdict(layout), sort_keys=True).encode()


def _encode(key: BlockKey, meta: bytes, tensors: list[torch.Tensor]) -> np.ndarray:
    assert len(key) == KEY_BYTES
    parts = [_raw(t) for t in tensors]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    head = _HEADER.pack(_MAGIC, key, len(meta), crc) + meta
    out = np.empty(len(head) + sum(len(p) for p in parts), dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = len(head)
    for part in parts:
        out[pos : pos + len(part)] = np.frombuffer(part, dtype=np.uint8)
        pos += len(part)
    return out


def decode_block(data: BlockBytes, key: BlockKey, layout: KVLayout, world_size: int) -> Block | None:
    """The block in ``data`` if it is whole and is ``key``'s block for ``layout``; else None (a miss)."""
    data = memoryview(data.data if isinstance(data, np.ndarray) else data).cast("B")
    if len(data) < _HEADER.size:
        return None
    magic, stored_key, meta_len, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC or stored_key != key:
        return None
    start = _HEADER.size + meta_len
    try:
        if json.loads(bytes(data[_HEADER.size : start])) != asdict(layout):
            return None
    except ValueError:
        return None
    body = memoryview(data)[start:]
    storage = getattr(torch, layout.storage_dtype)
    kv_shape = (2 * layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim)
    kv_bytes = _numel(kv_shape) * torch.tensor([], dtype=storage).element_size()
    quantized = layout.kv_dtype != "auto"
    sc_shape = kv_shape[:3]
    sc_bytes = _numel(sc_shape) * 2 if quantized else 0
    if len(body) != world_size * (kv_bytes + sc_bytes) or zlib.crc32(body) != crc:
        return None
    kv, scales = [], []
    pos = 0
    for _ in range(world_size):
        kv.append(_tensor(body[pos : pos + kv_bytes], storage, kv_shape))
        pos += kv_bytes
        if quantized:
            scales.append(_tensor(body[pos : pos + sc_bytes], SCALE_DTYPE, sc_shape))
            pos += sc_bytes
    return Block(tuple(kv), tuple(scales) if quantized else None, layout.kv_dtype, layout.dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _raw(t: torch.Tensor) -> memoryview:
    array: np.ndarray = t.contiguous().view(INT_OF_WIDTH[t.element_size()]).numpy()
    return memoryview(array.data).cast("B")


def _tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    width = torch.tensor([], dtype=dtype).element_size()
    with warnings.catch_warnings():
        # Bytes are read-only; a block's tensors are only ever read (payloads_of stacks them into new memory).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buf, dtype=INT_OF_WIDTH[width])
    return flat.view(dtype).view(shape)
