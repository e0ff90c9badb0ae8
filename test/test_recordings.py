"""The shipped recordings of real engines: the simulator checked against them offline (issue 26).

Each recording holds real runs (per task twin and outcome, per iteration cost) and the
calibration measured on the same engine; `validate-sim --real` replays them on the simulator.
The comparison is deterministic (no engine runs), so its figures are asserted.
"""

from __future__ import annotations

import pytest

from timelyllm_ros.evaluation.recording import RECORDING_DIR, load_recording
from timelyllm_ros.evaluation.validate_sim import COMPARED, compare

TOLERANCE = 0.15
"""The issue's bound on the median per-task error of response and completion times."""

CPU_RECORDINGS = sorted(p.stem for p in RECORDING_DIR.glob('*.json')
                        if load_recording(p).engine.get('hardware') == 'cpu')


def _within(result: dict) -> dict[str, dict[str, float]]:
    return {policy: {name: entry['median_abs_rel_error'][name]
                     for name in ('response', 'completion')}
            for policy, entry in result['policies'].items()}


def test_the_shipped_recordings_load_and_say_what_they_are() -> None:
    names = sorted(p.stem for p in RECORDING_DIR.glob('*.json'))
    assert 'cpu-smollm2-wid1' in names and 'h100-vllm026-wid1' in names
    for name in names:
        recording = load_recording(name)
        assert recording.source and recording.runs
        assert {run.policy for run in recording.runs} == {'vllm', 'timelyllm'}
        for run in recording.runs:
            assert run.tasks and all(t.pieces for t in run.tasks)
    h100 = load_recording('h100-vllm026-wid1')
    assert h100.missing and h100.engine['hardware'].startswith('NVIDIA H100')
    assert not load_recording('cpu-smollm2-wid1').missing


@pytest.mark.parametrize('name', CPU_RECORDINGS)
def test_the_simulator_is_within_15_percent_of_the_cpu_engines(name: str) -> None:
    result = compare(load_recording(name))
    errors = _within(result)
    assert all(e <= TOLERANCE for policy in errors.values() for e in policy.values()), errors
    assert result['ranking_same'], result['ranking']
    for entry in result['policies'].values():
        assert entry['real']['overall']['tasks'] == entry['sim']['overall']['tasks']
        assert set(entry['median_abs_rel_error']) == set(COMPARED)
        # the iterations, real and simulated, side by side: where a model is off shows there
        for side in ('real', 'sim'):
            run = entry[side]['run']
            assert run['engine_iterations'] > 0 and run['prefill_tokens'] > 0
            assert run['prefill_iteration_ms_median'] > run['decode_iteration_ms_median'] > 0


def test_the_h100_recording_replays_the_live_comparison() -> None:
    """The recording made from the H100 figures gives the live run's errors back (8.5 % and
    71.1 % response error then), so a model change can be judged on it offline."""
    errors = _within(compare(load_recording('h100-vllm026-wid1')))
    assert errors['vllm']['response'] == pytest.approx(0.085, abs=0.01)
    assert errors['timelyllm']['response'] == pytest.approx(0.70, abs=0.03)


@pytest.mark.xfail(strict=True, reason='issue 26: timelyllm response 69 % off on the H100; its '
                   "calibration was measured under vLLM's asynchronous scheduling, which "
                   'calibrate misread then (prefill curve, batch-change cost): it needs '
                   'calibrate and validate-sim --record again on a GPU')
def test_the_simulator_is_within_15_percent_of_vllm_on_the_h100() -> None:
    result = compare(load_recording('h100-vllm026-wid1'))
    errors = _within(result)
    assert all(e <= TOLERANCE for policy in errors.values() for e in policy.values())
    assert result['ranking_same']


def test_a_hostile_recording_is_refused_before_it_is_parsed(tmp_path) -> None:
    from timelyllm_ros.safe_files import WorkloadInputError

    deep = tmp_path / 'deep.json'
    deep.write_text('[' * 100_000 + ']' * 100_000)
    with pytest.raises(WorkloadInputError, match='deep.json'):
        load_recording(deep)
    nan = tmp_path / 'nan.json'
    nan.write_text('{"schema_version": 1, "seed": NaN}')
    with pytest.raises(WorkloadInputError, match='nan.json'):
        load_recording(nan)
