"""A decode replica's P/D figures from its ``/metrics``, and their change over a run.

The decode replica (``apps.replica.disaggregation``) counts remote prefills, retries
and KV bytes received, and observes each prompt's KV-transfer time into the
``flotilla:pd_kv_transfer_seconds`` histogram (``TRANSFER_BUCKETS``). The
benchmark scrapes before and after a run and takes the difference, so only
the run's requests count. A family with no sample yet (nothing moved) reads
as zero. Samples of several label sets (replicas) are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

from cli.bench.metrics import flotilla_samples
from cluster.metric_families import family

_COUNTERS = {"remote_prefills": "pd_remote_prefills", "prefill_retries": "pd_prefill_retries",
             "kv_bytes": "pd_kv_transfer_bytes"}
TRANSFER = "pd_kv_transfer_seconds"


@dataclass(frozen=True, slots=True)
class PDFigures:
    """One scrape's P/D counters and transfer histogram (cumulative ``(upper bound, count)``, ``+Inf`` last)."""

    remote_prefills: float = 0.0
    prefill_retries: float = 0.0
    kv_bytes: float = 0.0
    transfer_buckets: tuple[tuple[float, float], ...] = ()
    transfer_count: float = 0.0
    transfer_sum_s: float = 0.0

    def minus(self, before: PDFigures) -> PDFigures:
        """What moved between ``before`` and this scrape (a missing bucket counts as 0)."""
        earlier = dict(before.transfer_buckets)
        return PDFigures(
            remote_prefills=self.remote_prefills - before.remote_prefills,
            prefill_retries=self.prefill_retries - before.prefill_retries,
            kv_bytes=self.kv_bytes - before.kv_bytes,
            transfer_buckets=tuple((le, n - earlier.get(le, 0.0)) for le, n in self.transfer_buckets),
            transfer_count=self.transfer_count - before.transfer_count,
            transfer_sum_s=self.transfer_sum_s - before.transfer_sum_s)


def parse_pd_figures(text: str) -> PDFigures:
    """The P/D figures of a Prometheus text exposition (zeros where a family has no sample)."""
    counters = {key: 0.0 for key in _COUNTERS}
    sample_of = {family(name).exposition_name + "_total": key for key, name in _COUNTERS.items()}
    hist = family(TRANSFER).exposition_name
    buckets: dict[float, float] = {}
    count = total = 0.0
    for s in flotilla_samples(text):
        if s.name in sample_of:
            counters[sample_of[s.name]] += float(s.value)
        elif s.name == hist + "_bucket":
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + float(s.value)
        elif s.name == hist + "_count":
            count += float(s.value)
        elif s.name == hist + "_sum":
            total += float(s.value)
    return PDFigures(counters["remote_prefills"], counters["prefill_retries"], counters["kv_bytes"],
                     tuple(sorted(buckets.items())), count, total)
