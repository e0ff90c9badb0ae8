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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from timelyllm_ros.errors import GoalError, ProfileError, TimelyError
from timelyllm_ros.goals import MAX_ROBOT_ID_CHARS as MAX_ID_CHARS
from timelyllm_ros.goals import MAX_TASK_CHARS, UNREADABLE_CHARS
from timelyllm_ros.metrics import task_metrics
from timelyllm_ros.plan import Statement
from timelyllm_ros.profiles import RobotProfile, check_profile_name, clip
from timelyllm_ros.request import Generation, Segment, TaskStatus
from timelyllm_ros.robots.backend import SkillRecord
from timelyllm_ros.segmenter import segment_text
from timelyllm_ros.service import PlanGoal
from timelyllm_ros.tuf import TUF_CLASSES, Tuf

MAX_TASK_MESSAGE_BYTES = 64 * 1024
"""Largest ``task`` topic message read (UTF-8 bytes); longer ones are refused unparsed."""


MAX_JSON_NUMBER_CHARS = 32
"""Longest number literal in a JSON task message."""



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


def check_text(what: str, text: object, max_chars: int, *, empty: bool = False) -> str:
    """Check one text field received from outside.

    Args:
        what: The field's name, for the message.
        text: The received value.
        max_chars: Its longest allowed length.
        empty: Whether an empty (or blank) text is allowed.

    Returns:
        The text, unchanged.

    Raises:
        GoalError: not a string, empty or blank (unless allowed), longer than ``max_chars``,
            or holding a control character (other than tab, newline, carriage return) or a
            lone surrogate; the reason quotes the text cut to about 64 characters.
    """
    if not isinstance(text, str):
        raise GoalError(f'the {what} must be text, got {type(text).__name__}')
    if len(text) > max_chars:
        raise GoalError(f'the {what} is longer than {max_chars} characters ({len(text)})')
    if not empty and not text.strip():
        raise GoalError(f'the {what} is empty')
    bad = UNREADABLE_CHARS.search(text)
    if bad is not None:
        kind = 'a lone surrogate' if bad.group() >= '\ud800' else 'a control character'
        raise GoalError(f'the {what} {clip(text)} holds {kind} at {bad.start()}')
    return text


def check_urgency(urgency: object) -> str:
    """The urgency (TUF class) of a goal: ``''`` (the default) or one of the known classes.

    Raises:
        GoalError: anything else, quoting it cut to about 64 characters.
    """
    if not isinstance(urgency, str):
        raise GoalError(f'the urgency must be text, got {type(urgency).__name__}')
    name = urgency.strip()
    if name and name not in TUF_CLASSES:
        raise GoalError(f'unknown urgency {clip(urgency)}; known: {", ".join(TUF_CLASSES)}')
    return name


def goal_from_msg(goal: Any) -> PlanGoal:
    """PlanTask goal → PlanGoal, with every field checked at the edge.

    Raises:
        GoalError: a missing or invalid robot id, robot kind (a profile name, never a path),
            task text or urgency (TufError: an invalid TUF); any other failure to read the
            message is a GoalError too.
    """
    try:
        robot_id = check_text('robot id', goal.robot_id, MAX_ID_CHARS, empty=True)
        kind = goal.robot_kind
        if isinstance(kind, str) and not kind.strip():
            raise GoalError(f'{robot_id}: the goal names no robot kind')
        try:
            kind = check_profile_name(kind.strip() if isinstance(kind, str) else kind)
        except ProfileError as err:
            raise GoalError(f'{robot_id}: {err}') from None
        task = check_text('task text', goal.task, MAX_TASK_CHARS, empty=True)
        urgency = check_urgency(goal.urgency) or 'normal'
        tuf = tuf_from_msg(goal.tuf) if goal.has_tuf else None
        return PlanGoal(robot_id=robot_id, robot_kind=kind, task=task, urgency=urgency,
                        tuf=tuf,
                        wait_for_execution=bool(getattr(goal, 'wait_for_execution', True)))
    except TimelyError:
        raise
    except Exception as err:  # noqa: BLE001 -- a goal that cannot be read is refused
        raise GoalError(f'unreadable goal: {type(err).__name__}') from None


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


class _TufFields(BaseModel):
    """The ``tuf`` object of a JSON task message: finite numbers (checked again by Tuf)."""

    model_config = ConfigDict(extra='forbid', strict=True)

    ert_s: float = Field(allow_inf_nan=False)
    alpha: float = Field(allow_inf_nan=False)
    beta: float = Field(allow_inf_nan=False)


class _TaskFields(BaseModel):
    """A JSON task message (unknown keys are ignored)."""

    model_config = ConfigDict(extra='ignore', strict=True)

    task: str
    task_id: str | int = ''
    urgency: str = ''
    tuf: _TufFields | None = None


