"""The engine core: requests, KV blocks, scheduling, model execution and sampling."""
