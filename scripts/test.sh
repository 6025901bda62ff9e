#!/usr/bin/env bash
# Installs what is needed, then runs the whole test suite (CPU; starts real tritonservers on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q -ra "$@"
