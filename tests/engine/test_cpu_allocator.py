"""glibc's malloc told to keep freed memory (engine/cpu_allocator.py): a large activation allocated, written and
freed step after step is faulted in once, not every time; and an engine applies it only where configured to.

Each case runs in a fresh interpreter: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

# Sixteen rounds of a 64 MiB tensor (above glibc's largest mmap threshold, 32 MiB) allocated, written and freed;
# the minor page faults of the last four, before and after keep_freed_memory(). (The first rounds after it grow
# the heap: a small allocation placed after a freed chunk keeps the next aligned one from fitting there. Here
# the heap stopped growing after 7 rounds, 448 MiB on; in an engine RSS rose ~30 MiB, perf/README.md.)
_FAULTS = """
import json, resource, torch
from pagedllm.engine.cpu_allocator import keep_freed_memory

def repeat_faults():
    counts = []
    for _ in range(16):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(counts[-4:])

default = repeat_faults()
applied = keep_freed_memory()
print(json.dumps({"default": default, "applied": applied, "kept": repeat_faults()}))
"""

_ENGINE = """
import json, sys
from pagedllm import LLM
from pagedllm.engine import cpu_allocator

llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory_bytes=1 << 22, cpu_malloc_tuning=sys.argv[2] == "on")
print(json.dumps({"applied": cpu_allocator._applied, "stats": llm.get_stats().kernels["cpu_malloc_tuning"]}))
"""


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_activation_is_not_faulted_in_again():
    faults = _run(_FAULTS)
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults["applied"]
    assert faults["default"] > pages  # glibc's default: each round maps and faults in the tensor afresh
    assert faults["kept"] < pages // 10  # kept: the heap's pages are reused


@pytest.mark.parametrize("switch", ["on", "off"])
def test_the_engine_applies_it_only_when_configured(llama_dir, switch):
    got = _run(_ENGINE, str(llama_dir), switch)
    assert got == {"applied": switch == "on", "stats": switch == "on"}
