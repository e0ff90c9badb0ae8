"""Fit execution-time models of a robot profile from recorded skill executions (paper 000 §6).

:func:`fit_profile` collects, per skill, ``(arguments, seconds)`` samples from the
``SkillExecution`` messages of LRTrace bags (successful calls only; the arguments are parsed
from the recorded call text with the profile's grammar) and refits each skill in the kind its
current model has:

* ``parametric`` -- least squares on the same argument, with the same polynomial degree;
* ``sampled``    -- the recorded durations become the distribution;
* ``constant``   -- the mean.

Timings that make no sense are never written as a model (the models drive the report deadline
of the next segment, and the loader refuses them anyway, see
:mod:`timelyllm_ros.language.exec_time`):

* a duration shorter than :data:`~timelyllm_ros.language.exec_time.MIN_SKILL_S` (1 ms) is not a
  measurement of a skill (a zero-length record, a time scale that shrinks it to nothing): it
  is dropped, and counted (``invalid_samples``); a skill left without samples keeps its model;
* a parametric skill recorded at too few distinct argument values for its degree keeps its
  model (one value says nothing about how the time grows with it);
* a linear fit whose slope is negative: when the fall is significant (Student's t at 95 %,
  and more than 1 ms over the recorded range) the durations contradict the physics of a
  motion (the recording is broken: motions that ended early, mixed robots) and the skill
  keeps its model; when it is not, the slope is clamped to 0 and the intercept is the mean,
  which is the least-squares line among those that never fall;
* a polynomial of higher degree that falls somewhere keeps the skill's model;
* a fit that gives less than 1 ms for small arguments gets ``floor_s`` = 1 ms.

Each decision is said in the report (a skill's ``note``, or ``skipped`` with ``kept``), in
the fitted model's ``source`` and in the written profile's provenance.

The report gives, per fitted skill, the model, the number of samples and ``rel_error``: the
mean over the recorded calls of ``|fitted − reference| / reference``, both evaluated (mean
estimate) at that call's arguments, against a reference. The reference is, in this order: the
``reference`` profile when one is given; the models a bag recorded as its robot's
configuration (``lrtrace profile --backend emulator|sim`` stores the models the emulator or
simulated robot was timed with in the bag's meta, ``reference_models``); the profile before
fitting.

Time scale: a bag recorded on an emulator running at ``time_scale`` (bag meta ``time_scale``,
e.g. 0.05 = 20x faster than the robot) holds emulated seconds. Its durations are divided by
``time_scale`` before fitting, so fitted models (and the written profile) are in real-robot
seconds and compare directly with the profile the emulator was configured with.

:func:`write_profile` writes the updated profile as YAML with its provenance naming the bags
and the sample counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import TypeAdapter, ValidationError

from lrtrace import format as fmt
from lrtrace.reader import TraceBag, read_bag
from timelyllm_ros.errors import ProfileError, TraceFormatError
from timelyllm_ros.language.exec_time import (
    MIN_SKILL_S,
    ExecTimeModel,
    ParametricTime,
    falling_interval,
    fit_constant,
    fit_sampled,
    parametric_problem,
)
from timelyllm_ros.language.profiles import RobotProfile, load_profile_name_or_file
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.safe_files import DATA_FILE, InputError, TraceInputError, parse_json

__all__ = ['FitReport', 'SkillFit', 'bag_time_scale', 'collect_samples', 'fit_profile',
           'profile_skips', 'recorded_reference', 'write_profile']

Sample = tuple[dict[str, Any], float]


@dataclass(frozen=True, slots=True)
class SkillFit:
    """The outcome of fitting one skill."""

    skill: str
    model: dict[str, Any]
    samples: int
    rel_error: float | None      # None: no reference value to compare with (0 s)
    note: str = ''


@dataclass(slots=True)
class FitReport:
    """What :func:`fit_profile` did, per skill (canonical skill names)."""

    profile: str
    bags: list[str]
    skills: dict[str, SkillFit] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)   # skill or call -> why
    reference: str = ''      # what rel_error compares with
    seconds: str = ''        # the unit of the fitted models (real-robot seconds)
    invalid_samples: dict[str, int] = field(default_factory=dict)  # skill -> durations dropped

    @property
    def samples(self) -> int:
        return sum(f.samples for f in self.skills.values())

    def to_json(self) -> dict[str, Any]:
        """``{"skills": {SKILL: {"model": {...}, "rel_error": x, "samples": n}}}``.

        Also ``profile``, ``bags``, ``reference`` (what ``rel_error`` compares with),
        ``seconds`` (the models' unit and the time scales undone), ``skipped`` (skill or
        call → why: calls left out here, skills the profiling run did not profile, fits
        refused) and ``invalid_samples`` (skill → durations shorter than 1 ms dropped).
        """
        return {
            'profile': self.profile,
            'bags': self.bags,
            'reference': self.reference,
            'seconds': self.seconds,
            'skills': {name: {'model': f.model, 'rel_error': f.rel_error, 'samples': f.samples,
                              **({'note': f.note} if f.note else {})}
                       for name, f in self.skills.items()},
            'skipped': self.skipped,
            'invalid_samples': self.invalid_samples,
        }


def _parse_args(profile: RobotProfile, call: str) -> dict[str, Any] | None:
    """Arguments of one recorded call (``mf(50)``), or None when it does not parse."""
    statements = [s for cut in segment_text(profile, call) for s in cut.statements]
    if len(statements) != 1 or not statements[0].calls:
        return None
    return dict(statements[0].calls[0].args)


def bag_time_scale(bag: TraceBag) -> float:
    """The emulator time scale a bag was recorded at (meta ``time_scale``; 1 if none).

    Raises:
        TraceFormatError: a time scale that is not a positive number.
    """
    text = bag.info.get('time_scale')
    if text is None:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise TraceFormatError(f'{bag.path}: invalid time_scale {text!r} in the bag meta')
    return scale


def collect_samples(bags: Sequence[TraceBag], profile: RobotProfile
                    ) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """Per canonical skill name, the ``(args, seconds)`` of every successful recorded call.

    Seconds are real-robot seconds: each bag's durations divided by its :func:`bag_time_scale`.

    Returns:
        The samples and, per skipped call text, why it was skipped.
    """
    samples: dict[str, list[Sample]] = {}
    skipped: dict[str, str] = {}
    for bag in bags:
        scale = bag_time_scale(bag)
        for record in bag.skills:
            if not record.success:
                continue
            start, end = fmt.stamp_seconds(record.start_stamp), fmt.stamp_seconds(
                record.end_stamp)
            if math.isnan(start) or math.isnan(end) or end < start:
                skipped[record.call] = 'no valid start/end stamps'
                continue
            try:
                skill = profile.skill(record.skill).name
            except ProfileError:
                skipped[record.call] = f'skill {record.skill!r} is not in profile {profile.name}'
                continue
            args = _parse_args(profile, record.call)
            if args is None:
                skipped[record.call] = 'the call does not parse with the profile grammar'
                continue
            samples.setdefault(skill, []).append((args, (end - start) / scale))
    return samples, skipped


_MODEL: TypeAdapter[ExecTimeModel] = TypeAdapter(ExecTimeModel)


def recorded_reference(bags: Sequence[TraceBag]) -> tuple[dict[str, Any], str]:
    """The execution-time models the bags' robot was configured with, if they recorded it.

    ``lrtrace profile --backend emulator|sim`` stores them in the meta (``reference_models``,
    JSON ``{skill: model}``, real-robot seconds). Bags that disagree on a skill's model give
    no reference for that skill.

    Returns:
        Models by canonical skill name and a description ('' when no bag recorded any).

    Raises:
        TraceFormatError: a recorded reference that does not parse.
    """
    models: dict[str, Any] = {}
    conflicting: set[str] = set()
    origins: list[str] = []
    for bag in bags:
        text = bag.info.get('reference_models')
        if not text:
            continue
        try:
            data = parse_json(text, f'{bag.path}: reference_models', TraceInputError, DATA_FILE)
            recorded = {str(k): _MODEL.validate_python(v) for k, v in dict(data).items()}
        except (ValueError, TypeError, ValidationError) as err:
            raise TraceFormatError(f'{bag.path}: invalid reference_models in the bag meta: '
                                   f'{err}') from None
        for name, model in recorded.items():
            if name in models and models[name] != model:
                conflicting.add(name)
            models.setdefault(name, model)
        what = bag.info.get('emulator') or bag.info.get('backend') or 'robot'
        origins.append(f'{bag.path}: {what} timed by profile '
                       f'{bag.info.get("reference_profile", "?")} models x time_scale '
                       f'{bag_time_scale(bag):g}')
    for name in conflicting:
        models.pop(name)
    if not origins:
        return {}, ''
    return models, 'the configuration recorded in the bags (' + '; '.join(origins) + ')'


def profile_skips(bags: Sequence[TraceBag]) -> dict[str, str]:
    """Skills a profiling run did not profile, with its reason (bag meta ``skipped``)."""
    skipped: dict[str, str] = {}
    for bag in bags:
        text = bag.info.get('skipped')
        if not text:
            continue
        try:
            data = parse_json(text, f'{bag.path}: skipped', TraceInputError, DATA_FILE)
        except InputError:
            continue
        if isinstance(data, Mapping):
            for name, why in data.items():
                skipped.setdefault(str(name), f'not profiled: {why}')
    return skipped


def _x(model: ParametricTime, args: dict[str, Any]) -> float:
    """The model's argument value of one call (largest |value| of its named arguments)."""
    values = [abs(float(v)) for name in model.argument.split(',')
              if isinstance(v := args.get(name.strip()), (int, float))
              and not isinstance(v, bool)]
    return max(values) if values else 0.0


