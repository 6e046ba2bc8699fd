"""engine.models.hugepages: a copy in 2 MiB-aligned memory advised for huge pages, same values, freed with
its tensor."""

from __future__ import annotations

import gc
import weakref

import torch

from engine.models.hugepages import HUGE_PAGE, huge_page_copy


def anon_huge_kib() -> int | None:
    try:
        with open("/proc/self/smaps_rollup", encoding="utf-8") as rollup:
            return next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as enabled:
            return enabled.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def test_copy_keeps_shape_dtype_values_and_starts_on_a_huge_page():
    for shape in ((3, 1024, 512), (768, 512), (1000, 333)):
        tensor = torch.randn(*shape)
        copy = huge_page_copy(tensor)
        assert copy.shape == tensor.shape and copy.dtype == tensor.dtype and torch.equal(copy, tensor)
        assert copy.is_contiguous() and copy.data_ptr() % HUGE_PAGE == 0
        assert copy.data_ptr() != tensor.data_ptr()
    small = torch.randn(10, 10)
    assert torch.equal(huge_page_copy(small), small)  # under half a huge page: an ordinary copy (or itself)
    view = torch.randn(1024, 1024).t()
    assert torch.equal(huge_page_copy(view), view) and huge_page_copy(view).is_contiguous()


def test_pages_are_huge_where_the_kernel_allows_and_freed_with_the_tensor():
    before = anon_huge_kib()
    copy = huge_page_copy(torch.ones(16 * HUGE_PAGE // 4))
    during = anon_huge_kib()
    if before is not None and thp_mode() in ("always", "madvise"):
        assert during - before >= 8 * HUGE_PAGE // 1024  # at least half of the 16 pages (the kernel may split some)
    storage = weakref.ref(copy.untyped_storage())
    del copy
    gc.collect()
    assert storage() is None
    if before is not None and thp_mode() in ("always", "madvise"):
        assert anon_huge_kib() <= before + 2 * HUGE_PAGE // 1024
