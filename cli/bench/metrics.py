"""A server's ``/metrics`` as the benchmarks read it: fetch the Prometheus text, pick flotilla's samples, quantiles.

Every benchmark that scrapes goes through here: ``bench serve``'s server
probe (memory, CPU, engine steps per replica) and ``bench pd``'s P/D
counters and KV-transfer histogram. A scrape reaches one replica (Serve
routes ``/metrics`` like any request); the readers keep what they need per
``replica`` label or summed.

``histogram_quantile`` interpolates within a bucket as Prometheus's
function of that name does: linearly between the bucket's bounds (0 below
the first), and a rank in the ``+Inf`` bucket gives the highest finite bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from cluster.metric_families import PREFIX


async def fetch(session: aiohttp.ClientSession, base_url: str) -> str:
    """The text of ``base_url/metrics``; an error status raises ``aiohttp.ClientResponseError``."""
    async with session.get(base_url + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


def flotilla_samples(text: str) -> Iterator[Sample]:
    """The samples of flotilla's families (``PREFIX``) in a Prometheus text exposition.

    Text that is not the exposition format raises ``ValueError`` as it is read.
    """
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(PREFIX):
            yield from fam.samples


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """The ``q``-quantile (0..1) of cumulative ``buckets`` as Prometheus estimates it; None when empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    assert math.isinf(buckets[-1][0]), "a Prometheus histogram ends with the +Inf bucket"
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower  # the highest finite bound: the histogram says nothing above it
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
