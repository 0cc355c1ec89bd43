"""Paged KV block pool with reference counts and prefix caching (vLLM v1 KVCacheManager).

Every block has a ref count; blocks with ref count 0 are free.  A full block whose
tokens were computed is registered under a chained sha256 hash of (parent hash,
block token ids, extra keys: cache_salt on the first block, the LoRA adapter), so
a collision cannot share KV across tenants.  A freed block keeps its hash until it
is handed out again, so a later prompt with the same prefix can pick it up ("cached
but free") instead of recomputing.  Allocation takes blocks holding no cached
content first (the most recently freed of them first), then evicts the least
recently freed cached block.

State lives in flat arrays sized once (a GPU cache can have millions of blocks):
ref counts and hashes per block, a stack of free blocks without cached content, and
the free cached blocks in an intrusive doubly linked list over two int32 arrays
(vLLM's FreeKVCacheBlockQueue), so initialisation allocates a few arrays, a fully
cached pool costs no Python object per block beyond its hash, and every operation
costs O(blocks touched).

KV events (for the broker's cache-aware dispatch): routing keys of base-model blocks
entering the cache (stored) and of their content being evicted (removed), or a reset
(cleared).  ``drain_kv_events()`` hands over the changes since the last drain or
snapshot, netted per key so that ``stored`` and ``removed`` never share a key and their
order of application does not matter; past ``_kv_limit`` pending changes (nobody
drains) they collapse into a flag, and the next drain is a snapshot of the cache.  Blocks
hashed with a LoRA adapter are worker-local and never published; a per-block flag
remembers which blocks were, so only those are ever reported removed.  Blocks holding
image tokens fold in the images' cache keys (multimodal/images.py), which the gateway knows
too: they are published like any other.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq


import numpy as np

from common.prefix_hash import ROUTING_HASH_BYTES, BlockHash, fold_mm_hashes, hash_block
from common.protocol import KvBlockTokens, KvEvents
from worker.engine.records import EngineSequence

_MAX_BLOCKS = 2**31 - 1  # block ids and links are int32; one index is the list's sentinel
KV_EVENTS_MAX_PENDING = 1 << 16  # undrained KV event keys kept at most (then: a snapshot)


class _LRUList:
    """Doubly linked list of block ids threaded through two int32 arrays (``prev``
    and ``next`` indexed by block id; index ``capacity`` is the sentinel), oldest
    first.  O(1) append, remove and pop; only members' links are meaningful, so the
    arrays need no initialisation (np.empty of millions of entries is immediate)."""

    __slots__ = ("_prev", "_next", "_sentinel", "_len")

    def __init__(self, capacity: int):
        self._prev = np.empty(capacity + 1, dtype=np.int32)
        self._next = np.empty(capacity + 1, dtype=np.int32)
        self._sentinel = capacity
        self._prev[capacity] = self._next[capacity] = capacity
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, block_id: int) -> None:
        prev, nxt, s = self._prev, self._next, self._sentinel
        tail = prev[s]
        nxt[tail] = block_id
        prev[block_id] = tail
        nxt[block_id] = s
        prev[s] = block_id
        self._len += 1

    def remove(self, block_id: int) -> None:
        prev, nxt = self._prev, self._next
        p, n = prev[block_id], nxt[block_id]
        nxt[p] = n
        prev[n] = p
        self._len -= 1

    def pop_oldest(self) -> int:
        if not self._len:
            raise IndexError("pop from an empty block list")
        block_id = int(self._next[self._sentinel])
        self.remove(block_id)
        return block_id

    def __iter__(self):
        """Members oldest first (for tests and debugging; O(len))."""
        b = int(self._next[self._sentinel])
        while b != self._sentinel:
            yield b
            b = int(self._next[b])


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        if num_blocks >= _MAX_BLOCKS:
            raise ValueError(f"at most {_MAX_BLOCKS - 1} KV cache blocks are supported, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[Optional[BlockHash]] = [None] * num_blocks
        # Free blocks without cached content: a stack whose top is handed out next
        # (block 0 first at start, then the most recently freed).
        self._uncached = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._num_uncached = num_blocks
        self._free_cached = _LRUList(num_blocks)  # least recently freed first
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        # Prefix-cache statistics (tokens), for metrics.
        self.query_tokens = 0
        self.hit_tokens = 0
        # KV events: which blocks' keys were published (stored and not since removed),
        # and the changes not drained yet (routing key -> stored; netted per key).
        self._published = np.zeros(num_blocks, dtype=bool)
        self._kv_pending: dict[bytes, bool] = {}
        # Pending stored keys an outside router can match by tokens: key -> (parent key, tokens).
        self._kv_tokens: dict[bytes, tuple[Optional[bytes], bytes]] = {}
        self._kv_cleared = False
        self._kv_overflow = False  # too many pending changes: the next drain is a snapshot
        # At most this many pending changes (memory stays small when nobody drains; a
        # step's changes are far fewer): past it the next drain is a snapshot.
        self._kv_limit = min(4 * num_blocks, KV_EVENTS_MAX_PENDING)

    # --- accounting ------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_uncached + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- hashing ---------------------------------------------------------
    def _update_hashes(self, seq: EngineSequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        tokens = seq.token_ids
        adapter = getattr(seq.request, "lora_key", None)
        mm = getattr(seq.request, "mm", None)
        # Image requests: the cache keys of the items overlapping each block (by block index).
        mm_keys = mm.block_keys(bs) if mm is not None else None
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else None
            extra = seq.request.cache_salt if i == 0 else None
            h = hash_block(parent, tokens[i * bs:(i + 1) * bs], extra, adapter)
            if mm_keys:
                images = mm_keys.get(i)
                if images:
                    h = fold_mm_hashes(h, images)
            hashes.append(h)

    def _publishes(self, seq: EngineSequence, block_index: int) -> bool:
        """Whether a block's hash goes out as a KV event: not for adapter blocks
        (worker-local keys)."""
        return getattr(seq.request, "lora_key", None) is None

    # --- prefix cache lookup --------------------------------------------
    def find_cached_prefix(self, seq: EngineSequence) -> list[int]:
        """Block ids of the longest cached prefix of a sequence that has nothing computed.

        The last token is always recomputed (its logits are needed), and requests
        asking for prompt scores read nothing from the cache.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.request.wants_prompt_scores:
            return []
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- allocation ------------------------------------------------------
    def can_allocate(self, seq: EngineSequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        return self.num_blocks_to_take(seq, num_new_tokens, cached_blocks) <= self.num_free_blocks

    def num_blocks_to_take(self, seq: EngineSequence, num_new_tokens: int, cached_blocks: Seq[int]) -> int:
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(total) - len(seq.block_ids) - len(cached_blocks)
        # Cached hits that are currently free also leave the free queue.
        revived = sum(1 for b in cached_blocks if self._ref[b] == 0)
        return max(fresh, 0) + revived

    def allocate_slots(self, seq: EngineSequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after its computed ones,
        first adopting ``cached_blocks`` (a prefix-cache hit).  All or nothing."""
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        bs = self.block_size
        if cached_blocks:
            for block_id in cached_blocks:
                self._take(block_id)
            seq.block_ids.extend(cached_blocks)
            seq.num_computed_tokens += len(cached_blocks) * bs
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_ids)):
            seq.block_ids.append(self._pop_free())
        return True

    def _take(self, block_id: int) -> None:
        """One more reference to a prefix-cache hit (revived from the free list if free)."""
        if self._ref[block_id] == 0:
            self._free_cached.remove(block_id)
        self._ref[block_id] += 1

    def _pop_free(self) -> int:
        if self._num_uncached:
            self._num_uncached -= 1
            block_id = int(self._uncached[self._num_uncached])
        else:
            block_id = self._free_cached.pop_oldest()
            h = self._hash[block_id]  # evict its cached content
            if self._cached.get(h) == block_id:
                del self._cached[h]
            self._hash[block_id] = None
            if self._published[block_id]:
                self._published[block_id] = False
                self._kv_event(h, False)
        self._ref[block_id] = 1
        return block_id

    def fork(self, parent: EngineSequence, child: EngineSequence) -> None:
        """Let a sibling choice share the parent's full prompt blocks.

        The child recomputes the partial last prompt block (< block_size tokens)
        into its own blocks, which is cheaper than a copy-on-write machinery.
        """
        num_full = min(parent.num_prompt_tokens, parent.num_computed_tokens) // self.block_size
        shared = parent.block_ids[:num_full]
        for block_id in shared:
            self._take(block_id)
        child.block_ids = list(shared)
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_computed_tokens = num_full * self.block_size

    def register_computed_blocks(self, seq: EngineSequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_ids[i]
            h = seq.block_hashes[i]
            if self._hash[block_id] is None and h not in self._cached:
                self._cache_block(block_id, seq, i)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: EngineSequence) -> None:
        """Drop the sequence's references; unreferenced blocks join the free queue.

        Tail blocks are queued first so that, of one sequence, the shared-prefix
        blocks (most reusable) are evicted last; blocks without cached content are
        reused before any cached block.
        """
        self.release_blocks(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # --- KV transfer (prefill/decode disaggregation, worker/engine/disagg/kv_transfer.py) ----
    def hold_blocks(self, block_ids: Seq[int]) -> None:
        """One more reference to blocks a sequence holds (a finished prefill leg's
        blocks outlive it until the decode side pulled them)."""
        for block_id in block_ids:
            self._take(block_id)

    def release_blocks(self, block_ids: Seq[int]) -> None:
        """Drop one reference per block, the last ones first (see ``free``)."""
        ref = self._ref
        for block_id in reversed(block_ids):
            ref[block_id] -= 1
            if ref[block_id] == 0:
                if self._hash[block_id] is None:
                    self._uncached[self._num_uncached] = block_id
                    self._num_uncached += 1
                else:
                    self._free_cached.append(block_id)

    def import_blocks(self, seq: EngineSequence, count: int) -> list[tuple[int, int]]:
        """Cache entries for the first ``count`` full blocks of ``seq``'s tokens (K/V
        pulled from another worker): (block index, block id) of each block taken for
        one not cached yet, registered under its hash and referenced once -- the
        caller writes the K/V, then ``release_blocks`` them (they stay cached)."""
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return []
        self._update_hashes(seq)
        count = min(count, (seq.num_tokens - 1) // self.block_size, len(seq.block_hashes))
        out: list[tuple[int, int]] = []
        for i in range(count):
            h = seq.block_hashes[i]
            if h in self._cached:
                continue
            if not self.num_free_blocks:
                break
            block_id = self._pop_free()
            self._cache_block(block_id, seq, i)
            out.append((i, block_id))
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (after a weight change their K/V is stale).

        Free cached blocks become plain free blocks; blocks still held keep their
        data for their sequences but are no longer found by new ones.  Returns the
        number of blocks that were cached."""
        dropped = len(self._cached)
        while len(self._free_cached):
            block_id = self._free_cached.pop_oldest()
            self._uncached[self._num_uncached] = block_id
            self._num_uncached += 1
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        self._published[:] = False
        if self.enable_prefix_caching:
            self._kv_pending.clear()  # whatever was reported before is gone with the rest
            self._kv_tokens.clear()
            self._kv_overflow = False
            self._kv_cleared = True
        return dropped

    # --- KV events -------------------------------------------------------
    def _cache_block(self, block_id: int, seq: EngineSequence, i: int) -> None:
        """Block ``block_id`` now holds ``seq``'s block ``i``: it joins the prefix cache
        under that block's hash, and is announced (KV event, its tokens) if it may be."""
        h = seq.block_hashes[i]
        self._hash[block_id] = h
        self._cached[h] = block_id
        if self._publishes(seq, i):
            self._published[block_id] = True
            self._kv_event(h, True)
            self._kv_block_tokens(seq, i)

    def _kv_event(self, block_hash: BlockHash, stored: bool) -> None:
        if self._kv_overflow:
            return
        pending = self._kv_pending
        key = block_hash[:ROUTING_HASH_BYTES]
        pending[key] = stored  # the latest change of a key wins
        if not stored:
            self._kv_tokens.pop(key, None)
        if len(pending) > self._kv_limit:  # bounded: report the whole state instead
            pending.clear()
            self._kv_tokens.clear()
            self._kv_overflow = True

    def _kv_block_tokens(self, seq: EngineSequence, i: int) -> None:
        """Remember block ``i``'s parent key and tokens for the stored event just queued,
        when an outside router can match it by token ids alone: a salted chain (tenant
        isolation) or one holding an image has keys no token-only router can compute."""
        if self._kv_overflow or seq.request.cache_salt is not None or getattr(seq.request, "mm", None) is not None:
            return
        bs, n = self.block_size, ROUTING_HASH_BYTES
        parent = seq.block_hashes[i - 1][:n] if i else None
        tokens = np.asarray(seq.token_ids[i * bs:(i + 1) * bs], dtype="<i4").tobytes()
        self._kv_tokens[seq.block_hashes[i][:n]] = (parent, tokens)

    def drain_kv_events(self) -> Optional[KvEvents]:
        """The prefix-cache changes since the last drain or snapshot (None: none).
        ``stored`` and ``removed`` are disjoint; ``cleared`` comes first."""
        if self._kv_overflow:
            return self.snapshot_kv_events()
        pending = self._kv_pending
        if not pending and not self._kv_cleared:
            return None
        stored = [k for k, s in pending.items() if s]
        removed = [k for k, s in pending.items() if not s]
        known = self._kv_tokens
        tokens = [KvBlockTokens(k, *known[k]) for k in stored if k in known]
        events = KvEvents(stored=stored, removed=removed, cleared=self._kv_cleared, tokens=tokens)
        self._kv_pending = {}
        self._kv_tokens = {}
        self._kv_cleared = False
        return events

    def snapshot_kv_events(self) -> KvEvents:
        """Every published key now cached, as ``cleared`` + ``stored`` (for a
        (re)registration); pending changes are dropped (the snapshot includes them).
        O(cached blocks)."""
        self._kv_pending = {}
        self._kv_tokens = {}  # a snapshot names keys only: the block manager keeps no token ids
        self._kv_cleared = self._kv_overflow = False
        cached = self._cached
        if not cached:
            return KvEvents(cleared=True)
        ids = np.fromiter(cached.values(), dtype=np.int64, count=len(cached))
        flags = self._published[ids].tolist()
        n = ROUTING_HASH_BYTES
        return KvEvents(stored=[h[:n] for h, f in zip(cached, flags) if f], cleared=True)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens
