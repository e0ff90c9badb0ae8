"""``lrtrace fit`` on timing sets that make no sense: it refuses or clamps, and says so.

Each test records a small synthetic bag (what a broken recording would hold: durations that
fall as the distance grows, zero-length calls, a bag meta whose time scale shrinks every
duration to nothing, a single distinct argument) and checks the fitted profile, the report
(``--json`` and the human output) and the written profile's provenance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from utils import load_benchmark

from lrtrace.cli import main
from lrtrace.fit import fit_profile, write_profile
from lrtrace.recorder import TraceRecorder
from timelyllm_ros.language.exec_time import MIN_SKILL_S, ParametricTime
from timelyllm_ros.language.profiles import load_profile, load_profile_file
from timelyllm_ros.robots.backend import SkillRecord

Call = tuple[str, str, float]        # (skill, call text, seconds)


def _bag(path: Path, calls: Sequence[Call], info: dict[str, str] | None = None) -> Path:
    with TraceRecorder(path, source='synthetic degenerate timings', info=info) as recorder:
        t = 0.0
        for i, (skill, text, seconds) in enumerate(calls):
            recorder.record_skill('tello-01', f'task-{i}', 0,
                                  SkillRecord(skill, text, {}, t, t + seconds, True))
            t += seconds + 0.1
    return path


def _moves(seconds_at: dict[int, float], repeats: int = 1) -> list[Call]:
    return [('move_forward', f'mf({x})', s) for x, s in seconds_at.items()
            for _ in range(repeats)]


def _falling(rng: np.random.Generator) -> list[Call]:
    """mf durations that fall clearly with the distance (5 s at 20 cm, 1.2 s at 500 cm)."""
    return [('move_forward', f'mf({x})', 5.16 - 0.0079 * x + rng.normal(0, 0.02))
            for x in range(20, 501, 20)]


def test_significantly_falling_durations_are_refused_and_the_model_kept(tmp_path):
    bundled = load_profile('tello').skill('mf').exec_time
    fitted, report = fit_profile([_bag(tmp_path / 'b', _falling(np.random.default_rng(0)))],
                                 'tello')
    assert 'move_forward' not in report.skills
    why = report.skipped['move_forward']
    assert 'fall' in why and 'negative slope' in why and 'kept' in why, why
    assert fitted.skill('mf').exec_time == bundled
    assert fitted.skill('mf').exec_time.mean_s({'distance': 450}) > 4.0
    assert 'move_forward' in fitted.exec_time_provenance
    assert 'negative slope' in fitted.exec_time_provenance


def test_an_insignificant_negative_slope_is_clamped_to_the_mean(tmp_path):
    rng = np.random.default_rng(6)
    # A flat 2 s skill whose noise happens to lean down: the least-squares slope is negative
    # but indistinguishable from 0 (t about -0.9).
    seconds = {x: 2.0 + rng.normal(0, 0.05) - 1e-5 * x for x in range(20, 501, 40)}
    assert np.polyfit(list(seconds), list(seconds.values()), 1)[0] < 0
    _, report = fit_profile([_bag(tmp_path / 'b', _moves(seconds))], 'tello')
    fit = report.skills['move_forward']
    model = ParametricTime.model_validate(fit.model)
    assert model.coefficients[1] == 0.0
    assert model.coefficients[0] == pytest.approx(np.mean(list(seconds.values())))
    assert model.mean_s({'distance': 450}) == pytest.approx(model.mean_s({'distance': 20}))
    assert 'clamped' in fit.note and 'not significant' in fit.note, fit.note


def test_two_falling_samples_cannot_show_significance_and_are_clamped(tmp_path):
    _, report = fit_profile([_bag(tmp_path / 'b', _moves({20: 3.0, 500: 2.0}))], 'tello')
    model = ParametricTime.model_validate(report.skills['move_forward'].model)
    assert model.coefficients == pytest.approx([2.5, 0.0])
    assert 'clamped' in report.skills['move_forward'].note


def test_zero_length_samples_are_dropped_and_counted(tmp_path):
    calls = [('takeoff', 'to()', s) for s in (5.1, 0.0, 4.9, 0.0, 0.0, 5.0)]
    fitted, report = fit_profile([_bag(tmp_path / 'b', calls)], 'tello')
    assert fitted.skill('to').exec_time.seconds == pytest.approx(5.0)
    assert report.skills['takeoff'].samples == 3
    assert report.invalid_samples == {'takeoff': 3}
    assert '3 samples shorter than 1 ms dropped' in report.skills['takeoff'].note
    assert report.to_json()['invalid_samples'] == {'takeoff': 3}
    assert '3 samples shorter than 1 ms dropped' in fitted.skill('to').exec_time.source


def test_only_zero_length_samples_keep_the_model(tmp_path):
    calls = [('takeoff', 'to()', 0.0)] * 4 + [('scan', "s('cat')", 0.0)] * 3
    fitted, report = fit_profile([_bag(tmp_path / 'b', calls)], 'tello')
    tello = load_profile('tello')
    assert report.skills == {}
    assert fitted.skill('to').exec_time == tello.skill('to').exec_time
    assert fitted.skill('s').exec_time == tello.skill('s').exec_time
    assert 'all 4 samples shorter than 1 ms' in report.skipped['takeoff']
    assert 'all 3 samples shorter than 1 ms' in report.skipped['scan']
    assert report.invalid_samples == {'takeoff': 4, 'scan': 3}


def test_a_time_scale_that_shrinks_every_duration_to_nothing_fits_nothing(tmp_path):
    """1 s recorded at time_scale 1e300 is 1e-300 real-robot seconds: not a duration."""
    calls = _moves({x: 2.0 + 0.01 * x for x in range(20, 501, 60)}) + [('takeoff', 'to()', 5.0)]
    fitted, report = fit_profile([_bag(tmp_path / 'b', calls, {'time_scale': '1e300'})],
                                 'tello')
    assert report.skills == {}
    assert fitted.skill('to').exec_time.seconds == 5.0
    assert fitted.skill('mf').exec_time == load_profile('tello').skill('mf').exec_time


def test_one_distinct_argument_keeps_the_parametric_model_and_says_so(tmp_path):
    fitted, report = fit_profile([_bag(tmp_path / 'b', _moves({100: 2.6}, repeats=5))],
                                 'tello')
    assert 'move_forward' not in report.skills
    assert '1 distinct distance value' in report.skipped['move_forward']
    assert fitted.skill('mf').exec_time == load_profile('tello').skill('mf').exec_time
    assert '1 distinct distance value' in fitted.exec_time_provenance


def test_a_negative_intercept_is_floored_at_the_shortest_skill_time(tmp_path):
    # 0.01 s/cm through -0.1 s: the line gives 0 s (or less) below 10 cm.
    seconds = {x: -0.1 + 0.01 * x for x in range(20, 501, 40)}
    fitted, report = fit_profile([_bag(tmp_path / 'b', _moves(seconds))], 'tello')
    model = fitted.skill('mf').exec_time
    assert isinstance(model, ParametricTime)
    assert model.coefficients == pytest.approx([-0.1, 0.01], abs=1e-6)
    assert model.floor_s == MIN_SKILL_S and model.mean_s({'distance': 5}) == MIN_SKILL_S
    assert 'floored at 1 ms' in report.skills['move_forward'].note


def test_a_falling_cubic_is_refused(tmp_path):
    # mu is cubic in the bundled profile: durations that rise then fall over the range.
    seconds = {x: 2.0 + 0.02 * x - 0.00006 * x * x for x in range(20, 501, 40)}
    calls = [('move_up', f'mu({x})', s) for x, s in seconds.items()]
    fitted, report = fit_profile([_bag(tmp_path / 'b', calls)], 'tello')
    assert 'move_up' not in report.skills
    assert 'falls' in report.skipped['move_up'] and 'kept' in report.skipped['move_up']
    assert fitted.skill('mu').exec_time == load_profile('tello').skill('mu').exec_time


def test_the_written_profile_loads_and_never_falls(tmp_path):
    rng = np.random.default_rng(5)
    calls = _falling(rng) + [('takeoff', 'to()', s) for s in (0.0, 5.0, 5.2)]
    fitted, _ = fit_profile([_bag(tmp_path / 'b', calls)], 'tello')
    again = load_profile_file(write_profile(fitted, tmp_path / 'tello.yaml'))
    mf = again.skill('mf').exec_time
    assert mf.mean_s({'distance': 450}) >= mf.mean_s({'distance': 20}) > 0
    assert again.skill('to').exec_time.seconds == pytest.approx(5.1)
    assert 'negative slope' in again.exec_time_provenance
    assert '1 sample shorter than 1 ms dropped' in again.exec_time_provenance


def test_the_cli_reports_refusals_clamps_and_dropped_samples(tmp_path, capsys):
    calls = (_falling(np.random.default_rng(1)) + [('takeoff', 'to()', s) for s in (0.0, 5.0)]
             + [('move_up', 'mu(50)', 2.0), ('move_up', 'mu(90)', 2.0)])
    bag = _bag(tmp_path / 'b', calls)
    capsys.readouterr()
    assert main(['fit', str(bag), '--robot', 'tello', '--json']) == 0
    report = json.loads(capsys.readouterr().out)
    assert 'negative slope' in report['skipped']['move_forward']
    assert report['invalid_samples'] == {'takeoff': 1}
    assert 'shorter than 1 ms' in report['skills']['takeoff']['note']
    assert main(['fit', str(bag), '--robot', 'tello']) == 0
    text = capsys.readouterr().out
    assert 'skipped move_forward:' in text and 'negative slope' in text
    assert 'note takeoff: 1 sample shorter than 1 ms dropped' in text
    assert 'skipped move_up: 2 distinct distance values cannot fit degree 3' in text


def test_the_degenerate_fit_campaign_writes_no_degenerate_model():

    campaign = load_benchmark('degenerate_fits')
    counts = campaign.run_degenerate_fit_campaign(seed=7, cases=12)
    assert counts['cases'] == 12 and counts['fits_refused'] > 0
    assert counts['degenerate_models_written'] == 0
    assert counts['unloadable_profiles_written'] == 0 and counts['fit_crashes'] == 0
