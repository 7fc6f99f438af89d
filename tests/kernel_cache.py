"""Tests that point ``FLOTILLA_CACHE_DIR`` at a folder of their own (a model cache, a server's) share the CPU
kernels this machine has already built: built again there, they cost a test most of a minute."""

from __future__ import annotations

from pathlib import Path

from kvcache import cpu_kernels


def link_built_kernels(cache: Path) -> None:
    """Make ``cache``'s kernel build folder a link to this process's (created if need be); a folder already
    there is left alone."""
    kernels = cache / "torch_extensions"
    if kernels.exists():
        return
    built = cpu_kernels.cache_dir() / "torch_extensions"
    built.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    kernels.symlink_to(built, target_is_directory=True)