def _rel_error(fitted: Any, reference: Any, samples: list[Sample]) -> float | None:
    errors = []
    for args, _ in samples:
        ref = reference.mean_s(args)
        if ref <= 0:
            return None
        errors.append(abs(fitted.mean_s(args) - ref) / ref)
    return float(np.mean(errors)) if errors else None


def _count(n: int, what: str) -> str:
    return f'{n} {what}' + ('' if n == 1 else 's')


# Two-sided 95 % quantiles of Student's t by degrees of freedom; between two rows the smaller
# dof is used (a larger quantile: a fall is called significant a little less readily).
_T95 = ((1, 12.71), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (6, 2.447), (7, 2.365),
        (8, 2.306), (9, 2.262), (10, 2.228), (12, 2.179), (15, 2.131), (20, 2.086),
        (30, 2.042), (60, 2.000), (120, 1.980))


def _t95(dof: int) -> float:
    return next(t for d, t in reversed(_T95) if d <= dof)


def _falls_significantly(xs: list[float], seconds: list[float], coefficients: list[float]
                         ) -> tuple[bool, str]:
    """Whether a line's negative slope is real: t below -t95 and more than 1 ms of fall over
    the recorded range. Returns the verdict and the figures that decided it."""
    x, y = np.asarray(xs), np.asarray(seconds)
    intercept, slope = coefficients
    fall_s = -slope * float(x.max() - x.min())
    if fall_s <= MIN_SKILL_S:
        return False, f'{fall_s * 1000:.2g} ms of fall over the recorded range'
    if len(x) < 3:
        return False, f'{len(x)} samples leave no residual to judge by'
    residuals = y - (intercept + slope * x)
    sxx = float(((x - x.mean()) ** 2).sum())
    se = math.sqrt(float((residuals ** 2).sum()) / (len(x) - 2) / sxx)
    t = slope / se if se > 0 else -math.inf
    figures = (f't = {t:.3g} over {len(x)} samples, {fall_s:.3g} s of fall over the recorded '
               'range')
    return t < -_t95(len(x) - 2), figures


