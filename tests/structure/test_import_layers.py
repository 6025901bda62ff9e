"""The tree's import structure, checked by import-linter against the contracts in pyproject.toml: every package
imports only the layers below it (kernels <- attention <- models <- distributed <- engine <- llm, serving, cli),
no two modules of a package import each other, the client imports nothing of the engine, and only the Triton
adapter imports triton_python_backend_utils."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_points_down():
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
