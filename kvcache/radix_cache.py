"""Radix tree over page-aligned token prefixes, sharing KV pages between requests.

Ownership: the tree holds exactly one allocator reference on every page it
stores. ``match_prefix`` hands out none (callers ``incref`` what they keep);
``insert`` adopts pages only for token ranges the tree lacks; ``evict`` drops
the tree's reference. ``lock`` pins a node and its ancestors against eviction.
An unlocked page may still be referenced by someone else (a sibling of an
``n > 1`` request shares its prompt pages without a lock), so evicting it
frees nothing: ``evict`` counts only pages that reach the free list.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.page_allocator import PageAllocator

Key = tuple[int, ...]
_UIDS = itertools.count()  # heap tie-breaker: nodes themselves are unordered


class RadixNode:
    """One edge of the tree: a run of full pages and the tokens they hold."""

    __slots__ = ("key", "pages", "children", "parent", "lock_count", "last_access", "queued",
                 "removed", "namespace", "uid")  # fmt: skip

    def __init__(self, key: Key, pages: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[Key, RadixNode] = {}
        self.parent = parent  # None only for a namespace root
        self.lock_count = 0
        self.last_access = 0
        self.queued = False  # has an entry in the eviction heap
        self.removed = False  # evicted; a stale handle must not be locked
        self.namespace: str | None = None  # meaningful on roots only
        self.uid = next(_UIDS)

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, pages={self.pages}, lock={self.lock_count})"


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """``pages`` cover the first ``num_tokens`` tokens; pass ``node`` to ``lock``/``unlock``.

    ``node`` is a root (lock and unlock are no-ops on it) when nothing matched.
    ``num_node_pages``: when the match stops inside ``node``, how many of its
    pages it covers (0 when it covers ``node`` whole); ``lock_match`` splits
    the node there, so only matched pages are pinned.
    """

    pages: list[int]
    num_tokens: int
    node: RadixNode
    num_node_pages: int = 0


class RadixCache:
    """LRU prefix cache of KV pages, one tree per namespace (``None`` is the default)."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        """Build an empty cache whose pages come from ``allocator``."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[str | None, RadixNode] = {None: RadixNode((), [], None)}
        # Returned for namespaces with no tree yet, so a lookup never creates one.
        self._empty_root = RadixNode((), [], None)
        self._clock = 0
        # (access time, uid, node). Lazy: an entry may be stale (node no longer
        # an unlocked leaf, or touched since). Every unlocked non-root leaf is
        # queued, with an entry time <= its last_access; one entry per node.
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._num_evictable = 0  # pages on unlocked non-root nodes
        self._num_locked = 0  # pages on locked nodes

    @property
    def num_cached_pages(self) -> int:
        """Pages held by the tree."""
        return self._num_evictable + self._num_locked

    @property
    def num_evictable_pages(self) -> int:
        """Tree pages on unlocked nodes (all of them can be evicted)."""
        return self._num_evictable

    @property
    def num_locked_pages(self) -> int:
        """Tree pages on locked nodes."""
        return self._num_locked

    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of ``token_ids``, leaving >= 1 token uncovered.

        Touches only LRU access times; no structure or reference count changes.
        """
        ps = self.page_size
        tokens = tuple(token_ids)
        limit = (len(tokens) - 1) // ps * ps if tokens else 0
        node, num_tokens, num_node_pages, pages = self._walk(tokens, limit, namespace)
        return PrefixMatch(pages, num_tokens, node, num_node_pages)

    def insert(
        self, token_ids: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> int:
        """Cache the full pages of ``token_ids``; return how many tokens were already cached.

        ``pages[i]`` holds tokens ``i*page_size ..``. Cached ranges keep the
        tree's pages; new ranges adopt the caller's with one ``incref``. The
        caller keeps its own references and drops them afterwards.
        """
        ps = self.page_size
        num_full = len(token_ids) // ps
        if len(pages) < num_full:
            raise ValueError(f"{len(token_ids)} tokens need {num_full} pages, got {len(pages)}")
        end = num_full * ps
        tokens = tuple(token_ids)[:end]
        node, pos, split_pages, _ = self._walk(tokens, end, namespace)
        if pos == end:  # everything was cached already (maybe as a prefix of a longer key)
            return pos
        new_pages = list(pages[pos // ps : num_full])
        self.allocator.incref(new_pages)  # first, so a bad page leaves the tree untouched
        if node is self._empty_root:
            node = self._roots[namespace] = RadixNode((), [], None)
            node.namespace = namespace
        elif split_pages:
            node = self._split(node, split_pages)
        leaf = RadixNode(tokens[pos:], new_pages, node)
        leaf.last_access = self._clock
        node.children[leaf.key[:ps]] = leaf
        self._num_evictable += len(new_pages)
        self._enqueue(leaf)
        return pos

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction (one count each)."""
        if node.removed:
            raise RuntimeError("lock of a node that was evicted from the tree")
        while node.parent is not None:
            if node.lock_count == 0:
                self._num_evictable -= len(node.pages)
                self._num_locked += len(node.pages)
            node.lock_count += 1
            node = node.parent

    def lock_match(self, match: PrefixMatch) -> PrefixMatch:
        """Lock exactly ``match``'s pages (call it before anything else changes the tree).

        A match that stops inside a node first splits the node there, so the
        node's unmatched tail stays evictable: pinning it would keep a request
        from evicting the very pages it needs, with room to be had. Returns the
        match naming the node to ``unlock`` later.
        """
        node = match.node
        if match.num_node_pages and not node.removed and match.num_node_pages < len(node.pages):
            node = self._split(node, match.num_node_pages)
        self.lock(node)
        return PrefixMatch(match.pages, match.num_tokens, node)

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``; raises ``RuntimeError`` if ``node`` is not locked."""
        if node.parent is not None and node.lock_count <= 0:
            raise RuntimeError(f"unlock below zero of {node!r}")
        while node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                self._num_locked -= len(node.pages)
                self._num_evictable += len(node.pages)
                if not node.children:
                    self._enqueue(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Drop LRU unlocked whole leaves until ``num_pages`` pages are freed (or none is left).

        Counts pages back on the free list, not tree pages dropped (a shared
        page frees nothing); returns that count.
        """
        heap = self._heap
        free_before = self.allocator.num_free_pages
        freed = 0
        while freed < num_pages and heap:
            stamp, _, node = heap[0]
            if node.removed or node.children or node.lock_count:
                heapq.heappop(heap)  # re-queued when it is an unlocked leaf again
                node.queued = False
            elif stamp < node.last_access:  # touched since queued: move it back
                heapq.heapreplace(heap, (node.last_access, node.uid, node))
            else:
                heapq.heappop(heap)
                node.queued = False
                self._remove_leaf(node)
                freed = self.allocator.num_free_pages - free_before
        return freed

    def evict_namespaces(self, which: Callable[[str | None], bool]) -> int:
        """Evict every unlocked page of each namespace ``which`` picks (its KV must never be served again).

        Locked nodes stay (a request still reads them). Returns the pages freed, as ``evict`` counts them.
        """
        free_before = self.allocator.num_free_pages
        for namespace in [ns for ns in self._roots if which(ns)]:
            order, stack = [], [self._roots[namespace]]
            while stack:  # pre-order: every node before its children
                node = stack.pop()
                order.append(node)
                stack.extend(node.children.values())
            for node in reversed(order):  # children first, so each node is a leaf by its turn
                if node.parent is not None and not node.children and node.lock_count == 0:
                    self._remove_leaf(node)  # its heap entry, if any, is dropped lazily (node.removed)
        return self.allocator.num_free_pages - free_before

    def reset(self) -> int:
        """Evict every unlocked page (ancestors of locked nodes are locked); return the pages freed."""
        # Every unlocked node goes: the target cannot be met before the heap empties.
        return self.evict(self._num_evictable + 1)

    def check_integrity(self) -> None:
        """Verify every structural invariant against a full walk; raise ``AssertionError``."""
        ps = self.page_size
        owner: dict[int, RadixNode] = {}
        evictable = locked = 0
        assert not self._empty_root.children, "the shared empty root gained children"
        for ns, root in self._roots.items():
            assert root.parent is None and root.key == () and not root.pages and not root.removed
            assert root.namespace == ns and root.lock_count == 0, f"bad root of {ns!r}"
            assert ns is None or root.children, f"empty root of namespace {ns!r} was not pruned"
            stack = [root]
            while stack:
                node = stack.pop()
                for first, child in node.children.items():
                    where = f"{child!r} in namespace {ns!r}"
                    assert child.parent is node and not child.removed, f"stale link to {where}"
                    assert child.key and len(first) == ps, f"empty key or bad dict key at {where}"
                    assert child.key[:ps] == first, f"key of {where} does not start with {first}"
                    assert len(child.key) == len(child.pages) * ps, f"key/pages mismatch at {where}"
                    assert child.lock_count >= 0, f"negative lock at {where}"
                    if node.parent is not None:
                        assert node.lock_count >= child.lock_count, f"lock > parent's: {where}"
                        assert node.last_access >= child.last_access, f"parent older at {where}"
                    for page in child.pages:
                        assert page not in owner, f"page {page} at {where} also at {owner[page]!r}"
                        owner[page] = child
                        assert self.allocator.ref_count(page) >= 1, f"free page {page} at {where}"
                    if child.lock_count:
                        locked += len(child.pages)
                    else:
                        evictable += len(child.pages)
                        assert child.children or child.queued, f"unqueued evictable leaf {where}"
                    stack.append(child)
        assert (evictable, locked) == (self._num_evictable, self._num_locked), (
            f"counters evictable={self._num_evictable} locked={self._num_locked}, "
            f"walk found evictable={evictable} locked={locked}"
        )
        # One entry per queued node, never newer than the node (else LRU order breaks).
        uids = {uid for _, uid, _ in self._heap}
        assert len(uids) == len(self._heap), "a node has two eviction heap entries"
        for stamp, uid, node in self._heap:
            assert node.queued and uid == node.uid and stamp <= node.last_access, f"heap: {node!r}"

    def _walk(
        self, tokens: Key, end: int, namespace: str | None
    ) -> tuple[RadixNode, int, int, list[int]]:
        # Follow tokens[:end] down the tree, touching each node passed. Returns
        # (deepest node reached, tokens matched, pages matched inside that node
        # when the match stops inside it else 0, pages covering the match).
        ps = self.page_size
        node = self._roots.get(namespace, self._empty_root)
        self._clock += 1
        clock = self._clock
        pages: list[int] = []
        pos = 0
        while pos < end:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            child.last_access = clock
            node = child
            klen = len(child.key)
            # A one-page key is already proven equal by the dict lookup.
            if pos + klen <= end and (klen == ps or tokens[pos : pos + klen] == child.key):
                pages += child.pages
                pos += klen
                continue
            n = self._common_pages(tokens, pos, child.key, (end - pos) // ps)
            pages += child.pages[:n]
            return node, pos + n * ps, n, pages
        return node, pos, 0, pages

    def _common_pages(self, tokens: Key, pos: int, key: Key, max_pages: int) -> int:
        # Leading pages of ``key`` equal to ``tokens[pos:]`` (<= max_pages); the
        # first is known equal (dict lookup). Binary search over C-level slice
        # comparisons rather than a Python loop over tokens.
        ps = self.page_size
        lo, hi = 1, min(max_pages, len(key) // ps)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens[pos : pos + mid * ps] == key[: mid * ps]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        # Returns the new upper half. ``node`` keeps the lower half so handles
        # callers hold still lock all they locked; each lock on ``node`` also
        # covers its new parent, hence the copied lock count (counters unchanged).
        parent = node.parent
        assert parent is not None and 0 < num_pages < len(node.pages)
        cut = num_pages * self.page_size
        upper = RadixNode(node.key[:cut], node.pages[:num_pages], parent)
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        parent.children[node.key[: self.page_size]] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _enqueue(self, node: RadixNode) -> None:
        if not node.queued:
            node.queued = True
            heapq.heappush(self._heap, (node.last_access, node.uid, node))

    def _remove_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_count == 0
        self.allocator.free(node.pages)  # first: if it raises, the tree is unchanged
        del parent.children[node.key[: self.page_size]]
        node.removed = True
        self._num_evictable -= len(node.pages)
        if parent.parent is not None:
            if not parent.children and parent.lock_count == 0:
                self._enqueue(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # keep one-off tenants from leaking roots
        return len(node.pages)
