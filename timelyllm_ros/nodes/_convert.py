"""Message ⇄ core translations of the ROS layer (no rclpy import: testable without ROS).

Message classes are passed in, so the same helpers serve the generated interfaces and tests.
Core times are float seconds on the planner's clock; ROS stamps are epoch time, and
``origin_s`` is the epoch time of the planner clock's zero (``time.time() − clock.now()``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from timelyllm_ros.errors import GoalError
from timelyllm_ros.metrics import task_metrics
from timelyllm_ros.profiles import RobotProfile
from timelyllm_ros.request import Generation, Segment, TaskStatus
from timelyllm_ros.robots.backend import SkillRecord
from timelyllm_ros.segmenter import Statement, segment_text
from timelyllm_ros.service import PlanGoal
from timelyllm_ros.tuf import Tuf


def stamp(seconds: float, time_cls: type) -> Any:
    """builtin_interfaces/Time from epoch seconds (NaN → zero stamp)."""
    if not math.isfinite(seconds):
        return time_cls(sec=0, nanosec=0)
    total_ns = round(seconds * 1e9)
    return time_cls(sec=total_ns // 1_000_000_000, nanosec=total_ns % 1_000_000_000)


def seconds(stamp_msg: Any) -> float:
    """Epoch seconds of a builtin_interfaces/Time."""
    return stamp_msg.sec + stamp_msg.nanosec * 1e-9


def tuf_from_msg(msg: Any) -> Tuf:
    """TimeUtility → Tuf (raises TufError for invalid values)."""
    return Tuf(beta=float(msg.beta), ert_s=float(msg.ert_s), alpha=float(msg.alpha))


def tuf_to_msg(tuf: Tuf, cls: type) -> Any:
    return cls(ert_s=tuf.ert_s, alpha=tuf.alpha, beta=tuf.beta)


def goal_from_msg(goal: Any) -> PlanGoal:
    """PlanTask goal → PlanGoal (raises GoalError / TufError with the reason)."""
    urgency = goal.urgency.strip() or 'normal'
    tuf = tuf_from_msg(goal.tuf) if goal.has_tuf else None
    if not goal.robot_kind.strip():
        raise GoalError(f'{goal.robot_id}: the goal names no robot kind')
    return PlanGoal(robot_id=goal.robot_id, robot_kind=goal.robot_kind.strip(), task=goal.task,
                    urgency=urgency, tuf=tuf,
                    wait_for_execution=bool(getattr(goal, 'wait_for_execution', True)))


def segment_to_msg(generation: Generation, segment: Segment, origin_s: float, cls: type,
                   time_cls: type) -> Any:
    """A dispatched core segment → Segment message (feedback and the segments topic)."""
    return cls(robot_id=generation.spec.robot_id, goal_id=generation.task_id,
               index=segment.index, text=segment.text,
               skills=[c.skill for c in segment.calls], is_last=segment.is_last,
               generated_stamp=stamp(origin_s + segment.cut_time, time_cls),
               estimated_execution_s=segment.estimated_exec_s)


def statements_from_text(profile: RobotProfile, text: str) -> tuple[Statement, ...]:
    """Parse a received segment's text back into statements (robots execute statements).

    Raises:
        GoalError: the text holds a malformed statement or none at all.
    """
    cuts = segment_text(profile, text)
    rejected = [s for cut in cuts for s in cut.rejected]
    if rejected:
        raise GoalError(f'segment {text!r}: {rejected[0].text!r}: {rejected[0].error}')
    statements = tuple(s for cut in cuts for s in cut.statements)
    if not statements:
        raise GoalError(f'segment {text!r} holds no executable statement')
    return statements


def segment_from_msg(profile: RobotProfile, msg: Any) -> Segment:
    """Segment message → a core Segment the skill executor can run."""
    statements = statements_from_text(profile, msg.text)
    return Segment(index=int(msg.index), text=msg.text, statements=statements,
                   cut_time=seconds(msg.generated_stamp),
                   dispatch_time=seconds(msg.generated_stamp),
                   estimated_exec_s=float(msg.estimated_execution_s), tokens=0,
                   is_last=bool(msg.is_last))


def segment_done_to_msg(robot_id: str, goal_id: str, index: int, start_s: float, end_s: float,
                        success: bool, error: str, cls: type, time_cls: type) -> Any:
    """A robot's execution report (epoch seconds) → SegmentDone message."""
    return cls(robot_id=robot_id, goal_id=goal_id, index=index,
               start_stamp=stamp(start_s, time_cls), end_stamp=stamp(end_s, time_cls),
               success=success, error=error)


def segment_done_from_msg(msg: Any, origin_s: float) -> tuple[str, int, float, float, bool, str]:
    """SegmentDone → (goal id, index, start, end on the planner clock, success, error)."""
    return (msg.goal_id, int(msg.index), seconds(msg.start_stamp) - origin_s,
            seconds(msg.end_stamp) - origin_s, bool(msg.success), msg.error)


def skill_record_to_msg(robot_id: str, goal_id: str, segment_index: int, record: SkillRecord,
                        cls: type, time_cls: type) -> Any:
    """A SkillRecord (epoch seconds) → SkillExecution message (LRTrace)."""
    return cls(robot_id=robot_id, goal_id=goal_id, segment_index=segment_index,
               skill=record.skill, call=record.call,
               start_stamp=stamp(record.start_time, time_cls),
               end_stamp=stamp(record.end_time, time_cls), success=record.success,
               error=record.error)