def _fit_parametric(current: ParametricTime, data: list[Sample], source: str,
                    notes: list[str]) -> ParametricTime | str:
    """A parametric model of the same argument and degree, or why none (the skill keeps
    its model). Clamps and floors are appended to ``notes``."""
    degree = len(current.coefficients) - 1
    argument = current.argument
    xs = [_x(current, args) for args, _ in data]
    seconds = [s for _, s in data]
    distinct = len(set(xs))
    if distinct <= degree:
        return f'{_count(distinct, f"distinct {argument} value")} cannot fit degree {degree}'
    polyfit = np.polynomial.polynomial.polyfit
    fit = polyfit(np.abs(xs), seconds, degree)  # type: ignore[no-untyped-call]  # unannotated
    coefficients = [float(c) for c in fit]
    floor_s = current.floor_s
    if degree == 1 and coefficients[1] < 0:
        significant, figures = _falls_significantly(xs, seconds, coefficients)
        if significant:
            return (f'durations fall as {argument} grows (negative slope '
                    f'{coefficients[1]:.3g} s per unit, {figures}): not a duration model')
        notes.append(f'negative slope {coefficients[1]:.3g} clamped to 0 (not significant: '
                     f'{figures}): the mean')
        coefficients = [float(np.mean(seconds)), 0.0]
    elif falling_interval(coefficients, floor_s) is not None:
        problem = parametric_problem(coefficients, floor_s, argument)
        return f'the fitted degree-{degree} polynomial makes no sense: {problem}'
    # The prediction never falls above the floor, so its smallest value is at 0.
    if max(floor_s, coefficients[0]) < MIN_SKILL_S:
        floor_s = MIN_SKILL_S
        notes.append(f'floored at 1 ms: the fit gives less for small {argument}')
    try:
        return ParametricTime(argument=argument, coefficients=coefficients, floor_s=floor_s,
                              source=_source(source, notes))
    except ValueError as err:  # what the loader would refuse is not written either
        return f'the fit makes no sense: {err}'


