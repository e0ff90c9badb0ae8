"""Replay recorded LRTrace bags through the simulated fleet (paper 000 §6).

A replay is independent of the model that produced the trace: the simulated engine emits the
recorded token pieces, the segmenter cuts them again and simulated robots execute with the
recorded skill durations. :func:`traces_from_bags` turns bags into a trace set that replaces
the bundled derived one (per trace id the first recorded plan, its token pieces and prompt
size, plus the measured per-skill durations of every recorded task with that plan);
:func:`replay` then runs either the recorded tasks as they arrived or a programmable workload
drawn over the recorded traces.

:class:`LiveReplay` is the ROS-free half of the ``lrtrace_replayer`` node: it assigns a
workload's tasks to live robots, says which are due, and sums up the robots' result reports.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lrtrace import format as fmt
from lrtrace.reader import TraceBag, read_bag
from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.core.tuf import Tuf
from timelyllm_ros.errors import TraceFormatError, WorkloadError
from timelyllm_ros.evaluation.workloads import (
    BUILTIN_WORKLOADS,
    CLASS_TUF,
    WorkloadSpec,
    generate_tasks,
    load_workload_spec,
)
from timelyllm_ros.language.traces import Trace, TraceSet

__all__ = ['Dispatch', 'LiveReplay', 'RecordedTraceSet', 'recorded_tasks', 'replay',
           'replay_result', 'traces_from_bags']

logger = logging.getLogger(__name__)

SkillTimes = tuple[tuple[str, float], ...]
_TRACE_ID = re.compile(r'^T(\d+)$')


class RecordedTraceSet(TraceSet):
    """A trace set read from bags, with the measured skill durations of each trace.

    ``skill_times[trace_id]`` lists, per recorded task that generated that trace's plan, its
    ``(skill, seconds)`` in execution order.
    """

    skill_times: dict[int, list[SkillTimes]] = {}


def _read(sources: Sequence[str | Path | TraceBag]) -> list[TraceBag]:
    if not sources:
        raise TraceFormatError('no bag given')
    return [s if isinstance(s, TraceBag) else read_bag(s) for s in sources]


def _skill_times(bags: Sequence[TraceBag]) -> dict[tuple[int, str], SkillTimes]:
    """Per (bag index, task id), the successful skill durations in start order."""
    grouped: dict[tuple[int, str], list[tuple[float, str, float]]] = {}
    for index, bag in enumerate(bags):
        for record in bag.skills:
            start = fmt.stamp_seconds(record.start_stamp)
            end = fmt.stamp_seconds(record.end_stamp)
            if record.success and not math.isnan(start) and not math.isnan(end):
                grouped.setdefault((index, record.goal_id), []).append(
                    (start, record.skill, end - start))
    return {key: tuple((skill, s) for _, skill, s in sorted(rows))
            for key, rows in grouped.items()}


def traces_from_bags(bags: Sequence[str | Path | TraceBag]) -> RecordedTraceSet:
    """The recorded traces of some bags, by trace id.

    The trace id comes from the task type (``T3`` → 3); tasks of other types get fresh ids
    after the largest one. Tasks that generated no text are left out.

    Raises:
        TraceFormatError: unreadable bag, or no task with generated text.
    """
    read = _read(bags)
    times = _skill_times(read)
    traces: dict[int, Trace] = {}
    skill_times: dict[int, list[SkillTimes]] = {}
    others: dict[str, int] = {}
    pending: list[tuple[str, Any, int]] = []
    for index, bag in enumerate(read):
        for task in bag.tasks:
            if task.text:
                pending.append((task.task_type, task, index))
    if not pending:
        raise TraceFormatError('no recorded task with generated text in '
                               + ', '.join(str(b.path) for b in read))
    numbered = [int(m.group(1)) for t, _, _ in pending if (m := _TRACE_ID.match(t))]
    next_id = max(numbered, default=0) + 1
    for task_type, task, index in pending:
        match = _TRACE_ID.match(task_type)
        if match is not None:
            trace_id = int(match.group(1))
        else:
            if task_type not in others:
                others[task_type] = next_id
                next_id += 1
            trace_id = others[task_type]
        if trace_id not in traces:
            traces[trace_id] = Trace(
                id=trace_id, name=task_type or f'recorded {task.task_id}', robot=task.profile,
                task_class=task.task_class, prompt_tokens=max(1, int(task.prompt_tokens)),
                task=task.task or task_type or task.task_id, plan=task.text,
                tokens=tuple(task.token_pieces) or None)
        measured = times.get((index, task.task_id))
        if measured and task.text == traces[trace_id].plan:
            skill_times.setdefault(trace_id, []).append(measured)
    sources = sorted({b.source for b in read if b.source})
    provenance = (f'recorded by lrtrace in {", ".join(str(b.path) for b in read)}'
                  + (f' ({"; ".join(sources)})' if sources else ''))
    return RecordedTraceSet(provenance=provenance,
                            traces=[traces[i] for i in sorted(traces)],
                            skill_times=skill_times)


def recorded_tasks(bags: Sequence[str | Path | TraceBag]) -> list[TaskSpec]:
    """The recorded tasks exactly as they arrived: arrival, robot, TUF, prompt, pieces and the
    measured skill durations (task ids are prefixed with the bag index when several bags are
    given)."""
    read = _read(bags)
    times = _skill_times(read)
    tasks: list[TaskSpec] = []
    for index, bag in enumerate(read):
        for task in bag.tasks:
            if not task.text:
                continue
            prefix = f'b{index}-' if len(read) > 1 else ''
            tasks.append(TaskSpec(
                task_id=prefix + task.task_id, robot_id=prefix + task.robot_id,
                profile=task.profile, task_class=task.task_class, task_type=task.task_type,
                tuf=Tuf(beta=task.tuf.beta, ert_s=task.tuf.ert_s, alpha=task.tuf.alpha),
                arrival_time=fmt.stamp_seconds(task.arrival_stamp), task=task.task,
                prompt_tokens=int(task.prompt_tokens), task_tokens=int(task.task_tokens),
                script=tuple(task.token_pieces) or None,
                skill_times=times.get((index, task.task_id))))
    return tasks


def _spec(workload: WorkloadSpec | str | Path) -> WorkloadSpec:
    if isinstance(workload, WorkloadSpec):
        return workload
    if str(workload) in BUILTIN_WORKLOADS:
        return BUILTIN_WORKLOADS[str(workload)]
    if Path(workload).suffix in ('.yaml', '.yml'):
        return load_workload_spec(workload)
    raise WorkloadError(f'unknown workload {str(workload)!r}: give a built-in name '
                        f'({", ".join(BUILTIN_WORKLOADS)}) or a workload spec YAML file')


def workload_tasks(traces: RecordedTraceSet | TraceSet, workload: WorkloadSpec | str | Path,
                   seed: int = 0) -> list[TaskSpec]:
    """A programmable workload drawn over recorded traces, each task carrying the measured
    skill durations of one recorded run of its trace (cycling through them)."""
    spec = _spec(workload)
    tasks = generate_tasks(spec, seed, traces)
    measured = getattr(traces, 'skill_times', {})
    used: dict[int, int] = {}
    out = []
    for task in tasks:
        trace_id = int(task.task_type[1:]) if _TRACE_ID.match(task.task_type) else -1
        runs = measured.get(trace_id)
        if runs:
            n = used.get(trace_id, 0)
            used[trace_id] = n + 1
            task = replace(task, skill_times=runs[n % len(runs)])
        out.append(task)
    return out


def replay_result(source: Sequence[str | Path | TraceBag] | TraceSet,
                  workload: WorkloadSpec | str | Path | None = None, seed: int = 0,
                  policy: str = 'timelyllm', config: SchedulerConfig | None = None) -> Any:
    """Replay and return the :class:`~timelyllm_ros.evaluation.simulation.SimulationResult`.

    Args:
        source: bags (paths or read) or a trace set (e.g. from :func:`traces_from_bags`).
        workload: a workload spec (object, built-in name or YAML file) drawn over the recorded
            traces; ``None`` replays the recorded tasks as they arrived (bags only).
        seed: the workload's and the simulated robots' seed.
        policy: the scheduling policy.
        config: scheduler parameters.

    Raises:
        TraceFormatError: unreadable bags.
        WorkloadError: a workload naming a trace the bags do not hold, or no workload with a
            trace set.
    """
    from timelyllm_ros.evaluation.simulation import simulate

    if workload is None:
        if isinstance(source, TraceSet):
            raise WorkloadError('replaying a trace set needs a workload spec')
        tasks = recorded_tasks(source)
    else:
        traces = source if isinstance(source, TraceSet) else traces_from_bags(source)
        tasks = workload_tasks(traces, workload, seed)
    if not tasks:
        raise WorkloadError('nothing to replay: the workload has no task')
    return simulate(tasks, policy, seed=seed, config=config)


def replay(source: Sequence[str | Path | TraceBag] | TraceSet,
           workload: WorkloadSpec | str | Path | None = None, seed: int = 0,
           policy: str = 'timelyllm', config: SchedulerConfig | None = None
           ) -> dict[str, object]:
    """Replay recorded traces and return the metrics summary (``by_class``, ``by_type``,
    ``overall``, ``run``; the ``timelyllm run`` contract). See :func:`replay_result`."""
    from timelyllm_ros.evaluation.bench import run_summary

    return run_summary(replay_result(source, workload, seed, policy, config))


# -- live replay on robots (the lrtrace_replayer node) -------------------------------------------

@dataclass(frozen=True, slots=True)
class Dispatch:
    """A task to send to a live robot."""

    task: TaskSpec
    robot: str              # the robot (controller namespace) that gets it
    urgency: str            # the planner's TUF class for it (arm tasks are normal)


def _agent(robot_id: str) -> int:
    tail = robot_id.rsplit('-', 1)[-1]
    return int(tail) if tail.isdigit() else sum(robot_id.encode())


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


class LiveReplay:
    """A workload replayed on live robots: which robot gets which task when, and the outcome.

    Each task goes to a robot of its profile (``robots``: robot name → profile name), the
    workload's agent number modulo the robots of that kind; tasks of a kind no robot has are
    skipped. Reports are the controllers' ``PlanResult`` messages as dicts
    (:func:`timelyllm_ros.nodes.convert.plan_result_fields`: ``success``, ``outcome``,
    ``task_id``, times, ...).
    """

    def __init__(self, tasks: Sequence[TaskSpec], robots: Mapping[str, str]) -> None:
        if not robots:
            raise WorkloadError('no robot to replay the workload on')
        by_kind: dict[str, list[str]] = {}
        for robot, kind in robots.items():
            by_kind.setdefault(kind, []).append(robot)
        self.robots = dict(robots)
        self.tasks = sorted(tasks, key=lambda t: t.arrival_time)
        self.plan: list[Dispatch | None] = []
        for task in self.tasks:
            mine = by_kind.get(task.profile)
            self.plan.append(None if not mine else Dispatch(
                task, mine[_agent(task.robot_id) % len(mine)],
                CLASS_TUF.get(task.task_class, task.task_class)))
        self._next = 0
        self.sent: list[Dispatch] = []
        self.skipped: list[TaskSpec] = []
        self.reports: list[dict[str, object]] = []

    @classmethod
    def from_lists(cls, tasks: Sequence[TaskSpec], robots: Sequence[str],
                   kinds: Sequence[str]) -> LiveReplay:
        """From parallel lists of robot names and their profile names (node parameters)."""
        if len(robots) != len(kinds):
            raise WorkloadError(f'{len(robots)} robots but {len(kinds)} robot kinds: give one '
                                f'kind per robot')
        if len(set(robots)) != len(robots):
            raise WorkloadError(f'robots listed twice in {list(robots)}')
        return cls(tasks, dict(zip(robots, kinds, strict=True)))

    @property
    def all_sent(self) -> bool:
        return self._next >= len(self.plan)

    @property
    def missing(self) -> int:
        """Sent tasks whose report has not arrived."""
        return max(0, len(self.sent) - len(self.reports))

    @property
    def complete(self) -> bool:
        """Every task sent (or skipped) and every sent task reported back."""
        return self.all_sent and self.missing == 0

    def due(self, elapsed_s: float) -> list[Dispatch]:
        """The tasks that arrive by ``elapsed_s`` (seconds since the replay started), in
        arrival order; each is returned once (skipped ones are counted, not returned)."""
        out: list[Dispatch] = []
        while self._next < len(self.plan) and self.tasks[self._next].arrival_time <= elapsed_s:
            dispatch = self.plan[self._next]
            if dispatch is None:
                self.skipped.append(self.tasks[self._next])
            else:
                out.append(dispatch)
                self.sent.append(dispatch)
            self._next += 1
        return out

    def record(self, report: Mapping[str, object]) -> None:
        self.reports.append(dict(report))

    def summary(self) -> dict[str, object]:
        """Counts, and the means over succeeded tasks, overall and per task class."""
        classes = {d.task.task_id: d.task.task_class for d in self.sent}

        def kind(report: Mapping[str, object]) -> str:
            if report.get('success'):
                return 'succeeded'
            if report.get('outcome') in ('rejected', 'refused'):
                return str(report['outcome'])
            error = str(report.get('error', ''))
            for word in ('refused', 'rejected'):
                if error.startswith(word):
                    return word
            return 'failed'

        def stats(reports: list[dict[str, object]], sent: int) -> dict[str, object]:
            done = [r for r in reports if r.get('success')]

            def mean_of(key: str) -> float | None:
                values = [float(r[key]) for r in done if key in r]  # type: ignore[arg-type]
                # -1 marks a time the planner could not measure
                return _mean(values if key == 'utility' else [v for v in values if v >= 0.0])

            counts = {k: 0 for k in ('succeeded', 'failed', 'rejected', 'refused')}
            for report in reports:
                counts[kind(report)] += 1
            return {'sent': sent, 'reported': len(reports), **counts,
                    'utility_mean': mean_of('utility'),
                    'response_time_s_mean': mean_of('response_time_s'),
                    'waiting_time_s_mean': mean_of('waiting_time_s'),
                    'queued_s_mean': mean_of('queued_s')}

        by_class: dict[str, dict[str, object]] = {}
        for name in sorted(set(classes.values())):
            mine = [r for r in self.reports if classes.get(str(r.get('task_id', ''))) == name]
            by_class[name] = stats(mine, sum(c == name for c in classes.values()))
        return {'tasks': len(self.tasks), 'sent': len(self.sent), 'skipped': len(self.skipped),
                'missing': self.missing, 'overall': stats(self.reports, len(self.sent)),
                'by_class': by_class}

    def summary_lines(self) -> list[str]:
        """The summary as log lines: one overall, one per task class."""
        summary = self.summary()

        def line(name: str, stats: Mapping[str, object]) -> str:
            text = (f'{name}: {stats["sent"]} sent, {stats["succeeded"]} succeeded, '
                    f'{stats["failed"]} failed, {stats["rejected"]} rejected, '
                    f'{stats["refused"]} refused')
            for key, label, unit in (('utility_mean', 'utility', ''),
                                     ('response_time_s_mean', 'response', ' s'),
                                     ('waiting_time_s_mean', 'waiting', ' s'),
                                     ('queued_s_mean', 'queued', ' s')):
                if stats[key] is not None:
                    text += f', {label} {stats[key]:.3f}{unit}'
            return text

        head = (f'replayed {summary["sent"]} of {summary["tasks"]} tasks '
                f'({summary["skipped"]} without a robot of their kind, '
                f'{summary["missing"]} without a result)')
        by_class: Mapping[str, Mapping[str, object]] = summary['by_class']  # type: ignore[assignment]
        return [head, line('overall', summary['overall']),  # type: ignore[arg-type]
                *(line(f'  {name}', stats) for name, stats in by_class.items())]