def _json_number(kind: type) -> Any:
    """A ``json.loads`` hook converting number literals of at most MAX_JSON_NUMBER_CHARS."""
    def convert(literal: str) -> int | float:
        if len(literal) > MAX_JSON_NUMBER_CHARS:
            raise GoalError(f'task message holds a number longer than '
                            f'{MAX_JSON_NUMBER_CHARS} characters ({len(literal)})')
        return kind(literal)

    return convert


def _json_constant(name: str) -> float:
    raise GoalError(f'task message holds {name}: numbers must be finite')


def _load_json(text: str) -> object:
    """The JSON value of a message, or ``None`` when it is not JSON (plain text).

    Raises:
        GoalError: JSON that nests too deeply, or holds an overlong number or NaN/Infinity.
    """
    try:
        return json.loads(text, parse_int=_json_number(int), parse_float=_json_number(float),
                          parse_constant=_json_constant)
    except json.JSONDecodeError:
        return None
    except RecursionError:
        raise GoalError('task message nests too deeply') from None


def _validation_reason(err: ValidationError) -> str:
    """A pydantic error as ``field: message`` pairs, never quoting the input."""
    return '; '.join(
        f"{'.'.join(str(part) for part in e['loc']) or '<root>'}: {e['msg']}"
        for e in err.errors(include_input=False, include_url=False)[:3])


def parse_task(text: str) -> TaskRequest:
    """Read a ``task`` topic message: plain text, or the JSON object of :func:`task_payload`.

    The message is bounded (:data:`MAX_TASK_MESSAGE_BYTES`) before it is parsed; JSON numbers
    are bounded in length and finite; the task text must be non-empty, at most
    :data:`MAX_TASK_CHARS` characters, with no NUL or lone surrogate; the urgency is empty or
    a known TUF class. Reasons quote the message cut to about 64 characters.

    Raises:
        GoalError: any message that cannot be read as a task (TufError for a TUF whose
            values are finite but invalid); nothing else is raised.
    """
    try:
        return _parse_task(text)
    except GoalError:
        raise
    except Exception as err:  # noqa: BLE001 -- last resort: every failure is a GoalError
        raise GoalError(f'unreadable task message: {type(err).__name__}') from None


def _parse_task(text: str) -> TaskRequest:
    if not isinstance(text, str):
        raise GoalError(f'a task message must be text, got {type(text).__name__}')
    if len(text) > MAX_TASK_MESSAGE_BYTES or len(
            text.encode('utf-8', 'surrogatepass')) > MAX_TASK_MESSAGE_BYTES:
        raise GoalError(f'task message larger than {MAX_TASK_MESSAGE_BYTES} bytes')
    fields = _load_json(text) if text.lstrip().startswith('{') else None
    if not isinstance(fields, dict):  # plain text (possibly starting with a brace)
        return TaskRequest(task=check_text('task text', text, MAX_TASK_CHARS))
    if not isinstance(fields.get('task'), str):
        raise GoalError(f'task message {clip(text)} has no "task" text')
    try:
        parsed = _TaskFields.model_validate(fields)
    except ValidationError as err:
        if any(e['loc'][:1] == ('tuf',) for e in err.errors()):
            raise GoalError(f'task message {clip(text)}: bad "tuf": '
                            f'{_validation_reason(err)}') from None
        raise GoalError(f'task message {clip(text)}: {_validation_reason(err)}') from None
    tuf = None
    if parsed.tuf is not None:
        tuf = Tuf(beta=parsed.tuf.beta, ert_s=parsed.tuf.ert_s, alpha=parsed.tuf.alpha)
    return TaskRequest(task=check_text('task text', parsed.task, MAX_TASK_CHARS),
                       task_id=check_text('task id', str(parsed.task_id), MAX_ID_CHARS,
                                          empty=True),
                       urgency=check_urgency(parsed.urgency), tuf=tuf)


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
    """A PlanTask result as the JSON line controllers publish on ``plan_results``, with the
    plan the LLM wrote (``task_id`` and ``queued_s``, the time the task waited in the
    controller's queue, are added when given)."""
    return json.dumps({
        'robot_id': robot_id, 'robot_kind': robot_kind, 'success': bool(result.success),
        'error': result.error, 'plan': str(getattr(result, 'plan', '')),
        'segment_count': int(result.segment_count),
        'response_time_s': float(result.response_time_s),
        'waiting_time_s': float(result.waiting_time_s), 'utility': float(result.utility),
        **_extras(task_id, queued_s)})


def rejection_report(robot_id: str, task_id: str = '', queued_s: float | None = None,
                     reason: str = '') -> str:
    """The ``plan_results`` line of a goal the planner rejected (or could not be sent)."""
    return json.dumps({'robot_id': robot_id, 'success': False,
                       'error': f'rejected: {reason}' if reason else 'rejected',
                       **_extras(task_id, queued_s)})


def failure_report(robot_id: str, task_id: str, queued_s: float | None, reason: str) -> str:
    """The ``plan_results`` line of a task that ended without a PlanTask result (its planner
    left while serving it)."""
    return json.dumps({'robot_id': robot_id, 'success': False, 'error': reason,
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
