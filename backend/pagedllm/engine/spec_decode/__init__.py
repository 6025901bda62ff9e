"""Speculative decoding: proposers of draft tokens behind one protocol (proposer.py), and their verification
against the target model (verifier.py)."""
