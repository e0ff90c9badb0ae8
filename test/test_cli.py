"""The command contract: ``timelyllm bench`` / ``overhead`` / ``run`` outputs and errors."""

from __future__ import annotations

import csv
import json
import math

import pytest

from timelyllm_ros.cli import main
from timelyllm_ros.evaluation.bench import COMPARED_METRICS

METRIC_KEYS = {'tasks', 'completed', 'utility_mean', 'utility_max', 'response_time_mean_s',
               'waiting_time_mean_s', 'completion_time_mean_s', 'completion_rate',
               'slo_attainment', 'response_time_p95_s', 'response_time_p99_s',
               'completion_time_p95_s', 'completion_time_p99_s', 'killed',
               'utility_floored_mean', 'plan_utility_mean', 'plan_utility_floored_mean'}


@pytest.fixture(scope='module')
def wid1_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    code = main(['bench', '--workload', 'wid1', '--policies', 'vllm,seg-edf,timelyllm',
                 '--seed', '3', '--out', str(out), '--quiet'])
    assert code == 0
    return out


def test_bench_writes_the_summary_contract(wid1_bench):
    summary = json.loads((wid1_bench / 'summary.json').read_text())
    assert set(summary['policies']) == {'vllm', 'seg-edf', 'timelyllm'}
    assert summary['seed'] == 3 and summary['robot_jitter'] == 0.0
    assert summary['regime'] == 'default' and summary['engine']['prefix_caching']
    for result in summary['policies'].values():
        assert set(result['by_class']) == {'normal', 'urgent'}
        for metrics in [*result['by_class'].values(), result['overall']]:
            assert METRIC_KEYS <= set(metrics)
        overall = result['overall']
        assert overall['tasks'] == overall['completed'] == summary['tasks']
        by_class = result['by_class']
        assert overall['tasks'] == sum(m['tasks'] for m in by_class.values())
        # utility_max is the best achievable mean: sum of betas over tasks.
        expected_max = (by_class['normal']['tasks'] * 1.0 + by_class['urgent']['tasks'] * 2.0
                        ) / overall['tasks']
        assert overall['utility_max'] == pytest.approx(expected_max)
        assert by_class['urgent']['utility_max'] == 2.0


