"""Execution-time models of robot skills (paper 000 §6, "Execution time model").

Three kinds, as LRTrace profiles them:

* ``constant``   -- near-constant skills: the mean of repeated runs;
* ``parametric`` -- simple skills whose duration is a polynomial (usually linear) in one
  numeric argument, e.g. distance in cm or angle in degrees;
* ``sampled``    -- scenario-dependent skills (search): a recorded distribution, sampled in
  simulation.

The scheduler plans with :meth:`ExecTimeModel.min_s`, the minimum estimate, so that the next
segment is generated in time even when the robot is at its fastest (paper §4.3).

Because those estimates drive the report deadline of the next segment, a model that makes no
sense is refused when it is built or loaded, with the reason (a profile file names the skill):

* no time may be shorter than :data:`MIN_SKILL_S` (constants, samples, uniform bounds), and
  every figure must be a finite number;
* a parametric model must never fall as its argument grows, for any argument >= 0 (a model
  is checked on its own, without its skill's argument limits), except below its ``floor_s``;
* a parametric model must give a positive time to every non-zero argument (``d(0)`` may take
  0 s; ``mf(5)`` may not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The shortest time a skill can take (s). Even a skill performed locally (a query of the
#: latest perception result) costs a call through the executor; a command to a robot costs a
#: network round trip, many times more. A model or a recorded duration below this is not a
#: measurement of a skill.
MIN_SKILL_S = 0.001


class _Model(BaseModel):
    # nan and inf are refused in every figure: max(floor, nan) is the floor, so a nan slope
    # would plan every call at the floor without a word.
    model_config = ConfigDict(extra='forbid', frozen=True, allow_inf_nan=False)

    source: str = Field(
        default='unspecified',
        description='Where the figures come from (measured where, or derived from which spec).',
    )


class ConstantTime(_Model):
    """A skill that always takes about the same time."""

    kind: Literal['constant'] = 'constant'
    seconds: float

    @model_validator(mode='after')
    def _a_duration(self) -> ConstantTime:
        _check_duration(self.seconds, 'the time')
        return self

    def min_s(self, args: Mapping[str, object]) -> float:
        return self.seconds

    def mean_s(self, args: Mapping[str, object]) -> float:
        return self.seconds

    def max_s(self, args: Mapping[str, object]) -> float:
        return self.seconds

    def sample_s(self, args: Mapping[str, object], rng: np.random.Generator) -> float:
        return self.seconds


class ParametricTime(_Model):
    """Duration = polynomial in one numeric argument: ``sum(c_i * x**i)``, x = |argument|.

    ``coefficients`` are in increasing degree: ``[intercept, slope, ...]``. When ``argument``
    names several arguments (comma separated), x is the largest of their absolute values (e.g.
    a joint move is as long as its largest joint displacement).
    """

    kind: Literal['parametric'] = 'parametric'
    argument: str
    coefficients: list[float] = Field(min_length=1)
    floor_s: float = Field(default=0.0, ge=0.0, description='Lower bound of the prediction.')

    @model_validator(mode='after')
    def _never_falls(self) -> ParametricTime:
        problem = parametric_problem(self.coefficients, self.floor_s, self.argument)
        if problem:
            raise ValueError(problem)
        return self

    def _x(self, args: Mapping[str, object]) -> float:
        values = []
        for name in self.argument.split(','):
            value = args.get(name.strip())
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.append(abs(float(value)))
        return max(values) if values else 0.0

    def at(self, x: float) -> float:
        total = 0.0
        for coefficient in reversed(self.coefficients):
            total = total * x + coefficient
        return max(self.floor_s, total)

    def min_s(self, args: Mapping[str, object]) -> float:
        return self.at(self._x(args))

    def mean_s(self, args: Mapping[str, object]) -> float:
        return self.at(self._x(args))

    def max_s(self, args: Mapping[str, object]) -> float:
        return self.at(self._x(args))

    def sample_s(self, args: Mapping[str, object], rng: np.random.Generator) -> float:
        return self.at(self._x(args))


class SampledTime(_Model):
    """A recorded distribution: either ``samples`` (seconds) or a uniform ``[low, high]``."""

    kind: Literal['sampled'] = 'sampled'
    samples: list[float] | None = None
    uniform: tuple[float, float] | None = None

    @model_validator(mode='after')
    def _one_distribution(self) -> SampledTime:
        if (self.samples is None) == (self.uniform is None):
            raise ValueError('give exactly one of samples or uniform')
        if self.samples is not None:
            if not self.samples:
                raise ValueError('samples must be a non-empty list of seconds')
            _check_duration(min(self.samples), 'sample')
        if self.uniform is not None:
            if not self.uniform[0] <= self.uniform[1]:
                raise ValueError('uniform must be [low, high] with low <= high')
            _check_duration(self.uniform[0], 'uniform low')
        return self

    def min_s(self, args: Mapping[str, object]) -> float:
        return min(self.samples) if self.samples is not None else self.uniform[0]  # type: ignore[index]

    def mean_s(self, args: Mapping[str, object]) -> float:
        if self.samples is not None:
            return float(np.mean(self.samples))
        return (self.uniform[0] + self.uniform[1]) / 2  # type: ignore[index]

    def max_s(self, args: Mapping[str, object]) -> float:
        return max(self.samples) if self.samples is not None else self.uniform[1]  # type: ignore[index]

    def sample_s(self, args: Mapping[str, object], rng: np.random.Generator) -> float:
        if self.samples is not None:
            return float(self.samples[int(rng.integers(len(self.samples)))])
        low, high = self.uniform  # type: ignore[misc]
        return float(rng.uniform(low, high))


ExecTimeModel = Annotated[
    ConstantTime | ParametricTime | SampledTime, Field(discriminator='kind')
]


def _check_duration(seconds: float, what: str) -> None:
    if seconds < MIN_SKILL_S:
        raise ValueError(f'{what} {seconds:g} s is shorter than {MIN_SKILL_S:g} s, the shortest '
                         'time a skill takes')


# The polynomials below are numpy's highest-degree-first arrays (np.polyval, np.polyder,
# np.roots); models store their coefficients lowest first.
def _highest_first(coefficients: Sequence[float]) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.asarray(coefficients, dtype=np.float64)[::-1]


def _positive_real_roots(poly: np.ndarray[Any, np.dtype[np.float64]]) -> list[float]:
    """The real roots above 0 of a polynomial, ascending (a nearly real pair counts once)."""
    if not poly.any():
        return []
    real = {float(r.real) for r in np.roots(poly)
            if abs(r.imag) <= 1e-9 * max(1.0, abs(r.real))}
    return sorted(r for r in real if r > 0)


def falling_interval(coefficients: Sequence[float], floor_s: float = 0.0
                     ) -> tuple[float, float] | None:
    """Where ``max(floor_s, poly(x))`` falls as ``x`` grows over ``x >= 0``.

    Args:
        coefficients: The polynomial, lowest degree first (``[intercept, slope, ...]``).
        floor_s: The prediction's lower bound.

    Returns:
        The first interval ``(start, end)`` on which the prediction falls (``end`` is ``inf``
        when it falls for ever), or None when it never falls.
    """
    poly = _highest_first(coefficients)
    slope = np.polyder(poly)
    bounds = [0.0, *_positive_real_roots(slope), math.inf]
    for start, end in zip(bounds, bounds[1:], strict=False):
        probe = (start + end) / 2 if math.isfinite(end) else start + max(1.0, start)
        # The slope keeps its sign between two of its roots: one probe tells. A falling
        # stretch only matters where the polynomial is above the floor when it starts falling.
        if float(np.polyval(slope, probe)) < 0 and float(np.polyval(poly, start)) > floor_s:
            return start, end
    return None


def parametric_problem(coefficients: Sequence[float], floor_s: float = 0.0,
                       argument: str = 'x') -> str:
    """Why a parametric model makes no sense ('' when it does): see the module docstring."""
    poly = _highest_first(coefficients)
    falls = falling_interval(coefficients, floor_s)
    if falls is not None:
        start, end = falls
        begin_s = max(floor_s, float(np.polyval(poly, start)))
        where = (f'from {begin_s:.4g} s to {max(floor_s, float(np.polyval(poly, end))):.4g} s '
                 f'as {argument} grows from {start:.4g} to {end:.4g}' if math.isfinite(end)
                 else f'from {begin_s:.4g} s at {argument} {start:.4g} as {argument} grows')
        return f'negative slope: the time falls {where}; a duration model must never fall'
    if floor_s > 0:
        return ''
    roots = _positive_real_roots(poly)
    if roots:
        # The prediction never falls, so it is 0 s from 0 up to its last root.
        return (f'the model gives 0 s for {argument} up to {roots[-1]:.4g}: a skill takes '
                f'time (raise the intercept, or set floor_s to at least {MIN_SKILL_S:g})')
    if float(np.polyval(poly, 1.0)) <= 0:
        return f'the model gives 0 s for every {argument}'
    return ''


def fit_constant(seconds: list[float], source: str) -> ConstantTime:
    """Fit a constant model: the mean of the recorded durations."""
    if not seconds:
        raise ValueError('cannot fit a constant model to no samples')
    return ConstantTime(seconds=float(np.mean(seconds)), source=source)


def fit_parametric(
    xs: list[float], seconds: list[float], argument: str, source: str, degree: int = 1,
    floor_s: float = 0.0,
) -> ParametricTime:
    """Fit ``seconds ~ poly(x)`` by least squares (degree 1 = linear in distance/angle).

    Raises:
        ValueError: too few samples, or a fit that makes no sense (it falls as ``x`` grows,
            or gives 0 s; see :func:`parametric_problem`). ``lrtrace fit`` decides what to do
            with such timings before it gets here.
    """
    if len(xs) != len(seconds) or len(xs) <= degree:
        raise ValueError(f'need more than {degree} paired samples to fit degree {degree}')
    polyfit = np.polynomial.polynomial.polyfit
    fit = polyfit(np.abs(xs), seconds, degree)  # type: ignore[no-untyped-call]  # unannotated
    return ParametricTime(
        argument=argument, coefficients=[float(c) for c in fit], source=source, floor_s=floor_s
    )


def fit_sampled(seconds: list[float], source: str) -> SampledTime:
    """Keep the recorded distribution as it is."""
    if not seconds:
        raise ValueError('cannot fit a sampled model to no samples')
    return SampledTime(samples=[float(s) for s in seconds], source=source)
