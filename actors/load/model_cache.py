"""The model cache folder and the one way a model folder is written into it.

Embedded models and converted GGUF files are both built on first use under
``$FLOTILLA_CACHE_DIR/models``. ``build_once`` makes that safe when several
processes (a replica, its scheduler actor, its shards) ask at the same time:
each builder writes a private temp folder and renames it into place, and the
loser of a race discards its copy. A folder that exists is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """``$FLOTILLA_CACHE_DIR`` or ``~/.cache/flotilla``."""
    return Path(os.environ.get("FLOTILLA_CACHE_DIR") or Path.home() / ".cache" / "flotilla").expanduser()


def models_dir(root: Path | None = None) -> Path:
    """Where model folders live: ``<root or cache_dir()>/models``."""
    return (root or cache_dir()) / "models"


def build_once(final: Path, write: Callable[[Path], None]) -> Path:
    """Return ``final``, calling ``write(tmp_folder)`` first if it does not exist yet."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def update_json(path: Path, updates: dict[str, object]) -> None:
    """Merge ``updates`` into the JSON object in ``path`` (sorted keys, trailing newline)."""
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
