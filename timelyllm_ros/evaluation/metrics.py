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

A task that did not complete earns no utility (0) and is left out of the time means and
percentiles.
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


def task_metrics(generation: Generation) -> TaskMetrics:
    """Metrics of one task from its generation record."""
    spec = generation.spec
    segments = generation.segments
    finished = generation.status == TaskStatus.FINISHED
    nan = math.nan
    waits: list[float] = []
    execution = 0.0
    if finished:
        previous_end = spec.arrival_time
        for segment in segments:
            waits.append(segment.start_time - previous_end)
            execution += segment.end_time - segment.start_time
            previous_end = segment.end_time
    response = waits[0] if waits else nan
    tuf = spec.tuf
    plan_utility = (tuf.utility(waits[0]) + sum(tuf.utility_suspended(w) for w in waits[1:])
                    if waits else 0.0)
    return TaskMetrics(
        task_id=spec.task_id, robot_id=spec.robot_id, task_class=spec.task_class,
        task_type=spec.task_type, status=generation.status.name,
        arrival_time=spec.arrival_time, segments=len(segments), response_time_s=response,
        waiting_time_s=sum(waits) if waits else nan,
        execution_time_s=execution if finished else nan,
        completion_time_s=(segments[-1].end_time - spec.arrival_time) if finished else nan,
        utility=tuf.utility(response) if finished else 0.0, utility_max=tuf.beta,
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
        'utility_max': (sum(r.utility_max for r in rows) / n) if n else math.nan,
        'response_time_mean_s': _mean(responses),
        'waiting_time_mean_s': _mean(r.waiting_time_s for r in done),
        'completion_time_mean_s': _mean(completions),
        'response_time_p95_s': _percentile(responses, 95),
        'response_time_p99_s': _percentile(responses, 99),
        'completion_time_p95_s': _percentile(completions, 95),
        'completion_time_p99_s': _percentile(completions, 99),
        'plan_utility_mean': _mean(r.plan_utility for r in rows) if rows else math.nan,
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
