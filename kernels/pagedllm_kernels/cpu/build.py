"""Builds (once per machine and source version) and loads the C++ CPU kernels of this directory as one torch
extension (AVX-512), and those of avx2/ as a second one for CPUs without AVX-512. Each module's name carries a
digest of its sources and compiler flags, so an edited header is never served stale.

Once built, the module is loaded straight from its build directory: no ninja run, no build lock. That matters
because torch's build takes a lock file that a killed build leaves behind (every later build then waits forever:
one older than STALE_LOCK_S is removed), and because ninja 1.11 and 1.12+ hash commands differently, so two
processes finding different ninjas on their PATH (the system's, the venv's) would rebuild the module for each
other (~50 s each time). When a build is needed, the `ninja` package's own binary is put first on PATH.

scripts/install.sh builds both where the CPU can run them (`python -m pagedllm_kernels.cpu.build`), so no model
load or request pays for them. Every process logs which it did: "loaded" (with the path) or "built" (with the
time it took).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import time

logger = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
# avx512vbmi: byte shuffles widen an fp8 cache's e4m3 codes (simd.h); every CPU with AVX512-BF16 has it but
# Cooper Lake, which runs the avx2 kernels instead.
# avx512dq: vreduceps in the attention softmax's exp (simd.h); every CPU with AVX512-BF16 has it.
_NEEDED_FLAGS = ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi")
# -fopenmp: at::parallel_for is an OpenMP loop compiled into this extension, serial without it.
# Tuples, handed to torch as fresh lists: torch's `load` appends its own link flags to the lists it is given, and
# a mutated list would change the digest of every module built after it in the same process (scripts/install.sh
# builds two: the second got a name no other process computes, and the first server or test rebuilt it, ~55 s).
_CFLAGS = ("-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi",
           "-mavx512vnni", "-mfma", "-mamx-tile", "-mamx-bf16", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_AVX2_NEEDED_FLAGS = ("avx2", "fma", "f16c")
_AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a killed build


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


def vnni_supported() -> tuple[bool, str]:
    """AVX512-VNNI int8 dot products (the int8 linear), on top of what every kernel here needs; like AMX, built
    in either way and never called where the CPU lacks it."""
    return (False, "needs CPU feature avx512_vnni") if "avx512_vnni" not in _cpu_flags() else cpu_supported()


def cpu_supported() -> tuple[bool, str]:
    missing = [f for f in _NEEDED_FLAGS if f not in _cpu_flags()]
    return (False, f"needs CPU features {', '.join(missing)}") if missing else (True, "")


@functools.cache
def kernel_module(name: str):
    """pagedllm_kernels.cpu.<name> where this CPU can run the extension, else None (the caller's torch path);
    the build itself still happens on the first call into it."""
    if not cpu_supported()[0]:
        return None
    return importlib.import_module(f"pagedllm_kernels.cpu.{name}")


@functools.cache
def extension():
    """The compiled module; raises RuntimeError with the reason when this CPU or toolchain cannot have it."""
    ok, why = cpu_supported()
    if not ok:
        raise RuntimeError(why)
    return _build("pagedllm_cpu", cpu_sources(), _CFLAGS)


def cpu_sources() -> list[str]:
    """The AVX-512 module's sources: every .cpp and .h of this directory."""
    return sorted(glob.glob(os.path.join(_DIR, "*.cpp")) + glob.glob(os.path.join(_DIR, "*.h")))


def avx2_sources() -> list[str]:
    """The AVX2 module's sources: every .cpp and .h of avx2/."""
    return sorted(glob.glob(os.path.join(_DIR, "avx2", "*.cpp")) + glob.glob(os.path.join(_DIR, "avx2", "*.h")))


def avx2_supported() -> tuple[bool, str]:
    """AVX2 with FMA and F16C: what the avx2/ kernels need (every x86 CPU of the last decade; AVX-512 ones too)."""
    missing = [f for f in _AVX2_NEEDED_FLAGS if f not in _cpu_flags()]
    return (False, f"needs CPU features {', '.join(missing)}") if missing else (True, "")


@functools.cache
def avx2_extension():
    """The avx2/ kernels' module (built the same way, from their own sources and flags); raises RuntimeError
    with the reason when this CPU or toolchain cannot have it."""
    ok, why = avx2_supported()
    if not ok:
        raise RuntimeError(why)
    return _build("pagedllm_avx2", avx2_sources(), _AVX2_CFLAGS)


@functools.cache
def avx2_module(name: str):
    """pagedllm_kernels.cpu.<name> (one of the AVX2 kernels' wrappers) where this CPU can run them and they build,
    else None (the caller's torch path; a failed build is logged once)."""
    if not avx2_supported()[0]:
        return None
    try:
        avx2_extension()
    except Exception as e:  # no compiler, build failure
        logger.warning("AVX2 kernels unavailable (%s); %s's callers stay on torch", e, name)
        return None
    return importlib.import_module(f"pagedllm_kernels.cpu.{name}")


def _build(prefix: str, files: list[str], cflags: tuple[str, ...]):
    from torch.utils.cpp_extension import _get_build_directory, load

    name = module_name(prefix, files, cflags)
    build_dir = pathlib.Path(_get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    if built.exists() and not (build_dir / "lock").exists():
        module = _load_built(name, built)
        logger.info("C++ CPU kernels: loaded %s", built)
        return module
    _remove_stale_lock(build_dir / "lock")
    _use_package_ninja()
    logger.warning("C++ CPU kernels: building %s (once per machine and source version; a minute or two)", name)
    start = time.monotonic()
    module = load(name=name, sources=[f for f in files if f.endswith(".cpp")], verbose=False,
                  extra_cflags=list(cflags), extra_ldflags=list(_LDFLAGS))
    logger.warning("C++ CPU kernels: built %s in %.1f s", built, time.monotonic() - start)
    return module


def module_name(prefix: str, files: list[str], cflags: tuple[str, ...]) -> str:
    """The built module's name: `prefix` and a digest of the sources and the compiler and linker flags."""
    digest = hashlib.sha256(b"".join(pathlib.Path(f).read_bytes() for f in files) +
                            repr((list(cflags), list(_LDFLAGS))).encode()).hexdigest()[:12]
    return f"{prefix}_{digest}"


def _load_built(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_stale_lock(lock: pathlib.Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing the build lock %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _use_package_ninja() -> None:
    """Put the `ninja` package's binary first on PATH (torch runs whatever `ninja` PATH finds)."""
    try:
        import ninja
    except ImportError:
        return
    binary = shutil.which("ninja", path=ninja.BIN_DIR)
    if binary and shutil.which("ninja") != binary:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


if __name__ == "__main__":  # scripts/install.sh: build now, or say why this machine runs without the kernels
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        extension()
    except RuntimeError as e:
        logger.warning("C++ CPU kernels: not built (%s); the torch paths will run instead", e)
    try:
        avx2_extension()
    except RuntimeError as e:
        logger.warning("AVX2 kernels: not built (%s); bf16 linears without oneDNN's bf16 run on torch", e)
