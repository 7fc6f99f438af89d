"""The native CPU extension for the tests that exercise it: built once, or the test skipped with why."""

from __future__ import annotations

from types import ModuleType

import pytest

from kvcache import cpu_kernels

NO_EXTENSION = "the native extension cannot be built here (see the flotilla.kvcache warning)"


def require_kernels() -> None:
    """Skip (saying so) where the environment switches the native kernels off."""
    if not cpu_kernels.kernels_enabled():
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=0 in the environment")


def require_extension() -> ModuleType:
    """The built extension; skips, with the reason, where it is off or cannot be built (no compiler)."""
    require_kernels()
    module = cpu_kernels.load_extension()
    if module is None:
        pytest.skip(NO_EXTENSION)
    return module
