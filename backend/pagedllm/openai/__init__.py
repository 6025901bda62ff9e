"""An OpenAI-compatible HTTP front end (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`).

It imports nothing of the engine: every request goes over the wire to Triton, one gRPC bidirectional stream per
HTTP request, so Triton stays the transport and lifecycle owner and this process holds no model state.
`pagedllm openai --triton-url HOST:PORT` runs it against any Triton; `pagedllm serve` starts it beside Triton.
"""
