"""LoRA slot assignment (``scheduling.lora_slots``) and the step's token grouping (``actors.models.lora``)."""

from __future__ import annotations

import random

import pytest
import torch

from actors.models.lora import LoRAStep
from scheduling.lora_slots import NO_LORA, LoRASlots, cache_namespace, is_lora_namespace


def test_resident_adapters_share_slots_and_each_fill_is_loaded_once() -> None:
    slots = LoRASlots(2)
    assert slots.acquire("a") == 0 and slots.acquire("a") == 0 and slots.acquire("b") == 1
    assert slots.take_loads() == [(0, "a"), (1, "b")] and slots.take_loads() == []
    assert slots.acquire("c") is None  # both pinned
    slots.release(0)
    assert slots.acquire("c") is None  # "a" is still pinned once
    slots.release(0)
    assert slots.acquire("c") == 0 and slots.slot_of == {"c": 0, "b": 1}
    assert slots.take_loads() == [(0, "c")]
    assert slots.in_use("c") and not slots.in_use("a")


def test_the_least_recently_released_slot_goes_first() -> None:
    slots = LoRASlots(3)
    for name in "abc":
        slots.acquire(name)
    for slot in (1, 0, 2):
        slots.release(slot)
    assert slots.acquire("d") == 1 and slots.acquire("e") == 0
    slots.acquire("c")  # resident again: no load, leaves the eviction order
    assert slots.take_loads()[-2:] == [(1, "d"), (0, "e")]
    assert slots.acquire("f") is None


def test_an_unsent_load_is_superseded_and_forget_and_reset_empty_slots() -> None:
    slots = LoRASlots(1)
    slots.release(slots.acquire("a") or 0)
    assert slots.acquire("b") == 0 and slots.take_loads() == [(0, "b")]  # "a"'s fill never went out
    slots.release(0)
    slots.forget("b")
    assert slots.names == [None] and slots.acquire("a") == 0
    with pytest.raises(AssertionError, match="pinned"):
        slots.reset()
    slots.release(0)
    slots.reset()
    assert slots.slot_of == {} and slots.take_loads() == []


def test_cache_namespaces_keep_adapters_apart() -> None:
    assert cache_namespace(None, None) is None and cache_namespace("t", None) == "t"
    keys = {cache_namespace(ns, lora) for ns in (None, "t", "a") for lora in (None, "a", "t")}
    assert len(keys) == 9
    # An adapter's namespaces, in every tenant's namespace, and no other's (the pages its unload drops).
    for ns in (None, "t", "a"):
        assert is_lora_namespace(cache_namespace(ns, "a"), "a")
        assert not is_lora_namespace(cache_namespace(ns, "ba"), "a") and not is_lora_namespace(ns, "a")


@pytest.mark.parametrize("seed", range(5))
def test_step_grouping_covers_every_lora_token_once_within_twice_the_work(seed: int) -> None:
    rng = random.Random(seed)
    token_slots = [rng.choice([NO_LORA, 0, 1, 2, 3]) for _ in range(rng.randint(1, 300))]
    if rng.random() < 0.5:  # one long prompt of one adapter among decodes
        token_slots = [2] * 200 + token_slots
    step = LoRAStep.build(token_slots, torch.device("cpu"))
    lora_rows = [i for i, s in enumerate(token_slots) if s != NO_LORA]
    if not lora_rows:
        assert step is None
        return
    assert step is not None
    flat = step.gather.flatten().tolist()
    assert sorted(step.dst.tolist()) == lora_rows
    src = list(range(len(flat))) if step.src is None else step.src.tolist()
    assert [flat[i] for i in src] == step.dst.tolist()
    seg_len = step.gather.shape[1]
    for seg, slot in enumerate(step.slots.tolist()):
        rows = step.gather[seg].tolist()  # padding repeats a row of the segment's own slot
        assert all(token_slots[r] == slot for r in rows)
    assert step.gather.numel() <= 2 * len(lora_rows) + seg_len  # the padding bound of the module docstring
    assert step.gather_flat.tolist() == flat and step.base_rows == (len(lora_rows) < len(token_slots))
    if 2 * len(lora_rows) >= len(token_slots):  # every row read back in order: its own place, or the zero row
        assert step.inverse is not None
        assert [flat[p] if p < len(flat) else NO_LORA for p in step.inverse.tolist()] == [
            r if s != NO_LORA else NO_LORA for r, s in enumerate(token_slots)]
    else:
        assert step.inverse is None
    assert LoRAStep.build([NO_LORA] * 3, torch.device("cpu")) is None


def test_step_grouping_marks_the_shapes_that_need_no_copy() -> None:
    cpu = torch.device("cpu")
    decode = LoRAStep.build([2, 0, 1, 0, 2, 1], cpu)  # three adapters, two rows each: slots 0, 1, 2 in order
    assert decode is not None and decode.slot_range == (0, 3) and decode.whole_slot is None
    assert decode.slots.tolist() == [0, 1, 2] and decode.src is None  # no padding: nothing to select
    one = LoRAStep.build([3, 3, 3], cpu)
    assert one is not None and one.whole_slot == 3 and one.slot_range == (3, 1)
    mixed = LoRAStep.build([3, NO_LORA, 3], cpu)
    assert mixed is not None and mixed.whole_slot is None
    split = LoRAStep.build([0] * 5 + [1], cpu)  # slot 0 split into segments: no slice of the weights
    assert split is not None and split.slot_range is None and split.slots.tolist() == [0, 0, 1]
    assert split.src is not None and split.gather.tolist() == [[0, 1, 2], [3, 4, 3], [5, 5, 5]]
