"""Per-task and aggregate metrics of a run (paper 000 §4.2, Fig. 3, and §7.1 "Metrics").

* response time  = W(s₀): request arrival → start of the first segment's execution;
* time utility   = TUF₀(response time) (Eq. 1), the paper's headline metric;
* robot waiting  = Σ_k W(s_k), W(s_k) = start(s_k) − end(s_{k−1});
* completion     = end of the last segment − arrival = Σ_k (W(s_k) + E(s_k));
* plan utility   = TUF₀(W(s₀)) + Σ_{k≥1} TUF₁(W(s_k)), the objective of Eq. 3.

The rival schedulers optimise other figures, reported beside these: the completion rate
(TimeBill, whose Kill ends tasks), SLO attainment (SLICE; here a task meets its SLO when it
completes and its response time is within the ERT of its TUF₀, i.e. at full utility) and tail
latencies (Autellix: p95 / p99).

A task that never gets its whole plan (killed, failed, cancelled, or still open when the run
ends) is left out of the time means and percentiles, and scores what its robot's wait cost
when it learns no plan (or no more of it) comes (:meth:`~timelyllm_ros.core.tuf.Tuf.unserved`):
``min(0, TUF₀(t − arrival))``, 0 for an early ending and negative once its TUF is, as a late
plan would be. So ending a goal is never worth more than serving it at that time, and a policy
cannot raise its utility by killing goals it would serve late (issue 26). The plan utility
(Eq. 3) counts the segments the robot started, and the segment it was waiting for when it
learned, with the same rule. ``utility_floored_mean`` beside the signed mean floors every task
at 0 (the paper's figures never show negative utility), and the completion rate says how many
goals the utility is about.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from timelyllm_ros.core.request import Generation, TaskStatus


@dataclass(frozen=True, slots=True)
class TaskMetrics:
    """One task's outcome (times in s)."""

    task_id: str
    robot_id: str
    task_class: str
    task_type: str
    status: str
    arrival_time: float
    segments: int
    response_time_s: float
    waiting_time_s: float
    execution_time_s: float
    completion_time_s: float
    utility: float
    utility_max: float
    plan_utility: float
    suspensions: int
    error: str
    slo_met: bool = False

    @property
    def completed(self) -> bool:
        return self.status == TaskStatus.FINISHED.name


def task_metrics(generation: Generation, now: float | None = None) -> TaskMetrics:
    """Metrics of one task from its generation record.

    Args:
        generation: the task's record.
        now: the end of the run, for a goal still open then: its robot has had no plan by
            it. A goal still open without it scores 0 (a live goal asked about early).
    """
    spec = generation.spec
    segments = generation.segments
    finished = generation.status == TaskStatus.FINISHED
    nan = math.nan
    tuf = spec.tuf
    waits: list[float] = []
    execution = 0.0
    previous_end: float | None = spec.arrival_time
    for segment in segments:
        if math.isnan(segment.start_time) or previous_end is None:
            break
        waits.append(segment.start_time - previous_end)
        execution += segment.end_time - segment.start_time
        previous_end = None if math.isnan(segment.end_time) else segment.end_time
    plan_utility = (tuf.utility(waits[0]) + sum(tuf.utility_suspended(w) for w in waits[1:])
                    if waits else 0.0)
    utility = 0.0
    learned = generation.done_time if generation.status.terminal else now
    if finished:
        utility = tuf.utility(waits[0])
    elif learned is not None and not math.isnan(learned):
        utility = tuf.unserved(learned - spec.arrival_time)
        if previous_end is not None:        # the robot was waiting for the next segment
            plan_utility += tuf.unserved(learned - previous_end, suspended=bool(waits))
    response = waits[0] if finished else nan
    return TaskMetrics(
        task_id=spec.task_id, robot_id=spec.robot_id, task_class=spec.task_class,
        task_type=spec.task_type, status=generation.status.name,
        arrival_time=spec.arrival_time, segments=len(segments), response_time_s=response,
        waiting_time_s=sum(waits) if finished else nan,
        execution_time_s=execution if finished else nan,
        completion_time_s=(segments[-1].end_time - spec.arrival_time) if finished else nan,
        utility=utility, utility_max=tuf.beta,
        plan_utility=plan_utility, suspensions=generation.suspensions, error=generation.error,
        slo_met=finished and response <= tuf.ert_s,
    )


def _mean(values: Iterable[float]) -> float:
    data = [v for v in values if not math.isnan(v)]
    return float(np.mean(data)) if data else math.nan


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def aggregate(rows: Sequence[TaskMetrics]) -> dict[str, float | int]:
    """The summary M of a group of tasks (the ``summary.json`` contract)."""
    done = [r for r in rows if r.completed]
    n = len(rows)
    responses = [r.response_time_s for r in done]
    completions = [r.completion_time_s for r in done]
    return {
        'tasks': n,
        'completed': len(done),
        'killed': sum(r.status == TaskStatus.KILLED.name for r in rows),
        'completion_rate': len(done) / n if n else math.nan,
        'slo_attainment': sum(r.slo_met for r in rows) / n if n else math.nan,
        'utility_mean': _mean(r.utility for r in rows) if rows else math.nan,
        'utility_floored_mean': _mean(max(r.utility, 0.0) for r in rows) if rows else math.nan,
        'utility_max': (sum(r.utility_max for r in rows) / n) if n else math.nan,
        'response_time_mean_s': _mean(responses),
        'waiting_time_mean_s': _mean(r.waiting_time_s for r in done),
        'completion_time_mean_s': _mean(completions),
        'response_time_p95_s': _percentile(responses, 95),
        'response_time_p99_s': _percentile(responses, 99),
        'completion_time_p95_s': _percentile(completions, 95),
        'completion_time_p99_s': _percentile(completions, 99),
        'plan_utility_mean': _mean(r.plan_utility for r in rows) if rows else math.nan,
        'plan_utility_floored_mean': (_mean(max(r.plan_utility, 0.0) for r in rows)
                                      if rows else math.nan),
    }


def group_by(rows: Sequence[TaskMetrics], key: str) -> dict[str, dict[str, float | int]]:
    """Aggregates per value of a TaskMetrics field (``task_class`` or ``task_type``)."""
    groups: dict[str, list[TaskMetrics]] = {}
    for row in rows:
        groups.setdefault(str(getattr(row, key)), []).append(row)
    return {name: aggregate(group) for name, group in sorted(groups.items(), key=_natural)}


def _natural(item: tuple[str, object]) -> tuple[str, int]:
    name = item[0]
    digits = ''.join(c for c in name if c.isdigit())
    return (name.rstrip('0123456789'), int(digits) if digits else -1)


def as_row(metrics: TaskMetrics) -> dict[str, object]:
    """A flat dict for CSV output."""
    return asdict(metrics)
