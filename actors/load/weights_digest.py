"""Content digests of weight files: what cached KV names a model or a LoRA adapter by.

KV is a function of the weights that computed it. Keyed by a name (an
adapter's, the ``model`` setting), cached KV would outlive its weights: an
adapter unloaded and loaded again from another folder, two apps on one
cluster with an adapter of the same name, a fine-tune copied over the old
files at the same path would each meet KV of other weights. So the radix
cache's adapter namespaces (``scheduling.lora_slots.cache_namespace``) and
the tiers' block keys (``actors.engine.kv_tiers.model_identity``) name
weights by the SHA-256 of their files (``adapter_digest``, ``model_digest``).

Hashing runs at about a second per gigabyte, so each file's digest is cached
on disk under ``$FLOTILLA_CACHE_DIR/digests`` (on disk rather than in the
process: what it saves is the rehash at every restart), keyed by the file's
resolved path and valid while its size, mtime, ctime and inode are unchanged.
The ctime and inode as well as the mtime: a copy that keeps the old mtime
(``cp -p``, ``rsync -t``) still writes the file, which sets its ctime, and a
file renamed into place is another inode. Changing any of them costs a rehash,
never a stale digest. Nor is a file cached that changed while it was hashed,
or in the ``SETTLED_NS`` before (file times tick in jiffies, up to seconds on
some filesystems: a rewrite that soon after could leave every stamp as it was).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from actors.load.loader import checkpoint_files
from actors.load.lora_adapter import CONFIG_FILE, WEIGHTS_FILE
from actors.load.model_cache import cache_dir
from actors.log import get_logger

logger = get_logger(__name__.rsplit(".", 1)[-1])

MODEL_CONFIG_FILE = "config.json"
SETTLED_NS = 2_000_000_000  # a file last changed this recently is hashed, not cached (see above)


def adapter_digest(folder: Path) -> str:
    """The digest of a PEFT adapter folder: its ``adapter_config.json`` and ``adapter_model.safetensors``."""
    return files_digest({name: folder / name for name in (CONFIG_FILE, WEIGHTS_FILE)})


def model_digest(folder: Path) -> str:
    """The digest of a model folder: its ``config.json`` and every weight file the loader reads."""
    files = {MODEL_CONFIG_FILE: folder / MODEL_CONFIG_FILE}
    files.update({str(f.relative_to(folder)): f for f in checkpoint_files(folder)})
    return files_digest(files)


def files_digest(files: Mapping[str, Path]) -> str:
    """One digest over ``files`` (name in the folder -> path): equal iff equal names hold equal bytes.

    Names, not paths: the same weights in folders of other names (other nodes, other caches) agree.
    Raises ``OSError`` for a file that cannot be read.
    """
    parts = {name: file_digest(path) for name, path in files.items()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def file_digest(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, from the on-disk cache while the file's stat is unchanged."""
    real = path.resolve()
    stamp = _stamp(real)
    entry = _entry_path(real)
    try:
        cached = json.loads(entry.read_text())
        if isinstance(cached, dict) and cached.get("stamp") == stamp and isinstance(cached.get("sha256"), str):
            return str(cached["sha256"])
    except (OSError, ValueError):
        pass  # no entry yet, or an unreadable one: hash the file
    start_ns = time.time_ns()
    with real.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _, mtime_ns, ctime_ns, *_ = stamp
    settled = max(mtime_ns, ctime_ns) < start_ns - SETTLED_NS
    if settled and _stamp(real) == stamp:  # and unchanged while it was read: the digest is the file's
        _write_entry(entry, {"path": str(real), "stamp": stamp, "sha256": digest})
    return digest


def _stamp(path: Path) -> list[int]:
    # A list, as the entry's JSON reads back: size, mtime, ctime, inode, device.
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _entry_path(real: Path) -> Path:
    name = hashlib.sha256(str(real).encode()).hexdigest()[:32]
    return cache_dir() / "digests" / f"{name}.json"


def _write_entry(entry: Path, data: dict[str, object]) -> None:
    # Written aside and renamed into place: a reader (another process of this replica) sees a whole entry.
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=entry.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:  # a read-only cache folder costs a rehash next time, nothing else
        logger.warning("could not cache the digest of %s: %s", data["path"], e)
