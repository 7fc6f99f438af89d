"""flotilla's logger: INFO lines on stderr unless the application configured logging."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """A child of the ``flotilla`` logger, which gets one stderr handler on first use."""
    root = logging.getLogger("flotilla")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s flotilla: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root.getChild(name)
