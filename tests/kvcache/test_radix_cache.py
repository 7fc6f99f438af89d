"""Unit tests of the radix prefix cache (page size 4 unless a test says otherwise)."""

from __future__ import annotations

import pytest

from kvcache.page_allocator import PageAllocator
from kvcache.radix_cache import RadixCache

PS = 4


def make(num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, PS)


def put(
    alloc: PageAllocator, cache: RadixCache, tokens: list[int], ns: str | None = None
) -> list[int]:
    """Insert ``tokens`` with fresh pages the way a finished request does; return those pages."""
    pages = alloc.allocate(-(-len(tokens) // PS))
    cache.insert(tokens, pages, ns)
    alloc.free(pages)
    cache.check_integrity()
    alloc.check_integrity()
    return pages


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_empty_cache_matches_nothing_and_root_lock_is_a_no_op() -> None:
    _, cache = make()
    m = cache.match_prefix(seq(0, 12))
    assert (m.pages, m.num_tokens) == ([], 0)
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.match_prefix([]).num_tokens == 0
    assert cache.num_cached_pages == cache.num_locked_pages == 0
    cache.check_integrity()


def test_insert_then_match_returns_the_trees_pages() -> None:
    alloc, cache = make()
    pages = put(alloc, cache, seq(0, 12))
    assert all(alloc.ref_count(p) == 1 for p in pages)  # the tree's reference only
    m = cache.match_prefix(seq(0, 12) + [99])
    assert (m.pages, m.num_tokens) == (pages, 12)
    assert cache.num_cached_pages == cache.num_evictable_pages == 3


def test_match_never_covers_the_whole_prompt() -> None:
    alloc, cache = make()
    pages = put(alloc, cache, seq(0, 12))
    assert cache.match_prefix(seq(0, 12)).pages == pages[:2]  # last token left to compute
    assert cache.match_prefix(seq(0, 11)).num_tokens == 8
    assert cache.match_prefix(seq(0, 9)).num_tokens == 8
    assert cache.match_prefix(seq(0, 8)).num_tokens == 4
    assert cache.match_prefix(seq(0, 4)).num_tokens == 0
    assert cache.match_prefix(seq(0, 1)).num_tokens == 0


def test_match_does_not_change_ref_counts_or_structure() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 12))
    before = [alloc.ref_count(p) for p in range(alloc.num_pages)]
    m = cache.match_prefix(seq(0, 6))  # ends inside the only node: no split
    assert m.num_tokens == 4 and len(m.node.pages) == 3
    assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == before
    cache.check_integrity()


def test_insert_returns_cached_length_and_keeps_the_older_pages() -> None:
    alloc, cache = make()
    first = put(alloc, cache, seq(0, 8))
    second = alloc.allocate(4)
    assert cache.insert(seq(0, 16), second) == 8
    alloc.free(second)
    # Duplicate pages went back to the pool; the new range adopted the caller's.
    assert all(alloc.is_free(p) for p in second[:2])
    assert all(alloc.ref_count(p) == 1 for p in first + second[2:])
    assert cache.match_prefix(seq(0, 17)).pages == first + second[2:]
    assert cache.insert(seq(0, 16), second) == 16  # everything present: adopts nothing
    assert cache.insert(seq(0, 5), second) == 4  # a prefix of a longer key
    cache.check_integrity()


def test_insert_only_takes_full_pages_and_needs_enough_of_them() -> None:
    alloc, cache = make()
    pages = alloc.allocate(3)
    assert cache.insert(seq(0, 10), pages) == 0
    alloc.free(pages)
    assert alloc.is_free(pages[2])  # the partial third page stays the caller's
    assert cache.num_cached_pages == 2
    with pytest.raises(ValueError, match="need 3 pages"):
        cache.insert(seq(50, 12), alloc.allocate(2))
    assert cache.insert(seq(50, 3), []) == 0
    cache.check_integrity()


def test_insert_of_a_free_page_raises_and_leaves_the_tree_alone() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 8))
    with pytest.raises(RuntimeError, match="free page"):
        cache.insert(seq(0, 4) + seq(40, 4), [0, 63])  # diverges inside: would split
    assert cache.num_cached_pages == 2 and len(cache.match_prefix(seq(0, 9)).node.pages) == 2
    cache.check_integrity()


def test_divergence_inside_a_node_splits_it_at_a_page_boundary() -> None:
    alloc, cache = make()
    a = put(alloc, cache, seq(0, 12))
    b_tokens = seq(0, 4) + seq(100, 8)
    b_pages = alloc.allocate(3)
    assert cache.insert(b_tokens, b_pages) == 4
    alloc.free(b_pages)
    assert alloc.is_free(b_pages[0])
    shared = cache.match_prefix(seq(0, 5)).node
    assert (shared.key, shared.pages) == (tuple(seq(0, 4)), a[:1])
    assert sorted(len(c.pages) for c in shared.children.values()) == [2, 2]
    assert cache.match_prefix(seq(0, 13)).pages == a
    assert cache.match_prefix(b_tokens + [0]).pages == a[:1] + b_pages[1:]
    assert cache.num_cached_pages == 5
    cache.check_integrity()


