"""A `.gguf` file's config and tokenizer, converted once per machine into an HF-style directory and read from
there afterwards.

Reason: transformers builds both from the file's metadata in Python, parsing the whole vocabulary each time
(SmolLM2-135M: ~5 s for the config, ~7 s for the tokenizer, on every process start and engine reload). The
converted `config.json` and `tokenizer.json` load in well under a second. Beside them, `tensors.json` (each
tensor's type, shape and offset) lets the loader map the file without parsing its metadata again. The weights
are not cached: they are dequantized from the file at every load (pagedllm.models.gguf_checkpoint), so a cache
never doubles a model's disk footprint.

The cache directory is keyed by the file's absolute path, size and mtime, transformers' and gguf's versions and
CONVERSION_VERSION (bumped when what we write changes), so an edited file or an upgrade converts afresh. It lives
in $PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm. Each conversion is written to a
directory of its own and renamed into place, so concurrent loads (tensor-parallel workers, two servers) never
read a half-written one. Where the cache cannot be written, the conversion goes to a temporary directory of
this process instead.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from pagedllm.models.gguf_checkpoint import ARCHITECTURES, metadata_overrides, tensor_directory

logger = logging.getLogger(__name__)

CONVERSION_VERSION = 2  # 2: tensors.json
TENSORS = "tensors.json"


def cache_root() -> Path:
    if os.environ.get("PAGEDLLM_CACHE_DIR"):
        return Path(os.environ["PAGEDLLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedllm"


def converted_dir(path: str) -> str:
    """The HF-style directory (config.json, tokenizer files) holding `path`'s metadata, converted if needed."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _converted_dir(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)  # one stat-keyed lookup per process and file version
def _converted_dir(path: str, size: int, mtime_ns: int) -> str:
    versions = (transformers.__version__, _gguf_version(), CONVERSION_VERSION)
    key = hashlib.sha256(repr((path, size, mtime_ns, *versions)).encode())
    final = cache_root() / "gguf" / f"{Path(path).stem}-{key.hexdigest()[:16]}"
    if (final / "config.json").exists():
        return str(final)
    start = time.monotonic()
    config, tokenizer, tensors = _convert(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    except OSError as e:
        logger.warning("cannot write the GGUF metadata cache under %s (%s): converting into a temporary "
                       "directory, again at the next start", final.parent, e)
        staging = final = Path(tempfile.mkdtemp(prefix="pagedllm-gguf-"))
    # tokenizer and tensors first: config.json is what marks a directory complete
    tokenizer.save_pretrained(staging)
    (staging / TENSORS).write_text(json.dumps(tensors))
    config.save_pretrained(staging)
    if staging != final:
        try:
            staging.rename(final)
        except OSError:  # another process renamed its conversion into place first: theirs is as good
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("GGUF metadata of %s converted in %.1f s into %s", path, time.monotonic() - start, final)
    return str(final)


def _gguf_version() -> str:
    """The gguf package's version (its reader's conventions make the tensor directory), also when it is
    importable without being installed (llama.cpp's gguf-py on the path)."""
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        import gguf

        return getattr(gguf, "__version__", "unknown")


def tensor_directory_of(path: str) -> dict:
    """The tensors' directory of a `.gguf` file (pagedllm.models.gguf_checkpoint.tensor_directory), as converted."""
    return json.loads((Path(converted_dir(path)) / TENSORS).read_text())


def _convert(path: str):
    from gguf import GGUFReader

    directory, name = os.path.split(path)
    reader = GGUFReader(path)
    arch, overrides = metadata_overrides(reader)  # refuses an architecture we cannot build
    tensors = tensor_directory(reader)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.architectures = [ARCHITECTURES[arch]]
    # GGUF weights are dequantized at load; with dtype "auto" they load as bfloat16 (the file names no dtype).
    config.dtype = torch.bfloat16
    return config, AutoTokenizer.from_pretrained(directory, gguf_file=name), tensors
