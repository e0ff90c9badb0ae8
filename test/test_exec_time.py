"""Execution-time models: hand-computed predictions, sampling bounds, fitting, validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.exec_time import (
    MIN_SKILL_S,
    ConstantTime,
    ExecTimeModel,
    ParametricTime,
    SampledTime,
    fit_constant,
    fit_parametric,
    fit_sampled,
)
from timelyllm_ros.language.profiles import PROFILES_DIR, load_profile, load_profile_file

RNG_SEEDS = range(5)


# --- hand-computed values of the bundled models -------------------------------------------------


def test_tello_linear_moves():
    tello = load_profile('tello')
    for key in ('mf', 'mb', 'ml', 'mr'):
        model = tello.skill(key).exec_time
        # 1.8144 + 0.0072 * 100
        assert model.min_s({'distance': 100}) == pytest.approx(2.5344)
        assert model.mean_s({'distance': 100}) == pytest.approx(2.5344)
        assert model.sample_s({'distance': 100}, np.random.default_rng(0)) == pytest.approx(2.5344)
        # 1.8144 + 0.0072 * 500
        assert model.min_s({'distance': 500}) == pytest.approx(5.4144)


def test_tello_vertical_moves_are_cubic():
    tello = load_profile('tello')
    for key in ('mu', 'md'):
        model = tello.skill(key).exec_time
        # 1.3195 + 0.0388*50 - 0.0003*50**2 + 8e-7*50**3 = 1.3195 + 1.94 - 0.75 + 0.1
        assert model.min_s({'distance': 50}) == pytest.approx(2.6095)
        # 1.3195 + 7.76 - 12 + 6.4
        assert model.min_s({'distance': 200}) == pytest.approx(3.4795)


def test_tello_turns():
    tello = load_profile('tello')
    for key in ('tc', 'tu'):
        model = tello.skill(key).exec_time
        assert model.min_s({'degrees': 90}) == pytest.approx(2.269)  # 0.784 + 0.0165 * 90
        assert model.min_s({'degrees': 360}) == pytest.approx(6.724)


def test_tello_constants_and_scan():
    tello = load_profile('tello')
    rng = np.random.default_rng(1)
    assert tello.skill('to').exec_time.min_s({}) == pytest.approx(5.0)
    assert tello.skill('ld').exec_time.min_s({}) == pytest.approx(3.0)
    assert tello.skill('g').exec_time.sample_s({'object': 'cat'}, rng) == pytest.approx(2.5)
    assert tello.skill('sa').exec_time.mean_s({}) == pytest.approx(1.5675)
    assert tello.skill('p').exec_time.mean_s({}) == pytest.approx(0.041)
    for key in ('iv', 'ox', 'oy', 'ow', 'oh', 'od', 'l', 'tp', 'rp'):
        assert tello.skill(key).exec_time.min_s({}) == pytest.approx(0.001)
    scan = tello.skill('s').exec_time
    assert isinstance(scan, SampledTime)
    assert scan.samples == pytest.approx([k * 1.5275 for k in range(1, 9)])
    assert scan.min_s({}) == pytest.approx(1.5275)
    assert scan.mean_s({}) == pytest.approx(4.5 * 1.5275)
    assert tello.skill('d').exec_time.min_s({'seconds': 2.5}) == pytest.approx(2.5)


def test_indy7_models():
    indy7 = load_profile('indy7')
    mj = indy7.skill('mj').exec_time
    # x = max |joint| = 90 degrees: 0.6 + 0.006667 * 90
    args = {'j1': 0.0, 'j2': 30.0, 'j3': -90.0, 'j4': 0.0, 'j5': -45.0, 'j6': 10.0}
    assert mj.min_s(args) == pytest.approx(0.6 + 0.006667 * 90)
    mt = indy7.skill('mt').exec_time
    pose = {'x': 400.0, 'y': -500.0, 'z': 300.0, 'rx': 180.0, 'ry': 0.0, 'rz': 0.0}
    assert mt.min_s(pose) == pytest.approx(1.1)  # rotations do not count: 0.6 + 0.001 * 500
    assert indy7.skill('move_to').exec_time.min_s({}) == pytest.approx(0.8)
    assert indy7.skill('move_to').exec_time.mean_s({}) == pytest.approx((0.8 + 5.5) / 2)
    assert indy7.skill('take').exec_time.mean_s({}) == pytest.approx(3.6)
    assert indy7.skill('detect').exec_time.min_s({}) == pytest.approx(1.0)
    assert indy7.skill('grip').exec_time.min_s({}) == pytest.approx(0.5)
    assert indy7.skill('check').exec_time.min_s({}) == pytest.approx(0.05)


@pytest.mark.parametrize('name', ['tello', 'indy7'])
def test_min_never_exceeds_sample(name):
    for skill in load_profile(name).skills:
        model = skill.exec_time
        args = {a.name: (a.max if a.max is not None else 1) for a in skill.args if a.type != 'str'}
        lowest = model.min_s(args)
        assert lowest >= 0, skill.name
        assert lowest <= model.mean_s(args) + 1e-12, skill.name
        for seed in RNG_SEEDS:
            rng = np.random.default_rng(seed)
            for _ in range(50):
                assert lowest <= model.sample_s(args, rng) + 1e-12, skill.name


# --- the three model kinds ----------------------------------------------------------------------


def test_constant_model():
    model = ConstantTime(seconds=1.25, source='test')
    assert model.min_s({}) == model.mean_s({}) == 1.25
    assert model.sample_s({}, np.random.default_rng(0)) == 1.25
    with pytest.raises(ValidationError):
        ConstantTime(seconds=-1.0)


def test_parametric_model_details():
    model = ParametricTime(argument='a, b', coefficients=[1.0, 2.0, 0.5], floor_s=0.0)
    assert model.min_s({'a': -3, 'b': 2}) == pytest.approx(1 + 6 + 4.5)  # x = max(|-3|, |2|)
    assert model.min_s({}) == pytest.approx(1.0)  # missing argument: x = 0
    assert model.min_s({'a': 'far', 'b': True}) == pytest.approx(1.0)  # non-numbers ignored
    floored = ParametricTime(argument='x', coefficients=[-1.0, 1.0], floor_s=0.2)
    assert floored.min_s({'x': 0.5}) == pytest.approx(0.2)
    assert floored.at(3.0) == pytest.approx(2.0)
    with pytest.raises(ValidationError):
        ParametricTime(argument='x', coefficients=[])
    with pytest.raises(ValidationError):
        ParametricTime(argument='x', coefficients=[1.0], floor_s=-1)


def test_sampled_samples():
    model = SampledTime(samples=[2.0, 1.0, 6.0])
    assert model.min_s({}) == 1.0
    assert model.mean_s({}) == pytest.approx(3.0)
    rng = np.random.default_rng(7)
    draws = {model.sample_s({}, rng) for _ in range(200)}
    assert draws == {1.0, 2.0, 6.0}


def test_sampled_uniform_mean_and_bounds():
    model = SampledTime(uniform=(3.0, 4.2))
    assert model.min_s({}) == 3.0
    assert model.mean_s({}) == pytest.approx(3.6)
    rng = np.random.default_rng(3)
    draws = np.array([model.sample_s({}, rng) for _ in range(2000)])
    assert draws.min() >= 3.0 and draws.max() <= 4.2
    assert draws.mean() == pytest.approx(3.6, abs=0.05)
    assert SampledTime(uniform=(2.0, 2.0)).sample_s({}, rng) == 2.0


def test_sampled_validation():
    with pytest.raises(ValidationError, match='exactly one of samples or uniform'):
        SampledTime(samples=[1.0], uniform=(1.0, 2.0))
    with pytest.raises(ValidationError, match='exactly one of samples or uniform'):
        SampledTime()
    with pytest.raises(ValidationError, match='sample -0.5 s is shorter than 0.001 s'):
        SampledTime(samples=[1.0, -0.5])
    with pytest.raises(ValidationError, match='non-empty'):
        SampledTime(samples=[])
    with pytest.raises(ValidationError, match='low <= high'):
        SampledTime(uniform=(3.0, 1.0))
    with pytest.raises(ValidationError, match='low -1 s is shorter than 0.001 s'):
        SampledTime(uniform=(-1.0, 1.0))


def test_discriminated_union_and_frozen():
    adapter = TypeAdapter(ExecTimeModel)
    model = adapter.validate_python({'kind': 'sampled', 'uniform': [1, 2], 'source': 's'})
    assert isinstance(model, SampledTime) and model.uniform == (1.0, 2.0)
    assert isinstance(adapter.validate_python({'kind': 'constant', 'seconds': 1}), ConstantTime)
    with pytest.raises(ValidationError):
        adapter.validate_python({'kind': 'constant', 'seconds': 1, 'extra': 2})
    with pytest.raises(ValidationError):
        model.source = 'changed'  # type: ignore[misc]


# --- fitting ------------------------------------------------------------------------------------


def test_fit_constant_is_mean():
    model = fit_constant([1.0, 2.0, 4.5], source='bench')
    assert model.seconds == pytest.approx(2.5)
    assert model.source == 'bench'
    with pytest.raises(ValueError, match='no samples'):
        fit_constant([], source='bench')


def test_fit_parametric_noiseless_linear():
    xs = [20, 50, 100, 200, 500]
    seconds = [1.8144 + 0.0072 * x for x in xs]
    model = fit_parametric(xs, seconds, argument='distance', source='bench')
    assert model.argument == 'distance' and model.source == 'bench'
    assert model.coefficients == pytest.approx([1.8144, 0.0072], rel=1e-9)
    assert model.min_s({'distance': 100}) == pytest.approx(2.5344)


def test_fit_parametric_noiseless_cubic():
    coefficients = [1.3195, 0.0388, -0.0003, 8e-7]
    xs = np.linspace(20, 500, 12)
    seconds = [sum(c * x**i for i, c in enumerate(coefficients)) for x in xs]
    model = fit_parametric(list(xs), seconds, argument='distance', source='bench', degree=3)
    assert model.coefficients == pytest.approx(coefficients, rel=1e-6)


def test_fit_parametric_uses_absolute_argument():
    xs = [-90, -45, 45, 90, 180]
    seconds = [0.784 + 0.0165 * abs(x) for x in xs]
    model = fit_parametric(xs, seconds, argument='degrees', source='bench')
    assert model.coefficients == pytest.approx([0.784, 0.0165])


def test_fit_parametric_slightly_noisy():
    rng = np.random.default_rng(42)
    xs = np.repeat(np.arange(20, 501, 40), 5).astype(float)
    seconds = 1.8144 + 0.0072 * xs + rng.normal(0.0, 0.02, xs.size)
    model = fit_parametric(list(xs), list(seconds), argument='distance', source='bench')
    intercept, slope = model.coefficients
    assert intercept == pytest.approx(1.8144, rel=0.05)
    assert slope == pytest.approx(0.0072, rel=0.05)


def test_fit_parametric_errors():
    with pytest.raises(ValueError, match='more than 1 paired samples'):
        fit_parametric([], [], argument='x', source='s')
    with pytest.raises(ValueError, match='more than 1 paired samples'):
        fit_parametric([1.0], [2.0], argument='x', source='s')
    with pytest.raises(ValueError, match='paired'):
        fit_parametric([1.0, 2.0, 3.0], [1.0, 2.0], argument='x', source='s')
    with pytest.raises(ValueError, match='more than 3'):
        fit_parametric([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], argument='x', source='s', degree=3)


def test_fit_sampled_keeps_samples():
    recorded = [1.5275, 3.055, 4.5825]
    model = fit_sampled(recorded, source='bench')
    assert model.samples == recorded
    assert model.uniform is None
    assert model.min_s({}) == pytest.approx(1.5275)
    with pytest.raises(ValueError, match='no samples'):
        fit_sampled([], source='bench')
    with pytest.raises(ValidationError, match='shorter than 0.001 s'):
        fit_sampled([1.0, -2.0], source='bench')


# --- models that make no sense are refused when loaded ------------------------------------------


def _hand_edited(tmp_path: Path, short: str, exec_time: dict[str, object]) -> Path:
    """The bundled tello profile with one skill's model replaced, as a hand-edited file."""
    data = yaml.safe_load((PROFILES_DIR / 'tello.yaml').read_text(encoding='utf-8'))
    (skill,) = [s for s in data['skills'] if s['short'] == short]
    skill['exec_time'] = exec_time
    path = tmp_path / 'edited.yaml'
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding='utf-8')
    return path


