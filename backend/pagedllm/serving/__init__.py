"""Adapters that put the engine behind a server (Triton's Python backend)."""
