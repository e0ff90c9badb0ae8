"""Execution-time models of robot skills (paper 000 §6, "Execution time model").

Three kinds, as LRTrace profiles them:

* ``constant``   -- near-constant skills: the mean of repeated runs;
* ``parametric`` -- simple skills whose duration is a polynomial (usually linear) in one
  numeric argument, e.g. distance in cm or angle in degrees;
* ``sampled``    -- scenario-dependent skills (search): a recorded distribution, sampled in
  simulation.

The scheduler plans with :meth:`ExecTimeModel.min_s`, the minimum estimate, so that the next
segment is generated in time even when the robot is at its fastest (paper §4.3).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra='forbid', frozen=True)

    source: str = Field(
        default='unspecified',
        description='Where the figures come from (measured where, or derived from which spec).',
    )


class ConstantTime(_Model):
    """A skill that always takes about the same time."""

    kind: Literal['constant'] = 'constant'
    seconds: float = Field(ge=0.0)

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
        if self.samples is not None and (not self.samples or min(self.samples) < 0):
            raise ValueError('samples must be a non-empty list of non-negative seconds')
        if self.uniform is not None and not 0 <= self.uniform[0] <= self.uniform[1]:
            raise ValueError('uniform must be [low, high] with 0 <= low <= high')
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


def fit_constant(seconds: list[float], source: str) -> ConstantTime:
    """Fit a constant model: the mean of the recorded durations."""
    if not seconds:
        raise ValueError('cannot fit a constant model to no samples')
    return ConstantTime(seconds=float(np.mean(seconds)), source=source)


def fit_parametric(
    xs: list[float], seconds: list[float], argument: str, source: str, degree: int = 1
) -> ParametricTime:
    """Fit ``seconds ~ poly(x)`` by least squares (degree 1 = linear in distance/angle)."""
    if len(xs) != len(seconds) or len(xs) <= degree:
        raise ValueError(f'need more than {degree} paired samples to fit degree {degree}')
    polyfit = np.polynomial.polynomial.polyfit
    fit = polyfit(np.abs(xs), seconds, degree)  # type: ignore[no-untyped-call]  # unannotated
    return ParametricTime(
        argument=argument, coefficients=[float(c) for c in fit], source=source
    )


def fit_sampled(seconds: list[float], source: str) -> SampledTime:
    """Keep the recorded distribution as it is."""
    if not seconds:
        raise ValueError('cannot fit a sampled model to no samples')
    return SampledTime(samples=[float(s) for s in seconds], source=source)
