"""Record the int4 codes every ``Int4Linear`` is built with, so a test can compare them with the checkpoint's."""

from __future__ import annotations

import pytest

from actors.models.quant_linear import Int4Codes, Int4Linear


def record_int4_codes(monkeypatch: pytest.MonkeyPatch) -> dict[int, Int4Codes]:
    """From now until the test ends: each ``Int4Linear`` built adds its codes here, under its ``id``."""
    seen: dict[int, Int4Codes] = {}
    build = Int4Linear.__init__

    def spy(self: Int4Linear, codes: Int4Codes) -> None:
        build(self, codes)
        seen[id(self)] = codes

    monkeypatch.setattr(Int4Linear, "__init__", spy)
    return seen
