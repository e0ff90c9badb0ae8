"""``lrtrace profile --backend emulator`` → ``lrtrace fit``: the round trip recovers the timing.

Each robot's loopback emulator is driven through the real vendor client (djitellopy for the
Tello, IndyDCP3 for the Indy7) and the skill executor, then fitted in real-robot seconds (the
recorded durations divided by the emulator's ``time_scale``). These tests check the round
trip's shape: what is profiled, skipped, recorded and fitted, and with which model kind. How
close the fit comes to the emulator's configured models is a wall-clock measurement, so it is
a benchmark (``python3 benchmarks/profile_round_trip.py``, target 5 %), not asserted here.
The grids are smaller than the defaults to keep the file fast on 2 cores (about 25 s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lrtrace.cli import main
from lrtrace.reader import read_bag
from timelyllm_ros.language.exec_time import ParametricTime
from timelyllm_ros.language.profiles import load_profile

TELLO_FITTED = {'move_forward', 'move_backward', 'move_left', 'move_right', 'move_up',
                'move_down', 'turn_cw', 'turn_ccw', 'takeoff', 'land'}
TELLO_SKIPPED = {'scan', 'scan_abstract', 'goto', 'is_visible', 'object_x', 'object_y',
                 'object_width', 'object_height', 'object_distance', 'probe', 'log',
                 'take_picture', 're_plan', 'delay'}
INDY7_FITTED = {'move_joint', 'move_task', 'grip', 'release'}
INDY7_SKIPPED = {'move_to', 'pick', 'place', 'detect', 'check'}


def _fit_json(bag: Path, robot: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(['fit', str(bag), '--robot', robot, '--json']) == 0
    return json.loads(capsys.readouterr().out)


def _check_round_trip(report: dict[str, Any], robot: str, fitted: set[str],
                      skipped: set[str], grid: dict[str, list[float]]) -> None:
    profile = load_profile(robot)
    assert set(report['skills']) == fitted
    assert skipped <= set(report['skipped'])
    assert all(report['skipped'][name].startswith('not profiled: ') for name in skipped)
    assert 'real-robot seconds' in report['seconds']
    assert 'configuration recorded in the bags' in report['reference']
    for name, entry in report['skills'].items():
        reference = profile.skill(name).exec_time
        model = entry['model']
        assert model['kind'] == reference.kind, name
        assert entry['samples'] == len(grid.get(name, [0] * entry['samples'])), name
        assert entry['rel_error'] is not None and entry['rel_error'] >= 0.0, name
        if isinstance(reference, ParametricTime):
            fitted_model = ParametricTime.model_validate(model)
            assert fitted_model.argument == reference.argument, name
            assert len(fitted_model.coefficients) == len(reference.coefficients), name


def test_tello_emulator_profile_fit_round_trip(tmp_path, capsys):
    pytest.importorskip('djitellopy')
    from lrtrace.profiling import profile_robot

    run = profile_robot('tello', 'emulator', tmp_path / 'tello', grid=4, repeats=1,
                        time_scale=0.1)
    assert run.time_scale == 0.1 and set(run.samples) == TELLO_FITTED
    assert all(count == 4 for count in run.samples.values())
    assert set(run.skipped) == TELLO_SKIPPED
    assert 'perception source' in run.skipped['scan']
    assert 'locally' in run.skipped['delay']
    assert run.meta['unstamped_calls'] == '0'
    print(f'tello profile: {run.wall_s:.1f} s')
    info = read_bag(tmp_path / 'tello').info
    assert info['emulator'] == 'TelloEmulator' and float(info['time_scale']) == 0.1
    assert set(json.loads(info['reference_models'])) == TELLO_FITTED
    report = _fit_json(tmp_path / 'tello', 'tello', capsys)
    distances, degrees = [20, 180, 340, 500], [1, 121, 240, 360]
    grid = {name: distances for name in TELLO_FITTED if name.startswith('move')}
    grid.update(turn_cw=degrees, turn_ccw=degrees)
    _check_round_trip(report, 'tello', TELLO_FITTED, TELLO_SKIPPED, grid)


def test_indy7_emulator_profile_fit_round_trip_through_the_cli(tmp_path, capsys):
    pytest.importorskip('neuromeka')
    pytest.importorskip('grpc')
    bag = tmp_path / 'indy7'
    assert main(['profile', '--robot', 'indy7', '--backend', 'emulator', '--grid', '4',
                 '--repeats', '1', '--time-scale', '0.5', '--out', str(bag)]) == 0
    out = capsys.readouterr().out
    assert 'time_scale 0.5' in out and 'skipped detect:' in out
    info = read_bag(bag).info
    assert info['emulator'] == 'Indy7Emulator' and float(info['time_scale']) == 0.5
    # The way back to the zero pose is performed but not recorded: 4 samples per move skill.
    assert len(read_bag(bag).skills) == 4 * len(INDY7_FITTED)
    report = _fit_json(bag, 'indy7', capsys)
    grid = {'move_joint': list(np.linspace(175 / 4, 175, 4)),
            'move_task': list(np.linspace(800 / 4, 800, 4))}
    _check_round_trip(report, 'indy7', INDY7_FITTED, INDY7_SKIPPED, grid)
    # The fitted models are real-robot seconds: the written profile plans with them as is.
    capsys.readouterr()
    assert main(['fit', str(bag), '--robot', 'indy7']) == 0
    text = capsys.readouterr().out
    assert 'skipped detect: not profiled: ' in text and 'move_joint' in text


def test_fit_without_recorded_reference_compares_with_the_profile(tmp_path, capsys):
    bag = tmp_path / 'sim'
    assert main(['profile', '--robot', 'tello', '--backend', 'sim', '--grid', '3',
                 '--repeats', '1', '--out', str(bag)]) == 0
    report = _fit_json(bag, 'tello', capsys)
    assert report['skills']['move_forward']['rel_error'] < 1e-9
    assert report['seconds'] == 'real-robot seconds'
    capsys.readouterr()
    assert main(['fit', str(bag), '--robot', 'tello', '--reference', 'tello', '--json']) == 0
    assert json.loads(capsys.readouterr().out)['reference'] == 'profile tello as given'


@pytest.mark.parametrize('argv, message', [
    (['--robot', 'nobot', '--backend', 'emulator'], 'unknown robot profile'),
    (['--robot', 'tello', '--backend', 'warp'], 'unknown backend'),
    (['--robot', 'tello', '--backend', 'indydcp3'], 'drives the indy7 robot'),
    (['--robot', 'chatbot', '--backend', 'emulator'], 'no emulator'),
    (['--robot', 'tello', '--backend', 'djitellopy', '--time-scale', '0.1'],
     'emulator only'),
    (['--robot', 'indy7', '--backend', 'emulator', '--grid', '0'], 'must be >= 1'),
])
def test_profile_cli_errors_return_1(tmp_path, capsys, argv, message):
    assert main(['profile', *argv, '--out', str(tmp_path / 'bag')]) == 1
    err = capsys.readouterr().err
    assert err.startswith('ERROR: ') and message in err
    assert not (tmp_path / 'bag').exists()


def test_profile_refuses_an_existing_bag(tmp_path, capsys):
    (tmp_path / 'bag').mkdir()
    assert main(['profile', '--robot', 'indy7', '--backend', 'emulator',
                 '--out', str(tmp_path / 'bag')]) == 1
    assert 'exists already' in capsys.readouterr().err
