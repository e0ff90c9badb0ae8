"""The backend interface: a robot that performs one skill call at a time.

Backends wrap a vendor client (djitellopy for the Tello, IndyDCP3 from ``neuromeka`` for the
Indy7) or simulate one. The skill executor (:mod:`timelyllm_ros.robots.executor`) validates a
whole segment with :meth:`RobotBackend.check` before it sends anything, then calls
:meth:`RobotBackend.perform` skill after skill.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from timelyllm_ros.clock import Clock, SimClock
from timelyllm_ros.profiles import RobotProfile
from timelyllm_ros.segmenter import SkillCall


def wait_on(clock: Clock, seconds: float) -> None:
    """Let ``seconds`` pass on ``clock``: advance a SimClock, sleep on any other clock."""
    if seconds <= 0:
        return
    if isinstance(clock, SimClock):
        clock.elapse(seconds)
    else:
        time.sleep(seconds)


@dataclass(frozen=True, slots=True)
class SkillRecord:
    """One executed (or failed) skill, for LRTrace (float seconds on the executor's clock)."""

    skill: str                 # canonical skill name
    call: str                  # the call as written, e.g. mf(50)
    args: dict[str, int | float | str]
    start_time: float
    end_time: float
    success: bool
    error: str = ''
    result: object = None      # perception skills return a value (iv → True/False)


class RobotBackend(ABC):
    """A robot that performs skill calls of one profile, blocking until each is done."""

    profile: RobotProfile

    @abstractmethod
    def connect(self) -> None:
        """Open the connection (idempotent). Raises RobotError when the robot does not answer."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent, never raises)."""

    @abstractmethod
    def supports(self, skill: str) -> bool:
        """Whether this backend can perform the skill (canonical name)."""

    def check(self, call: SkillCall) -> None:
        """Raise RobotError if the call cannot be sent (unsupported skill, robot limits)."""
        from timelyllm_ros.errors import RobotError

        if not self.supports(call.skill):
            raise RobotError(f'{self.profile.name}: skill {call.skill!r} ({call.text}) is not '
                             f'supported by {type(self).__name__}')
        skill = self.profile.skill(call.skill)
        for arg in skill.args:
            value = call.args.get(arg.name)
            if value is None:
                raise RobotError(f'{call.text}: missing argument {arg.name!r}')
            if arg.type == 'str':
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise RobotError(f'{call.text}: {arg.name} must be {arg.type}, got {value!r}')
            if (arg.min is not None and value < arg.min) or (
                    arg.max is not None and value > arg.max):
                raise RobotError(f'{call.text}: {arg.name}={value} {arg.unit} is outside the '
                                 f'robot limits [{arg.min}, {arg.max}]')

    @abstractmethod
    def perform(self, call: SkillCall) -> object:
        """Perform one call and return its result (None for actions).

        Raises:
            RobotError: the robot refused, failed, timed out or is disconnected.
        """

    def __enter__(self) -> RobotBackend:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
