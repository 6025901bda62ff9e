"""Builds (once per machine and source version) and loads the C++ CPU kernels of this directory as one torch
extension. The module name carries a digest of the sources, so an edited header is never served stale."""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import pathlib

_DIR = os.path.dirname(os.path.abspath(__file__))
_NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def amx_supported() -> tuple[bool, str]:
    """AMX tiles with bf16, on top of what every kernel here needs. The extension is built with the AMX code
    either way; on CPUs without AMX it is simply never called."""
    missing = [f for f in ("amx_tile", "amx_bf16") if f not in _cpu_flags()]
    return (False, f"needs CPU features {', '.join(missing)}") if missing else cpu_supported()


def cpu_supported() -> tuple[bool, str]:
    missing = [f for f in _NEEDED_FLAGS if f not in _cpu_flags()]
    return (False, f"needs CPU features {', '.join(missing)}") if missing else (True, "")


@functools.cache
def extension():
    """The compiled module; raises RuntimeError with the reason when this CPU or toolchain cannot have it."""
    ok, why = cpu_supported()
    if not ok:
        raise RuntimeError(why)
    from torch.utils.cpp_extension import load

    files = sorted(glob.glob(os.path.join(_DIR, "*.cpp")) + glob.glob(os.path.join(_DIR, "*.h")))
    digest = hashlib.sha256(b"".join(pathlib.Path(f).read_bytes() for f in files)).hexdigest()[:12]
    # -fopenmp: at::parallel_for is an OpenMP loop compiled into this extension, serial without it.
    return load(name=f"pagedllm_cpu_{digest}", sources=[f for f in files if f.endswith(".cpp")], verbose=False,
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile",
                              "-mamx-bf16", "-fopenmp"],
                extra_ldflags=["-fopenmp"])
