"""The engine options a benchmark's command line sets, as ``EngineConfig`` keyword arguments.

Light on purpose (no engine imports): each bench's ``__init__`` builds its
options with it before importing the bench itself (``cli.bench.registry``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

# What each replica and scheduler actor of a benchmark's local app reserves: its replicas share the machine's
# cores (each forward has its own thread count), and several must fit a small local cluster.
SHARED_ACTOR_CPUS = 0.1


def engine_options(args: argparse.Namespace, optional: Iterable[str] = ()) -> dict[str, object]:
    """``max_num_seqs``, ``max_model_len``, ``enable_prefix_caching`` (``--prefix-caching``), and each
    of ``max_num_batched_tokens`` and ``optional`` the command line has and sets (not None)."""
    engine: dict[str, object] = {
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching,
    }
    for name in ("max_num_batched_tokens", *optional):
        value = getattr(args, name, None)
        if value is not None:
            engine[name] = value
    return engine
