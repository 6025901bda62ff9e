"""Load-test a real pagedllm server with the tools users bring: perf_analyzer (gRPC streaming), genai-perf
(`--backend vllm` and `--backend tensorrtllm` converters) and locust (SSE and gRPC users). Starts its own
server on free loopback ports (or uses --grpc-url/--http-url), runs the tool, stops.

    .venv/bin/python perf/load_tools.py perf_analyzer [--concurrency 1,4,16]
    .venv/bin/python perf/load_tools.py locust [--users 16 --seconds 30]
    .venv/bin/python perf/load_tools.py genai-perf [--backend vllm|tensorrtllm]
    .venv/bin/python perf/load_tools.py genai-perf --endpoint-type chat   # through the OpenAI front end
Installs what each tool needs on first use (apt libb64-0d and pip nvidia-cuda-runtime-cu12 for
perf_analyzer; locust and genai-perf each into a venv of its own under .cache/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import OUT_DIR, model_dir
from pagedllm.net import free_port
from pagedllm.serving import launcher

VENV = Path(sys.executable).parent
ENGINE = {"dtype": "bfloat16", "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30, "max_num_seqs": 64}
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def pip(*pkgs: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pkgs], check=True)


def ensure_perf_analyzer() -> dict:
    if subprocess.run(["dpkg", "-s", "libb64-0d"], capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "libb64-0d"], check=True)
    lib = VENV.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / \
        "nvidia" / "cuda_runtime" / "lib"
    if not (lib / "libcudart.so.12").exists():
        pip("nvidia-cuda-runtime-cu12")
    return {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def run_perf_analyzer(grpc_url: str, args) -> None:
    env = ensure_perf_analyzer()
    data = {"data": [{"text_input": [PROMPT], "stream": [True], "exclude_input_in_output": [True],
                      "sampling_parameters": [json.dumps({"max_tokens": str(args.max_tokens), "ignore_eos": "true"})]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    for c in args.concurrency.split(","):
        out = subprocess.run([str(VENV / "perf_analyzer"), "-m", "pagedllm", "-i", "grpc", "--streaming",
                              "-u", grpc_url, "--input-data", f.name, f"--concurrency-range={c}",
                              "--measurement-interval=8000", "--stability-percentage=50", "--max-trials=3"],
                             env=env, capture_output=True, text=True, timeout=600)
        summary = [line.strip() for line in out.stdout.splitlines() if "Concurrency:" in line]
        print(json.dumps({"tool": "perf_analyzer", "concurrency": int(c), "max_tokens": args.max_tokens,
                          "returncode": out.returncode, "summary": summary or out.stdout[-800:] + out.stderr[-800:]}),
              flush=True)


GENAI_PERF_VENV = Path(__file__).resolve().parents[1] / ".cache" / "genai-perf-venv"


def ensure_genai_perf() -> Path:
    """genai-perf in a venv of its own (its pandas/plotly stack stays out of the engine's venv)."""
    bin_dir = GENAI_PERF_VENV / "bin"
    if not (bin_dir / "genai-perf").exists():
        subprocess.run(["/usr/bin/python3.11", "-m", "venv", str(GENAI_PERF_VENV)], check=True)
        subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "genai-perf==0.0.16"], check=True)
    return bin_dir


