"""Fixtures of the kvcache tests."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.kvcache.native import require_extension


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    """The built native extension (``tests.kvcache.native.require_extension``)."""
    return require_extension()
