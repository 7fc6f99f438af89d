"""Fixtures of the kvcache tests."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.kvcache.native import require_extension


@pytest.fixture(scope="module", autouse=True)
def _single_thread_torch() -> Iterator[None]:
    """One torch thread for these tests' tiny tensors (as tests/actors/conftest.py does): on a busy box, the
    default team's threads spin waiting for each other on every op. A test about thread counts sets its own
    and restores it. Module scope: it covers the module's fixtures too; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    """The built native extension (``tests.kvcache.native.require_extension``)."""
    return require_extension()
