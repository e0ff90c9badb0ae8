"""Hostile files and command-line arguments (issue 31, items 5 and 6).

Every file the project reads is bounded before it is parsed (size, nesting, YAML aliases) and
every number in it checked; every command-line argument has its range. What is refused is an
``error: …`` naming the field, exit status 2, no traceback and no output written.

The cases that ate memory or never returned run the command line in a subprocess under a
60 s timeout and an address-space limit, so that a regression fails here instead of taking
the machine down.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml
from utils import load_benchmark

from lrtrace.cli import _read_poses
from lrtrace.cli import main as lrtrace_main
from timelyllm_ros.cli import main as timelyllm_main
from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.errors import EngineError, RobotError
from timelyllm_ros.safe_files import InputError

MEMORY_LIMIT = 3 << 30    # bytes of address space of a command line run here
TIMEOUT_S = 60

# Nine levels of nine aliases: 441 bytes that a plain yaml.safe_load turns into 9**9 strings
# once a validator walks them.
ALIAS_BOMB = 'name: w\n' + ''.join(
    f'{level}: &{level} [{", ".join([f"*{prev}"] * 9) if prev else ", ".join(["lol"] * 9)}]\n'
    for prev, level in zip(['', *'abcdefgh'], 'abcdefghi', strict=True))

SPEC = {'name': 'w', 'eps': 0.25, 'max_tpe': 2, 'trace_ids': [1, 2], 'agents': 4,
        'duration_s': 20.0}
RECORD = {'trigger time': 1.0, 'agent_id': 0, 'trace_id': 4, 'task_input': 'find scissors',
          'exe_time_detail': [['s(', 1.5], ['g(', 2.5]], 'tuf': [1, 1, 1.5]}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_cli(module: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command line in a child bounded in time and memory (it inherits PYTHONPATH)."""
    env = {**os.environ, 'OPENBLAS_NUM_THREADS': '1', 'MPLBACKEND': 'Agg'}
    return subprocess.run([sys.executable, '-m', module, *argv], capture_output=True,
                          text=True, timeout=TIMEOUT_S, preexec_fn=_limit_memory, env=env,
                          cwd=cwd, check=False)


def assert_refused(returncode: int | str | None, stderr: str, *fields: str) -> None:
    assert returncode == 2, stderr[-2000:]
    assert 'Traceback' not in stderr and 'error: ' in stderr
    for field in fields:
        assert field in stderr, stderr[-2000:]


