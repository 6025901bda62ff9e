"""Large CPU buffers on transparent huge pages (huge_pages.py): aligned, advised and, where the host's THP allows
it, really backed by 2 MiB pages once written; small ones and other devices untouched; the weight layouts and
the KV cache allocated through it."""

import re
from pathlib import Path

import pytest
import torch
from pagedllm import LLM
from pagedllm_kernels import fp8_layout, huge_pages, int4_layout

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_mode = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else "absent"
needs_thp = pytest.mark.skipif(thp_mode not in ("always", "madvise"), reason=f"transparent huge pages: {thp_mode}")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            mapping = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
def test_a_large_buffer_starts_on_a_huge_page_and_holds_what_is_written(dtype):
    t = huge_pages.empty((3, 1000, 1500), dtype)
    assert t.shape == (3, 1000, 1500) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    src = torch.randn(3, 1000, 1500).to(dtype)
    t.copy_(src)
    assert torch.equal(t.view(torch.uint8), src.view(torch.uint8))


@needs_thp
def test_written_pages_are_huge():
    t = huge_pages.zeros((16 << 20,), torch.uint8)
    assert huge_bytes_at(t.data_ptr()) >= huge_pages.HUGE_PAGE


def test_small_buffers_and_other_devices_are_plain_allocations():
    t = huge_pages.empty((100, 100), torch.float32)
    assert t.shape == (100, 100) and t.untyped_storage().nbytes() == 100 * 100 * 4
    assert huge_pages.empty((4 << 20,), torch.uint8, "meta").device.type == "meta"


def test_the_mapping_lives_as_long_as_a_view_of_it():
    view = huge_pages.zeros((8 << 20,), torch.uint8)[-16:]
    view += 7
    assert view.tolist() == [7] * 16


def test_copy_of_a_view_is_a_contiguous_copy():
    src = torch.randn(1024, 2048).t()
    got = huge_pages.copy_of(src)
    assert got.is_contiguous() and torch.equal(got, src) and got.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_the_weight_layouts_and_the_kv_cache_use_it(llama_dir):
    w = torch.randn(1024, 2048).to(torch.bfloat16)
    assert fp8_layout.arrange(w).data_ptr() % huge_pages.HUGE_PAGE == 0
    codes = torch.randint(0, 16, (2048, 4096), dtype=torch.uint8)  # packed: 4 MiB
    packed, _, _ = int4_layout.pack(codes, torch.ones(2048, 32), torch.zeros(2048, 32), 128)
    assert packed.data_ptr() % huge_pages.HUGE_PAGE == 0
    llm = LLM(llama_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 << 20, device="cpu")
    caches = llm.engine.executor.worker.runner.kv_caches
    assert all(c.data_ptr() % huge_pages.HUGE_PAGE == 0 for c in caches)
    assert all(not c.any() for c in caches)
