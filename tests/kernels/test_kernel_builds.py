"""The C++ kernels' module names: the same in every process, so a module is built once per machine."""

from __future__ import annotations

import os

from pagedllm_kernels.cpu import build


def test_a_build_leaves_the_next_modules_name_as_a_fresh_process_computes_it(monkeypatch, tmp_path):
    """scripts/install.sh builds both extensions in one process. torch's `load` appends its own link flags to the
    lists it is handed: were those our flags, the second module's digest would differ from the one every later
    process computes, and the first server or test would build it again."""
    cpu_sources, avx2_sources = build.cpu_sources(), build.avx2_sources()
    fresh = [build.module_name("pagedllm_cpu", cpu_sources, build._CFLAGS),
             build.module_name("pagedllm_avx2", avx2_sources, build._AVX2_CFLAGS)]
    built = []

    def load_as_torch_does(name, sources, extra_cflags, extra_ldflags, **_):
        extra_ldflags += ["-L/torch/lib", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
        extra_cflags.append("-fPIC")
        built.append(name)
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there: both take the build path
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # the build puts the ninja package's binary first
    monkeypatch.setattr("torch.utils.cpp_extension.load", load_as_torch_does)
    build._build("pagedllm_cpu", cpu_sources, build._CFLAGS)
    build._build("pagedllm_avx2", avx2_sources, build._AVX2_CFLAGS)
    assert built == fresh
