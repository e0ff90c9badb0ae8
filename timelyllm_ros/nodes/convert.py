"""Message ⇄ core translations of the ROS layer (no rclpy import: testable without ROS).

Message classes are passed in, so the same helpers serve the generated interfaces and tests.
Core times are float seconds on the planner's clock; ROS stamps are ROS time, and
``origin_s`` is the ROS time of the planner clock's zero (0 in the nodes: their core clock
is the node clock).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from timelyllm_ros.core.request import Generation, Segment, TaskStatus
from timelyllm_ros.core.task_record import (
    STAMP_FIELDS,
    STAMP_LIST_FIELDS,
    UNSET_STAMP_SEC,
    task_record_fields,
)
from timelyllm_ros.core.tuf import TUF_CLASSES, Tuf
from timelyllm_ros.errors import GoalError, TimelyError
from timelyllm_ros.evaluation.metrics import task_metrics
from timelyllm_ros.language.plan import Statement
from timelyllm_ros.language.profiles import RobotProfile, clip
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.live.goals import MAX_ROBOT_ID_CHARS as MAX_ID_CHARS
from timelyllm_ros.live.goals import MAX_TASK_CHARS, check_text, check_urgency
from timelyllm_ros.live.service import PlanGoal
from timelyllm_ros.robots.backend import SkillRecord


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
    """PlanTask goal → PlanGoal: the fields as received (the robot kind and urgency stripped,
    an empty urgency the default class), not yet checked: the planner's service checks every
    goal (:func:`timelyllm_ros.live.goals.validate_goal`).

    Raises:
        GoalError: a message that cannot be read at all (TufError: an invalid TUF).
    """
    try:
        kind, urgency = goal.robot_kind, goal.urgency
        return PlanGoal(robot_id=goal.robot_id,
                        robot_kind=kind.strip() if isinstance(kind, str) else kind,
                        task=goal.task,
                        urgency=(urgency.strip() if isinstance(urgency, str) else urgency)
                        or 'normal',
                        tuf=tuf_from_msg(goal.tuf) if goal.has_tuf else None,
                        wait_for_execution=bool(getattr(goal, 'wait_for_execution', True)))
    except TimelyError:
        raise
    except Exception as err:  # noqa: BLE001 -- a goal that cannot be read is refused
        raise GoalError(f'unreadable goal: {type(err).__name__}') from None


def clean_segment_text(text: str) -> str:
    """A segment's text without the separators and blanks around it (the generated text
    keeps them: a plan is the concatenation of its segments' raw texts)."""
    return text.strip(SEGMENT_TEXT_TRIM)


SEGMENT_TEXT_TRIM = ' \t\r\n;'
"""What :func:`clean_segment_text` strips: blanks and the ``;`` statement separator."""


def segment_to_msg(generation: Generation, segment: Segment, origin_s: float, cls: type,
                   time_cls: type) -> Any:
    """A dispatched core segment → Segment message (feedback and the segments topic)."""
    return cls(robot_id=generation.spec.robot_id, goal_id=generation.task_id,
               index=segment.index, text=clean_segment_text(segment.text),
               skills=[c.skill for c in segment.calls], is_last=segment.is_last,
               generated_stamp=stamp(origin_s + segment.cut_time, time_cls),
               estimated_execution_s=segment.estimated_exec_s)


def is_plan_end(msg: Any) -> bool:
    """Whether a Segment message is the marker closing a plan whose last segment was sent
    before its generation ended (:func:`timelyllm_ros.live.service.closing_segment`)."""
    return bool(msg.is_last) and not msg.text and not list(msg.skills)


def task_record_to_msg(generation: Generation, task_id: str, cls: type, tuf_cls: type,
                       time_cls: type) -> Any:
    """An ended goal → its LRTrace ``TaskRecord`` (``task_id``: the sender's id, else the
    planner's); stamps that never happened are LRTrace's unset stamp."""
    return _task_record_msg(task_record_fields(generation, task_id=task_id or None), cls,
                            tuf_cls, time_cls)


@dataclass(frozen=True, slots=True)
class SegmentRun:
    """How a robot ran one received segment (controller clock, seconds)."""

    start_s: float
    end_s: float
    success: bool
    error: str = ''


