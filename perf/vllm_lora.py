"""perf/lora.py --with-vllm: runs perf/vllm_lora_peer.py in vLLM's venv with its CPU documentation's setup
(tcmalloc and Intel OpenMP preloaded, threads bound), and returns its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from vllm_env import ensure_vllm, peer_env


def run_vllm_lora(path, prompts, max_tokens, loras, rank, rounds) -> list[dict]:
    py = ensure_vllm()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": path, "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 256, "rank": rank,
                   "max_tokens": max_tokens, "prompts": prompts, "rounds": rounds,
                   "adapters": [(lo.lora_name, lo.lora_path) for lo in loras]}, f)
    out = subprocess.run([str(py), str(Path(__file__).with_name("vllm_lora_peer.py")), f.name], env=peer_env(),
                         capture_output=True, text=True, timeout=3600)
    os.unlink(f.name)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"peer"')]
    if not lines:
        raise RuntimeError(f"vLLM run failed:\n{out.stderr[-3000:]}")
    return lines
