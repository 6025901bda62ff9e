"""What the CPU paged-attention kernel tests share about their caches."""


def poison_outside_rows(k_cache, v_cache, tables, lens, block_size: int) -> None:
    """NaN (caches in the plain layout) in every block no row owns (the padding block 0 among them) and in each
    row's last block past its length (bf16: also an odd last token's pair mate)."""
    owned = {int(b) for i, n in enumerate(lens) for b in tables[i, :-(-int(n) // block_size)]}
    for b in range(k_cache.shape[0]):
        if b not in owned:
            k_cache[b], v_cache[b] = float("nan"), float("nan")
    for i, n in enumerate(lens.tolist()):
        last, used = int(tables[i, (n - 1) // block_size]), (n - 1) % block_size + 1
        k_cache[last, used:], v_cache[last, used:] = float("nan"), float("nan")