def robot_task_record_to_msg(robot_id: str, profile: str, request: TaskRequest,
                             default_urgency: str, sent_s: float,
                             segments: Sequence[Any], runs: dict[int, SegmentRun],
                             error: str, done_s: float, cls: type, tuf_cls: type,
                             time_cls: type) -> Any:
    """The ``TaskRecord`` a controller writes for a task whose planner left mid-plan (the
    planner's own record went with it): what the robot saw, its received ``segments``
    (Segment messages) and the ``runs`` of those it executed; the planner's own figures
    (token pieces, token counts, dispatch stamps) stay empty, 0 or unset."""
    urgency = request.urgency or default_urgency
    tuf = request.tuf if request.tuf is not None else TUF_CLASSES[urgency]
    nan = math.nan
    texts = [str(msg.text) for msg in segments]
    ran = [runs.get(int(msg.index)) for msg in segments]
    fields = {
        'robot_id': robot_id, 'task_id': request.task_id, 'profile': profile,
        'task_class': urgency, 'task_type': '', 'task': request.task,
        'tuf': {'ert_s': tuf.ert_s, 'alpha': tuf.alpha, 'beta': tuf.beta},
        'arrival_stamp': sent_s, 'prompt_tokens': 0, 'task_tokens': 0,
        # token counts are the planner's: 0 (one per segment, as readers expect)
        'text': ''.join(texts), 'token_pieces': [], 'cut_tokens': [0] * len(segments),
        'cut_stamps': [seconds(msg.generated_stamp) for msg in segments],
        'dispatch_stamps': [nan] * len(segments),
        'start_stamps': [run.start_s if run else nan for run in ran],
        'end_stamps': [run.end_s if run else nan for run in ran],
        'estimated_execution_s': [float(msg.estimated_execution_s) for msg in segments],
        'segment_texts': texts,
        'segment_success': [bool(run and run.success) for run in ran],
        'segment_errors': [run.error if run else '' for run in ran],
        'status': TaskStatus.FAILED.name, 'finish_reason': '', 'error': error,
        'suspensions': 0, 'preemptions': 0, 'done_stamp': done_s,
    }
    return _task_record_msg(fields, cls, tuf_cls, time_cls)


def _task_record_msg(fields: dict[str, Any], cls: type, tuf_cls: type,
                     time_cls: type) -> Any:
    def record_stamp(seconds_: float) -> Any:
        if math.isnan(seconds_):
            return time_cls(sec=UNSET_STAMP_SEC, nanosec=0)
        return stamp(seconds_, time_cls)

    for name in STAMP_FIELDS:
        fields[name] = record_stamp(fields[name])
    for name in STAMP_LIST_FIELDS:
        fields[name] = [record_stamp(t) for t in fields[name]]
    fields['tuf'] = tuf_cls(**fields['tuf'])
    return cls(**fields)


def statements_from_text(profile: RobotProfile, text: str) -> tuple[Statement, ...]:
    """Parse a received segment's text back into statements (robots execute statements).

    Never raises anything but GoalError, whatever the text (the segmenter never raises).

    Raises:
        GoalError: the text is not text, or holds a malformed statement or none at all.
    """
    if not isinstance(text, str):
        raise GoalError(f'segment text must be text, got {type(text).__name__}')
    cuts = segment_text(profile, text)
    rejected = [s for cut in cuts for s in cut.rejected]
    if rejected:
        raise GoalError(f'segment {clip(text)}: {clip(rejected[0].text)}: '
                        f'{rejected[0].error}')
    statements = tuple(s for cut in cuts for s in cut.statements)
    if not statements:
        raise GoalError(f'segment {clip(text)} holds no executable statement')
    return statements


def segment_from_msg(profile: RobotProfile, msg: Any) -> Segment:
    """Segment message → a core Segment the skill executor can run.

    Raises:
        GoalError: a malformed or empty text (see :func:`statements_from_text`), a
            non-finite or negative estimate, or any other failure to read the message.
    """
    try:
        statements = statements_from_text(profile, msg.text)
        estimate = float(msg.estimated_execution_s)
        if not math.isfinite(estimate) or estimate < 0:
            raise GoalError(f'segment {clip(msg.text)}: estimated execution time {estimate} '
                            'is not a finite number >= 0')
        return Segment(index=int(msg.index), text=msg.text, statements=statements,
                       cut_time=seconds(msg.generated_stamp),
                       dispatch_time=seconds(msg.generated_stamp),
                       estimated_exec_s=estimate, tokens=0, is_last=bool(msg.is_last))
    except GoalError:
        raise
    except Exception as err:  # noqa: BLE001 -- a segment that cannot be read is refused
        raise GoalError(f'unreadable segment message: {type(err).__name__}') from None


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
    """A task as a controller receives it on its ``task`` topic (a ``Task`` message).

    An empty ``urgency`` means the controller's own ``urgency`` parameter.
    """

    task: str
    task_id: str = ''
    urgency: str = ''
    tuf: Tuf | None = None


def task_to_msg(request: TaskRequest, cls: type, tuf_cls: type) -> Any:
    """A task → the ``Task`` message a sender publishes to a robot's ``task`` topic."""
    msg = cls(task_id=request.task_id, task=request.task, urgency=request.urgency)
    if request.tuf is not None:
        msg.has_tuf = True
        msg.tuf = tuf_to_msg(request.tuf, tuf_cls)
    return msg


