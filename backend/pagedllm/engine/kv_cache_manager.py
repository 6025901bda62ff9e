"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, forking, freeing.

A request's KV grows block by block as its computed tokens grow: nothing is reserved up front.

Forking (parallel samples, beams): a fork takes references on its parent's blocks instead of copying them.
Blocks are written only at positions at or after a sequence's computed tokens, so only a shared block that is
about to be written needs a private copy: `allocate_slots` gives the writer a fresh block and records
(source, destination) in `block_copies`, which the next step's runners carry out before the forward pass.
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
        self.block_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pairs the next step applies
        self.has_forks = False  # until a first fork no block can need a copy (the hot path skips the check)
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
        held = self.req_blocks.get(request.request_id, ())
        have = len(held) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        new = max(0, cdiv(total, self.block_size) - have)
        # Prefix hits that sit in the free queue leave it when touched, so they count against it too.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return new + revived + len(self._shared_written(held, request.num_computed_tokens, total))

    def _shared_written(self, blocks, num_computed: int, total: int) -> list[int]:
        """Indices of held blocks that tokens num_computed..total-1 write into while another sequence shares
        them (a fork's last, partly filled block): each needs a private copy first."""
        if not self.has_forks or total <= num_computed:
            return []
        last = min(len(blocks), cdiv(total, self.block_size))
        return [i for i in range(num_computed // self.block_size, last) if blocks[i].ref_cnt > 1]

    def allocate_slots(self, request: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones. False (and no change) if the
        pool cannot hold them."""
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        for i in self._shared_written(blocks, request.num_computed_tokens, total):  # copy-on-write
            fresh = self.pool.get_new_blocks(1)[0]
            self.block_copies.append((blocks[i].block_id, fresh.block_id))
            self.pool.free_blocks([blocks[i]])  # the other holders keep it
            blocks[i] = fresh
        if new_computed_blocks:
            self.pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
        num_new_blocks = cdiv(total, self.block_size) - len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """`child` shares the blocks holding `parent`'s first `num_tokens` tokens (a reference each, no copy)."""
        blocks = self.req_blocks.get(parent.request_id, [])[:cdiv(num_tokens, self.block_size)]
        self.has_forks = True
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self.num_indexed[child.request_id] = min(self.num_indexed.get(parent.request_id, 0), len(blocks))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs recorded since the last call, in order (the step that writes applies them)."""
        copies, self.block_copies = self.block_copies, []
        return copies

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

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

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
