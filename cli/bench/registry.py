"""Every ``flotilla bench <name>`` sub-command, in the order ``flotilla bench --help`` lists them.

A bench is a package under ``cli/bench/`` whose ``__init__`` is its command
line (a ``Bench``); its modules do the work. ``cli.main`` builds one
sub-command per entry of ``BENCHES``.

Import cost: building the parser imports every entry, and ``flotilla
--help`` and ``flotilla plan`` build it, so an entry imports argparse and
light helpers only. Its ``run`` imports the bench's work (torch, Ray, the
app, aiohttp, matplotlib) when the sub-command runs, inside the method:
that is the reason for each such function-level import.

Benches share pieces through ``harness`` (Ray, Serve, offline engines),
``metrics`` (``/metrics`` scrapes), ``stats``, ``stream_client`` and
``workload``, never through another bench's package.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from cli.bench.accuracy import AccuracyBench
from cli.bench.autoscale import AutoscaleBench
from cli.bench.kv_tiers import KVTiersBench
from cli.bench.lora import LoRABench
from cli.bench.moe import MoEBench
from cli.bench.offline import OfflineBench
from cli.bench.pd import PDBench
from cli.bench.profile import ProfileBench
from cli.bench.ray_overhead import RayOverheadBench
from cli.bench.scheduler import SchedulerBench
from cli.bench.serve import ServeBench
from cli.bench.spec import SpecBench, SpecWorkloadsBench
from cli.bench.structured import StructuredBench


class Bench(Protocol):
    """One ``flotilla bench`` sub-command: its name and help, its flags, and what running it does."""

    name: str
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the sub-command's flags (and sub-parsers, if any) to its own ``parser``."""

    def run(self, args: argparse.Namespace) -> int:
        """Run with the parsed ``args``; returns the exit status."""


BENCHES: tuple[Bench, ...] = (
    ServeBench(),
    AutoscaleBench(),
    SpecBench(),
    SpecWorkloadsBench(),
    AccuracyBench(),
    StructuredBench(),
    PDBench(),
    LoRABench(),
    KVTiersBench(),
    MoEBench(),
    ProfileBench(),
    SchedulerBench(),
    OfflineBench(),
    RayOverheadBench(),
)
