"""Degenerate timing sets against ``lrtrace fit`` (issue 31, item 7).

    python3 benchmarks/degenerate_fits.py [--cases 60] [--seed 0] [--json]

Each case records a small bag of successful Tello skill executions whose timings make no
sense, in one to three seeded ways at once, fits the tello profile to it with
:func:`lrtrace.fit.fit_profile`, writes the profile with :func:`lrtrace.fit.write_profile` and
reads the written YAML back as plain data (not through the profile loader, which refuses what
this campaign looks for). The ways, in turn:

* ``falling``: ``mf`` durations that fall clearly as the distance grows;
* ``flat_noise``: a flat ``mf`` whose noise gives a slope of either sign;
* ``two_falling``: two ``mf`` samples, the longer distance the shorter time;
* ``zeros``: zero-length ``to``, ``ld`` or ``s`` records among real ones, or only those;
* ``tiny_scale``: the bag's ``time_scale`` so large that every duration shrinks below 1 ms;
* ``one_value``: ``mf`` at a single distance;
* ``negative_intercept``: a steep ``mf`` line that crosses 0 s above 0 cm;
* ``falling_cubic``: ``mu`` durations that rise, then fall over the range.

Counted:

* ``degenerate_models_written`` (must be 0): written models that give a time under 1 ms (the
  shortest a skill takes) or that fall as the argument grows, anywhere in the skill's
  argument range (evaluated at 481 points of it for parametric models);
* ``unloadable_profiles_written`` (must be 0): written profiles the profile loader refuses;
* ``fit_crashes`` (must be 0): an exception out of fitting or writing;
* ``fits_refused`` and ``fits_adjusted``: skills whose timings were refused (the model kept)
  and fitted models with a note (samples dropped, a slope clamped, a floor raised): what the
  fitter did instead.

:func:`run_degenerate_fit_campaign` returns the counts with ``cases``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lrtrace.fit import fit_profile, write_profile
from lrtrace.recorder import TraceRecorder
from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.exec_time import MIN_SKILL_S
from timelyllm_ros.language.profiles import RobotProfile, load_profile, load_profile_file
from timelyllm_ros.robots.backend import SkillRecord

WAYS = ('falling', 'flat_noise', 'two_falling', 'zeros', 'tiny_scale', 'one_value',
        'negative_intercept', 'falling_cubic')
Call = tuple[str, str, float]        # (skill, call text, seconds)


def degenerate_calls(rng: random.Random, way: str) -> tuple[list[Call], dict[str, str]]:
    """The recorded calls of one way of being degenerate, and the bag meta it needs."""
    distances = range(20, 501, rng.choice([20, 40, 80]))
    if way == 'falling':
        top, slope = rng.uniform(3, 8), rng.uniform(0.002, 0.01)
        return [('move_forward', f'mf({x})', max(0.0, top - slope * x + rng.gauss(0, 0.02)))
                for x in distances], {}
    if way == 'flat_noise':
        level = rng.uniform(0.5, 4)
        return [('move_forward', f'mf({x})', level + rng.gauss(0, 0.05)) for x in distances], {}
    if way == 'two_falling':
        low, high = sorted(rng.sample(range(20, 501), 2))
        return [('move_forward', f'mf({low})', 3.0), ('move_forward', f'mf({high})', 2.0)], {}
    if way == 'zeros':
        skill, text, seconds = rng.choice([('takeoff', 'to()', 5.0), ('land', 'ld()', 3.0),
                                           ('scan', "s('cat')", 1.5)])
        real = rng.randint(0, 4)
        return ([(skill, text, 0.0)] * rng.randint(1, 5)
                + [(skill, text, seconds + rng.gauss(0, 0.1)) for _ in range(real)]), {}
    if way == 'tiny_scale':
        calls = [('move_forward', f'mf({x})', 1.8 + 0.0072 * x) for x in distances]
        return calls + [('takeoff', 'to()', 5.0)], {'time_scale': rng.choice(['1e300', '1e6'])}
    if way == 'one_value':
        x = rng.randrange(20, 501)
        return [('move_forward', f'mf({x})', rng.uniform(1, 5))] * rng.randint(1, 6), {}
    if way == 'negative_intercept':
        slope = rng.uniform(0.005, 0.02)
        cross = rng.uniform(1, 19)                     # 0 s at this distance (below 20 cm)
        return [('move_forward', f'mf({x})', slope * (x - cross)) for x in distances], {}
    peak = rng.uniform(150, 400)                       # falling_cubic: rises, then falls
    return [('move_up', f'mu({x})', max(0.0, 3.0 - 0.00003 * (x - peak) ** 2))
            for x in distances], {}


def _record(path: Path, calls: Sequence[Call], info: dict[str, str]) -> None:
    with TraceRecorder(path, source='degenerate fit campaign', info=info) as recorder:
        t = 0.0
        for i, (skill, text, seconds) in enumerate(calls):
            recorder.record_skill('tello-01', f'task-{i}', 0,
                                  SkillRecord(skill, text, {}, t, t + seconds, True))
            t += seconds + 0.1


def model_problem(model: dict[str, Any], low: float, high: float) -> str:
    """Why a written model (plain data) is degenerate over arguments ``[low, high]``, or ''."""
    kind = model.get('kind')
    if kind == 'constant':
        return '' if float(model['seconds']) >= MIN_SKILL_S else f'{model["seconds"]} s'
    if kind == 'sampled':
        shortest = (min(model['samples']) if model.get('samples') is not None
                    else model['uniform'][0])
        return '' if float(shortest) >= MIN_SKILL_S else f'a sample of {shortest} s'
    xs = np.linspace(low, high, 481)
    times = np.maximum(float(model.get('floor_s', 0.0)),
                       np.polyval(np.asarray(model['coefficients'], dtype=float)[::-1], xs))
    if (times[xs > 0] < MIN_SKILL_S).any():
        return f'{times.min():.3g} s at the shortest'
    if (np.diff(times) < -1e-12).any():
        return 'falls as the argument grows'
    return ''


def _argument_range(profile: RobotProfile, skill: str) -> tuple[float, float]:
    bounds = [(a.min or 0.0, a.max or 0.0) for a in profile.skill(skill).args
              if a.type != 'str']
    if not bounds:
        return 0.0, 0.0
    return min(abs(b[0]) for b in bounds), max(max(abs(b[0]), abs(b[1])) for b in bounds)


def run_degenerate_fit_campaign(seed: int, cases: int) -> dict[str, int]:
    """Fit ``cases`` degenerate timing sets; the counts (see the module docstring)."""
    rng = random.Random(seed)
    tello = load_profile('tello')
    counts = dict.fromkeys(('degenerate_models_written', 'unloadable_profiles_written',
                            'fit_crashes', 'fits_refused', 'fits_adjusted'), 0)
    with tempfile.TemporaryDirectory(prefix='degenerate-fits-') as tmp:
        for case in range(cases):
            calls: list[Call] = []
            info: dict[str, str] = {}
            for way in rng.sample(WAYS, rng.randint(1, 3)):
                more, meta = degenerate_calls(rng, way)
                calls += more
                info.update(meta)
            bag, out = Path(tmp) / f'bag-{case}', Path(tmp) / f'fitted-{case}.yaml'
            try:
                _record(bag, calls, info)
                fitted, report = fit_profile([bag], tello)
                write_profile(fitted, out)
            except Exception:  # noqa: BLE001 -- counted
                counts['fit_crashes'] += 1
                continue
            counts['fits_refused'] += sum(why.endswith('; kept')
                                          for why in report.skipped.values())
            counts['fits_adjusted'] += sum(bool(f.note) for f in report.skills.values())
            written = {s['name']: s['exec_time']
                       for s in yaml.safe_load(out.read_text(encoding='utf-8'))['skills']}
            for name in report.skills:
                if model_problem(written[name], *_argument_range(tello, name)):
                    counts['degenerate_models_written'] += 1
            try:
                load_profile_file(out)
            except ProfileError:
                counts['unloadable_profiles_written'] += 1
    return {'cases': cases, **counts}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the campaign and print its counts (exit status 1 if a must-be-0 count is not)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--cases', type=int, default=60, help='degenerate timing sets')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--json', action='store_true', help='print the counts as JSON')
    args = parser.parse_args(argv)
    result = run_degenerate_fit_campaign(args.seed, args.cases)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f'{key}: {value}')
    bad = (result['degenerate_models_written'] + result['unloadable_profiles_written']
           + result['fit_crashes'])
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