@pytest.mark.parametrize('short, exec_time, problem', [
    # durations that fall with the distance: mf(450) would be planned as 0 s
    ('mf', {'kind': 'parametric', 'argument': 'distance', 'coefficients': [4.0, -0.01]},
     'negative slope'),
    # a cubic that rises, then falls past 3 m
    ('mu', {'kind': 'parametric', 'argument': 'distance',
            'coefficients': [1.0, 0.02, 0.0, -2e-7]}, 'negative slope'),
    # a line through 0 s at 10 cm: mf(5) would take no time
    ('mf', {'kind': 'parametric', 'argument': 'distance', 'coefficients': [-0.1, 0.01]},
     '0 s for distance up to 10'),
    ('mf', {'kind': 'parametric', 'argument': 'distance', 'coefficients': [0.0]},
     '0 s for every distance'),
    ('mf', {'kind': 'parametric', 'argument': 'distance', 'coefficients': [float('nan'), 1.0]},
     'finite number'),
    ('to', {'kind': 'constant', 'seconds': 0.0}, 'shorter than 0.001 s'),
    ('to', {'kind': 'constant', 'seconds': 1e-300}, 'shorter than 0.001 s'),
    ('to', {'kind': 'constant', 'seconds': float('inf')}, 'finite number'),
    ('s', {'kind': 'sampled', 'samples': [1.5, 0.0, 3.0]}, 'shorter than 0.001 s'),
    ('s', {'kind': 'sampled', 'uniform': [0.0, 3.0]}, 'shorter than 0.001 s'),
])
def test_a_hand_edited_model_that_makes_no_sense_is_refused_naming_the_skill(
        tmp_path, short, exec_time, problem):
    path = _hand_edited(tmp_path, short, exec_time)
    with pytest.raises(ProfileError) as info:
        load_profile_file(path)
    message = str(info.value)
    name = load_profile('tello').skill(short).name
    assert f'({name}).exec_time' in message, message
    assert problem in message, message


