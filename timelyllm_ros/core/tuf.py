"""Time-utility functions (paper 000 §2.3, Eq. 1, and the TUF₀/TUF₁ split of Eq. 3).

``U(t) = min(β, α·(t − ERT) + β)`` with t the response (waiting) time. Utility stays at β until
the expected response time ERT, then falls with slope α (α ≤ 0) and goes negative past the
zero-utility time ``ERT − β/α``.

TUF₀ is the agent's own TUF, applied to the first segment's waiting time (the response time).
TUF₁ applies to every later segment: same α and β, ERT = 0, i.e. the next segment should be
ready the moment the robot finishes the previous one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from timelyllm_ros.errors import TufError

TufClass = Literal['normal', 'urgent', 'chatbot']


@dataclass(frozen=True, slots=True)
class Tuf:
    """Eq. 1. ``beta`` > 0 is the initial utility, ``ert_s`` ≥ 0 the expected response time,
    ``alpha`` ≤ 0 the slope (utility per second) after ERT."""

    beta: float
    ert_s: float
    alpha: float

    def __post_init__(self) -> None:
        for field, value in (('beta', self.beta), ('ert_s', self.ert_s), ('alpha', self.alpha)):
            if not math.isfinite(value):
                raise TufError(f'TUF {field} must be finite, got {value}')
        if self.beta <= 0:
            raise TufError(f'TUF beta (initial utility) must be > 0, got {self.beta}')
        if self.ert_s < 0:
            raise TufError(f'TUF ERT must be >= 0 s, got {self.ert_s}')
        if self.alpha > 0:
            raise TufError(f'TUF alpha (slope) must be <= 0 so utility never rises, '
                           f'got {self.alpha}')

    @classmethod
    def from_zero_time(cls, beta: float, ert_s: float, zero_s: float) -> Tuf:
        """Build from the authors' ``[U_max, ERT, t_zero]`` form (utility 0 at ``zero_s``)."""
        if not zero_s > ert_s:
            raise TufError(f'TUF zero-utility time {zero_s} s must be after ERT {ert_s} s')
        return cls(beta=beta, ert_s=ert_s, alpha=-beta / (zero_s - ert_s))

    def utility(self, t: float) -> float:
        """Utility of a response after ``t`` seconds (Eq. 1)."""
        return min(self.beta, self.alpha * (t - self.ert_s) + self.beta)

    @property
    def zero_s(self) -> float:
        """Time at which utility reaches 0 (``inf`` for a flat TUF)."""
        return math.inf if self.alpha == 0 else self.ert_s - self.beta / self.alpha

    def suspended(self) -> Tuf:
        """TUF₁ for segments k ≥ 1: same α, β, ERT = 0 (Eq. 3)."""
        return Tuf(beta=self.beta, ert_s=0.0, alpha=self.alpha)

    def utility_suspended(self, t: float) -> float:
        """TUF₁(t) = min(β, α·max(t, 0) + β)."""
        return min(self.beta, self.alpha * max(t, 0.0) + self.beta)

    def unserved(self, t: float, suspended: bool = False) -> float:
        """Utility of a segment that never comes, ``t`` seconds into the wait when the robot
        learns it (the goal was killed, failed, or is still open): ``min(0, TUF(t))``.

        Eq. 1 prices a response; a robot that gets none earns no β, but the wait it spent
        costs what any response at that time would once the TUF is negative. So an early
        refusal is worth 0 (never more than a plan delivered then) and a late one as much as
        the late plan: ending a hopeless goal early is rewarded only for being early.
        """
        return min(0.0, self.utility_suspended(t) if suspended else self.utility(t))


NORMAL = Tuf(beta=1.0, ert_s=1.0, alpha=-2.0)
"""Normal robot tasks: ERT 1 s, β = 1, utility 0 at 1.5 s."""
URGENT = Tuf.from_zero_time(beta=2.0, ert_s=0.2, zero_s=0.5)
"""Urgent tasks (error handling): ERT 0.2 s, β = 2, α = −6.67, utility 0 at 0.5 s."""
CHATBOT = NORMAL
"""Chatbot: the same as normal robot–human interaction."""

TUF_CLASSES: dict[str, Tuf] = {'normal': NORMAL, 'urgent': URGENT, 'chatbot': CHATBOT}


def tuf_for_class(name: str) -> Tuf:
    """The paper's TUF of a task class; raise TufError for an unknown class."""
    try:
        return TUF_CLASSES[name]
    except KeyError:
        known = ', '.join(TUF_CLASSES)
        raise TufError(f'unknown TUF class {name!r}; known: {known}') from None
