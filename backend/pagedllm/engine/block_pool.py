"""The physical KV blocks: ref counts, an O(1) LRU free list and the prefix-cache index.

Invariants:
- Block 0 is the null block: never handed out, used to pad block tables.
- A block is in the free queue iff its ref_cnt is 0. A free block may still hold a cached hash; it keeps its
  KV and can be revived by a prefix hit until `get_new_blocks` pops it and evicts the hash.
- The free queue is ordered by eviction priority: the head is evicted first. Freed blocks go to the tail, and
  callers free a request's blocks tail-first, so a request's last blocks are evicted before its first ones.
"""

from __future__ import annotations

from pagedllm.engine.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: popleft, append, remove are O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def block_ids(self) -> list[int]:
        out, b = [], self._head.next_free
        while b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.null_block.ref_cnt = 1  # pinned forever
        self.cached: dict[bytes, KVCacheBlock] = {}  # digest -> block holding that prefix's KV

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # --- prefix cache -------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        block = self.cached.get(block_hash.digest)
        # Compare the tokens too: a digest collision must never serve another prefix's KV.
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash.digest in self.cached:
            return  # an identical block is already indexed; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash.digest] = block

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes. Only allowed when no block is in use (else returns False)."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    # --- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash.digest) is block:
                del self.cached[block.block_hash.digest]
            block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving those that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the free queue's tail in the given order."""
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue.append(block)