@pytest.mark.parametrize('exec_time', [
    {'kind': 'parametric', 'argument': 'distance', 'coefficients': [-1.0, 0.01],
     'floor_s': 0.2},                                   # the floor keeps it positive
    {'kind': 'parametric', 'argument': 'distance', 'coefficients': [0.0, 0.01]},   # 0 at 0 cm
    {'kind': 'parametric', 'argument': 'distance', 'coefficients': [1.5, 0.0]},    # flat
    {'kind': 'parametric', 'argument': 'distance', 'coefficients': [3.0, -0.01],
     'floor_s': 3.0},                                   # falls only below its floor
    {'kind': 'constant', 'seconds': MIN_SKILL_S},
])
def test_models_that_never_fall_below_zero_load(tmp_path, exec_time):
    assert load_profile_file(_hand_edited(tmp_path, 'mf', exec_time)).skill('mf')


def test_the_bundled_models_pass_the_checks():
    # The vertical moves are cubic with a negative square term, yet rise everywhere.
    up = load_profile('tello').skill('mu').exec_time
    assert isinstance(up, ParametricTime) and up.coefficients[2] < 0
    times = [up.mean_s({'distance': x}) for x in range(0, 2001, 10)]
    assert times == sorted(times)
    assert load_profile('indy7').skills


def test_fit_parametric_refuses_a_falling_fit():
    with pytest.raises(ValueError, match='negative slope'):
        fit_parametric([20, 100, 500], [5.0, 4.0, 1.0], argument='distance', source='s')