def task_from_msg(msg: Any) -> TaskRequest:
    """Read a ``Task`` message, every field checked at the edge.

    The task text must be non-empty, at most :data:`MAX_TASK_CHARS` characters, with no
    control character or lone surrogate; the id at most :data:`MAX_ID_CHARS`; the urgency
    empty or a known TUF class; the TUF (when ``has_tuf``) valid. Reasons quote the offending
    text cut to about 64 characters.

    Raises:
        GoalError: any message that cannot be read as a task (TufError for an invalid TUF);
            nothing else is raised.
    """
    try:
        tuf = tuf_from_msg(msg.tuf) if msg.has_tuf else None
        return TaskRequest(task=check_text('task text', msg.task, MAX_TASK_CHARS),
                           task_id=check_text('task id', msg.task_id, MAX_ID_CHARS,
                                              empty=True),
                           urgency=check_urgency(msg.urgency), tuf=tuf)
    except GoalError:
        raise
    except Exception as err:  # noqa: BLE001 -- last resort: every failure is a GoalError
        raise GoalError(f'unreadable task message: {type(err).__name__}') from None


def goal_to_msg(robot_id: str, robot_kind: str, request: TaskRequest, default_urgency: str,
                cls: type, tuf_cls: type) -> Any:
    """A received task → the PlanTask goal a controller sends (waiting for execution)."""
    goal = cls(robot_id=robot_id, task_id=request.task_id, robot_kind=robot_kind,
               task=request.task,
               urgency=request.urgency or default_urgency, wait_for_execution=True)
    if request.tuf is not None:
        goal.has_tuf = True
        goal.tuf = tuf_to_msg(request.tuf, tuf_cls)
    return goal


Outcome = str
"""How a task ended: one of ``PlanResult``'s constants (succeeded, failed, canceled,
rejected, refused)."""

REJECTED_PREFIX = 'rejected: '
"""Start of a PlanTask result's error when the planner refused the goal before planning
it (accept-then-abort: the action client learns why from the result)."""


def outcome_of(status: int, result: Any) -> Outcome:
    """The outcome of a PlanTask goal from its final status (``action_msgs/GoalStatus``
    value: 4 succeeded, 5 canceled, 6 aborted) and result."""
    if result.success:
        return 'succeeded'
    if str(result.error).startswith(REJECTED_PREFIX):
        return 'rejected'
    return 'canceled' if status == 5 else 'failed'


def plan_result_to_msg(cls: type, time_cls: type, *, stamp_s: float, robot_id: str,
                       robot_kind: str, task_id: str, outcome: Outcome, queued_s: float = 0.0,
                       error: str = '', result: Any = None,
                       streamed: Sequence[str] = ()) -> Any:
    """The ``PlanResult`` a controller publishes when a task ends: from the goal's PlanTask
    ``result`` when there is one, else from ``error`` and the segment texts that had
    ``streamed`` in (refused, or the planner left mid-plan)."""
    msg = cls(stamp=stamp(stamp_s, time_cls), robot_id=robot_id, robot_kind=robot_kind,
              task_id=task_id, outcome=outcome, success=outcome == 'succeeded', error=error,
              response_time_s=-1.0, waiting_time_s=-1.0, utility=0.0,
              queued_s=float(queued_s), plan=''.join(streamed), segment_count=len(streamed))
    if result is not None:
        msg.error = error or str(result.error)
        msg.plan = str(result.plan)
        msg.segment_count = int(result.segment_count)
        msg.response_time_s = float(result.response_time_s)
        msg.waiting_time_s = float(result.waiting_time_s)
        msg.utility = float(result.utility)
    return msg


PLAN_RESULT_FIELDS = ('robot_id', 'robot_kind', 'task_id', 'outcome', 'success', 'error',
                      'plan', 'segment_count', 'response_time_s', 'waiting_time_s', 'utility',
                      'queued_s')


def plan_result_fields(msg: Any) -> dict[str, Any]:
    """A ``PlanResult`` message as a plain dict (stamp left out), for summaries and JSON."""
    return {name: getattr(msg, name) for name in PLAN_RESULT_FIELDS}


def rejection_to_msg(cls: type, time_cls: type, stamp_s: float, robot_id: object,
                     task_id: object, reason: str) -> Any:
    """The ``PlanRejection`` of a refused goal (ids that are not text are sent empty)."""
    return cls(stamp=stamp(stamp_s, time_cls),
               robot_id=robot_id if isinstance(robot_id, str) else '',
               task_id=task_id if isinstance(task_id, str) else '', reason=reason)