def test_a_split_keeps_existing_locks_covering_their_pages() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 16))
    m = cache.match_prefix(seq(0, 9))  # ends inside the 4-page node
    assert m.num_tokens == 8
    cache.lock(m.node)
    assert cache.num_locked_pages == 4  # the whole partially matched node
    put(alloc, cache, seq(0, 8) + [7, 7, 7, 7])  # splits the locked node after 2 pages
    assert cache.num_locked_pages == 4 and cache.num_evictable_pages == 1
    assert cache.evict(100) == 1
    assert cache.match_prefix(seq(0, 9)).pages == m.pages  # still cached
    cache.unlock(m.node)
    assert cache.num_locked_pages == 0 and cache.reset() == 4
    assert alloc.num_free_pages == alloc.num_pages


def test_namespaces_never_share_pages() -> None:
    alloc, cache = make()
    a = put(alloc, cache, seq(0, 8), "tenant-a")
    assert cache.match_prefix(seq(0, 9)).num_tokens == 0
    assert cache.match_prefix(seq(0, 9), "tenant-b").num_tokens == 0
    assert cache.match_prefix(seq(0, 9), "tenant-a").pages == a
    d = put(alloc, cache, seq(0, 8))  # same tokens, default namespace: its own pages
    assert cache.match_prefix(seq(0, 9)).pages == d
    assert set(a).isdisjoint(d) and cache.num_cached_pages == 4
    assert cache.reset() == 4
    assert cache.match_prefix(seq(0, 9), "tenant-a").num_tokens == 0
    assert alloc.num_free_pages == alloc.num_pages


def test_evict_takes_least_recently_used_leaves_first() -> None:
    alloc, cache = make()
    a = put(alloc, cache, seq(0, 8))
    b = put(alloc, cache, seq(100, 8))
    c = put(alloc, cache, seq(200, 8))
    cache.match_prefix(seq(0, 9))  # a is now the most recently used
    assert cache.evict(1) == 2  # whole leaves go
    assert all(alloc.is_free(p) for p in b)
    assert cache.match_prefix(seq(100, 9)).num_tokens == 0
    assert cache.evict(2) == 2
    assert all(alloc.is_free(p) for p in c) and not any(alloc.is_free(p) for p in a)
    assert cache.evict(0) == 0
    cache.check_integrity()


def test_evict_reaches_a_parent_once_its_children_are_gone() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 8))
    put(alloc, cache, seq(0, 4) + seq(50, 4))  # root -> [0..3] -> {[4..7], [50..53]}
    put(alloc, cache, seq(100, 4))
    cache.match_prefix(seq(100, 5))  # newest, but the parent [0..3] is older
    # The parent is not a leaf until both children go; then it is the oldest.
    assert cache.evict(3) == 3
    assert cache.match_prefix(seq(100, 5)).num_tokens == 4
    assert cache.match_prefix(seq(0, 5)).num_tokens == 0
    cache.check_integrity()


def test_evict_counts_freed_pages_not_pages_still_held_elsewhere() -> None:
    alloc, cache = make(num_pages=8)
    shared = put(alloc, cache, seq(0, 8))  # the least recently used leaf...
    alloc.incref(shared)  # ...also held, unlocked, by a running sibling
    other = put(alloc, cache, seq(100, 8))
    free = alloc.num_free_pages
    # Dropping the shared leaf frees nothing, so eviction goes on to the next one.
    assert cache.evict(1) == 2
    assert alloc.num_free_pages == free + 2 and all(alloc.is_free(p) for p in other)
    assert cache.num_cached_pages == 0 and not any(alloc.is_free(p) for p in shared)
    assert cache.evict(1) == 0  # nothing unlocked left: stops short
    alloc.free(shared)
    assert alloc.num_free_pages == alloc.num_pages
    cache.check_integrity()


def test_reset_returns_the_pages_it_freed() -> None:
    alloc, cache = make(num_pages=8)
    held = put(alloc, cache, seq(0, 8))
    alloc.incref(held)
    put(alloc, cache, seq(100, 4))
    assert cache.reset() == 1 and cache.num_cached_pages == 0
    alloc.free(held)
    assert alloc.num_free_pages == alloc.num_pages


def test_locked_nodes_survive_eviction() -> None:
    alloc, cache = make()
    a = put(alloc, cache, seq(0, 12))
    put(alloc, cache, seq(100, 8))
    m = cache.match_prefix(seq(0, 13))
    cache.lock(m.node)
    cache.lock(m.node)
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (3, 2)
    assert cache.evict(100) == 2
    assert cache.match_prefix(seq(0, 13)).pages == a
    assert cache.reset() == 0
    cache.unlock(m.node)
    assert cache.evict(100) == 0
    cache.unlock(m.node)
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (0, 3)
    assert cache.evict(1) == 3
    assert alloc.num_free_pages == alloc.num_pages
    with pytest.raises(RuntimeError, match="evicted"):
        cache.lock(m.node)


