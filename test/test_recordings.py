"""The shipped recordings of real engines: the simulator checked against them offline (issue 26).

Each recording holds real runs (per task twin and outcome, per iteration cost) and the
calibration measured on the same engine; `validate-sim --real` replays them on the simulator.
The comparison is deterministic (no engine runs), so its figures are asserted.
"""

from __future__ import annotations

import pytest

from timelyllm_ros.evaluation.recording import load_recording, shipped_recordings
from timelyllm_ros.evaluation.validate_sim import COMPARED, compare

TOLERANCE = 0.15
"""The issue's bound on the median per-task error of response and completion times."""

CPU_RECORDINGS = sorted(name for name, path in shipped_recordings().items()
                        if load_recording(path).engine.get('hardware') == 'cpu')


def _within(result: dict) -> dict[str, dict[str, float]]:
    return {policy: {name: entry['median_abs_rel_error'][name]
                     for name in ('response', 'completion')}
            for policy, entry in result['policies'].items()}


def test_the_shipped_recordings_load_and_say_what_they_are() -> None:
    names = sorted(shipped_recordings())
    assert 'cpu-smollm2-wid1' in names and 'h100-vllm026-wid1' in names
    for name in names:
        recording = load_recording(name)
        assert recording.source and recording.runs
        assert {run.policy for run in recording.runs} >= {'vllm', 'timelyllm'}
        for run in recording.runs:
            assert run.tasks and all(t.pieces for t in run.tasks)
    h100 = load_recording('h100-vllm026-wid1')
    assert h100.missing and h100.engine['hardware'].startswith('NVIDIA H100')
    assert not load_recording('cpu-smollm2-wid1').missing
    h200 = load_recording('h200-vllm026-wid1')
    assert not h200.missing and h200.engine['hardware'] == 'NVIDIA H200'
    assert len(h200.runs) == 6 and all(len(run.engine_iterations) > 1000 for run in h200.runs)
    assert h200.calibration.gpu.startswith('GPU: NVIDIA H200')
    assert h200.calibration.engine.outputs_one_iteration_late


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


H200_ERRORS = {  # response error, each replayed on the calibration it holds (see the xfail below)
    'h200-vllm026-wid1': {'vllm': 0.173, 'timelyllm': 0.269, 'semantic': 0.263,
                          'autellix-plas': 0.296, 'timebill': 0.206, 'slice': 0.197},
    'h200-vllm026-wid2': {'vllm': 0.136, 'timelyllm': 0.300, 'slice': 0.186},
    'h200-vllm026-wid1-100': {'vllm': 0.063, 'timelyllm': 0.126, 'slice': 0.101,
                              'semantic': 0.192, 'autellix-plas': 0.151, 'timebill': 0.179},
    'h200-vllm026-wid2-100': {'vllm': 0.028, 'timelyllm': 0.138, 'slice': 0.140},
}


@pytest.mark.parametrize('name', sorted(H200_ERRORS))
def test_the_h200_recordings_replay_with_the_ranking_and_completion_of_the_gpu(name) -> None:
    """Recorded on an H200 (vLLM 0.26.0, Llama-3-8B shape) and replayed offline: completion
    within 1 %, the same ranking, and response errors where the note left them, so that a
    model change shows here as a change of these figures."""
    result = compare(load_recording(name))
    assert result['ranking_same'], result['ranking']
    errors = _within(result)
    assert all(entry['completion'] <= 0.01 for entry in errors.values()), errors
    assert {p: e['response'] for p, e in errors.items()} == pytest.approx(H200_ERRORS[name],
                                                                          abs=0.002)


_DRIFT = ('issue 26: semantic, autellix-plas and timebill 19, 15, 18 % off on response (vllm, '
          'timelyllm, slice 6, 13, 10 %): they ran three minutes after the others, on a GPU '
          'machine that decoded 13 % slower then (batch 1: 6.9-7.2 ms against 6.1-6.3)')
_FIRST_SESSION = ('issue 26: 14-30 % off on response: recorded with older code and a '
                  'calibration measured by calibrate before its fixes (kept as history)')


@pytest.mark.parametrize('name', [
    'h200-vllm026-wid2-100',
    pytest.param('h200-vllm026-wid1-100', marks=pytest.mark.xfail(strict=True, reason=_DRIFT)),
    pytest.param('h200-vllm026-wid1', marks=pytest.mark.xfail(strict=True,
                                                              reason=_FIRST_SESSION)),
    pytest.param('h200-vllm026-wid2', marks=pytest.mark.xfail(strict=True,
                                                              reason=_FIRST_SESSION)),
])
def test_the_simulator_is_within_15_percent_of_vllm_on_the_h200(name) -> None:
    """Every policy's median response and completion error within 15 %, the same ranking."""
    result = compare(load_recording(name))
    errors = _within(result)
    assert all(e <= TOLERANCE for policy in errors.values() for e in policy.values()), errors
    assert result['ranking_same']


def test_a_gzip_recording_loads_and_a_gzip_bomb_is_refused(tmp_path) -> None:
    import gzip

    from timelyllm_ros.evaluation.recording import write_recording
    from timelyllm_ros.safe_files import WorkloadInputError

    recording = load_recording('cpu-smollm2-wid1')
    path = write_recording(recording, tmp_path / 'r.json.gz')
    assert path.read_bytes()[:2] == b'\x1f\x8b'
    assert load_recording(path) == recording
    bomb = tmp_path / 'bomb.json.gz'
    bomb.write_bytes(gzip.compress(b' ' * (65 << 20)))
    with pytest.raises(WorkloadInputError, match='larger than'):
        load_recording(bomb)
    broken = tmp_path / 'broken.json.gz'
    broken.write_bytes(b'\x1f\x8b not gzip')
    with pytest.raises(WorkloadInputError, match='gzip'):
        load_recording(broken)


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
