"""Prefix-aware routing core: send a prompt where its prefix is likely cached.

The router cannot see replicas' KV caches, so it keeps an *approximate* copy:
for every replica, a character-level radix tree of the prompt text it recently
routed there. A new prompt goes to the replica with the longest matching
prefix, unless that replica's queue exceeds the least-loaded replica's by more
than ``imbalance_threshold``; then (and when nothing matches) it falls back to
power-of-two-choices over all replicas. Ties on match length go to the shorter
queue, so a prefix every replica has seen (a shared system prompt) spreads load.

Memory is bounded per replica (``max_chars_per_replica`` characters of edge
text, least-recently-used leaves evicted first) and entries older than
``ttl_s`` are dropped, mirroring how the replicas' own caches forget.

Invariant (given a non-decreasing ``now``): recording a prompt stamps every
node on its path with the same time, so a parent is never older than its children. The oldest node is thus
always a leaf, which lets eviction and expiry work leaf by leaf from a heap.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Mapping

# Removed replica ids are remembered (to never route to them again) up to this many.
_MAX_TOMBSTONES = 4096


class NoReplicaError(RuntimeError):
    """``route`` was given no live replica to choose from."""


class _Node:
    """A radix-tree node: ``edge`` is the text on the edge from ``parent``."""

    __slots__ = ("children", "edge", "last_access", "parent")

    def __init__(self, edge: str, parent: _Node | None, now: float) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last_access = now


def _common_len(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``.

    Slice comparisons run in C; a binary search over them beats a per-character
    Python loop on long prompts.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    """One replica's bounded, aging radix tree of routed prompt text."""

    def __init__(self) -> None:
        self.root = _Node("", None, float("-inf"))
        self.num_chars = 0
        # Lazy min-heap of (last_access, seq, leaf); stale entries are skipped on pop.
        self._heap: list[tuple[float, int, _Node]] = []
        self._seq = itertools.count()
        self._num_nodes = 0

    def match(self, text: str) -> int:
        """Number of leading characters of ``text`` present in the tree (read-only)."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common_len(child.edge, text[i:i + len(child.edge)])
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, text: str, now: float) -> None:
        """Record ``text``, stamping its whole path with ``now``."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, now)
                node.children[text[i]] = leaf
                self.num_chars += len(leaf.edge)
                self._num_nodes += 1
                self._push(leaf)
                return
            k = _common_len(child.edge, text[i:i + len(child.edge)])
            if k < len(child.edge):
                child = self._split(child, k)
            child.last_access = now
            i += k
            node = child
        if not node.children and node is not self.root:
            self._push(node)

    def evict(self, max_chars: int, expire_before: float) -> None:
        """Drop leaves older than ``expire_before``, then LRU leaves until ``max_chars`` fit."""
        while self._heap:
            last_access, _, leaf = self._heap[0]
            if not self._is_live_leaf(leaf, last_access):
                heapq.heappop(self._heap)
                continue
            if last_access >= expire_before and self.num_chars <= max_chars:
                break
            heapq.heappop(self._heap)
            self._remove_leaf(leaf)
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._rebuild_heap()

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` chars; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.edge)
        upper = _Node(child.edge[:k], parent, child.last_access)
        parent.children[upper.edge[0]] = upper
        child.edge = child.edge[k:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        self._num_nodes += 1
        return upper

    def _remove_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children
        del parent.children[leaf.edge[0]]
        leaf.parent = None
        self.num_chars -= len(leaf.edge)
        self._num_nodes -= 1
        if not parent.children and parent is not self.root:
            self._push(parent)

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._heap, (leaf.last_access, next(self._seq), leaf))

    def _is_live_leaf(self, node: _Node, stamp: float) -> bool:
        return node.parent is not None and not node.children and node.last_access == stamp

    def _rebuild_heap(self) -> None:
        """Drop stale heap entries (touching a leaf repeatedly leaves many behind)."""
        leaves: list[tuple[float, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append((node.last_access, next(self._seq), node))
        heapq.heapify(leaves)
        self._heap = leaves


class PrefixRouterCore:
    """Pick a replica for each prompt: prefix affinity, bounded by load balance.

    ``loads`` maps each live replica id to its queue length; only those ids are
    candidates. ``remove_replica`` forgets a replica's tree and keeps it out of
    later routing even if stale load reports still list it (Serve's replica ids
    are never reused). A match shorter than ``min_match_chars`` (default: about
    one KV page of text) is no affinity at all: a few shared characters are not
    worth a queue.
    """

    def __init__(
        self,
        *,
        max_chars_per_replica: int = 1_000_000,
        ttl_s: float = 600.0,
        imbalance_threshold: float = 8.0,
        min_match_chars: int = 64,
        seed: int | None = None,
    ) -> None:
        if max_chars_per_replica < 1:
            raise ValueError(f"max_chars_per_replica must be >= 1, got {max_chars_per_replica}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not imbalance_threshold >= 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        if min_match_chars < 1:
            raise ValueError(f"min_match_chars must be >= 1, got {min_match_chars}")
        self.max_chars_per_replica = max_chars_per_replica
        self.ttl_s = ttl_s
        self.imbalance_threshold = imbalance_threshold
        self.min_match_chars = min_match_chars
        self._rng = random.Random(seed)
        self._trees: dict[str, PrefixTree] = {}
        self._removed: OrderedDict[str, None] = OrderedDict()

    def route(self, prompt_text: str, loads: Mapping[str, float], now: float) -> str:
        """The replica for ``prompt_text``; the prompt is recorded under it."""
        best = self.choose(prompt_text, loads, now)
        self.record(best, prompt_text, now)
        return best

    def choose(self, prompt_text: str, loads: Mapping[str, float], now: float) -> str:
        """The replica ``route`` would pick, without recording the prompt.

        For callers that learn only later where the request really went (Serve
        may try another replica if the first refuses): they ``record`` then.
        """
        candidates = [r for r in loads if r not in self._removed]
        if not candidates:
            raise NoReplicaError("no live replica to route to")
        matches = self.match(prompt_text, candidates, now)
        least = min(loads[r] for r in candidates)
        best = max(candidates, key=lambda r: (matches[r], -loads[r]))
        if matches[best] < self.min_match_chars or loads[best] - least > self.imbalance_threshold:
            best = self.power_of_two(candidates, loads)
        return best

    def match(self, prompt_text: str, replicas: list[str], now: float) -> dict[str, int]:
        """Matched prefix length of ``prompt_text`` per replica, after expiring old entries."""
        out: dict[str, int] = {}
        for r in replicas:
            tree = self._trees.get(r)
            if tree is None:
                out[r] = 0
                continue
            tree.evict(self.max_chars_per_replica, now - self.ttl_s)
            out[r] = tree.match(prompt_text)
        return out

    def power_of_two(self, candidates: list[str], loads: Mapping[str, float]) -> str:
        """Sample two distinct replicas at random; the shorter queue wins (first on ties)."""
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return b if loads[b] < loads[a] else a

    def record(self, replica_id: str, prompt_text: str, now: float) -> None:
        """Note that ``prompt_text`` was sent to ``replica_id``; enforce its memory bound."""
        if replica_id in self._removed:
            return
        tree = self._trees.setdefault(replica_id, PrefixTree())
        # A prompt longer than the whole budget keeps its head: prefixes are what match.
        tree.insert(prompt_text[: self.max_chars_per_replica], now)
        tree.evict(self.max_chars_per_replica, now - self.ttl_s)

    def remove_replica(self, replica_id: str) -> None:
        """Forget ``replica_id``: drop its tree and never route to it again."""
        self._trees.pop(replica_id, None)
        self._removed[replica_id] = None
        while len(self._removed) > _MAX_TOMBSTONES:
            self._removed.popitem(last=False)

    def forget_missing(self, live_ids: set[str]) -> None:
        """Drop the tree of every replica not in ``live_ids`` (it left the fleet, or is draining).

        Unlike ``remove_replica`` this leaves no tombstone: a replica that comes
        back (briefly unreachable, not removed) is routed to again, with a fresh tree.
        """
        for replica_id in [r for r in self._trees if r not in live_ids]:
            del self._trees[replica_id]

    def num_chars(self, replica_id: str) -> int:
        """Characters of prompt text currently held for ``replica_id`` (0 if none)."""
        tree = self._trees.get(replica_id)
        return tree.num_chars if tree is not None else 0
