"""Unit tests of the reference-counted page allocator."""

from __future__ import annotations

import pytest

from kvcache.errors import OutOfPagesError
from kvcache.page_allocator import PageAllocator


def test_fresh_pool_is_all_free() -> None:
    alloc = PageAllocator(8)
    assert alloc.num_pages == 8
    assert alloc.num_free_pages == 8
    assert all(alloc.is_free(p) and alloc.ref_count(p) == 0 for p in range(8))
    alloc.check_integrity()


def test_allocate_gives_distinct_pages_with_one_ref() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(3) + alloc.allocate(5)
    assert sorted(pages) == list(range(8))
    assert all(alloc.ref_count(p) == 1 and not alloc.is_free(p) for p in pages)
    assert alloc.num_free_pages == 0
    alloc.check_integrity()


def test_allocate_zero_and_negative() -> None:
    alloc = PageAllocator(4)
    assert alloc.allocate(0) == []
    assert alloc.can_allocate(0)
    assert not alloc.can_allocate(-1)
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    assert alloc.num_free_pages == 4


def test_out_of_pages_allocates_nothing() -> None:
    alloc = PageAllocator(4)
    held = alloc.allocate(3)
    assert alloc.can_allocate(1)
    assert not alloc.can_allocate(2)
    with pytest.raises(OutOfPagesError) as excinfo:
        alloc.allocate(2)
    assert (excinfo.value.num_requested, excinfo.value.num_free) == (2, 1)
    assert alloc.num_free_pages == 1
    assert [alloc.ref_count(p) for p in held] == [1, 1, 1]
    alloc.check_integrity()


def test_shared_page_is_freed_by_its_last_reference() -> None:
    alloc = PageAllocator(4)
    [page] = alloc.allocate(1)
    alloc.incref([page, page])
    assert alloc.ref_count(page) == 3
    alloc.free([page])
    alloc.free([page])
    assert not alloc.is_free(page)
    alloc.free([page])
    assert alloc.is_free(page)
    assert alloc.num_free_pages == 4
    alloc.check_integrity()


def test_freed_pages_are_reused_lifo() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(4)
    alloc.free([pages[1], pages[2]])
    # The most recently freed page comes back first (warm in whatever cache).
    assert alloc.allocate(2) == [pages[2], pages[1]]


def test_double_free_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.free([b])
    with pytest.raises(RuntimeError, match=f"double free of page {b}"):
        alloc.free([a, b])
    # Atomic: a's reference was not dropped by the failed call.
    assert alloc.ref_count(a) == 1
    assert alloc.num_free_pages == 3
    alloc.check_integrity()


def test_free_listing_a_page_more_often_than_its_refs_rolls_back() -> None:
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.incref([b])
    with pytest.raises(RuntimeError, match=f"double free of page {a}"):
        alloc.free([b, a, a])
    assert (alloc.ref_count(a), alloc.ref_count(b)) == (1, 2)
    assert alloc.num_free_pages == 2
    alloc.check_integrity()


def test_incref_of_free_page_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(4)
    [a] = alloc.allocate(1)
    with pytest.raises(RuntimeError, match="free page 3"):
        alloc.incref([a, 3])
    assert alloc.ref_count(a) == 1
    alloc.check_integrity()


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_out_of_range_page_ids_are_rejected(page: int) -> None:
    alloc = PageAllocator(4)
    held = alloc.allocate(4)
    for call in (alloc.incref, alloc.free):
        with pytest.raises(ValueError, match="out of range"):
            call([held[0], page])
    with pytest.raises(ValueError):
        alloc.ref_count(page)
    assert all(alloc.ref_count(p) == 1 for p in held)
    alloc.check_integrity()


def test_empty_pool() -> None:
    alloc = PageAllocator(0)
    assert alloc.num_free_pages == 0
    assert alloc.allocate(0) == []
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    with pytest.raises(ValueError):
        PageAllocator(-1)


def test_check_integrity_catches_corruption() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(2)
    alloc._free_list.append(alloc._free_list[0])  # a duplicate on the free list
    with pytest.raises(AssertionError, match="twice"):
        alloc.check_integrity()

    alloc = PageAllocator(4)
    [page] = alloc.allocate(1)
    alloc._ref_counts[page] = 0  # unreferenced but not free: a leak
    with pytest.raises(AssertionError, match="not on the free list"):
        alloc.check_integrity()

    alloc = PageAllocator(4)
    alloc._ref_counts[alloc._free_list[-1]] = 1  # referenced yet handed out again later
    with pytest.raises(AssertionError, match="ref count 1"):
        alloc.check_integrity()
