"""Reference-counted allocator of fixed-size KV pages.

A page is one ``page_size``-token slot of the KV pool, named by its id
``0 .. num_pages - 1``. Several owners may share a page (running requests and
the radix prefix cache); each owner holds one reference, and a page returns to
the free list when its last reference is dropped.

Invariant: ``ref_count(p) == 0`` if and only if ``p`` is on the free list, and
the free list holds each free page exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.errors import OutOfPagesError


class PageAllocator:
    """Hands out page ids from a LIFO free list and counts references on them.

    ``allocate`` and ``free`` are O(1) per page. Every mutating call is atomic:
    when it raises, the allocator is left exactly as it was before the call.
    """

    def __init__(self, num_pages: int) -> None:
        """Create a pool of ``num_pages`` pages, all free."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._ref_counts: list[int] = [0] * num_pages
        # A stack: allocate pops from the end. Reversed so a fresh pool hands
        # out 0, 1, 2, ... which keeps tests and debug dumps readable.
        self._free_list: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_pages(self) -> int:
        """Total number of pages in the pool."""
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages with no reference, available to ``allocate``."""
        return len(self._free_list)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``allocate(num_pages)`` would succeed now."""
        return 0 <= num_pages <= len(self._free_list)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages, each with reference count 1.

        Raises:
            OutOfPagesError: fewer than ``num_pages`` pages are free; nothing
                is allocated.
            ValueError: ``num_pages`` is negative.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        free_list = self._free_list
        if num_pages > len(free_list):
            raise OutOfPagesError(num_pages, len(free_list))
        if num_pages == 0:
            return []
        pages = free_list[-num_pages:]
        del free_list[-num_pages:]
        pages.reverse()  # pop order: the most recently freed page comes first
        ref_counts = self._ref_counts
        for page in pages:
            ref_counts[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gets two).

        Raises:
            RuntimeError: a page is free; sharing a free page is a caller bug.
                No reference is added.
            ValueError: a page id is out of range. No reference is added.
        """
        pages = list(pages)
        ref_counts = self._ref_counts
        for page in pages:
            self._check_id(page)
            if ref_counts[page] == 0:
                raise RuntimeError(f"incref of free page {page}")
        for page in pages:
            ref_counts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching 0 become free.

        Raises:
            RuntimeError: ``double free of page N``, when a page has no
                reference left to drop (including a page listed more times
                than it has references). No reference is dropped.
            ValueError: a page id is out of range. No reference is dropped.
        """
        pages = list(pages)
        ref_counts = self._ref_counts
        free_list = self._free_list
        # Pages reaching 0 are appended in order, so a rollback only has to
        # truncate the free list back to its old length.
        old_free_len = len(free_list)
        for i, page in enumerate(pages):
            if not (0 <= page < self._num_pages) or ref_counts[page] == 0:
                for done in pages[:i]:
                    ref_counts[done] += 1
                del free_list[old_free_len:]
                self._check_id(page)
                raise RuntimeError(f"double free of page {page}")
            ref_counts[page] -= 1
            if ref_counts[page] == 0:
                free_list.append(page)

    def ref_count(self, page: int) -> int:
        """Number of references on ``page`` (0 when free)."""
        self._check_id(page)
        return self._ref_counts[page]

    def is_free(self, page: int) -> bool:
        """Whether ``page`` has no reference and sits on the free list."""
        self._check_id(page)
        return self._ref_counts[page] == 0

    def check_integrity(self) -> None:
        """Verify the allocator's invariants; raise ``AssertionError`` naming the first broken one."""
        n = self._num_pages
        assert len(self._ref_counts) == n, f"{len(self._ref_counts)} ref counts for {n} pages"
        seen: set[int] = set()
        for page in self._free_list:
            assert 0 <= page < n, f"free list holds out-of-range page {page}"
            assert page not in seen, f"page {page} is on the free list twice"
            seen.add(page)
            assert self._ref_counts[page] == 0, (
                f"page {page} is on the free list with ref count {self._ref_counts[page]}"
            )
        num_zero = 0
        for page, count in enumerate(self._ref_counts):
            assert count >= 0, f"page {page} has negative ref count {count}"
            if count == 0:
                num_zero += 1
                assert page in seen, f"page {page} has ref count 0 but is not on the free list"
        assert num_zero == len(self._free_list), (
            f"{num_zero} pages have ref count 0 but the free list holds {len(self._free_list)}"
        )

    def _check_id(self, page: int) -> None:
        # Python lists accept negative indices, so an unchecked -1 would
        # silently alias the last page.
        if not (0 <= page < self._num_pages):
            raise ValueError(f"page {page} is out of range 0..{self._num_pages - 1}")