def skill_record_from_msg(msg: Any) -> SkillRecord:
    """SkillExecution message → SkillRecord (epoch seconds; arguments are not carried)."""
    return SkillRecord(skill=msg.skill, call=msg.call, args={},
                       start_time=seconds(msg.start_stamp), end_time=seconds(msg.end_stamp),
                       success=bool(msg.success), error=msg.error)


def result_fields(generation: Generation) -> dict[str, Any]:
    """The PlanTask result of an ended goal."""
    metrics = task_metrics(generation)
    finished = generation.status in (TaskStatus.FINISHED, TaskStatus.GENERATED)

    def finite(value: float) -> float:
        return value if math.isfinite(value) else -1.0

    return {
        'success': finished,
        'error': generation.error if not finished else '',
        'plan': ''.join(s.text for s in generation.segments),
        'segment_count': len(generation.segments),
        'response_time_s': finite(metrics.response_time_s),
        'waiting_time_s': finite(metrics.waiting_time_s),
        'utility': metrics.utility,
    }


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """A task as a controller receives it on its ``task`` topic.

    The message is either the plain task text, or a JSON object ``{"task": ..., "task_id":
    ..., "urgency": ..., "tuf": {"ert_s": ..., "alpha": ..., "beta": ...}}`` (what
    ``lrtrace_replayer`` sends, so that a workload's TUF classes and TUFs reach the planner).
    An empty ``urgency`` means the controller's own ``urgency`` parameter.
    """

    task: str
    task_id: str = ''
    urgency: str = ''
    tuf: Tuf | None = None


def task_payload(task: str, task_id: str = '', urgency: str = '', tuf: Tuf | None = None) -> str:
    """The ``task`` topic message of a task with an id, a TUF class and a TUF."""
    fields: dict[str, Any] = {'task': task}
    if task_id:
        fields['task_id'] = task_id
    if urgency:
        fields['urgency'] = urgency
    if tuf is not None:
        fields['tuf'] = {'ert_s': tuf.ert_s, 'alpha': tuf.alpha, 'beta': tuf.beta}
    return json.dumps(fields)


def parse_task(text: str) -> TaskRequest:
    """Read a ``task`` topic message: plain text, or the JSON object of :func:`task_payload`.

    Raises:
        GoalError: a JSON task object with missing or invalid fields (TufError for the TUF).
    """
    if not text.lstrip().startswith('{'):
        return TaskRequest(task=text)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        return TaskRequest(task=text)      # plain text that happens to start with a brace
    if not isinstance(fields, dict):
        return TaskRequest(task=text)
    task = fields.get('task')
    if not isinstance(task, str):
        raise GoalError(f'task message {text!r} has no "task" text')
    tuf = None
    if fields.get('tuf') is not None:
        raw = fields['tuf']
        try:
            tuf = Tuf(beta=float(raw['beta']), ert_s=float(raw['ert_s']),
                      alpha=float(raw['alpha']))
        except (KeyError, TypeError, ValueError) as err:
            raise GoalError(f'task message {text!r}: bad "tuf": {err!r}') from None
    return TaskRequest(task=task, task_id=str(fields.get('task_id', '')),
                       urgency=str(fields.get('urgency', '')), tuf=tuf)


def goal_to_msg(robot_id: str, robot_kind: str, request: TaskRequest, default_urgency: str,
                cls: type, tuf_cls: type) -> Any:
    """A received task → the PlanTask goal a controller sends (waiting for execution)."""
    goal = cls(robot_id=robot_id, robot_kind=robot_kind, task=request.task,
               urgency=request.urgency or default_urgency, wait_for_execution=True)
    if request.tuf is not None:
        goal.has_tuf = True
        goal.tuf = tuf_to_msg(request.tuf, tuf_cls)
    return goal


def _extras(task_id: str, queued_s: float | None) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if task_id:
        extras['task_id'] = task_id
    if queued_s is not None:
        extras['queued_s'] = float(queued_s)
    return extras


def result_report(robot_id: str, robot_kind: str, result: Any, task_id: str = '',
                  queued_s: float | None = None) -> str:
    """A PlanTask result as the JSON line controllers publish on ``plan_results``
    (``task_id`` and ``queued_s``, the time the task waited in the controller's queue, are
    added when given)."""
    return json.dumps({
        'robot_id': robot_id, 'robot_kind': robot_kind, 'success': bool(result.success),
        'error': result.error, 'segment_count': int(result.segment_count),
        'response_time_s': float(result.response_time_s),
        'waiting_time_s': float(result.waiting_time_s), 'utility': float(result.utility),
        **_extras(task_id, queued_s)})


def rejection_report(robot_id: str, task_id: str = '', queued_s: float | None = None,
                     reason: str = '') -> str:
    """The ``plan_results`` line of a goal the planner rejected (or could not be sent)."""
    return json.dumps({'robot_id': robot_id, 'success': False,
                       'error': f'rejected: {reason}' if reason else 'rejected',
                       **_extras(task_id, queued_s)})


def refusal_report(robot_id: str, task_id: str, reason: str) -> str:
    """The ``plan_results`` line of a task the controller refused (its queue was full, or the
    task message was invalid); ``error`` starts with ``refused:``."""
    return json.dumps({'robot_id': robot_id, 'success': False, 'error': f'refused: {reason}',
                       **_extras(task_id, None)})


def parse_report(text: str) -> dict[str, Any]:
    """Read a ``plan_results`` line back (raises ValueError on anything else)."""
    report = json.loads(text)
    if not isinstance(report, dict) or 'robot_id' not in report or 'success' not in report:
        raise ValueError(f'not a plan result report: {text!r}')
    return report