def test_bench_writes_tasks_csv_and_figures(wid1_bench):
    summary = json.loads((wid1_bench / 'summary.json').read_text())
    with (wid1_bench / 'tasks.csv').open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 * summary['tasks']
    assert {r['policy'] for r in rows} == {'vllm', 'seg-edf', 'timelyllm'}
    timely = [r for r in rows if r['policy'] == 'timelyllm']
    mean = sum(float(r['utility']) for r in timely) / len(timely)
    assert mean == pytest.approx(summary['policies']['timelyllm']['overall']['utility_mean'])
    metric_figures = [f'metric_{m}.png' for m in COMPARED_METRICS]
    for name in ('fig5_utility.png', 'fig5_response.png', 'fig5_waiting.png',
                 'fig8_policies.png', *metric_figures):
        assert (wid1_bench / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_bench_runs_the_contended_regime_beside_the_default(wid1_bench, capsys):
    """Issue 26: the default engine cannot separate the policies; the contended regime (no
    prefix caching) runs beside it, in its own folder."""
    contended = json.loads((wid1_bench / 'contended' / 'summary.json').read_text())
    assert contended['regime'] == 'contended'
    assert contended['engine']['prefix_caching'] is False
    assert set(contended['policies']) == {'vllm', 'seg-edf', 'timelyllm'}
    assert (wid1_bench / 'contended' / 'tasks.csv').exists()
    default = json.loads((wid1_bench / 'summary.json').read_text())
    # every prompt prefilled whole: the engine is busier, the goals are served later
    for policy in ('vllm', 'timelyllm'):
        assert (contended['policies'][policy]['overall']['response_time_mean_s']
                > default['policies'][policy]['overall']['response_time_mean_s'])


def test_bench_regimes_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(['bench', '--regimes', 'default,crowded', '--out', str(tmp_path)])
    assert 'regimes are distinct names' in capsys.readouterr().err
    assert main(['bench', '--regimes', 'paper', '--engine', 'cpu', '--model', 'smollm2',
                 '--out', str(tmp_path), '--quiet']) == 1
    assert "the paper regime is the paper's calibration" in capsys.readouterr().err


def test_bench_is_reproducible_with_a_seed(wid1_bench, tmp_path):
    assert main(['bench', '--workload', 'wid1', '--policies', 'vllm,seg-edf,timelyllm',
                 '--seed', '3', '--out', str(tmp_path), '--quiet']) == 0
    first = json.loads((wid1_bench / 'summary.json').read_text())
    second = json.loads((tmp_path / 'summary.json').read_text())
    for policy in first['policies']:
        assert first['policies'][policy]['by_type'] == second['policies'][policy]['by_type']


def test_bench_batch_sweep_and_arm_figures(tmp_path):
    code = main(['bench', '--workload', 'wid3', '--compose', '9,(10,11)', '--policies',
                 'vllm,timelyllm', '--batch-sizes', '1,4', '--out', str(tmp_path), '--quiet'])
    assert code == 0
    summary = json.loads((tmp_path / 'summary.json').read_text())
    assert set(summary['batch_sweep']) == {'vllm', 'timelyllm'}
    assert set(summary['batch_sweep']['timelyllm']) == {'1', '4'}
    assert set(summary['policies']['vllm']['by_class']) == {'arm'}
    for name in ('fig7_batch_sweep.png', 'fig9_arm_utility.png', 'fig9_arm_waiting.png'):
        assert (tmp_path / name).exists()


@pytest.mark.parametrize('policy', ['timelyllm', 'vllm'])
def test_overhead_times_real_decisions_that_admit(capsys, policy):
    assert main(['overhead', '--queued', '1,8,40', '--repeats', '3', '--policy', policy,
                 '--json']) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {'1', '8', '40'}
    for queued, cost in result.items():
        assert math.isfinite(cost['decision_ms']) and cost['decision_ms'] >= 0
        assert 1 <= cost['admitted'] <= int(queued)       # the batch had room: it admitted
        assert cost['per_admission_ms'] <= cost['decision_ms']


def test_bench_reports_decision_overhead_per_policy(wid1_bench):
    summary = json.loads((wid1_bench / 'summary.json').read_text())
    for result in summary['policies'].values():
        assert 0 < result['run']['decision_ms_mean'] < 1000


def test_run_prints_tables(capsys):
    assert main(['run', '--workload', 'wid1', '--compose', '(1,6),2', '--policy',
                 'seg-fcfs']) == 0
    out = capsys.readouterr().out
    assert 'per task class' in out and 'urgent' in out and 'T6' in out
    assert 'real time' in out


@pytest.mark.parametrize(('argv', 'message'), [
    (['run', '--workload', 'wid9'], "unknown workload 'wid9'"),
    (['run', '--policy', 'lottery'], "unknown policy 'lottery'"),
    (['bench', '--policies', 'vllm,nope', '--out', 'x'], "unknown policy 'nope'"),
    (['run', '--compose', '(1,2'], 'composition'),
    (['run', '--workload-file', '/nonexistent/w.json'], 'cannot read workload'),
    (['run', '--calibration', 'no-such-gpu'], "no calibration 'no-such-gpu'"),
])
def test_bad_input_prints_an_error_and_returns_1(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_bench_matrix_refuses_a_standing_policy_it_does_not_run(tmp_path, capsys):
    out = tmp_path / 'matrix'
    assert main(['bench', '--matrix', '--workloads', 'wid1', '--seeds', '0', '--policies',
                 'vllm,timelyllm', '--standing', 'slice', '--out', str(out), '--quiet']) == 1
    assert "'slice' must be one of at least two policies" in capsys.readouterr().err
    assert not out.exists()                     # refused before any cell ran


def test_bench_matrix_gives_each_cell_its_spread_over_seeds(tmp_path, capsys):
    """Issue 26/28: workloads × regimes × seeds × policies in one command."""
    import statistics

    from timelyllm_ros.evaluation.matrix import verdict

    out = tmp_path / 'matrix'
    assert main(['bench', '--matrix', '--workloads', 'wid1,authors-arm', '--regimes',
                 'default,contended', '--seeds', '0,1', '--policies', 'vllm,timelyllm',
                 '--standing', 'timelyllm', '--out', str(out), '--quiet']) == 0
    printed = capsys.readouterr().out
    assert '| workload | regime | policy |' in printed
    assert 'Where timelyllm stands against the best other policy' in printed
    matrix = json.loads((out / 'matrix.json').read_text())
    assert matrix['seeds'] == [0, 1] and matrix['robot_jitter'] == 0.1
    # the standing is the verdict of each figure against vllm's, the only other policy
    judged = matrix['standing']
    assert judged['policy'] == 'timelyllm'
    for workload in ('wid1', 'authors-arm'):
        for regime in ('default', 'contended'):
            for figure, entry in judged['cells'][workload][regime].items():
                own = matrix['cells'][workload][regime]['timelyllm'][figure]
                other = matrix['cells'][workload][regime]['vllm'][figure]
                assert entry['best'] == 'vllm' and entry['best_mean'] == other['mean']
                assert entry['verdict'] == verdict(own['mean'], own['sd'], other['mean'],
                                                   other['sd'], figure)
                assert (entry['verdict'] == 'behind') == (
                    f'{workload} {regime} {figure}' in judged['behind'])
    assert (out / 'matrix.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    for workload in ('wid1', 'authors-arm'):
        for regime in ('default', 'contended'):
            for policy in ('vllm', 'timelyllm'):
                cell = matrix['cells'][workload][regime][policy]
                assert set(cell) >= {'urgent utility', 'urgent floored', 'completion',
                                     'mean response s', 'p95 response s', 'SLO'}
                # each figure is the seeds' bench summaries, mean and sample spread
                summaries = [json.loads((out / workload / regime / f'seed{seed}' /
                                         'summary.json').read_text()) for seed in (0, 1)]
                completion = [s['policies'][policy]['overall']['completion_rate']
                              for s in summaries]
                assert cell['completion']['values'] == completion
                assert cell['completion']['mean'] == pytest.approx(statistics.fmean(completion))
                assert cell['completion']['sd'] == pytest.approx(statistics.stdev(completion))
                response = [s['policies'][policy]['overall']['response_time_mean_s']
                            for s in summaries]
                assert cell['mean response s']['values'] == response
                assert summaries[0]['robot_jitter'] == 0.1
    # no figures per cell: the matrix draws one
    assert not list((out / 'wid1' / 'default' / 'seed0').glob('*.png'))
    # recorded arrivals and skill times: the jitter makes the seeds' completion times differ
    arm = [json.loads((out / 'authors-arm' / 'default' / f'seed{seed}' / 'summary.json')
                      .read_text())['policies']['timelyllm']['overall']['completion_time_mean_s']
           for seed in (0, 1)]
    assert arm[0] != arm[1]
