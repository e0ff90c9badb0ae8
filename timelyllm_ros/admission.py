"""Admission: may the best queued generation join the running batch now? (paper 000 §4.4)

Two checks, kept apart from the ranking so every policy can reuse them:

* :func:`fits` -- the batch cap and KV memory (the engine owns the memory accounting);
* :func:`latency_guided` -- the most urgent running generation must still finish its segment
  within its remaining budget when the batch grows. Its worst-case time is
  ``WCET = run_cost(candidate) + (l_max − tokens of its segment so far) · step_s(b + 1)``, where
  ``run_cost`` is the prefill or swap-in the candidate adds to the next iteration and
  ``step_s(b + 1)`` is the observed recent decode-step time scaled by the engine's latency
  model from b to b + 1 generations. The budget is the slack until the robot needs that
  segment: ``need + ERT − now − comm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from timelyllm_ros.engines.base import Engine
from timelyllm_ros.request import Generation


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    """What an admission test may look at."""

    now: float                                  # s
    comm_s: float                               # one-way network latency (s)
    engine: Engine
    running: Sequence[Generation]               # generations in the batch
    max_batch: int                              # batch cap of this run
    recent_step_s: float | None                 # observed decode-step time, None before any
    max_segment_tokens: Callable[[Generation], int]  # l_max of a generation's robot profile
    urgency_tie_s: Callable[[Generation], float] | None = None  # budgets closer than this tie
    queued: Sequence[Generation] = ()           # generations in the queue (do not mutate)


def fits(candidate: Generation, ctx: AdmissionContext) -> bool:
    """Batch cap and KV memory."""
    if len(ctx.running) >= ctx.max_batch:
        return False
    return ctx.engine.can_run(candidate.task_id)


def budget_s(generation: Generation, ctx: AdmissionContext) -> float:
    """Time left before the robot needs the segment being generated."""
    return generation.need_time + generation.ert_s - ctx.now - ctx.comm_s


def wcet_s(generation: Generation, extra_s: float, batch_size: int,
           ctx: AdmissionContext) -> float:
    """Worst-case time to finish the generation's current segment in a batch of the given size."""
    remaining = max(ctx.max_segment_tokens(generation) - generation.segment_tokens, 1)
    model_next = ctx.engine.decode_step_s(batch_size)
    if ctx.recent_step_s is None:
        return extra_s + remaining * model_next
    model_now = ctx.engine.decode_step_s(max(len(ctx.running), 1))
    scale = model_next / model_now if model_now > 0 else 1.0
    return extra_s + remaining * ctx.recent_step_s * scale


def latency_guided(candidate: Generation, ctx: AdmissionContext) -> bool:
    """§4.4: admit only if the most urgent running generation keeps its budget.

    If the candidate is at least as urgent as every running generation, waiting cannot help
    it, so it is admitted (subject to :func:`fits`). Budgets that differ by less than
    ``urgency_tie_s`` (one segment generation time G by default in the scheduler) count as
    equally urgent: requests of one event arrive milliseconds apart, and serialising them
    would make each wait a whole segment for a difference of a few milliseconds.
    """
    if not ctx.running:
        return True
    most_urgent = min(ctx.running, key=lambda g: budget_s(g, ctx))
    budget = budget_s(most_urgent, ctx)
    tie = ctx.urgency_tie_s(candidate) if ctx.urgency_tie_s is not None else 0.0
    if budget_s(candidate, ctx) <= budget + tie:
        return True
    extra = ctx.engine.run_cost_s(candidate.task_id)
    return wcet_s(most_urgent, extra, len(ctx.running) + 1, ctx) <= budget
