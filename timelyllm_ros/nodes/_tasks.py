"""A robot's task admission: one plan executing at a time, a bounded queue of waiting tasks.

No rclpy import: the controller node wraps it, tests use it directly. Thread-safe (the
controller's subscription and action callbacks run on several executor threads).

* a task that arrives while the robot is free starts at once;
* one that arrives while it executes a plan waits, and starts when every task before it has
  ended (:meth:`TaskQueue.finish`); tasks wait in order of their rank (lower first: urgent
  tasks are not stuck behind normal ones), then of arrival;
* once ``max_waiting`` tasks wait, further ones are refused (``max_waiting=0``: never wait).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar('T')

Outcome = Literal['start', 'queued', 'refused']


@dataclass(frozen=True, slots=True)
class Admission:
    """What happened to an offered task."""

    outcome: Outcome
    position: int = 0       # 1-based place among the waiting tasks (queued only)
    waiting: int = 0        # tasks waiting after the decision


@dataclass(frozen=True, slots=True)
class Started(Generic[T]):
    """A task that becomes the active one, and how long it waited for the robot."""

    item: T
    queued_s: float


class TaskQueue(Generic[T]):
    """The active task of one robot and the tasks waiting for it."""

    def __init__(self, max_waiting: int, rank: Callable[[T], int] = lambda item: 0) -> None:
        if max_waiting < 0:
            raise ValueError(f'max_waiting must be >= 0, not {max_waiting}')
        self.max_waiting = max_waiting
        self._rank = rank
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, T, float]] = []   # (rank, task, arrival), in order
        self._active: T | None = None
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def active(self) -> T | None:
        return self._active

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def offer(self, item: T, now: float) -> Admission:
        """A task arrived at ``now`` (any clock in seconds): start it, queue it or refuse it.

        With outcome ``'start'`` the caller must start ``item`` and later call :meth:`finish`.
        """
        with self._lock:
            if not self._busy:
                self._busy = True
                self._active = item
                return Admission('start', 0, len(self._waiting))
            if len(self._waiting) >= self.max_waiting:
                return Admission('refused', 0, len(self._waiting))
            rank = self._rank(item)
            position = next((i for i, (r, _, _) in enumerate(self._waiting) if r > rank),
                            len(self._waiting))
            self._waiting.insert(position, (rank, item, now))
            return Admission('queued', position + 1, len(self._waiting))

    def finish(self, now: float) -> Started[T] | None:
        """The active task ended (done, failed or never started): the next waiting task becomes
        active and is returned (the caller starts it), or None when the robot is now free."""
        with self._lock:
            if not self._waiting:
                self._busy = False
                self._active = None
                return None
            _, item, since = self._waiting.pop(0)
            self._active = item
            return Started(item, max(0.0, now - since))

    def snapshot(self) -> tuple[T | None, list[T]]:
        """The active task and the waiting ones, in queue order (for a journal)."""
        with self._lock:
            return self._active, [item for _, item, _ in self._waiting]

    def drain(self) -> list[T]:
        """Drop every waiting task (shutdown) and return them, in queue order."""
        with self._lock:
            items = [item for _, item, _ in self._waiting]
            self._waiting.clear()
            return items
