"""``cli.bench.accuracy.divergence``: where two greedy outputs part and the base's top-2 gap there."""

from __future__ import annotations

import torch

from cli.bench.accuracy.divergence import divergences, first_difference, margin_quantiles, top2_gaps


def test_first_difference_counts_an_ending_as_a_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 7]) == 2
    assert first_difference([], [4]) == 0


def test_divergences_report_the_base_gap_where_outputs_part() -> None:
    logits = [torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.9, 0.0]]), torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 4.0]])]
    base = [[0, 0], [1, 2]]
    found = divergences(base, [[0, 1], [1, 2]], logits)
    assert len(found) == 1 and found[0]["request"] == 0 and found[0]["position"] == 1
    assert abs(found[0]["base_margin"] - 0.1) < 1e-6
    # Against ran past the base's end: no base logits there, so no gap.
    assert divergences([[0, 0]], [[0, 0, 2]], logits[:1]) == [{"request": 0, "position": 2, "base_margin": None}]


def test_margin_quantiles_take_each_request_s_smallest_gap() -> None:
    logits = [torch.tensor([[5.0, 1.0], [2.0, 1.5]]), torch.tensor([[0.0, 3.0]]), torch.tensor([[1.0, 1.25]])]
    assert torch.allclose(top2_gaps(logits[0]), torch.tensor([4.0, 0.5]))
    q = margin_quantiles(logits)
    assert q["min"] == 0.25 and q["p50"] == 0.5
    assert margin_quantiles([]) == {}
