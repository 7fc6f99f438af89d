"""Print what a node's `make install` asks pip for, one requirement a line.

    python scripts/e2e/node_requirements.py pyproject.toml "torch==2.13.0"

`make e2e` fills a wheelhouse with these before the node's network is cut
off: torch (the Makefile's pin), the project's dependencies and `dev` extra,
its build requirements (the editable install builds in isolation) and pip.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import tomllib


def node_requirements(pyproject: dict[str, Any], torch_pin: str) -> list[str]:
    project = pyproject["project"]
    return [torch_pin, *project["dependencies"], *project["optional-dependencies"]["dev"],
            *pyproject["build-system"]["requires"], "pip"]


if __name__ == "__main__":
    data = tomllib.loads(Path(sys.argv[1]).read_text())
    print("\n".join(node_requirements(data, sys.argv[2])))
