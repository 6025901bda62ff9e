"""Block pool unit tests that pin exact block ids and free-queue order."""

import pytest

from pagedllm.engine.block_hash import hash_block_tokens
from pagedllm.engine.block_pool import BlockPool


def test_null_block_is_reserved_and_order_is_fifo():
    pool = BlockPool(10)
    assert pool.null_block.block_id == 0
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 6
    pool.free_blocks(list(reversed(blocks)))  # a request frees its tail first
    assert pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert pool.num_free_blocks == 9


def test_asking_for_too_many_blocks_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(4)
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_touch_revives_a_free_cached_block_from_the_middle_of_the_queue():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(b, h)
    pool.free_blocks([c, b, a])
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1]
    hit = pool.get_cached_block(h)
    assert hit is b
    pool.touch([hit])
    assert b.ref_cnt == 1
    assert pool.free_queue.block_ids() == [4, 5, 3, 1]
    pool.touch([hit])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and 2 not in pool.free_queue.block_ids()
    pool.free_blocks([b])
    assert pool.free_queue.block_ids() == [4, 5, 3, 1, 2]


def test_popping_a_cached_block_evicts_its_hash_lru_first():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    ha, hb = hash_block_tokens(None, [7]), hash_block_tokens(None, [8])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([a, b, c])  # queue: a(1), b(2), c(3)
    (x,) = pool.get_new_blocks(1)
    assert x is a and a.block_hash is None
    assert pool.get_cached_block(ha) is None
    assert pool.get_cached_block(hb) is b


def test_hash_chain_and_token_check():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    h2 = hash_block_tokens(h1, [5, 6, 7, 8])
    assert h2 != hash_block_tokens(None, [5, 6, 7, 8])  # the parent is part of the hash
    assert h2 == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h1)
    # Same digest but other tokens (a forged collision) must not be served.
    forged = type(h1)(h1.digest, (9, 9, 9, 9))
    assert pool.get_cached_block(forged) is None
    assert pool.get_cached_block(h1) is blk


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_block(blk, h)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and blk.block_hash is None


class _Seq:
    def __init__(self, request_id: str, num_computed_tokens: int = 0) -> None:
        self.request_id, self.num_computed_tokens = request_id, num_computed_tokens


def test_fork_shares_blocks_and_the_first_write_into_a_shared_block_copies_it():
    from pagedllm.engine.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    parent = _Seq("p")
    assert kv.allocate_slots(parent, 10)  # blocks 1, 2, 3: the last holds 2 of its 4 tokens
    parent.num_computed_tokens = 10
    child = _Seq("c", 10)
    kv.fork(parent, child, 10)
    assert kv.block_ids("c") == kv.block_ids("p") == [1, 2, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2] and kv.num_free_blocks == 6
    # The child writes token 10 into shared block 3: it gets block 4, a copy of 3, and nothing else changes.
    assert kv.can_allocate(child, 1) and kv.allocate_slots(child, 1)
    assert kv.block_ids("c") == [1, 2, 4] and kv.take_block_copies() == [(3, 4)]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    # The parent now holds block 3 alone: writing into it copies nothing.
    assert kv.allocate_slots(parent, 1) and kv.block_ids("p") == [1, 2, 3] and kv.take_block_copies() == []
    # A fork at a block boundary shares only full blocks: its next token starts a new block, no copy.
    edge = _Seq("e", 8)
    kv.fork(parent, edge, 8)
    assert kv.allocate_slots(edge, 1) and kv.block_ids("e") == [1, 2, 5] and kv.take_block_copies() == []
    # Room is counted with the copy: with 4 blocks free, 15 more tokens need 4 new blocks plus the copy.
    late = _Seq("l", 10)
    kv.fork(child, late, 10)
    assert kv.num_free_blocks == 4 and not kv.can_allocate(late, 15) and kv.can_allocate(late, 14)
    for seq in (parent, child, edge, late):
        kv.free(seq)
    assert kv.all_free()
