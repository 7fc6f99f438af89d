"""flotilla's Python client SDK.

Importable with only aiohttp installed: no torch, no Ray. The client classes
arrive with the SDK work; today the package carries the version.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
