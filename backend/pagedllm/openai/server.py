"""`pagedllm openai`: the front end under uvicorn, against a Triton that is already running.

SIGTERM or SIGINT makes uvicorn stop accepting connections and drain the ones open (streams included) for up
to `--drain-timeout` seconds, then close its HTTP session to Triton; `pagedllm serve` relies on that to stop the
front end before Triton drains.
"""

from __future__ import annotations

import argparse

DEFAULT_PORT = 9000


def add_openai_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--triton-url", required=True, metavar="HOST:HTTPPORT",
                   help="Triton's HTTP address (its generate extension carries the requests)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--model-name", default="pagedllm", help="the Triton model to forward requests to")
    p.add_argument("--engine-channel", default=None, metavar="PATH",
                   help="the model's engine channel (its engine.json `openai_channel`): requests go over it "
                        "instead of Triton's HTTP endpoint (fewer round trips per token)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model-name)")
    p.add_argument("--lora-separator", default="_lora_",
                   help="model <served name><separator><adapter> runs that LoRA adapter ('': adapters not by name)")
    p.add_argument("--drain-timeout", type=int, default=30, metavar="S",
                   help="on SIGTERM/SIGINT, how long open requests may take to finish")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    import uvicorn

    from pagedllm.openai.app import create_app

    app = create_app(args.triton_url, args.model_name, args.served_model_name, args.lora_separator or None,
                     args.engine_channel)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout)
    return 0
