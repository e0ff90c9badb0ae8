"""The one priority queue of initial and suspended generations (paper 000 §3, §5).

Priorities depend on the current time, so they are recomputed at every decision rather than
kept as heap keys. The queue therefore stores each generation's priority inputs as columns
of numpy arrays (structure of arrays) that a policy turns into a priority vector in a few
vectorised operations; a decision then takes its k best rows with a partial sort
(:func:`best_rows`, O(n + k log k)), not one scan of the queue per admission.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.request import Generation

_COLUMNS = ('arrival', 'ref_time', 'ert', 'ert0', 'beta', 'alpha', 'g', 'seq', 'first')

Column = NDArray[np.float64]   # one value per queued generation


@dataclass(frozen=True, slots=True)
class QueueView:
    """Read-only columns of the queued generations (row i = the i-th queued generation).

    ``ref_time`` is when the robot needs the segment: the request's arrival for the first
    segment, the estimated end of the previous segment's execution for later ones. ``ert`` is
    the ERT of the TUF governing the segment (TUF₀ for the first, 0 for TUF₁), ``ert0`` the
    ERT of the request's TUF₀, ``g`` the
    expected generation time G of one segment, ``first`` 1.0 for an initial generation,
    ``task_ids`` the generation of each row.
    """

    arrival: Column
    ref_time: Column
    ert: Column
    ert0: Column
    beta: Column
    alpha: Column
    g: Column
    seq: Column
    first: Column
    comm_s: float
    task_ids: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.seq)


class GenerationQueue:
    """Queued generations with O(1) insert and remove (swap with the last row)."""

    def __init__(self, capacity: int = 64) -> None:
        self._data = np.zeros((len(_COLUMNS), capacity))
        self._items: list[Generation] = []
        self._ids: list[str] = []           # task id of each row, beside _items
        self._slot: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._slot

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._items))

    def push(self, generation: Generation, g_s: float) -> None:
        """Queue a generation (its columns are read now: re-push after changing its state)."""
        if generation.task_id in self._slot:
            raise ValueError(f'{generation.task_id} is already queued')
        n = len(self._items)
        if n == self._data.shape[1]:
            self._data = np.concatenate([self._data, np.zeros_like(self._data)], axis=1)
        tuf = generation.spec.tuf
        self._data[:, n] = (generation.spec.arrival_time, generation.need_time,
                            generation.ert_s, tuf.ert_s, tuf.beta, tuf.alpha, g_s, generation.seq,
                            1.0 if generation.k == 0 else 0.0)
        self._items.append(generation)
        self._ids.append(generation.task_id)
        self._slot[generation.task_id] = n

    def remove(self, task_id: str) -> Generation:
        """Take a generation out of the queue (KeyError if absent)."""
        slot = self._slot.pop(task_id)
        last = len(self._items) - 1
        generation = self._items[slot]
        if slot != last:
            moved = self._items[last]
            self._items[slot] = moved
            self._ids[slot] = moved.task_id
            self._data[:, slot] = self._data[:, last]
            self._slot[moved.task_id] = slot
        self._items.pop()
        self._ids.pop()
        return generation

    def at(self, row: int) -> Generation:
        return self._items[row]

    def row_of(self, task_id: str) -> int:
        """The row of a queued generation (rows move when others are removed)."""
        return self._slot[task_id]

    @property
    def generations(self) -> list[Generation]:
        """The queued generations, row order (the live list: read, do not mutate)."""
        return self._items

    def view(self, comm_s: float) -> QueueView:
        n = len(self._items)
        columns = self._data[:, :n]
        return QueueView(*columns, comm_s=comm_s,  # type: ignore[misc]  # 9 rows, 9 columns
                         task_ids=tuple(self._ids))


def best_rows(priorities: Column, seq: Column, k: int) -> NDArray[np.intp]:
    """The rows of the ``k`` highest priorities, best first: ties go to the lower ``seq``
    (the earlier queued), and every row tied with the k-th is included, so the order is the
    one repeated argmax-with-tie-break would give. A NaN priority ranks as -inf.
    """
    n = len(priorities)
    if np.isnan(priorities).any():
        priorities = np.where(np.isnan(priorities), -np.inf, priorities)
    if k < n:
        kth = np.partition(priorities, n - k)[n - k]      # the k-th highest
        rows = np.flatnonzero(priorities >= kth)
    else:
        rows = np.arange(n)
    order = np.lexsort((seq[rows], -priorities[rows]))
    best: NDArray[np.intp] = rows[order]
    return best
