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

Loops and conditionals nest (``4{tc(90);?iv('keys')==True{tp()}}``): the structure is read back
from the statement text, whose calls the segmenter already validated. The first failing skill
stops the segment; :class:`SegmentExecution` reports what ran, with times from the executor's
clock, and the failure. Robot failures never raise out of :meth:`SkillExecutor.execute`.
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from timelyllm_ros.clock import Clock
from timelyllm_ros.errors import ProfileError, RobotError
from timelyllm_ros.request import Segment
from timelyllm_ros.robots.backend import RobotBackend, SkillRecord
from timelyllm_ros.robots.base import Execution
from timelyllm_ros.segmenter import SkillCall, Statement

logger = logging.getLogger(__name__)

ConditionValue = int | float | str | bool | None

_WS = re.compile(r'\s*')
_INT = re.compile(r'[+-]?\d+')
_COMPARISON = re.compile(r'==|!=|<=|>=|<|>')
_LITERAL = re.compile(
    r"""(?:True|False)(?!\w)|[+-]?(?:\d+\.?\d*|\.\d+)(?![\w.])|'[^']*'|"[^"]*\""""
)
_OPERATORS: dict[str, Callable[[object, object], bool]] = {
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


@dataclass(frozen=True, slots=True)
class _Perform:
    call: SkillCall


@dataclass(frozen=True, slots=True)
class _Loop:
    repeat: int
    body: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Conditional:
    condition: SkillCall
    op: str | None
    value: ConditionValue
    body: tuple[_Node, ...]


_Node = _Perform | _Loop | _Conditional


class _Unstructured(Exception):
    """The statement text does not line up with its calls (hand-built statements)."""


class _Stop(Exception):
    """Internal: a skill failed, the segment stops."""


class _StructureReader:
    """Reads the nesting of a validated statement back from its text and its calls."""

    def __init__(self, statement: Statement) -> None:
        self.s = statement.text
        self.i = 0
        self.calls = statement.calls
        self.k = 0

    def read(self) -> _Node:
        node = self._statement()
        self._ws()
        if self.i != len(self.s) or self.k != len(self.calls):
            raise _Unstructured(f'trailing text {self.s[self.i:]!r}')
        return node

    def _ws(self) -> None:
        match = _WS.match(self.s, self.i)
        assert match is not None
        self.i = match.end()

    def _peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ''

    def _expect(self, char: str) -> None:
        self._ws()
        if self._peek() != char:
            raise _Unstructured(f'expected {char!r} at {self.i}')
        self.i += 1

    def _call(self) -> SkillCall:
        self._ws()
        if self.k >= len(self.calls):
            raise _Unstructured('more calls in the text than in the statement')
        call = self.calls[self.k]
        if not self.s.startswith(call.text, self.i):
            raise _Unstructured(f'call {call.text!r} not found at {self.i}')
        self.i += len(call.text)
        self.k += 1
        return call

    def _statement(self) -> _Node:
        self._ws()
        char = self._peek()
        if char == '?':
            self.i += 1
            condition = self._call()
            self._ws()
            op: str | None = None
            value: ConditionValue = None
            comparison = _COMPARISON.match(self.s, self.i)
            if comparison is not None:
                op = comparison.group()
                self.i = comparison.end()
                self._ws()
                literal = _LITERAL.match(self.s, self.i)
                if literal is None:
                    raise _Unstructured('missing literal')
                value = _literal_value(literal.group())
                self.i = literal.end()
            self._expect('{')
            return _Conditional(condition, op, value, self._body())
        if char.isdigit() or char in '+-':
            count = _INT.match(self.s, self.i)
            if count is None:
                raise _Unstructured('bad loop count')
            self.i = count.end()
            self._expect('{')
            return _Loop(int(count.group()), self._body())
        return _Perform(self._call())

    def _body(self) -> tuple[_Node, ...]:
        nodes: list[_Node] = []
        while True:
            self._ws()
            while self._peek() == ';':
                self.i += 1
                self._ws()
            if self._peek() == '}':
                self.i += 1
                return tuple(nodes)
            if not self._peek():
                raise _Unstructured("missing '}'")
            nodes.append(self._statement())


def _literal_value(literal: str) -> int | float | str | bool:
    if literal in ('True', 'False'):
        return literal == 'True'
    if literal[0] in '\'"':
        return literal[1:-1]
    return float(literal) if '.' in literal else int(literal)


def _structure(statement: Statement) -> tuple[_Node, ...]:
    """The statement as a tree of performs, loops and conditionals."""
    calls = statement.calls
    if statement.kind == 'text' or not calls:
        return ()
    if statement.kind == 'skill':
        return tuple(_Perform(call) for call in calls)
    try:
        node = _StructureReader(statement).read()
    except _Unstructured as err:
        # hand-built statements: fall back to the flat call list
        logger.debug('statement %r read flat: %s', statement.text, err)
        if statement.kind == 'loop':
            return (_Loop(statement.repeat, tuple(_Perform(c) for c in calls)),)
        return (_Conditional(calls[0], statement.condition_op, statement.condition_value,
                             tuple(_Perform(c) for c in calls[1:])),)
    if statement.kind == 'conditional' and isinstance(node, _Conditional):
        # the segmenter's parse of the top-level comparison is authoritative
        node = _Conditional(node.condition, statement.condition_op, statement.condition_value,
                            node.body)
    return (node,)


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
            RobotError: A malformed statement, an unsupported skill or an argument outside
                the robot's limits; the message names the call.
        """
        for statement in statements:
            if statement.error is not None:
                raise RobotError(f'{statement.text}: malformed statement: {statement.error}')
            for call in statement.calls:
                try:
                    self.backend.check(call)
                except ProfileError as err:
                    raise RobotError(f'{call.text}: {err}') from None

    def execute(self, segment: Segment) -> SegmentExecution:
        """Validate, then perform the segment's statements in order.

        Args:
            segment: The dispatched segment.

        Returns:
            The execution record. On a refused segment ``skills`` is empty; on a failing
            skill the segment stops there and ``error`` names the call and the reason.
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
        except RobotError as err:
            return SegmentExecution(segment.index, start, self.clock.now(), False,
                                    f'segment {segment.index}: cannot connect: {err}')
        records: list[SkillRecord] = []
        try:
            for statement in segment.statements:
                for node in _structure(statement):
                    self._run(node, records)
        except _Stop as stop:
            return SegmentExecution(segment.index, start, self.clock.now(), False, str(stop),
                                    records)
        return SegmentExecution(segment.index, start, self.clock.now(), True, '', records)

    def _run(self, node: _Node, records: list[SkillRecord]) -> None:
        if isinstance(node, _Perform):
            self._perform(node.call, records)
        elif isinstance(node, _Loop):
            for _ in range(node.repeat):
                for child in node.body:
                    self._run(child, records)
        else:
            result = self._perform(node.condition, records)
            try:
                holds = condition_holds(result, node.op, node.value)
            except RobotError as err:
                raise _Stop(f'{node.condition.text}: condition failed: {err}') from None
            logger.debug('condition %s -> %r %s %r: %s', node.condition.text, result, node.op,
                         node.value, holds)
            if holds:
                for child in node.body:
                    self._run(child, records)

    def _perform(self, call: SkillCall, records: list[SkillRecord]) -> object:
        begin = self.clock.now()
        try:
            result = self.backend.perform(call)
        except RobotError as err:
            reason = str(err)
            records.append(SkillRecord(call.skill, call.text, dict(call.args), begin,
                                       self.clock.now(), False, reason))
            prefix = f'{call.text}: '
            raise _Stop(f'{call.text} failed: {reason.removeprefix(prefix)}') from None
        records.append(SkillRecord(call.skill, call.text, dict(call.args), begin,
                                   self.clock.now(), True, '', result))
        return result
