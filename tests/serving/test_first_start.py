"""First start: the C++ CPU kernels are built once per machine, whatever the process. A plain Python process
(an offline run, `pagedllm batch`, the tests) and the Triton server's Python-backend stub load the same built
module in turn, and neither builds it again; the server's log reports the load and the engine's start-up
phases with their times."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_server import start, stop

from pagedllm_kernels.cpu.build import cpu_supported

pytestmark = pytest.mark.server

_LOAD = ("import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
         "from pagedllm_kernels.cpu.build import extension; print(extension().__file__)")


def _load_in_plain_python() -> tuple[str, str]:
    """(the loaded module's path, what the process logged), from a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, check=True, timeout=600)
    return done.stdout.strip().splitlines()[-1], done.stderr


def _builds(module_path: str) -> dict[str, tuple[int, int]]:
    """Every built module beside this one: path -> (inode, mtime), which a rebuild would change."""
    root = Path(module_path).parent.parent
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.glob("*/*.so")}


@pytest.mark.skipif(not cpu_supported()[0], reason=f"no C++ CPU kernels here: {cpu_supported()[1]}")
def test_server_and_plain_python_load_one_build_in_turn(llama_dir, tmp_path):
    path, _ = _load_in_plain_python()  # builds here if nothing did before (scripts/install.sh does)
    before = _builds(path)
    server = start(tmp_path, llama_dir, {"dtype": "bfloat16"})  # bf16: the CPU attention kernel is a candidate
    try:
        log = server.log.read_text()
    finally:
        stop(server)
    assert f"C++ CPU kernels: loaded {path}" in log, log[-3000:]
    assert "C++ CPU kernels: building" not in log
    assert "engine start: weights" in log and "engine ready in " in log

    again, logged = _load_in_plain_python()
    assert again == path and "building" not in logged, logged
    assert _builds(path) == before and os.path.exists(path)
