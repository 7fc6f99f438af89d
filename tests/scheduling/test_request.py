from __future__ import annotations

import pytest

from scheduling.request import Request, RequestStatus
from scheduling.sampling_params import SamplingParams


def test_lifecycle_allows_only_documented_transitions() -> None:
    r = Request("a", [1, 2, 3], SamplingParams())
    assert r.status is RequestStatus.WAITING
    with pytest.raises(RuntimeError):
        r.set_status(RequestStatus.FINISHED)  # must run first
    r.set_status(RequestStatus.RUNNING)
    r.set_status(RequestStatus.PREEMPTED)
    with pytest.raises(RuntimeError):
        r.set_status(RequestStatus.RUNNING)  # back through WAITING only
    r.set_status(RequestStatus.WAITING)
    r.set_status(RequestStatus.RUNNING)
    r.set_status(RequestStatus.FINISHED)
    with pytest.raises(RuntimeError):
        r.set_status(RequestStatus.ABORTED)
    assert r.is_finished


def test_token_accounting() -> None:
    r = Request("b", [5, 6], SamplingParams())
    r.output_token_ids.extend([7, 8, 9])
    assert r.num_tokens == 5 and r.num_prompt_tokens == 2
    assert r.all_token_ids == [5, 6, 7, 8, 9]
