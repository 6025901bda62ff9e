"""Content hashes of full KV blocks, chained through the parent block's hash.

A block's hash covers its parent's hash, its own token ids and extra keys (anything else that changes the KV,
e.g. a LoRA id), so equal hashes mean equal prefixes. SHA-256 makes an accidental collision practically
impossible, and the pool also compares the block's own token ids on every hit (block_pool.py).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple


class BlockHash(NamedTuple):
    digest: bytes
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids, extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256(parent.digest if parent is not None else b"root")
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest(), tuple(token_ids))