def run_genai_perf(grpc_url: str, args) -> None:
    bin_dir = ensure_genai_perf()
    tokenizer = model_dir("llama", args.size, "bfloat16")
    env = {**ensure_perf_analyzer(), "HF_HUB_OFFLINE": "1",
           "PATH": f"{VENV}:{bin_dir}:{os.environ.get('PATH', '')}"}  # genai-perf calls perf_analyzer
    cmd = [str(bin_dir / "genai-perf"), "profile", "-m", "pagedllm", "--backend",
           args.backend, "--tokenizer", tokenizer, "--streaming", "-u", grpc_url, "--concurrency",
           args.concurrency.split(",")[-1], "--synthetic-input-tokens-mean", "128", "--output-tokens-mean",
           str(args.max_tokens), "--measurement-interval", "8000", "--artifact-dir",
           os.path.join(OUT_DIR, f"genai-perf-{args.backend}")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(out.stdout[-4000:], out.stderr[-2000:], flush=True)


def run_genai_perf_chat(openai_url: str, model: str, args) -> None:
    """genai-perf's OpenAI chat endpoint type against our OpenAI front end, serving the default chat model: its
    tokenizer (from the GGUF metadata) is saved as an HF directory for genai-perf to count tokens with."""
    from pagedllm.models.checkpoint import load_tokenizer

    bin_dir = ensure_genai_perf()
    tokenizer = os.path.join(OUT_DIR, "models", "smollm2-tokenizer")
    if not os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        load_tokenizer(model).save_pretrained(tokenizer)
    env = {**ensure_perf_analyzer(), "HF_HUB_OFFLINE": "1",
           "PATH": f"{VENV}:{bin_dir}:{os.environ.get('PATH', '')}"}
    for concurrency in args.concurrency.split(","):
        cmd = [str(bin_dir / "genai-perf"), "profile", "-m", "pagedllm", "--endpoint-type", "chat", "--streaming",
               "-u", openai_url, "--tokenizer", tokenizer, "--concurrency", concurrency,
               "--synthetic-input-tokens-mean", "128", "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(args.max_tokens), "--extra-inputs", "ignore_eos:true",
               "--extra-inputs", f"max_tokens:{args.max_tokens}", "--measurement-interval", "15000",
               "--artifact-dir", os.path.join(OUT_DIR, f"genai-perf-chat-c{concurrency}")]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        print(f"--- genai-perf chat, concurrency {concurrency}\n", out.stdout[-4000:], out.stderr[-2000:],
              flush=True)


LOCUST_VENV = Path(__file__).resolve().parents[1] / ".cache" / "locust-venv"


def ensure_locust() -> Path:
    """locust in a venv of its own: it needs a newer geventhttpclient than tritonclient's HTTP client pins."""
    bin_dir = LOCUST_VENV / "bin"
    if not (bin_dir / "locust").exists():
        subprocess.run(["/usr/bin/python3.11", "-m", "venv", str(LOCUST_VENV)], check=True)
        subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "locust",
                        "tritonclient[grpc]==2.51.0", "numpy<2"], check=True)
    return bin_dir


def run_locust(http_url: str, grpc_url: str, args) -> None:
    bin_dir = ensure_locust()
    locustfile = Path(__file__).with_name("locustfile.py")
    csv_prefix = os.path.join(OUT_DIR, "locust")
    client_src = str(Path(__file__).resolve().parents[1] / "client")  # the client imports no engine code
    env = {**os.environ, "PAGEDLLM_GRPC_URL": grpc_url, "PAGEDLLM_MAX_TOKENS": str(args.max_tokens),
           "PYTHONPATH": client_src}
    out = subprocess.run([str(bin_dir / "locust"), "-f", str(locustfile), "--headless", "-u", str(args.users),
                          "-r", str(args.users), "-t", f"{args.seconds}s", "--host", f"http://{http_url}",
                          "--csv", csv_prefix, "--only-summary"], env=env, capture_output=True, text=True,
                         timeout=args.seconds + 120)
    print(out.stdout[-3000:], out.stderr[-3000:], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tool", choices=["perf_analyzer", "genai-perf", "locust"])
    ap.add_argument("--size", default="small")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--backend", default="vllm", choices=["vllm", "tensorrtllm"])
    ap.add_argument("--endpoint-type", default="kserve", choices=["kserve", "chat"],
                    help="genai-perf: Triton's gRPC (kserve, a tiny random model) or the OpenAI chat endpoint "
                         "(the default model, SmolLM2-135M-Instruct)")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=30)
    args = ap.parse_args()
    os.makedirs(OUT_DIR, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pagedllm-load-"))
    chat = args.tool == "genai-perf" and args.endpoint_type == "chat"
    model = str(launcher.default_model()) if chat else model_dir("llama", args.size, "bfloat16")
    channel = launcher.engine_channel_path(work) if chat else None  # the front end over it, as serve runs it
    server = launcher.launch_on_free_ports(work, model, {**ENGINE, "openai_channel": channel})
    frontend = None
    try:
        http, grpc = f"127.0.0.1:{server.http_port}", f"127.0.0.1:{server.grpc_port}"
        if chat:
            port = free_port()
            frontend = launcher.start_openai_frontend("127.0.0.1", port, http, drain_timeout=10,
                                                      engine_channel=channel)
            launcher.wait_openai_ready(f"http://127.0.0.1:{port}", frontend)
            run_genai_perf_chat(f"127.0.0.1:{port}", model, args)
        elif args.tool == "perf_analyzer":
            run_perf_analyzer(grpc, args)
        elif args.tool == "genai-perf":
            run_genai_perf(grpc, args)
        else:
            run_locust(http, grpc, args)
    finally:
        launcher.stop_process(frontend)
        launcher.stop_server(server.proc)


if __name__ == "__main__":
    main()
