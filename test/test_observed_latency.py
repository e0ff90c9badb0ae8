"""The latency model real engines learn from their own iterations."""

from __future__ import annotations

import pytest

from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.engines.observed import (
    NEW_REQUEST_DEFAULT_DECODE_S,
    NEW_REQUEST_DEFAULT_TPS,
    ObservedLatency,
    new_request_join_tokens,
)
from timelyllm_ros.engines.sim import SimulatedEngine


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


def test_the_vllm_engines_price_a_join_at_its_whole_context_or_its_last_partial_block() -> None:
    assert new_request_join_tokens(880, resumed=False, block_size=16) == 880
    assert new_request_join_tokens(885, resumed=True, block_size=16) == 5
    assert new_request_join_tokens(880, resumed=True, block_size=16) == 16   # one token at least
    latency = ObservedLatency()
    assert latency.nearest_decode_s(4, default_s=0.02) == 0.02
    latency.record_decode(2, 0.010)
    latency.record_decode(16, 0.016)
    assert latency.nearest_decode_s(2, default_s=0.0) == 0.010
    assert latency.nearest_decode_s(1, default_s=0.0) == 0.010             # never below
    assert latency.nearest_decode_s(4, default_s=0.0) == pytest.approx(0.010 * 2 ** 0.1)
    assert latency.nearest_decode_s(12, default_s=0.0) == pytest.approx(0.016)


def test_a_simulated_engine_prices_admission_as_the_real_engine_it_replays() -> None:
    """On the H200 the vLLM engine priced a new goal at its whole prompt over the prefill
    throughput it had observed (the step reporting a prefill is the one after it, under
    asynchronous scheduling), while the simulator priced its uncached part by the
    calibration: timelyllm admitted the normal goals of a WID2 burst with the urgent ones in
    the simulator and after them on the GPU (31.7 % response error; 13.8 % when the simulated
    engine prices as the real one did). With ``estimates='observed'`` it does; its own
    iterations keep the calibration's times."""
    model = load_calibration('llama3-8b-bf16_h200-vllm026')
    assert model.engine.estimates == 'observed'
    as_model = model.model_copy(update={'engine': model.engine.model_copy(
        update={'estimates': 'model'})})
    engines = {'observed': SimulatedEngine(model), 'model': SimulatedEngine(as_model)}
    for engine in engines.values():
        for i in range(2):
            engine.register(EngineRequest(request_id=f'g{i}', prompt='p', prompt_tokens=880,
                                          max_tokens=8, script=tuple('abcdefgh')))
    observed = engines['observed']
    assert observed.run_cost_s('g0') == pytest.approx(880 / NEW_REQUEST_DEFAULT_TPS)
    assert observed.decode_step_s(3) == NEW_REQUEST_DEFAULT_DECODE_S
    assert engines['model'].run_cost_s('g0') == pytest.approx(model.prefill_s(880))
    mirror = ObservedLatency()
    for name, engine in engines.items():
        engine.run('g0')
        results = [engine.step() for _ in range(4)]
        if name == 'observed':
            for result in results:
                if result.prefill_tokens:
                    mirror.record_prefill(result.prefill_tokens, result.duration_s)
                elif result.text:
                    mirror.record_decode(result.batch_size, result.duration_s)
    assert mirror.prefill_tps is not None
    assert observed.run_cost_s('g1') == pytest.approx(880 / mirror.prefill_tps)
    assert observed.decode_step_s(1) == mirror.decode_s[1]
    assert engines['model'].busy_s == pytest.approx(observed.busy_s)
