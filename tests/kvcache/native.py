"""The native CPU extension for the tests that exercise it: built once, or the test failed or skipped with why.

A missing extension skips a test only where no C++ compiler exists. Where one
does, the build failing means a kernel source that does not compile (or a
broken toolchain): that fails every native test instead of hiding behind skips.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import pytest
from torch.utils import cpp_extension

from kvcache import cpu_kernels

NO_EXTENSION = "the native extension cannot be built here: no C++ compiler"

T = TypeVar("T")


def compiler() -> str | None:
    """The C++ compiler torch's build runs (``$CXX``, else ``c++``) where it is on PATH, else None."""
    return shutil.which(cpp_extension.get_cxx_compiler())


def fail_if_compiler(what: str) -> None:
    """Fail the test (saying why the build failed) when ``what`` is missing although a compiler exists."""
    found = compiler()
    if found is not None:
        pytest.fail(f"{what} is missing although {found} is present: the build failed "
                    f"({cpu_kernels.build_failure()})", pytrace=False)  # fmt: skip


def require_kernels() -> None:
    """Skip (saying so) where the environment switches the native kernels off."""
    if not cpu_kernels.kernels_enabled():
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=0 in the environment")


def require_native(load: Callable[[], T | None]) -> T:
    """What ``load`` gets from the built extension. Skips where the kernels are switched off or no compiler
    exists; fails where a compiler exists and the build failed anyway."""
    require_kernels()
    got = load()
    if got is None:
        fail_if_compiler("the native extension")
        pytest.skip(NO_EXTENSION)
    return got


def require_extension() -> ModuleType:
    """The built extension module (``require_native``)."""
    return require_native(cpu_kernels.load_extension)
