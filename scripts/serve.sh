#!/usr/bin/env bash
# Installs what is needed, then serves the default model (made offline if absent) through real Triton.
# Extra arguments go to `pagedllm serve` (e.g. --model DIR --http-port 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/pagedllm serve "$@"