def exit_status(main: Callable[[Sequence[str]], int], argv: list[str]) -> int | str | None:
    """A CLI's exit status in-process: argparse refuses by SystemExit(2)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def _spec(tmp_path: Path, text: str, name: str = 'w.yaml') -> str:
    path = tmp_path / name
    path.write_text(text, encoding='utf-8')
    return str(path)


def _authors(tmp_path: Path, records: object, name: str = 'w.json') -> str:
    path = tmp_path / name
    path.write_text(records if isinstance(records, str) else json.dumps(records),
                    encoding='utf-8')
    return str(path)


@pytest.fixture(scope='module')
def bag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp('bags') / 'small'
    assert lrtrace_main(['record', '--workload', 'wid1', '--limit', '3', '--out',
                         str(path)]) == 0
    return path


# -- 5: input that ate memory or never returned ------------------------------------------------
def test_alias_bomb_workload_is_refused_before_it_expands(tmp_path):
    assert len(ALIAS_BOMB) < 450
    result = run_cli('timelyllm_ros', 'run', '--workload-file', _spec(tmp_path, ALIAS_BOMB),
                     cwd=tmp_path)
    assert_refused(result.returncode, result.stderr, 'w.yaml', 'expands to more than')


def test_alias_bomb_workload_spec_of_a_replay_is_refused(tmp_path, bag):
    result = run_cli('lrtrace.cli', 'replay', str(bag), '--workload-spec',
                     _spec(tmp_path, ALIAS_BOMB), cwd=tmp_path)
    assert_refused(result.returncode, result.stderr, 'w.yaml', 'expands to more than')


@pytest.mark.parametrize(('change', 'field'), [
    ({'eps': '.inf'}, 'eps'),
    ({'duration_s': '.inf'}, 'duration_s'),
    ({'eps': '1.0e+7', 'duration_s': '1.0e+4'}, 'eps x duration_s'),
])
def test_workload_spec_that_would_never_end_is_refused(tmp_path, change, field):
    text = ''.join(f'{k}: {change.get(k, json.dumps(v))}\n' for k, v in SPEC.items())
    result = run_cli('timelyllm_ros', 'run', '--workload-file', _spec(tmp_path, text),
                     cwd=tmp_path)
    assert_refused(result.returncode, result.stderr, field)


@pytest.mark.parametrize(('change', 'field'), [
    ({'trigger time': float('nan')}, 'trigger time'),
    ({'exe_time_detail': [['s(', float('nan')]]}, 'exe_time_detail'),
])
def test_authors_nan_times_are_refused(tmp_path, change, field):
    path = _authors(tmp_path, [RECORD, {**RECORD, **change}])    # json.dumps writes NaN
    result = run_cli('timelyllm_ros', 'run', '--workload-file', path, cwd=tmp_path)
    assert_refused(result.returncode, result.stderr, 'record 1', field)


# -- 6: tracebacks instead of errors, and what was accepted without a word ---------------------
@pytest.mark.parametrize(('text', 'field'), [
    ('name: w\neps: ' + '[' * 5000, 'nested deeper'),
    (''.join(f'{k}: {v}\n' for k, v in {**SPEC, 'agents': 10**30}.items()), 'agents'),
    (''.join(f'{k}: {v}\n' for k, v in {**SPEC, 'max_tpe': 10**9}.items()), 'max_tpe'),
    (''.join(f'{k}: {v}\n' for k, v in {**SPEC, 'eps': 0.001, 'duration_s': 1}.items()),
     'no task'),
])
def test_workload_spec_out_of_range_is_an_error(capsys, tmp_path, text, field):
    status = exit_status(timelyllm_main, ['run', '--workload-file', _spec(tmp_path, text)])
    assert_refused(status, capsys.readouterr().err, field)


@pytest.mark.parametrize(('records', 'field'), [
    ('[' * 100_000, 'nested deeper'),
    ([RECORD, 7], 'record 1'),
    ([RECORD, {**RECORD, 'trigger time': 'soon'}], 'trigger time'),
    ([{**RECORD, 'exe_time_detail': [['s(', 1.0, 2.0]]}], 'exe_time_detail'),
    ([{**RECORD, 'exe_time_detail': 'fast'}], 'exe_time_detail'),
    ([{**RECORD, 'exe_time_detail': [['s(', -1.0]]}], 'exe_time_detail'),
    ([{**RECORD, 'trigger time': -5.0}], 'trigger time'),
])
def test_authors_records_out_of_shape_are_an_error(capsys, tmp_path, records, field):
    status = exit_status(timelyllm_main, ['run', '--workload-file', _authors(tmp_path, records)])
    assert_refused(status, capsys.readouterr().err, field)


def test_non_utf8_workload_file_is_an_error(capsys, tmp_path):
    path = tmp_path / 'latin1.yaml'
    path.write_bytes('name: caf\xe9\n'.encode('latin-1'))
    assert_refused(exit_status(timelyllm_main, ['run', '--workload-file', str(path)]),
                   capsys.readouterr().err, 'encoding', 'not UTF-8')


def test_endless_workload_file_is_read_no_further_than_its_bound(tmp_path):
    result = run_cli('timelyllm_ros', 'run', '--workload-file', '/dev/zero', cwd=tmp_path)
    assert_refused(result.returncode, result.stderr, '/dev/zero', 'size')


def test_profile_grid_too_large_is_refused(tmp_path):
    result = run_cli('lrtrace.cli', 'profile', '--robot', 'tello', '--grid', '100000',
                     '--repeats', '100000', '--out', 'bag', cwd=tmp_path)
    assert_refused(result.returncode, result.stderr, '--grid')
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(('argv', 'field'), [
    (['run', '--tasks', '0'], '--tasks'),
    (['run', '--tasks', '-1'], '--tasks'),
    (['run', '--seed', '-1'], '--seed'),
    (['run', '--comm-ms', 'nan'], '--comm-ms'),
    (['run', '--engine-opt', 'max_num_seqs=0', '--tasks', '2'], 'max_num_seqs'),
    (['overhead', '--queued', '1,x'], '--queued'),
    (['bench', '--batch-sizes', '0,4', '--out', 'b'], '--batch-sizes'),
])
def test_timelyllm_arguments_out_of_range_are_an_error(capsys, tmp_path, monkeypatch, argv,
                                                       field):
    monkeypatch.chdir(tmp_path)
    assert_refused(exit_status(timelyllm_main, argv), capsys.readouterr().err, field)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(('argv', 'field'), [
    (['record', '--chunk-size', '0', '--limit', '2', '--out', 'bag'], '--chunk-size'),
    (['record', '--jitter', '-1', '--limit', '2', '--out', 'bag'], '--jitter'),
    (['record', '--jitter', 'nan', '--limit', '2', '--out', 'bag'], '--jitter'),
    (['record', '--seed', '-1', '--limit', '2', '--out', 'bag'], '--seed'),
    (['record', '--limit', '2', '--out', 'missing/bag'], '--out'),
    (['profile', '--robot', 'tello', '--grid', '1000', '--repeats', '1000', '--out', 'bag'],
     '--grid x --repeats'),
])
def test_lrtrace_arguments_out_of_range_are_an_error(capsys, tmp_path, monkeypatch, argv,
                                                     field):
    monkeypatch.chdir(tmp_path)
    assert_refused(exit_status(lrtrace_main, argv), capsys.readouterr().err, field)
    assert not list(tmp_path.iterdir())


def test_outputs_into_a_missing_directory_are_refused_before_any_work(capsys, tmp_path, bag):
    missing = tmp_path / 'missing'
    for main, argv, field in [
            (timelyllm_main, ['run', '--tasks', '2', '--json', f'{missing}/s.json'], '--json'),
            (lrtrace_main, ['inspect', str(bag), '--plot', f'{missing}/t.png'], '--plot'),
            (lrtrace_main, ['replay', str(bag), '--json', f'{missing}/s.json'], '--json')]:
        assert_refused(exit_status(main, argv), capsys.readouterr().err, field)
    assert not missing.exists()


# -- every loader, one mechanism -----------------------------------------------------------------
HOSTILE = {
    'alias bomb': ALIAS_BOMB.encode(),
    'recursive alias': b'a: &a [1, *a]\n',
    'deep': b'[' * 200_000,
    'not UTF-8': b'name: \xff\xfe\n',
    'huge integer': b'[' + b'9' * 5000 + b']',
}
# Run in a bounded child (a regression here eats memory): each loader on each file, and
# whether it raised the error its callers catch, as an InputError naming the file.
LOADERS_SCRIPT = """
import json, sys
from lrtrace.cli import _read_poses
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.errors import EngineError, ProfileError, RobotError, WorkloadError
from timelyllm_ros.language.profiles import load_profile_file
from timelyllm_ros.safe_files import InputError
from timelyllm_ros.language.traces import load_trace_set
from timelyllm_ros.evaluation.workloads import load_authors_workload, load_workload_spec

