"""Chained block hashes of token prefixes: the prefix cache's keys (worker/engine/core/block_manager.py)
and, cut to ``ROUTING_HASH_BYTES``, the keys the broker's cache-aware dispatch matches
against the KV events workers publish.

Block i's hash covers (parent hash, its ``block_size`` token ids, extra keys), so equal
hashes mean equal prefixes (vLLM's ``--prefix-caching-hash-algo sha256``).  The cache
salt keys the first block only, which separates tenants for the whole chain.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

import numpy as np

BlockHash = bytes  # 32-byte sha256 digest
ROOT_HASH: BlockHash = hashlib.sha256(b"tokserve-kv-root").digest()
# What routing keeps of a hash: 8 bytes make an accidental match across a worker's
# cache (~1e5 blocks) vanishingly rare, and a false match only costs a cache miss.
ROUTING_HASH_BYTES = 8


def _text_key(value: Optional[str]) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<Q", len(raw)) + raw  # length-prefixed: no two keys serialise alike


def hash_block(parent_hash: Optional[BlockHash], token_ids: Sequence[int], extra: Optional[str] = None,
               adapter: Optional[str] = None) -> BlockHash:
    """sha256 of the parent's hash, the block's token ids (int64 little-endian) and
    its extra keys."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(_text_key(extra))
    h.update(_text_key(adapter))
    return h.digest()


def fold_mm_hashes(block_hash: BlockHash, mm_keys: Sequence[str]) -> BlockHash:
    """A block hash with the cache keys of the images in the block folded in: the same
    placeholder tokens behind different images never share KV (nor a routing key)."""
    h = hashlib.sha256(b"tokserve-kv-mm")
    h.update(block_hash)
    for m in mm_keys:
        raw = m.encode("utf-8")
        h.update(struct.pack("<Q", len(raw)) + raw)
    return h.digest()


def routing_key(block_hash: BlockHash) -> bytes:
    return block_hash[:ROUTING_HASH_BYTES]


def prompt_routing_hashes(token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None,
                          max_blocks: int = 4096, mm_spans: Sequence[tuple[int, int, str]] = ()) -> list[bytes]:
    """Routing keys of the prompt's blocks a worker could serve from its cache: full
    blocks only, never the one holding the last token (it is always recomputed).
    ``mm_spans``: (offset, length, cache key) of each image's placeholder run, in prompt
    order; a block overlapping images has their keys folded in, as the workers do."""
    n = min((len(token_ids) - 1) // block_size, max_blocks) if token_ids else 0
    tokens = np.asarray(token_ids[:n * block_size], dtype="<i8")
    out, parent = [], None
    for i in range(n):
        start, end = i * block_size, (i + 1) * block_size
        parent = hash_block(parent, tokens[start:end], cache_salt if i == 0 else None)
        keys = [key for offset, length, key in mm_spans if offset < end and offset + length > start]
        if keys:
            parent = fold_mm_hashes(parent, keys)
        out.append(parent[:ROUTING_HASH_BYTES])
    return out
