"""``actors.api``: the boundary types stay light, and finish reasons keep their wire strings."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from actors.api import FinishReason, SequenceDelta

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_boundary_pulls_in_no_torch_ray_or_transformers() -> None:
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import actors.api; "
            f"print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_finish_reason_is_its_wire_string() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert json.dumps({"finish_reason": FinishReason.STOP}) == '{"finish_reason": "stop"}'
    assert (f"{FinishReason.LENGTH}", str(FinishReason.ABORT)) == ("length", "abort")  # not "FinishReason.ABORT"
    assert FinishReason("error") is FinishReason.ERROR and FinishReason.ERROR == "error"
    assert pickle.loads(pickle.dumps(FinishReason.STOP)) is FinishReason.STOP  # as it crosses Ray


def test_completed_and_failed_split_the_reasons() -> None:
    assert [r for r in FinishReason if r.completed] == [FinishReason.STOP, FinishReason.LENGTH]
    assert [r for r in FinishReason if r.failed] == [FinishReason.ABORT, FinishReason.ERROR]


def test_a_delta_is_built_by_keyword_only() -> None:
    with pytest.raises(TypeError):
        SequenceDelta("r", 0, [], "", None)  # type: ignore[misc]
    d = SequenceDelta(request_id="r", index=0, token_ids=[], text="", logprobs=None, finish_reason=FinishReason.STOP)
    assert d.finish_reason is FinishReason.STOP and d.timing is None
