"""A simulated robot backend: performs skill calls by letting their modelled time pass.

:class:`SimulatedBackend` implements :class:`~timelyllm_ros.robots.backend.RobotBackend` for any
profile without hardware. Each call takes the profile's execution-time model (a draw from
``sample_s``, so sampled skills vary and constant / parametric ones are exact) times optional
multiplicative jitter; on a :class:`~timelyllm_ros.core.clock.SimClock` that time is elapsed
virtually, on any other clock the backend sleeps. Perception skills answer from a
``perception`` table (by default everything is visible and numeric queries give 0.5), and
failures can be injected per skill or at random. It backs the executor tests and dry runs of
the live pipeline; the fleet simulation uses :class:`~timelyllm_ros.robots.sim.SimulatedRobot`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from timelyllm_ros.core.clock import Clock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.robots.backend import RobotBackend, wait_on

logger = logging.getLogger(__name__)

#: Default answers of perception skills by canonical name (skills not listed return None).
DEFAULT_PERCEPTION: dict[str, object] = {
    'is_visible': True,
    'object_x': 0.5,
    'object_y': 0.5,
    'object_width': 0.5,
    'object_height': 0.5,
    'object_distance': 0.5,
    'scan': True,
    'scan_abstract': True,
    'probe': 'unknown',
}


class SimulatedBackend(RobotBackend):
    """A robot of any profile that performs calls by letting the modelled time pass.

    Attributes:
        performed: Every call performed (or attempted) so far, in order.
    """

    def __init__(self, profile: RobotProfile, clock: Clock,
                 rng: np.random.Generator | None = None, jitter: float = 0.0,
                 fail_on: Iterable[str] = frozenset(), fail_probability: float = 0.0,
                 perception: dict[str, object] | None = None) -> None:
        """Create a simulated robot.

        Args:
            profile: The robot profile (skills and execution-time models).
            clock: Advanced (SimClock) or slept on (any other clock) while a skill runs.
            rng: Random source for sampled models, jitter and random failures.
            jitter: Standard deviation of the multiplicative noise: a duration is the model
                time times ``max(0, 1 + N(0, jitter))``.
            fail_on: Calls that fail after their duration: a canonical skill name, a short
                form or a call text (``mf(50)``).
            fail_probability: Chance that any call fails after its duration.
            perception: Answers of perception skills, looked up by call text
                (``iv('cat')``), ``short:argument`` (``iv:cat``), short form, then canonical
                name; unlisted ones fall back to :data:`DEFAULT_PERCEPTION`.

        Raises:
            ValueError: ``jitter`` < 0 or ``fail_probability`` outside [0, 1].
        """
        if jitter < 0.0:
            raise ValueError('jitter must be >= 0')
        if not 0.0 <= fail_probability <= 1.0:
            raise ValueError('fail_probability must be within [0, 1]')
        self.profile = profile
        self.clock = clock
        self._rng = rng if rng is not None else np.random.default_rng()
        self._jitter = jitter
        self._fail_on = frozenset(fail_on)
        self._fail_probability = fail_probability
        self._perception = dict(perception or {})
        self.connected = False
        self.performed: list[SkillCall] = []

    def connect(self) -> None:
        """Nothing to open: mark the robot connected."""
        self.connected = True

    def close(self) -> None:
        """Mark the robot disconnected."""
        self.connected = False

    def supports(self, skill: str) -> bool:
        """Every skill of the profile is supported."""
        return skill in self.profile.skill_index

    def duration_s(self, call: SkillCall) -> float:
        """The time this call will take: model draw times the jitter factor."""
        model = self.profile.skill(call.skill).exec_time
        seconds = model.sample_s(dict(call.args), self._rng)
        if self._jitter:
            seconds *= max(0.0, 1.0 + float(self._rng.normal(0.0, self._jitter)))
        return seconds

    def perform(self, call: SkillCall) -> object:
        """Let the call's duration pass, then fail if told to or return its result.

        Raises:
            RobotError: Not connected, a call :meth:`check` refuses, or an injected failure.
        """
        if not self.connected:
            raise RobotError(f'{call.text}: {self.profile.name} simulated robot is not connected')
        self.check(call)
        self.performed.append(call)
        wait_on(self.clock, self.duration_s(call))
        if self._fail_on & {call.skill, call.short, call.text}:
            raise RobotError(f'{call.text}: injected failure')
        if self._fail_probability and float(self._rng.random()) < self._fail_probability:
            raise RobotError(f'{call.text}: injected random failure')
        return self._result(call)

    def _result(self, call: SkillCall) -> object:
        first = next(iter(call.args.values()), None)
        keys = [call.text]
        if first is not None:
            keys += [f'{call.short}:{first}', f'{call.skill}:{first}']
        keys += [call.short, call.skill]
        for key in keys:
            if key in self._perception:
                return self._perception[key]
        if call.skill == 'log':
            logger.info('%s log: %s', self.profile.name, first)
            return first
        return DEFAULT_PERCEPTION.get(call.skill)
