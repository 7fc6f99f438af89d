"""The Prometheus text parser on a fixed sample (the live server's /metrics is still filling in)."""

from __future__ import annotations

import math

import pytest

from flotilla import MetricsParseError, Sample, parse_prometheus

TEXT = r'''
# HELP flotilla_requests_total Requests finished, by reason.
# TYPE flotilla_requests_total counter
flotilla_requests_total{model="tiny",finish_reason="stop"} 12
flotilla_requests_total{model="tiny",finish_reason="length"} 3 1700000000000
# HELP flotilla_ttft_seconds Time to first token.
# TYPE flotilla_ttft_seconds histogram
flotilla_ttft_seconds_bucket{model="tiny",le="0.1"} 4
flotilla_ttft_seconds_bucket{model="tiny",le="+Inf"} 15
flotilla_ttft_seconds_sum{model="tiny"} 2.5
flotilla_ttft_seconds_count{model="tiny"} 15
# TYPE flotilla_kv_pages_free gauge
flotilla_kv_pages_free{replica="r-1"} NaN
flotilla_kv_pages_free{replica="r-2"} -Inf
# TYPE flotilla_declared_only gauge
process_open_fds 7
weird{path="a \"quoted\" \\ back\nline",empty=""} 1.5e3
'''


def test_families_samples_labels_and_values() -> None:
    fam = parse_prometheus(TEXT)
    assert list(fam) == ["flotilla_requests_total", "flotilla_ttft_seconds", "flotilla_kv_pages_free",
                         "flotilla_declared_only", "process_open_fds", "weird"]
    assert fam["flotilla_requests_total"] == [
        Sample("flotilla_requests_total", {"model": "tiny", "finish_reason": "stop"}, 12.0),
        Sample("flotilla_requests_total", {"model": "tiny", "finish_reason": "length"}, 3.0, 1700000000000),
    ]
    ttft = fam["flotilla_ttft_seconds"]
    assert [s.name for s in ttft] == ["flotilla_ttft_seconds_bucket"] * 2 + ["flotilla_ttft_seconds_sum",
                                                                             "flotilla_ttft_seconds_count"]
    assert ttft[1].labels == {"model": "tiny", "le": "+Inf"} and ttft[2].value == 2.5
    free = fam["flotilla_kv_pages_free"]
    assert math.isnan(free[0].value) and free[1].value == -math.inf
    assert fam["flotilla_declared_only"] == []  # declared, no samples yet: still listed
    assert fam["process_open_fds"] == [Sample("process_open_fds", {}, 7.0)]
    assert fam["weird"][0].labels == {"path": 'a "quoted" \\ back\nline', "empty": ""}
    assert fam["weird"][0].value == 1500.0


def test_suffixes_only_join_families_of_the_right_type() -> None:
    fam = parse_prometheus("# TYPE queue gauge\nqueue_count 3\n")
    assert fam["queue_count"][0].value == 3.0 and fam["queue"] == []


@pytest.mark.parametrize("line", ["bad-name 1", 'x{a="1} 2', "x{a=1} 2", "x one", "x 1 2 3", '{a="b"} 1'])
def test_malformed_lines_name_their_line(line: str) -> None:
    with pytest.raises(MetricsParseError) as info:
        parse_prometheus(f"ok 1\n{line}\n")
    assert info.value.line_number == 2 and isinstance(info.value, ValueError)
