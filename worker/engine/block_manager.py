"""Paged KV block pool with reference counts and prefix caching (vLLM v1 KVCacheManager).

Every block has a ref count; blocks with ref count 0 sit in an LRU free queue.
A full block whose tokens were computed is registered under a chained hash
``hash(parent_hash, block_token_ids, extra_keys)`` (extra keys = cache_salt on the
first block, so salts isolate sharing).  A freed block keeps its hash until it
is handed out again, so a later prompt with the same prefix can pick it up from
the free queue ("cached but free") instead of recomputing; eviction takes the
least recently freed block first, and blocks holding no cached content first of all.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence as Seq

from worker.engine.request import EngineSequence

_ROOT_HASH = hash(("tokserve-kv-root",))


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Optional[int] = None


def hash_block(parent_hash: Optional[int], token_ids: Seq[int], extra: Optional[str] = None) -> int:
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids), extra))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Prefix-cache statistics (tokens), for metrics.
        self.query_tokens = 0
        self.hit_tokens = 0

    # --- accounting ------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- hashing ---------------------------------------------------------
    def _update_hashes(self, seq: EngineSequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        tokens = seq.token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else None
            extra = seq.request.cache_salt if i == 0 else None
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs], extra))

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
        return self.num_blocks_to_take(seq, num_new_tokens, cached_blocks) <= len(self._free)

    def num_blocks_to_take(self, seq: EngineSequence, num_new_tokens: int, cached_blocks: Seq[int]) -> int:
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(total) - len(seq.block_ids) - len(cached_blocks)
        # Cached hits that are currently free also leave the free queue.
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
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
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
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
            block = self.blocks[seq.block_ids[i]]
            h = seq.block_hashes[i]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: EngineSequence) -> None:
        """Drop the sequence's references; unreferenced blocks join the free queue.

        Tail blocks are queued first so that, of one sequence, the shared-prefix
        blocks (most reusable) are evicted last; blocks without cached content go
        to the front, to be reused before any cached block.
        """
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens
