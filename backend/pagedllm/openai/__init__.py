"""An OpenAI-compatible HTTP front end (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`).

It imports nothing of the engine: every request goes over the wire to Triton, one request to its HTTP
`generate_stream` endpoint per OpenAI request, so Triton stays the transport and lifecycle owner and this
process holds no model state. `pagedllm openai --triton-url HOST:HTTPPORT` runs it against any Triton;
`pagedllm serve` starts it beside Triton.
"""
