"""Stateful property test of PageAllocator + RadixCache used the way the scheduler uses them.

The test keeps its own model: the references it holds outside the tree (per
page), the requests it has admitted (locked match + pages), raw holds (some
on tree pages without a lock, as a sibling of an ``n > 1`` request holds its
prompt pages), and what tokens each tree page holds. Since the tree holds exactly one reference per page,
``ref_count(p) - outside[p]`` must be 1 for tree pages and 0 otherwise; that
gives the tree's page set independently of the tree's own bookkeeping.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcache.errors import OutOfPagesError
from kvcache.page_allocator import PageAllocator
from kvcache.radix_cache import RadixCache, RadixNode

NUM_PAGES = 32
# Prompts are a cut of one of a few shared bases plus a random tail over a tiny
# vocabulary, so prefixes collide often and diverge both on and inside pages.
_BASE = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
_BASES = [_BASE, _BASE[:4] + [2, 2, 2, 2, 1, 1, 1, 1], _BASE[:6] + [1, 0, 1, 0, 1, 0]]
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(_BASES),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=5),
).filter(bool)
namespace_st = st.sampled_from([None, "a"])

Content = tuple[str | None, tuple[int, ...]]  # (namespace, every token up to the page's end)


@dataclass
class Admitted:
    """A running request: its lock on the match and its own page references."""

    tokens: list[int]  # prompt + tokens it will have generated when it finishes
    namespace: str | None
    node: RadixNode
    matched: list[int]
    pages: list[int]


class CacheMachine(RuleBasedStateMachine):
    """Random admit / finish / abort / raw allocate / free / match / evict sequences."""

    @initialize(page_size=st.integers(2, 4))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(NUM_PAGES)
        self.cache = RadixCache(self.alloc, page_size)
        self.outside: Counter[int] = Counter()  # references the test holds
        self.requests: list[Admitted] = []
        self.groups: list[list[int]] = []  # raw allocations, unrelated to the tree
        self.content: dict[int, Content] = {}  # valid for pages while in the tree

    # --- model helpers -------------------------------------------------------

    def tree_pages(self) -> set[int]:
        return {p for p in range(NUM_PAGES) if self.alloc.ref_count(p) > self.outside[p]}

    def expected_match(self, tokens: list[int], ns: str | None) -> int:
        """Pages the tree should match, from the content model alone."""
        cached = {self.content[p] for p in self.tree_pages()}
        limit = (len(tokens) - 1) // self.ps
        n = 0
        while n < limit and (ns, tuple(tokens[: (n + 1) * self.ps])) in cached:
            n += 1
        return n

    def check_match(self, tokens: list[int], ns: str | None) -> list[int]:
        m = self.cache.match_prefix(tokens, ns)
        assert m.num_tokens == len(m.pages) * self.ps
        assert m.num_tokens < len(tokens) or not tokens
        assert len(m.pages) == self.expected_match(tokens, ns)
        for i, page in enumerate(m.pages):
            assert self.content[page] == (ns, tuple(tokens[: (i + 1) * self.ps]))
        return m.pages

    def count_nodes(self) -> int:
        """Nodes in the tree (two new nodes from one insert means a split)."""
        stack = list(self.cache._roots.values())
        n = 0
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n

    def release(self, pages: list[int]) -> None:
        self.alloc.free(pages)
        self.outside.subtract(pages)

    # --- rules ---------------------------------------------------------------

    @rule(prompt=tokens_st, generated=st.integers(0, 6), ns=namespace_st)
    def admit(self, prompt: list[int], generated: int, ns: str | None) -> None:
        self.check_match(prompt, ns)
        m = self.cache.match_prefix(prompt, ns)
        event(f"admit: matched {min(len(m.pages), 2)}+ pages")
        self.cache.lock(m.node)
        self.alloc.incref(m.pages)
        self.outside.update(m.pages)
        tokens = prompt + [(len(prompt) + i) % 3 for i in range(generated)]
        need = -(-len(tokens) // self.ps) - len(m.pages)
        if not self.alloc.can_allocate(need):
            self.cache.evict(need - self.alloc.num_free_pages)
        if not self.alloc.can_allocate(need):
            # Short of pages only once nothing unlocked is left to evict.
            assert self.cache.num_evictable_pages == 0
            free_before = self.alloc.num_free_pages
            with pytest.raises(OutOfPagesError):
                self.alloc.allocate(need)
            assert self.alloc.num_free_pages == free_before
            event("admit: out of pages after evicting")
            self.release(m.pages)
            self.cache.unlock(m.node)
            return
        pages = m.pages + self.alloc.allocate(need)
        self.outside.update(pages[len(m.pages) :])
        self.requests.append(Admitted(tokens, ns, m.node, list(m.pages), pages))

    @precondition(lambda self: self.requests)
    @rule(idx=st.integers(0, 1000))
    def finish(self, idx: int) -> None:
        req = self.requests.pop(idx % len(self.requests))
        nodes_before = self.count_nodes()
        present = self.cache.insert(req.tokens, req.pages, req.namespace)
        event(f"finish: {self.count_nodes() - nodes_before} new nodes")
        assert present % self.ps == 0 and present >= len(req.matched) * self.ps
        for i in range(present // self.ps, len(req.tokens) // self.ps):
            self.content[req.pages[i]] = (req.namespace, tuple(req.tokens[: (i + 1) * self.ps]))
        self.release(req.pages)
        self.cache.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(idx=st.integers(0, 1000))
    def abort(self, idx: int) -> None:
        req = self.requests.pop(idx % len(self.requests))
        self.release(req.pages)
        self.cache.unlock(req.node)

    @rule(n=st.integers(0, 12))
    def allocate_raw(self, n: int) -> None:
        if self.alloc.can_allocate(n):
            pages = self.alloc.allocate(n)
            self.outside.update(pages)
            self.groups.append(pages)
        else:
            with pytest.raises(OutOfPagesError):
                self.alloc.allocate(n)

    @rule(tokens=tokens_st, ns=namespace_st)
    def hold_cached(self, tokens: list[int], ns: str | None) -> None:
        """Reference matched tree pages without a lock; evicting them then frees nothing."""
        pages = self.check_match(tokens, ns)
        event(f"hold: {min(len(pages), 2)}+ tree pages")
        self.alloc.incref(pages)
        self.outside.update(pages)
        self.groups.append(list(pages))

    @precondition(lambda self: self.groups)
    @rule(idx=st.integers(0, 1000))
    def free_raw(self, idx: int) -> None:
        self.release(self.groups.pop(idx % len(self.groups)))

    @rule(tokens=tokens_st, ns=namespace_st)
    def match(self, tokens: list[int], ns: str | None) -> None:
        self.check_match(tokens, ns)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        evictable = self.cache.num_evictable_pages
        cached = self.cache.num_cached_pages
        free = self.alloc.num_free_pages
        before = self.tree_pages()
        freed = self.cache.evict(n)
        gone = before - self.tree_pages()
        event(f"evict: freed {'some' if freed else 'none'}, dropped {'more' if len(gone) > freed else 'as many'}")
        # The count is of pages back on the free list, not of tree pages dropped.
        assert freed == sum(1 for p in gone if not self.outside[p])
        assert self.alloc.num_free_pages == free + freed
        assert len(gone) <= evictable
        assert self.cache.num_cached_pages == cached - len(gone)
        if freed < n:  # stopped short only with nothing unlocked left
            assert self.cache.num_evictable_pages == 0
        # Pages a running request matched are locked, hence still in the tree.
        assert not gone & {p for r in self.requests for p in r.matched}

    # --- invariants, checked after every step --------------------------------

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_integrity()
        self.cache.check_integrity()
        tree = self.tree_pages()
        held_only_outside = 0
        for p in range(NUM_PAGES):
            extra = self.alloc.ref_count(p) - self.outside[p]
            assert extra in (0, 1), (
                f"page {p}: ref {self.alloc.ref_count(p)}, test holds {self.outside[p]}"
            )
            assert self.alloc.is_free(p) == (self.outside[p] == 0 and p not in tree)
            held_only_outside += self.outside[p] > 0 and p not in tree
        assert len(tree) == self.cache.num_cached_pages
        assert len({self.content[p] for p in tree}) == len(tree), "two tree pages hold one prefix"
        assert (
            self.alloc.num_free_pages
            + self.cache.num_evictable_pages
            + self.cache.num_locked_pages
            + held_only_outside
            == NUM_PAGES
        )
        matched = {p for r in self.requests for p in r.matched}
        assert matched <= tree and len(matched) <= self.cache.num_locked_pages

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        while self.requests:
            self.abort(0)
        while self.groups:
            self.free_raw(0)
        assert self.cache.num_locked_pages == 0
        assert self.cache.reset() >= 0
        assert self.cache.num_cached_pages == 0
        assert self.alloc.num_free_pages == NUM_PAGES
        self.alloc.check_integrity()
        self.cache.check_integrity()


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheProperties = CacheMachine.TestCase
