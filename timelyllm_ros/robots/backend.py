"""The backend interface: a robot that performs one skill call at a time.

Backends wrap a vendor client (djitellopy for the Tello, IndyDCP3 from ``neuromeka`` for the
Indy7) or simulate one. The skill executor (:mod:`timelyllm_ros.robots.executor`) validates a
whole segment with :meth:`RobotBackend.check` before it sends anything, then calls
:meth:`RobotBackend.perform` skill after skill.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from timelyllm_ros.core.clock import Clock, SimClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.language.validation import call_problem


def wait_on(clock: Clock, seconds: float) -> None:
    """Let ``seconds`` pass on ``clock``: advance a SimClock, sleep on any other clock.

    Raises:
        RobotError: ``seconds`` is not a finite number.
    """
    if not math.isfinite(seconds):
        raise RobotError(f'cannot wait {seconds} s: not a finite number')
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
        """Raise RobotError if the call cannot be sent.

        The skill must be supported by this backend and known to the profile, the call must
        carry exactly the skill's arguments, each of its type, finite and within the profile's
        limits (``nan``, ``inf`` and out-of-range values never reach a robot, whatever built
        the call).

        Raises:
            RobotError: naming the call and the problem.
        """
        if not self.supports(call.skill):
            raise RobotError(f'{self.profile.name}: skill {call.skill!r} ({call.text}) is not '
                             f'supported by {type(self).__name__}')
        problem = call_problem(self.profile, call)
        if problem is not None:
            raise RobotError(f'{call.text}: {problem}')

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
