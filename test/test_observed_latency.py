"""The latency model real engines learn from their own iterations."""

from __future__ import annotations

import pytest

from timelyllm_ros.engines.observed import ObservedLatency


def test_moving_averages_weight_the_newest_observation() -> None:
    latency = ObservedLatency(min_prefill_tokens=9)
    latency.record_prefill(8, 0.1)                       # too few tokens to rate
    assert latency.prefill_tps is None
    assert latency.prefill_s(100, default_tps=50.0) == pytest.approx(2.0)
    latency.record_prefill(100, 1.0)
    latency.record_prefill(300, 1.0)
    assert latency.prefill_tps == pytest.approx(0.5 * 300 + 0.5 * 100)
    latency.record_prefill(100, 0.0)                     # no time measured: ignored
    assert latency.prefill_tps == pytest.approx(200.0)
    latency.record_decode(4, 0.10)
    latency.record_decode(4, 0.20)
    assert latency.decode_s[4] == pytest.approx(0.7 * 0.10 + 0.3 * 0.20)


def test_decode_step_lookup_interpolates_and_optionally_extrapolates() -> None:
    latency = ObservedLatency()
    assert latency.interpolated_decode_s(3, default_s=0.05) == 0.05
    latency.record_decode(1, 0.010)
    latency.record_decode(2, 0.020)
    latency.record_decode(8, 0.080)
    assert latency.interpolated_decode_s(2, default_s=0.0) == pytest.approx(0.020)
    assert latency.interpolated_decode_s(5, default_s=0.0) == pytest.approx(0.050)
    assert latency.interpolated_decode_s(16, default_s=0.0) == pytest.approx(0.080)
    assert latency.interpolated_decode_s(16, default_s=0.0,
                                         extrapolate=True) == pytest.approx(0.160)