def _source(source: str, notes: list[str]) -> str:
    return source + (f' ({"; ".join(notes)})' if notes else '')


def fit_profile(bags: Sequence[str | Path | TraceBag], profile: RobotProfile | str | Path,
                reference: RobotProfile | str | Path | None = None
                ) -> tuple[RobotProfile, FitReport]:
    """Refit the execution-time models of a profile from recorded skill executions.

    Args:
        bags: LRTrace bags (paths or already read).
        profile: the profile to update (object, bundled name or YAML path).
        reference: the profile ``rel_error`` compares with (default: the models the bags
            recorded as their robot's configuration, else ``profile`` as given).

    Returns:
        The updated profile (skills without samples unchanged; real-robot seconds, see the
        module docstring) and the report.

    Raises:
        TraceFormatError: a bag cannot be read, or no bag holds a sample of this profile.
        ProfileError: unknown profile.
    """
    base = profile if isinstance(profile, RobotProfile) else load_profile_name_or_file(profile)
    ref = reference if isinstance(reference, RobotProfile) else (
        load_profile_name_or_file(reference) if reference is not None else base)
    read = [b if isinstance(b, TraceBag) else read_bag(b) for b in bags]
    names = [str(b.path) for b in read]
    samples, skipped = collect_samples(read, base)
    if not samples:
        raise TraceFormatError(f'no successful skill execution of profile {base.name!r} in '
                               f'{", ".join(names)}')
    recorded, recorded_origin = ({}, '') if reference is not None else recorded_reference(read)
    for name, why in profile_skips(read).items():
        if name not in samples:
            skipped.setdefault(name, why)
    sources = sorted({b.source for b in read if b.source})
    origin = f'{", ".join(names)}' + (f' (recorded: {"; ".join(sources)})' if sources else '')
    scales = sorted({bag_time_scale(b) for b in read})
    report = FitReport(
        profile=base.name, bags=names, skipped=skipped,
        reference=(f'profile {ref.name} as given' if reference is not None else
                   recorded_origin + f'; other skills: profile {base.name}' if recorded_origin
                   else f'profile {base.name} before fitting'),
        seconds=('real-robot seconds' + (
            f' (recorded durations / time_scale {", ".join(f"{s:g}" for s in scales)})'
            if scales != [1.0] else '')))
    skills = []
    kept: dict[str, str] = {}      # skill -> why its timings were not fitted
    for skill in base.skills:
        recorded_data = samples.get(skill.name)
        if not recorded_data:
            skills.append(skill)
            continue
        data = [(args, s) for args, s in recorded_data if s >= MIN_SKILL_S]
        dropped = len(recorded_data) - len(data)
        notes = [f'{_count(dropped, "sample")} shorter than 1 ms dropped'] if dropped else []
        if dropped:
            report.invalid_samples[skill.name] = dropped
        current = skill.exec_time
        source = f'fitted by lrtrace fit from {origin}, {_count(len(data), "sample")}'
        seconds = [s for _, s in data]
        fitted: Any
        if not data:
            fitted = (f'all {_count(dropped, "sample")} shorter than 1 ms (not durations of '
                      'a skill)')
        elif isinstance(current, ParametricTime):
            fitted = _fit_parametric(current, data, source, notes)
        elif current.kind == 'sampled':
            fitted = fit_sampled(seconds, _source(source, notes))
        else:
            fitted = fit_constant(seconds, _source(source, notes))
        if isinstance(fitted, str):
            kept[skill.name] = report.skipped[skill.name] = f'{fitted}; kept'
            skills.append(skill)
            continue
        reference_model = recorded.get(skill.name) or (
            ref.skill(skill.name).exec_time if skill.name in ref.skill_index else current)
        report.skills[skill.name] = SkillFit(
            skill=skill.name, model=fitted.model_dump(mode='json', exclude_none=True),
            samples=len(data), rel_error=_rel_error(fitted, reference_model, data),
            note='; '.join(notes))
        skills.append(skill.model_copy(update={'exec_time': fitted}))
    fitted_names = ', '.join(report.skills)
    provenance = (f'{fitted_names} fitted by lrtrace fit from {origin}, {report.samples} '
                  f'samples in all.' if report.skills else
                  f'No skill fitted by lrtrace fit from {origin}.')
    adjusted = [f'{name}: {f.note}' for name, f in report.skills.items() if f.note]
    if adjusted:
        provenance += f' Adjusted: {"; ".join(adjusted)}.'
    if kept:
        provenance += (' Not fitted, kept as before: '
                       + '; '.join(f'{name}: {why.removesuffix("; kept")}'
                                   for name, why in kept.items()) + '.')
    if len(report.skills) < len(base.skills):
        provenance += f' Other skills as before: {base.exec_time_provenance}'
    fields = base.model_dump(mode='json', exclude_none=True)
    fields['skills'] = [s.model_dump(mode='json', exclude_none=True) for s in skills]
    fields['exec_time_provenance'] = provenance
    return RobotProfile.model_validate(fields), report


def write_profile(profile: RobotProfile, path: str | Path) -> Path:
    """Write a profile as YAML that :func:`~timelyllm_ros.language.profiles.load_profile` reads
    back.

    Raises:
        ProfileError: the file cannot be written.
    """
    path = Path(path)
    data = profile.model_dump(mode='json', exclude_none=True)
    text = (f'# Robot profile {profile.name}, written by lrtrace fit.\n'
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=99))
    try:
        path.write_text(text, encoding='utf-8')
    except OSError as err:
        raise ProfileError(f'{path}: cannot write profile: {err.strerror}') from None
    return path
