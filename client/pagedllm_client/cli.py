"""`pagedllm-client generate "prompt" [--stream] [--max-tokens N] ...`: prints tokens as they arrive."""

from __future__ import annotations

import argparse
import sys

from pagedllm_client.client import PagedLLMClient, ServerError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm-client")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for a prompt")
    g.add_argument("prompt")
    g.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    g.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    g.add_argument("--model", default="pagedllm")
    g.add_argument("--stream", action="store_true", help="print pieces as they arrive")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    args = p.parse_args(argv)
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    client = PagedLLMClient(url, args.protocol, args.model)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.seed, "stop": args.stop}
    try:
        if args.stream:
            for piece in client.stream(args.prompt, **sampling):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            print(client.generate(args.prompt, stream=args.protocol == "grpc", **sampling).text)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