def test_unlock_below_zero_raises() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 8))
    m = cache.match_prefix(seq(0, 9))
    with pytest.raises(RuntimeError, match="below zero"):
        cache.unlock(m.node)
    cache.lock(m.node)
    cache.unlock(m.node)
    with pytest.raises(RuntimeError, match="below zero"):
        cache.unlock(m.node)
    assert cache.num_evictable_pages == 2
    cache.check_integrity()


def test_scheduler_usage_pattern_frees_the_whole_pool() -> None:
    alloc, cache = make(16)
    for prompt in (seq(0, 10), seq(0, 10), seq(0, 6) + seq(90, 7)):
        m = cache.match_prefix(prompt)
        cache.lock(m.node)
        alloc.incref(m.pages)
        tokens = prompt + [1, 2, 3]  # prompt plus generated tokens
        pages = m.pages + alloc.allocate(-(-len(tokens) // PS) - len(m.pages))
        cache.insert(tokens, pages)
        alloc.free(pages)
        cache.unlock(m.node)
        cache.check_integrity()
        alloc.check_integrity()
    assert cache.match_prefix(seq(0, 10) + [1, 2, 3, 4]).num_tokens == 12
    assert alloc.num_free_pages + cache.num_cached_pages == alloc.num_pages
    cache.reset()
    assert alloc.num_free_pages == alloc.num_pages


def test_check_integrity_catches_corruption() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 8))
    node = cache.match_prefix(seq(0, 9)).node
    node.lock_count = 1  # lock behind the counters' back
    with pytest.raises(AssertionError, match="counters"):
        cache.check_integrity()
    node.lock_count = 0
    alloc.free(node.pages)  # someone dropped the tree's reference
    with pytest.raises(AssertionError, match="free page"):
        cache.check_integrity()


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RadixCache(PageAllocator(4), 0)


def test_lock_match_inside_a_key_pins_only_the_matched_pages() -> None:
    alloc, cache = make()
    pages = put(alloc, cache, seq(0, 6 * PS))  # one 6-page key
    query = seq(0, 2 * PS) + [999] * 5  # shares its first 2 pages
    match = cache.match_prefix(query)
    assert (match.num_tokens, match.pages, match.num_node_pages) == (2 * PS, pages[:2], 2)
    locked = cache.lock_match(match)
    assert cache.num_locked_pages == 2 and cache.num_evictable_pages == 4
    cache.check_integrity()
    assert cache.evict(6) == 4  # the unmatched tail goes; the matched head stays
    assert cache.match_prefix(query).pages == pages[:2]
    cache.unlock(locked.node)
    assert cache.num_locked_pages == 0 and cache.num_evictable_pages == 2
    cache.check_integrity()
    assert cache.reset() == 2 and alloc.num_free_pages == alloc.num_pages


def test_lock_match_of_whole_keys_splits_nothing() -> None:
    alloc, cache = make()
    put(alloc, cache, seq(0, 3 * PS))
    match = cache.match_prefix(seq(0, 3 * PS) + [7])
    assert match.num_node_pages == 0
    locked = cache.lock_match(match)
    assert locked.node is match.node and cache.num_locked_pages == 3
    cache.unlock(locked.node)
    cache.check_integrity()


def test_evicting_namespaces_drops_their_unlocked_pages_only() -> None:
    """An unloaded adapter's trees go at once (``evict_namespaces``): every unlocked page of the namespaces
    picked is freed, a locked path stays whole, other namespaces are untouched."""
    alloc, cache = make()
    for ns in ("x", "y", None):
        put(alloc, cache, seq(0, 16), ns)
        put(alloc, cache, seq(0, 8) + seq(50, 8), ns)  # a branch off the first
    put(alloc, cache, seq(100, 8), "x2")
    held = cache.lock_match(cache.match_prefix(seq(0, 13), "y"))  # 3 pages of y's trunk in use
    before = cache.num_cached_pages
    freed = cache.evict_namespaces(lambda ns: ns in ("x", "y"))
    cache.check_integrity()
    alloc.check_integrity()
    assert freed == 6 + 3 and cache.num_cached_pages == before - freed  # x whole; y but its locked 3 pages
    assert cache.match_prefix(seq(0, 17), "x").num_tokens == 0
    assert cache.match_prefix(seq(0, 17), "y").num_tokens == 12
    assert cache.match_prefix(seq(0, 17)).num_tokens == 16 and cache.match_prefix(seq(100, 9), "x2").num_tokens == 8
    cache.unlock(held.node)
    assert cache.evict_namespaces(lambda ns: ns == "y") == 3
    assert cache.match_prefix(seq(0, 17), "y").num_tokens == 0
    cache.check_integrity()
    assert cache.evict(100) == 6 + 2  # the eviction heap still works over what is left (and the stale entries)
    cache.check_integrity()
