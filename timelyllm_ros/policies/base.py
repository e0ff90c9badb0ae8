"""The policy plug-in interface: how generations are ranked, admitted and (optionally) steered.

A policy says whether generations are suspended at segment boundaries (``segmented``),
whether segments are sent to the robot as they are cut (``streaming``; if not, the whole plan
is sent when generation ends), and, at each decision, the priority of every queued generation
(higher runs sooner) plus whether the best one may join the batch. That is all TimelyLLM and
the paper's baselines need. A ranking that finds the rows leading its order on the way (the
stranded goals' share does) hands them over too (:meth:`Policy.ranked`), so that the decision
does not sort the queue again.

The rival schedulers steer more of the loop, through optional hooks with do-nothing
defaults, each called by the scheduler at one point of every tick:

1. :meth:`Policy.overruns`  -- generations to kill (TimeBill's Kill);
2. :meth:`Policy.preempt`   -- running generations to take out of the batch, keeping their KV
   resident, swapping it to host or dropping it (Semantic Scheduling, Autellix, SLICE);
3. ranking and admission (:meth:`priorities`, :meth:`admit`), then :meth:`kv_evict_ratio` for
   each admitted generation (TimeBill's α);
4. :meth:`decode_mask` -- which running generations decode in this iteration (SLICE);
5. the engine iteration, then the observers :meth:`on_step`, :meth:`on_cut`, :meth:`on_end`;
   :meth:`on_submit` runs when a request arrives.

:meth:`attach` runs once, when a scheduler takes the policy: it hands over the engine's
read-only view and the batch cap, for a ranking that reads the engine's state.

The scheduler loop never changes to add a policy; policy state lives in the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import AdmissionContext, fits
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation
from timelyllm_ros.engines.base import EngineView, StepResult

Eviction = Literal['keep', 'host', 'none']   # KV stays resident / swapped to host / dropped


class Policy(ABC):
    """Ranks queued generations and admits them into the running batch."""

    name: ClassVar[str]
    description: ClassVar[str] = ''
    segmented: ClassVar[bool] = True      # suspend at each segment cut, keep KV
    streaming: ClassVar[bool] = True      # dispatch each segment when it is cut

    @abstractmethod
    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        """Priority of each queued row at time ``now`` (higher first; ties go to lower seq).

        A pure function of the policy's state, the queue and ``now``: it changes nothing, so
        that a status snapshot may ask at any time (what a decision needs to keep goes in
        :meth:`admit` or the observers; the decision's ranked queue is ``ctx.ranked``)."""

    def ranked(self, queue: QueueView, now: float
               ) -> tuple[NDArray[np.float64], NDArray[np.intp] | None]:
        """:meth:`priorities`, and the rows that lead their order where the ranking found them
        on the way (best first: the first rows of the order that :func:`~timelyllm_ros.core.
        queue.best_rows` gives, with no other row tied with any of them), else None. A decision
        takes its first candidates from those rows instead of sorting the queue again."""
        return self.priorities(queue, now), None

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        """Whether ``candidate`` (the best queued generation) may join the batch now."""
        return fits(candidate, ctx)

    def attach(self, engine: EngineView, batch_cap: int) -> None:
        """The scheduler this policy serves runs ``engine`` with at most ``batch_cap``
        generations at once: a policy whose ranking reads the engine's state keeps the view
        (it tells, it cannot act)."""
        return

    # -- optional steering hooks ------------------------------------------------------------
    def overruns(self, ctx: AdmissionContext) -> Mapping[str, str]:
        """Generations (running or queued) to end now, each with the reason (Kill)."""
        return {}

    def preempt(self, ctx: AdmissionContext) -> Mapping[str, Eviction]:
        """Running generations to take out of the batch before admission, and where their KV
        goes. They re-enter the queue and keep their token ids.

        A queued (suspended or preempted) generation may be named too, with ``'host'`` or
        ``'none'``: its KV, if still resident, is swapped out or dropped and it stays queued
        (priority-based KV eviction, Semantic Scheduling's Alg. 4)."""
        return {}

    def kv_evict_ratio(self, generation: Generation, ctx: AdmissionContext) -> float | None:
        """Share of the prompt's KV to evict once ``generation`` is prefilled (None: keep all).
        Asked only when the engine supports KV compression."""
        return None

    def decode_mask(self, ctx: AdmissionContext) -> Collection[str] | None:
        """Running generations to decode in this iteration (None: all of them)."""
        return None

    # -- observers --------------------------------------------------------------------------
    def on_submit(self, generation: Generation, now: float) -> None:
        """A request was queued."""
        return

    def on_step(self, result: StepResult, stepped: Sequence[Generation],
                ctx: AdmissionContext) -> None:
        """An engine iteration advanced ``stepped`` (the clock already moved past it)."""
        return

    def on_cut(self, generation: Generation, now: float) -> None:
        """A segment of ``generation`` was cut (and sent, for streaming policies). A segmented
        generation leaves the batch when its next statement begins (:meth:`on_suspend`) or
        ends there (:meth:`on_end`), or at the cut itself with the scheduler's
        ``suspend_on_next_statement`` off."""
        return

    def on_suspend(self, generation: Generation, now: float) -> None:
        """A segmented ``generation`` left the batch for the queue after a cut (its KV kept):
        it waits to generate its next segment."""
        return

    def on_end(self, generation: Generation, now: float) -> None:
        """``generation`` stopped generating for good (generated, failed or cancelled)."""
        return
