"""The skill executor: runs one dispatched segment on a robot backend, skill after skill.

The executor is the robot-side half of a segment's life. It first validates every skill call of
the segment with :meth:`RobotBackend.check` (supported skill, arguments within the robot's
limits) and refuses the whole segment before anything is sent when one call does not pass. It
then performs the statements in order:

* a skill statement performs its call;
* a loop ``N{...}`` performs its body ``N`` times;
* a conditional ``?cond OP literal{...}`` performs the condition call (a perception query such as
  ``iv('cat')``) and the body only when the comparison holds (a bare ``?cond{...}`` holds when the
  result is truthy).

Loops and conditionals nest (``4{tc(90);?iv('keys')==True{tp()}}``): the executor walks the tree
the segmenter parsed (:attr:`Statement.condition` and :attr:`Statement.body`); a statement built
by hand from a flat call list (no body) runs its calls in order, a conditional's first call being
its condition. The first failing skill stops the segment; :class:`SegmentExecution` reports
what ran, with times from the executor's clock, and the failure. Robot failures never raise
out of :meth:`SkillExecutor.execute`: a :class:`~timelyllm_ros.errors.RobotError` or any other
exception from the backend (a vendor client's ``ValueError``, a dead socket) becomes a failed
skill record and a failed segment naming the call and the reason.

Before anything is sent, every statement is re-checked against the robot's profile
(:func:`~timelyllm_ros.language.validation.statement_problem`: finite arguments within the limits,
loop counts, nesting depth, conditions from query skills), whatever built it.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from timelyllm_ros.core.clock import Clock
from timelyllm_ros.core.request import Segment
from timelyllm_ros.errors import RobotError, describe_error
from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.validation import statement_problem
from timelyllm_ros.robots.backend import RobotBackend, SkillRecord
from timelyllm_ros.robots.base import Execution

logger = logging.getLogger(__name__)

ConditionValue = int | float | str | bool | None

_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    '==': operator.eq, '!=': operator.ne, '<': operator.lt, '<=': operator.le,
    '>': operator.gt, '>=': operator.ge,
}
_FALSE_WORDS = frozenset({'', 'false', 'no', '0', 'none', 'null'})
_TRUE_WORDS = frozenset({'true', 'yes', '1'})


@dataclass(slots=True)
class SegmentExecution:
    """How one segment ran on the robot (float seconds on the executor's clock).

    Attributes:
        index: The segment's index in its task.
        start_time: When the executor took the segment.
        end_time: When the last skill ended (or the segment was refused / failed).
        success: Whether every statement ran to completion.
        error: Why the segment failed ('' on success): the skill call and the reason.
        skills: One record per performed skill, in order, the failed one last; empty when
            the segment was refused before anything was sent.
    """

    index: int
    start_time: float
    end_time: float
    success: bool
    error: str = ''
    skills: list[SkillRecord] = field(default_factory=list)

    def to_execution(self) -> Execution:
        """The summary the fleet simulation's :class:`~timelyllm_ros.robots.base.Execution`
        contract reports."""
        return Execution(self.start_time, self.end_time, self.success, self.error)


class _Stop(Exception):
    """Internal: a skill failed, the segment stops."""


def _as_bool(result: object) -> bool:
    if isinstance(result, str):
        word = result.strip().casefold()
        if word in _FALSE_WORDS:
            return False
        if word in _TRUE_WORDS:
            return True
        raise RobotError(f'cannot read {result!r} as True/False')
    return bool(result)


def condition_holds(result: object, op: str | None, value: ConditionValue) -> bool:
    """Evaluate a condition: the condition call's result compared with a literal.

    Args:
        result: What the condition call returned (e.g. ``True`` for ``iv('cat')``).
        op: ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, or ``None`` for "truthy".
        value: The literal on the right-hand side (ignored when ``op`` is ``None``).

    Returns:
        Whether the body runs.

    Raises:
        RobotError: The result cannot be compared with the literal (e.g. text vs. number).
    """
    if op is None:
        return _as_bool(result)
    compare = _OPERATORS.get(op)
    if compare is None:
        raise RobotError(f'unknown comparison {op!r}')
    left: object = result
    right: object = value
    if isinstance(value, bool):
        left = _as_bool(result)
    elif isinstance(value, (int, float)):
        if isinstance(result, bool) or not isinstance(result, (int, float, str)):
            raise RobotError(f'cannot compare {result!r} with the number {value!r}')
        try:
            left = float(result)
        except ValueError:
            raise RobotError(f'cannot compare {result!r} with the number {value!r}') from None
    elif isinstance(value, str):
        left = str(result).strip().casefold()
        right = value.strip().casefold()
    else:
        raise RobotError(f'cannot compare with {value!r}')
    try:
        return bool(compare(left, right))
    except TypeError as err:
        raise RobotError(f'cannot compare {result!r} {op} {value!r}: {err}') from None


class SkillExecutor:
    """Validates and performs segments on one robot backend, recording every skill."""

    def __init__(self, backend: RobotBackend, clock: Clock) -> None:
        """Create an executor.

        Args:
            backend: The robot; connected lazily on the first segment.
            clock: Where start/end times of segments and skills are read.
        """
        self.backend = backend
        self.clock = clock

    def validate(self, statements: Sequence[Statement]) -> None:
        """Check every call of the statements against the backend before anything is sent.

        Raises:
            RobotError: A malformed statement, a statement the profile does not allow (see
                :func:`~timelyllm_ros.language.validation.statement_problem`), an unsupported
                skill or an argument the backend refuses; the message names the call. Any exception
                of the backend's check is reported as a RobotError.
        """
        profile = self.backend.profile
        for statement in statements:
            if statement.error is not None:
                raise RobotError(f'{statement.text}: malformed statement: {statement.error}')
            problem = statement_problem(profile, statement)
            if problem is not None:
                named = problem.startswith(f'{statement.text}: ')
                raise RobotError(problem if named else f'{statement.text}: {problem}')
            for call in statement.calls:
                try:
                    self.backend.check(call)
                except RobotError:
                    raise
                except Exception as err:  # noqa: BLE001 -- a refusal, whatever the backend
                    raise RobotError(f'{call.text}: {describe_error(err, limit=None)}') from None

    def execute(self, segment: Segment) -> SegmentExecution:
        """Validate, then perform the segment's statements in order.

        Args:
            segment: The dispatched segment.

        Returns:
            The execution record. On a refused segment ``skills`` is empty; on a failing
            skill the segment stops there and ``error`` names the call and the reason. Never
            raises for anything the robot or its backend does.
        """
        start = self.clock.now()
        try:
            self.validate(segment.statements)
        except RobotError as err:
            return SegmentExecution(segment.index, start, self.clock.now(), False,
                                    f'segment {segment.index} refused before sending anything: '
                                    f'{err}')
        try:
            self.backend.connect()
        except Exception as err:  # noqa: BLE001 -- robot failures never raise out
            reason = describe_error(err, limit=None)
            return SegmentExecution(segment.index, start, self.clock.now(), False,
                                    f'segment {segment.index}: cannot connect: {reason}')
        records: list[SkillRecord] = []
        try:
            for statement in segment.statements:
                self._run(statement, records)
        except _Stop as stop:
            return SegmentExecution(segment.index, start, self.clock.now(), False, str(stop),
                                    records)
        except Exception as err:  # noqa: BLE001 -- last resort: fail the segment, never raise
            logger.exception('segment %d failed unexpectedly', segment.index)
            reason = describe_error(err, limit=None)
            return SegmentExecution(segment.index, start, self.clock.now(), False,
                                    f'segment {segment.index} failed: {reason}', records)
        return SegmentExecution(segment.index, start, self.clock.now(), True, '', records)

    def _run(self, statement: Statement, records: list[SkillRecord]) -> None:
        """Perform one statement, descending into the body of a conditional or loop."""
        if statement.kind == 'loop':
            for _ in range(statement.repeat):
                self._run_body(statement, statement.calls, records)
        elif statement.kind == 'conditional':
            condition = statement.condition or next(iter(statement.calls), None)
            if condition is None:
                return
            result = self._perform(condition, records)
            try:
                holds = condition_holds(result, statement.condition_op,
                                        statement.condition_value)
            except RobotError as err:
                raise _Stop(f'{condition.text}: condition failed: {err}') from None
            logger.debug('condition %s -> %r %s %r: %s', condition.text, result,
                         statement.condition_op, statement.condition_value, holds)
            if holds:
                self._run_body(statement, statement.calls[1:], records)
        elif statement.kind == 'skill':
            for call in statement.calls:
                self._perform(call, records)

    def _run_body(self, statement: Statement, flat: Sequence[SkillCall],
                  records: list[SkillRecord]) -> None:
        """Perform the body of a conditional or loop: its nested statements, or ``flat`` (its
        body calls) for a statement built by hand without a body."""
        if statement.body:
            for child in statement.body:
                self._run(child, records)
        else:
            for call in flat:
                self._perform(call, records)

    def _perform(self, call: SkillCall, records: list[SkillRecord]) -> object:
        """Perform one call; any exception of the backend is a failed record and stops."""
        begin = self.clock.now()
        try:
            result = self.backend.perform(call)
        except Exception as err:  # noqa: BLE001 -- robot failures never raise out
            reason = describe_error(err, limit=None)
            records.append(SkillRecord(call.skill, call.text, dict(call.args), begin,
                                       self.clock.now(), False, reason))
            prefix = f'{call.text}: '
            raise _Stop(f'{call.text} failed: {reason.removeprefix(prefix)}') from None
        records.append(SkillRecord(call.skill, call.text, dict(call.args), begin,
                                   self.clock.now(), True, '', result))
        return result
