"""Attention backends: each stores new K/V into the paged cache and attends over it through block tables."""
