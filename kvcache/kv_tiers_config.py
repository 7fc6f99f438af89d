"""``EngineConfig.kv_offload``: which KV tiers an engine keeps prefix pages in (``kvcache.kv_tiers``).

The feature is the KV tiers throughout the code and docs (docs/kv_tiers.md); ``kv_offload`` is only the
name of its user-facing option (config key, ``--kv-offload``), kept as it is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from kvcache.errors import CacheConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class KVTiersConfig:
    """``EngineConfig.kv_offload``: which tiers an engine keeps evicted prefix pages in.

    ``host_bytes``: host memory for blocks (0: no host tier). ``disk_bytes``:
    a local disk folder (0: none) at ``disk_path`` (default: a folder of its
    own under the model cache, removed when the engine stops; a given path is
    kept and its blocks are found again by the next engine; one engine per
    path). ``cluster``: write blocks through to the node's KV store actor and
    read other replicas' blocks from every node's store (needs Ray), each
    store holding at most ``cluster_bytes``. ``load_wait_s``: the longest a
    waiting request is held back for its blocks to arrive (requests behind
    it are admitted meanwhile); past it, it computes its prefix instead (a
    step never waits for a load). Two seconds by default: on a busy CPU a
    long prompt's prefill takes longer than its load; lower it on GPUs.
    ``save_queue_bytes``: the most bytes of copied-out pages waiting for the
    tiers to file them; a step's pages beyond it are dropped unsaved and
    counted (``dropped_saves``), so a slow disk or store never blocks a step
    nor grows the process without bound (one step copies out up to 256 pages,
    about 512 MiB on an 8B model). 1 GiB by default. ``cluster_app``: whose
    cluster stores the engine uses (one per node, app and model; a Serve
    replica sets its app's name; None: engines outside Serve share theirs),
    so ``flotilla kv drop --app NAME`` drops one app's blocks.
    """

    host_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | None = None
    cluster: bool = False
    cluster_bytes: int = GiB
    load_wait_s: float = 2.0
    save_queue_bytes: int = GiB
    cluster_app: str | None = None

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "cluster_bytes", "save_queue_bytes"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():  # JSON's 2e9
                value = int(value)
                object.__setattr__(self, name, value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CacheConfigError("kv_offload", f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.cluster, bool):
            raise CacheConfigError("kv_offload", f"cluster must be true or false, got {self.cluster!r}")
        wait = self.load_wait_s
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 60:
            raise CacheConfigError("kv_offload", f"load_wait_s must be a number of seconds in [0, 60], got {wait!r}")
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise CacheConfigError("kv_offload", f"disk_path must be a folder path, got {self.disk_path!r}")
        if self.disk_path is not None and not self.disk_bytes:
            raise CacheConfigError("kv_offload", "disk_path is set but disk_bytes is 0: give the disk tier a size")
        if self.cluster_app is not None and (not isinstance(self.cluster_app, str) or not self.cluster_app):
            raise CacheConfigError("kv_offload", f"cluster_app must be an app's name, got {self.cluster_app!r}")
        if self.cluster and not self.cluster_bytes:
            raise CacheConfigError("kv_offload", "cluster is on but cluster_bytes is 0")
        if not (self.host_bytes or self.disk_bytes or self.cluster):
            raise CacheConfigError("kv_offload", "every tier is off: set host_bytes, disk_bytes or cluster")

    @classmethod
    def parse(cls, value: KVTiersConfig | dict[str, object] | str | None) -> KVTiersConfig | None:
        """From a config, a dict, or its JSON text (``--kv-offload``); None stays None."""
        if value is None or isinstance(value, KVTiersConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise CacheConfigError("kv_offload", f"is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise CacheConfigError("kv_offload", f"must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise CacheConfigError("kv_offload", f"unknown field {unknown[0]!r}; known: {sorted(known)}")
        return cls(**value)  # type: ignore[arg-type]  # each field is checked in __post_init__

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
