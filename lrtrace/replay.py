"""Replay recorded LRTrace bags through the simulated fleet (paper 000 §6).

A replay is independent of the model that produced the trace: the simulated engine emits the
recorded token pieces, the segmenter cuts them again and simulated robots execute with the
recorded skill durations. :func:`traces_from_bags` turns bags into a trace set that replaces
the bundled derived one (per trace id the first recorded plan, its token pieces and prompt
size, plus the measured per-skill durations of every recorded task with that plan);
:func:`replay` then runs either the recorded tasks as they arrived or a programmable workload
drawn over the recorded traces.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lrtrace import format as fmt
from lrtrace.reader import TraceBag, read_bag
from lrtrace.traces import Trace, TraceSet
from lrtrace.workloads import (
    BUILTIN_WORKLOADS,
    WorkloadSpec,
    generate_tasks,
    load_workload_spec,
)
from timelyllm_ros.errors import TraceFormatError, WorkloadError
from timelyllm_ros.request import TaskSpec
from timelyllm_ros.scheduler import SchedulerConfig
from timelyllm_ros.tuf import Tuf

__all__ = ['RecordedTraceSet', 'recorded_tasks', 'replay', 'replay_result', 'traces_from_bags']

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
    """Replay and return the :class:`~timelyllm_ros.simulation.SimulationResult`.

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
    from timelyllm_ros.simulation import simulate

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
    from timelyllm_ros.bench import run_summary

    return run_summary(replay_result(source, workload, seed, policy, config))
