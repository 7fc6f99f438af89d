"""The native CPU extension for the tests that exercise it: built once, or the test skipped with why."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import pytest

from kvcache import cpu_kernels

NO_EXTENSION = "the native extension cannot be built here (see the flotilla.kvcache warning)"

T = TypeVar("T")


def require_kernels() -> None:
    """Skip (saying so) where the environment switches the native kernels off."""
    if not cpu_kernels.kernels_enabled():
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=0 in the environment")


def require_native(load: Callable[[], T | None]) -> T:
    """What ``load`` gets from the built extension (None where it cannot be built: no compiler); skips, with
    the reason, where the kernels are off or the extension is missing."""
    require_kernels()
    got = load()
    if got is None:
        pytest.skip(NO_EXTENSION)
    return got


def require_extension() -> ModuleType:
    """The built extension module (``require_native``)."""
    return require_native(cpu_kernels.load_extension)