LOADERS = {'workload spec': (load_workload_spec, WorkloadError),
           'authors workload': (load_authors_workload, WorkloadError),
           'trace set': (load_trace_set, WorkloadError),
           'profile': (load_profile_file, ProfileError),
           'calibration': (load_calibration, EngineError),
           'poses': (_read_poses, RobotError)}
outcomes = {}
for path in sys.argv[1:]:
    for name, (load, promised) in LOADERS.items():
        try:
            load(path)
            outcome = 'accepted'
        except InputError as err:
            good = isinstance(err, promised) and path in str(err) and len(str(err)) < 600
            outcome = 'refused' if good else f'refused badly: {type(err).__name__}: {err}'
        except Exception as err:
            outcome = f'{type(err).__name__}: {str(err)[:300]}'
        outcomes[f'{name} <- {path}'] = outcome
print(json.dumps(outcomes))
"""


def test_every_loader_refuses_hostile_files_with_its_own_error(tmp_path):
    paths = []
    for index, content in enumerate(HOSTILE.values()):
        paths.append(tmp_path / f'hostile-{index}.yaml')     # calibrations: paths end in .yaml
        paths[-1].write_bytes(content)
    env = {**os.environ, 'OPENBLAS_NUM_THREADS': '1'}
    result = subprocess.run([sys.executable, '-c', LOADERS_SCRIPT, *map(str, paths)],
                            capture_output=True, text=True, timeout=TIMEOUT_S,
                            preexec_fn=_limit_memory, env=env, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    outcomes = json.loads(result.stdout)
    assert len(outcomes) == len(HOSTILE) * 6
    assert {case: outcome for case, outcome in outcomes.items() if outcome != 'refused'} == {}


def test_calibration_with_infinite_latency_is_refused(tmp_path):
    data = yaml.safe_load(load_calibration().model_dump_json())
    data['prefill_ms']['ms'][0] = float('inf')
    path = tmp_path / 'cal.yaml'
    path.write_text(yaml.safe_dump(data), encoding='utf-8')
    with pytest.raises(EngineError, match='prefill_ms'):
        load_calibration(path)


@pytest.mark.parametrize('value', [str(10**30), '.nan', '-.inf', 'true', '1e9'])
def test_pose_coordinates_out_of_range_are_refused(tmp_path, value):
    path = tmp_path / 'poses.yaml'
    path.write_text(f'cup: [0, 0, {value}, 0, 180, 0]\n', encoding='utf-8')
    with pytest.raises(RobotError, match='poses must map') as info:
        _read_poses(str(path))
    assert isinstance(info.value, InputError)


def test_simulator_refuses_a_zero_batch_cap():
    with pytest.raises(EngineError, match='max_num_seqs: must be >= 1, got 0'):
        create_engine('sim', max_num_seqs='0')


def test_hostile_files_campaign_small():
    """benchmarks/hostile_files.py, imported from its path (benchmarks/ is not a package)."""
    campaign = load_benchmark('hostile_files')
    counts = campaign.run_hostile_files_campaign(seed=3, cases=6)
    assert counts['cases'] == 6
    assert counts['hostile_file_crashes'] == 0 and counts['hostile_file_hangs'] == 0
