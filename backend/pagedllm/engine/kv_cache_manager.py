"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing.

A request's KV grows block by block as its computed tokens grow: nothing is reserved up front.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.engine.block_pool import BlockPool, KVCacheBlock
from pagedllm.engine.kv_sizing import cdiv
from pagedllm.engine.request import Request


class Sequence(Protocol):
    """What allocation needs of a sequence: a Request, or a draft model's copy of one."""

    request_id: str
    num_computed_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_indexed: dict[str, int] = {}  # per request: leading blocks already offered to the cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached

    # --- prefix cache -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request (a pure lookup, no refs taken).

        At least the last token is always left to compute, so the step that finishes the prefill has logits.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (lookups of requests that stay queued are not counted)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # --- allocation ---------------------------------------------------------------------
    def can_allocate(self, request: Sequence, num_new_tokens: int,
                     new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, new_computed_blocks) <= \
            self.pool.num_free_blocks

    def _num_blocks_needed(self, request, num_new_tokens, new_computed_blocks) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        new = max(0, cdiv(total, self.block_size) - have)
        # Prefix hits that sit in the free queue leave it when touched, so they count against it too.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return new + revived

    def allocate_slots(self, request: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones. False (and no change) if the
        pool cannot hold them."""
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full of computed KV. Only computed blocks are indexed, so a
        prefix hit can never see a block whose KV was scheduled but not written (e.g. its owner was preempted)."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(request.request_id, ())
        done = self.num_indexed.get(request.request_id, 0)
        # A stop inside an accepted speculative run can leave fewer known tokens than computed ones.
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(done, full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_indexed[request.request_id] = max(done, full)

    def free(self, request: Sequence) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_indexed.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))  # tail first: evicted before the shared head

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def stats(self) -> dict:
        """The EngineStats fields this manager owns."""
        return {"num_blocks_total": self.num_usable_blocks, "num_blocks_free": self.num_free_blocks,
                "kv_cache_usage": self.pool.usage(), "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits}

    def all_free(self) -> bool:
        return not self.req_blocks and self.pool.num_free_blocks == self.pool.num_usable_blocks
