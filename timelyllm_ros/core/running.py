"""The running batch: the generations in the engine's batch, with what admission reads of them.

Every admission round's latency test reads the whole running batch (each generation's
budget, the tokens its segment has left, its TUF slope; :class:`~timelyllm_ros.core.
admission.BatchColumns`). Read from the generations, one attribute of one object at a time,
that cost a fifth of a decision at 5,000 robots (a batch of about 250 read at every
decision). So the scheduler keeps the running generations here, a dict in the order they
joined (as before: task id → generation), and beside it, as columns, the values that change
only when a generation joins or its robot's timing moves: ``need + ERT`` (when the robot
needs the segment, plus the governing TUF's ERT), ``l_max`` and α, from the first time they
are read (a policy without the latency test never reads them). Removals leave a hole, filled
when the columns are next read. A segment's token count changes at every step, and is
read at each decision instead (one array of it).

The scheduler tells :meth:`RunningBatch.refresh` whenever it changes a running generation's
``need_time`` or segment index (a dispatch, a robot's report).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from timelyllm_ros.core.queue import Column
from timelyllm_ros.core.request import Generation

_NEED_ERT, _L_MAX, _ALPHA = range(3)


class RunningBatch(dict[str, Generation]):
    """Running generations by task id, in the order they joined, with their columns.

    Args:
        l_max: a generation's longest segment in tokens (its robot profile's ``l_max``, asked
            once per profile).
    """

    def __init__(self, l_max: Callable[[Generation], int]) -> None:
        super().__init__()
        self._l_max = l_max
        self._l_max_of: dict[str, int] = {}     # per robot profile (the same for each of it)
        self._columns: Column = np.empty((3, 64))
        self._used = 0                          # rows written, the removed ones included
        self._slot: dict[str, int] = {}         # task id -> its row
        self._removed: list[int] = []           # rows of generations no longer running
        self._kept = False                      # columns kept (from the first read on)

    def __setitem__(self, task_id: str, generation: Generation) -> None:
        if not self._kept:
            super().__setitem__(task_id, generation)
            return
        slot = self._slot.get(task_id)
        if slot is None:
            slot = self._used
            if slot == self._columns.shape[1]:
                self._columns = np.concatenate([self._columns, np.empty_like(self._columns)],
                                               axis=1)
            self._used += 1
            self._slot[task_id] = slot
        super().__setitem__(task_id, generation)
        self._write(slot, generation)

    def __delitem__(self, task_id: str) -> None:
        super().__delitem__(task_id)
        if self._kept:
            self._removed.append(self._slot.pop(task_id))

    def pop(self, task_id: str, *default: Generation | None) -> Generation | None:  # type: ignore[override]
        if not self._kept:
            return super().pop(task_id, *default)
        if task_id in self:
            generation = self[task_id]
            del self[task_id]
            return generation
        if default:
            return default[0]
        raise KeyError(task_id)

    def _unsupported(self, *args: object, **kwargs: object) -> None:
        raise TypeError('a RunningBatch changes by item only (set, del, pop)')

    clear = popitem = setdefault = update = __ior__ = _unsupported   # type: ignore[assignment]

    def refresh(self, generation: Generation) -> None:
        """Read a running generation's ``need_time`` and segment index again (no-op if it is
        not running)."""
        slot = self._slot.get(generation.task_id) if self._kept else None
        if slot is not None:
            self._write(slot, generation)

    def _write(self, slot: int, generation: Generation) -> None:
        spec = generation.spec
        l_max = self._l_max_of.get(spec.profile)
        if l_max is None:
            l_max = self._l_max_of[spec.profile] = self._l_max(generation)
        columns = self._columns
        columns[_NEED_ERT, slot] = generation.need_time + generation.ert_s
        columns[_L_MAX, slot] = l_max
        columns[_ALPHA, slot] = spec.tuf.alpha

    def columns(self) -> tuple[Column, Column, Column]:
        """``(need + ERT, l_max, α)`` of the running generations, in the batch's order (views:
        read them before the batch changes). The first read starts keeping them: a scheduler
        whose policy never reads them (no latency test) never writes them."""
        if not self._kept:
            self._keep()
        elif self._removed:
            self._close_holes()
        used = self._used
        return (self._columns[_NEED_ERT, :used], self._columns[_L_MAX, :used],
                self._columns[_ALPHA, :used])

    def _keep(self) -> None:
        n = len(self)
        if n > self._columns.shape[1]:
            self._columns = np.empty((3, 2 * n))
        self._slot = {task_id: row for row, task_id in enumerate(self)}
        self._used, self._kept = n, True
        for row, generation in enumerate(self.values()):
            self._write(row, generation)

    def _close_holes(self) -> None:
        """Move the running generations' rows together, in order (the dict's order is theirs:
        rows are written as generations join, and a removal keeps the others' order)."""
        keep = np.ones(self._used, dtype=bool)
        keep[self._removed] = False
        self._used = n = len(self)
        self._columns[:, :n] = self._columns[:, :len(keep)][:, keep]
        self._slot = {task_id: row for row, task_id in enumerate(self)}
        self._removed = []

    def column_errors(self) -> list[str]:
        """Where a column disagrees with its generation (empty when consistent; for tests and
        the scheduler's invariant check; none before they are kept)."""
        if not self._kept:
            return []
        need_ert, l_max, alpha = self.columns()
        problems = []
        for row, generation in enumerate(self.values()):
            expected = (generation.need_time + generation.ert_s, self._l_max(generation),
                        generation.spec.tuf.alpha)
            found = (float(need_ert[row]), float(l_max[row]), float(alpha[row]))
            if found != expected:
                problems.append(f'{generation.task_id}: batch columns (need + ERT, l_max, '
                                f'alpha) {found}, generation {expected}')
        return problems
