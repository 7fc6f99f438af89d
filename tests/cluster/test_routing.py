"""Prefix-aware routing core: radix tree against a model, affinity, load, aging, memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.routing import NoReplicaError, PrefixRouterCore, PrefixTree

EVEN = {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def edge_chars(tree: PrefixTree) -> int:
    """Characters actually held, counted by walking the tree."""
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        total += len(node.edge)
        for key, child in node.children.items():
            assert child.parent is node and child.edge and child.edge[0] == key
            assert child.last_access <= node.last_access or node is tree.root
            stack.append(child)
    return total


texts = st.text(alphabet="abc", max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(texts, max_size=20), st.lists(texts, max_size=10))
def test_tree_match_equals_longest_common_prefix(inserted: list[str], queries: list[str]) -> None:
    tree = PrefixTree()
    for i, text in enumerate(inserted):
        tree.insert(text, float(i))
    for q in queries + inserted:
        assert tree.match(q) == max((common(q, t) for t in inserted), default=0)
    assert tree.num_chars == edge_chars(tree)


@settings(max_examples=200, deadline=None)
@given(st.lists(texts, max_size=40), st.integers(1, 30))
def test_tree_memory_bound_and_lru(inserted: list[str], cap: int) -> None:
    tree = PrefixTree()
    for i, text in enumerate(inserted):
        tree.insert(text[:cap], float(i))
        tree.evict(cap, float("-inf"))
        assert tree.num_chars <= cap
        assert tree.num_chars == edge_chars(tree)
        # The prompt just recorded is the most recent: it always survives.
        assert tree.match(text[:cap]) == len(text[:cap])


def test_lru_evicts_least_recently_used_entry() -> None:
    tree = PrefixTree()
    tree.insert("aaaa", 0.0)
    tree.insert("bbbb", 1.0)
    tree.insert("aaaa", 2.0)  # touch: now "bbbb" is the oldest
    tree.insert("cccc", 3.0)
    tree.evict(8, float("-inf"))
    assert (tree.match("aaaa"), tree.match("bbbb"), tree.match("cccc")) == (4, 0, 4)


def test_same_prefix_goes_to_the_same_replica() -> None:
    core = PrefixRouterCore(seed=0)
    docs = [f"<doc {i}> " + "lorem ipsum " * 20 for i in range(8)]
    first = {i: core.route(doc + "question 0", EVEN, 0.0) for i, doc in enumerate(docs)}
    for q in range(1, 10):
        for i, doc in enumerate(docs):
            assert core.route(doc + f"question {q}", EVEN, float(q)) == first[i]
    assert len(set(first.values())) > 1  # distinct prefixes spread over replicas


def test_equal_matches_go_to_the_shorter_queue() -> None:
    core = PrefixRouterCore(min_match_chars=8, seed=0)
    for r in ("a", "b"):
        core.record(r, "SYSTEM: be helpful. ", 0.0)
    loads = {"a": 3.0, "b": 1.0}
    assert core.route("SYSTEM: be helpful. hi", loads, 1.0) == "b"


def test_overloaded_affinity_replica_is_overridden() -> None:
    core = PrefixRouterCore(imbalance_threshold=8, min_match_chars=8, seed=0)
    core.record("a", "shared prefix, long enough to matter", 0.0)
    prompt = "shared prefix, long enough to matter. Q?"
    assert core.route(prompt, {"a": 8.0, "b": 0.0}, 1.0) == "a"  # within threshold
    assert core.route(prompt, {"a": 9.0, "b": 0.0}, 2.0) == "b"  # beyond: p2c picks b


def test_entries_age_out_after_ttl() -> None:
    core = PrefixRouterCore(ttl_s=60, seed=0)
    core.record("a", "remember me", 0.0)
    assert core.match("remember me", ["a"], 59.0) == {"a": 11}
    core.record("a", "remember", 59.0)  # refreshes only the shared part
    assert core.match("remember me", ["a"], 100.0) == {"a": 8}
    assert core.match("remember me", ["a"], 200.0) == {"a": 0}
    assert core.num_chars("a") == 0


def test_memory_bound_per_replica() -> None:
    core = PrefixRouterCore(max_chars_per_replica=1000, seed=1)
    for i in range(500):
        core.route(f"user {i}: " + "x" * (i % 300), {"a": 0.0, "b": 0.0}, float(i))
        assert core.num_chars("a") <= 1000 and core.num_chars("b") <= 1000
    core.record("a", "y" * 5000, 600.0)  # longer than the budget: keeps its head
    assert core.num_chars("a") == 1000
    assert core.match("y" * 5000, ["a"], 600.0) == {"a": 1000}


def test_removed_replicas_are_never_chosen() -> None:
    core = PrefixRouterCore(seed=0)
    core.record("a", "my prompt", 0.0)
    core.remove_replica("a")
    assert core.num_chars("a") == 0
    stale_loads = {"a": 0.0, "b": 50.0, "c": 60.0}
    for i in range(50):
        assert core.route("my prompt", stale_loads, float(i)) != "a"
    core.record("a", "my prompt", 60.0)
    assert core.num_chars("a") == 0
    with pytest.raises(NoReplicaError):
        core.route("x", {"a": 0.0}, 61.0)
    with pytest.raises(NoReplicaError):
        core.route("x", {}, 61.0)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 100),
                                            min_size=2))
def test_power_of_two_never_picks_the_most_loaded(seed: int, loads: dict[str, float]) -> None:
    core = PrefixRouterCore(seed=seed)
    worst = max(loads.values())
    if list(loads.values()).count(worst) > 1:
        return
    choice = core.power_of_two(list(loads), loads)
    assert loads[choice] < worst


def test_power_of_two_picks_the_less_loaded_of_two() -> None:
    for seed in range(20):
        core = PrefixRouterCore(seed=seed)
        assert core.route(f"fresh {seed}", {"a": 5.0, "b": 1.0}, 0.0) == "b"


def test_seeded_routing_is_reproducible() -> None:
    loads = {r: float(i % 3) for i, r in enumerate("abcdefgh")}

    def run() -> list[str]:
        core = PrefixRouterCore(seed=42)
        return [core.route(f"prompt {i}", loads, float(i)) for i in range(50)]

    assert run() == run()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_chars_per_replica": 0},
        {"ttl_s": 0},
        {"imbalance_threshold": -1},
        {"min_match_chars": 0},
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PrefixRouterCore(**kwargs)  # type: ignore[arg-type]


def test_choose_does_not_record_and_forget_missing_leaves_no_tombstone() -> None:
    core = PrefixRouterCore(min_match_chars=8, seed=0)
    prompt = "a long shared system prompt. Q?"
    picked = core.choose(prompt, EVEN, 0.0)
    assert picked in EVEN and core.num_chars(picked) == 0  # choose alone remembers nothing
    core.record("b", prompt, 0.0)
    assert core.choose(prompt, EVEN, 1.0) == "b"
    core.forget_missing({"a", "c", "d"})
    assert core.num_chars("b") == 0
    assert core.route(prompt, {"b": 0.0}, 2.0) == "b"  # back in the fleet: a candidate again
