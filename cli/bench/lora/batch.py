"""The batch of ``flotilla bench lora``: a module of its own, so the command line and the run both read it
without importing each other (the command line stays light: ``cli.bench.registry``)."""

from __future__ import annotations

BATCH_SIZE = 32  # the batch: step time at 32 sequences with 1, 8 and 32 adapters
