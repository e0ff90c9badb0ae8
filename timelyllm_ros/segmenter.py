"""Incremental segmentation of streamed LLM output into executable segments (TimelyLLM §4.2).

TimelyLLM does not wait for a whole plan: the moment the detokenized output contains a complete,
executable statement, the text generated so far is cut into a *segment*, the segment is
dispatched to the robot and the generation of that request is suspended until the robot nears
the end of the segment. This module finds those cut points.

A :class:`Segmenter` is fed the newly detokenized text after every decoding step and answers
with a :class:`Cut` when one or more statements completed. The rule depends on the profile's
``segmentation``:

* ``skills`` -- a TypeFly MiniSpec-like skill language. Statements are separated by ``;`` or a
  newline. A simple statement ``short(args)`` is complete the moment its ``)`` balances the
  opening ``(``; a conditional ``?COND{BODY}`` and a loop ``N{BODY}`` are complete at the ``}``
  matching their first ``{``. Completed statements are validated against the profile (known
  skill, argument count, typed, finite arguments within the robot's limits, a condition that
  calls a query skill, loop counts up to ``max_loop_count``, nesting up to
  ``max_nesting_depth``, number literals up to ``MAX_NUMBER_CHARS`` characters); malformed
  ones are rejected, never dispatched. Nothing a model writes makes the segmenter raise: the
  parser checks the nesting depth before it descends, and an unexpected failure while
  validating one statement rejects that statement.
* ``sentence`` -- chatbot answers: a sentence ends at ``.``, ``!`` or ``?`` (plus closing quotes
  or brackets) once the following whitespace arrived.
* ``paragraph`` -- chatbot answers cut at blank lines.

The scanner is incremental: each :meth:`Segmenter.feed` costs O(len(delta)) plus the validation
of the statements it completes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from timelyllm_ros.errors import SegmentationError
from timelyllm_ros.plan import SkillCall, Statement
from timelyllm_ros.profiles import MAX_NUMBER_CHARS, RobotProfile, clip

CutReason = Literal['skill', 'sentence', 'paragraph', 'eos', 'length']
FinishReason = Literal['eos', 'length']

_CLOSER = {'(': ')', '[': ']', '{': '}'}
_NONSPACE = re.compile(r'[^\s;]')
_SPECIAL = re.compile(r'[()\[\]{};\n\'"]')
_SEPARATOR = re.compile(r'[;\n]')
_IDENT = re.compile(r'[A-Za-z_]\w*')
_WS = re.compile(r'\s*')
_INT = re.compile(r'[+-]?[0-9]+(?![\w.])')
_COMPARISON = re.compile(r'==|!=|<=|>=|<|>')
_LITERAL = re.compile(
    r"""(?:True|False)(?!\w)|[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?![\w.])|'[^']*'|"[^"]*\""""
)
_SENTENCE_END = re.compile('[.!?][.!?"\'\\)\\]}\u00bb\u201d\u2019]*')
_BLANK_LINE = re.compile(r'\n[^\S\n]*\n')


@dataclass(frozen=True, slots=True)
class Cut:
    """One segment: the output text between two cut points and its executable statements.

    Attributes:
        text: The segment text from the previous cut's end up to ``end``.
        statements: The executable statements of the segment (at least one unless ``final``).
        rejected: Malformed statements met in this segment's text (never dispatched).
        start: Offset of the segment's first character in the whole output.
        end: Offset just past the segment's last character.
        final: Whether :meth:`Segmenter.finish` produced it.
        reason: Why the cut was made: the segmentation rule, or how generation ended.
    """

    text: str
    statements: tuple[Statement, ...]
    rejected: tuple[Statement, ...]
    start: int
    end: int
    final: bool = False
    reason: CutReason = 'skill'

    @property
    def calls(self) -> tuple[SkillCall, ...]:
        """All skill calls of all statements, in order."""
        return tuple(call for statement in self.statements for call in statement.calls)


class _ParseError(Exception):
    """A completed skill statement does not follow the grammar or the profile."""


class _Parser:
    """Recursive-descent parser and validator of one completed skill statement.

    The recursion is bounded: a body deeper than the profile's ``max_nesting_depth`` is
    rejected before the parser descends into it.
    """

    def __init__(self, profile: RobotProfile, text: str) -> None:
        self.profile = profile
        self.s = text
        self.i = 0

    def parse(self) -> Statement:
        """Parse the whole text as one statement; malformed text gives a statement with error.

        Never raises: an unexpected exception while validating gives a rejected statement
        naming it (a last resort; every known malformation has its own message).
        """
        text = self.s.strip()
        try:
            statement = self._statement(0, 1)
            self._ws()
            if self.i < len(self.s):
                raise _ParseError(f'unexpected text after the statement: '
                                  f'{clip(self.s[self.i:])}')
        except _ParseError as err:
            return Statement(text=text, calls=(), error=str(err), kind='skill')
        except Exception as err:  # noqa: BLE001 -- last resort: reject, never raise out
            return Statement(text=text, calls=(), kind='skill',
                             error=f'statement could not be validated: {type(err).__name__}')
        return statement

    def _ws(self) -> bool:
        """Skip whitespace; return whether it held a newline."""
        match = _WS.match(self.s, self.i)
        assert match is not None
        self.i = match.end()
        return '\n' in match.group()

    def _peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ''

    def _expect(self, char: str, after: str) -> None:
        self._ws()
        if self._peek() != char:
            found = repr(self._peek()) if self._peek() else 'the end'
            raise _ParseError(f'expected {char!r} after {after}, found {found}')
        self.i += 1

    def _statement(self, depth: int, repeats: int) -> Statement:
        """Parse one statement (with its nested ones) from the current position.

        Args:
            depth: How many bodies enclose the statement (0 at the top level).
            repeats: How many times the enclosing loops repeat it (their counts multiplied).
        """
        self._ws()
        start = self.i
        char = self._peek()
        if char == '?':
            self.i += 1
            return self._conditional(start, depth, repeats)
        if char and char in '0123456789+-':
            return self._loop(start, depth, repeats)
        if char and (char.isalpha() or char == '_'):
            call = self._call()
            return Statement(text=call.text, calls=(call,))
        raise _ParseError(f'not a statement: unexpected {char!r}' if char else 'empty statement')

    def _conditional(self, start: int, depth: int, repeats: int) -> Statement:
        self._ws()
        if not _IDENT.match(self.s, self.i):
            raise _ParseError("a condition '?' must be followed by a skill call")
        condition = self._call()
        if not self.profile.skill(condition.skill).query:
            raise _ParseError(f'condition must be a query skill, not {condition.short!r}')
        self._ws()
        match = _COMPARISON.match(self.s, self.i)
        op: str | None = None
        value: int | float | str | bool | None = None
        if match is not None:
            op = match.group()
            self.i = match.end()
            self._ws()
            literal = _LITERAL.match(self.s, self.i)
            if literal is None:
                raise _ParseError(f'expected a literal after {op!r} in the condition')
            self.i = literal.end()
            value = _literal_value(literal.group())
        self._expect('{', 'the condition')
        body = self._body(depth + 1, repeats)
        return Statement(text=self.s[start:self.i], calls=(condition, *_flat_calls(body)),
                         kind='conditional', condition_op=op, condition_value=value,
                         condition=condition, body=body)

    def _loop(self, start: int, depth: int, repeats: int) -> Statement:
        count = _INT.match(self.s, self.i)
        if count is None:
            raise _ParseError('a loop count must be a positive integer')
        literal = count.group()
        if len(literal) > MAX_NUMBER_CHARS:
            raise _ParseError(f'a loop count must be at most {self.profile.max_loop_count}, '
                              f'got a {len(literal)}-character number')
        repeat = int(literal)
        if repeat <= 0:
            raise _ParseError(f'a loop count must be a positive integer, got {repeat}')
        limit = self.profile.max_loop_count
        if repeat > limit:
            raise _ParseError(f'a loop count must be at most {limit}, got {repeat}')
        if repeat * repeats > limit:
            raise _ParseError(f'nested loops repeat their body {repeat * repeats} times, more '
                              f'than {limit}')
        self.i = count.end()
        self._expect('{', 'the loop count')
        body = self._body(depth + 1, repeat * repeats)
        return Statement(text=self.s[start:self.i], calls=_flat_calls(body), kind='loop',
                         repeat=repeat, body=body)

    def _body(self, depth: int, repeats: int) -> tuple[Statement, ...]:
        """Parse body statements after ``{`` up to and including the matching ``}``.

        Args:
            depth: The body's nesting depth (1 for the body of a top-level statement),
                checked against the profile's ``max_nesting_depth`` before descending.
            repeats: How many times the enclosing loops repeat the body.
        """
        limit = self.profile.max_nesting_depth
        if depth > limit:
            raise _ParseError(f'nesting deeper than {limit}')
        statements: list[Statement] = []
        while True:
            self._ws()
            while self._peek() == ';':
                self.i += 1
                self._ws()
            if self._peek() == '}':
                self.i += 1
                break
            if not self._peek():
                raise _ParseError("missing '}'")
            statements.append(self._statement(depth, repeats))
            newline = self._ws()
            if self._peek() not in (';', '}') and not newline:
                raise _ParseError(f"expected ';' or '}}' in the body, found {self._peek()!r}")
        if not statements:
            raise _ParseError('empty body')
        return tuple(statements)

    def _call(self) -> SkillCall:
        start = self.i
        ident = _IDENT.match(self.s, self.i)
        if ident is None:
            raise _ParseError(f'expected a skill call, found {self._peek()!r}')
        name = ident.group()
        self.i = ident.end()
        shown = name if len(name) <= 32 else f'{name[:32]}...'
        self._expect('(', repr(shown))
        pieces = self._arguments(shown)
        skill = self.profile.skill_index.get(name)
        if skill is None:
            raise _ParseError(f'unknown skill {clip(name)}')
        for number, piece in enumerate(pieces, 1):
            if _has_bracket(piece):
                raise _ParseError(
                    f'{name}: argument {number} must be a literal, not {clip(piece.strip())}'
                )
        if len(pieces) != len(skill.args):
            wanted = ', '.join(a.name for a in skill.args) or 'none'
            raise _ParseError(
                f'{name} takes {len(skill.args)} argument(s) ({wanted}), got {len(pieces)}'
            )
        args: dict[str, int | float | str] = {}
        for arg, piece in zip(skill.args, pieces, strict=True):
            try:
                args[arg.name] = arg.parse(piece)
            except ValueError as err:
                raise _ParseError(f'{name}: {err}') from None
        return SkillCall(skill=skill.name, short=name, args=args, text=self.s[start:self.i])

    def _arguments(self, name: str) -> list[str]:
        """Split the argument list after ``(`` at top-level commas, up to the matching ``)``."""
        s = self.s
        depth = 0
        quote = ''
        pieces: list[str] = []
        begin = self.i
        for j in range(self.i, len(s)):
            char = s[j]
            if quote:
                if char == quote:
                    quote = ''
            elif char in '\'"':
                quote = char
            elif char in '([{':
                depth += 1
            elif char in ')]}':
                if depth == 0:
                    if char != ')':
                        raise _ParseError(f'{name}: unbalanced {char!r} in the arguments')
                    inner = s[begin:j]
                    if pieces or inner.strip():
                        pieces.append(inner)
                    self.i = j + 1
                    return pieces
                depth -= 1
            elif char == ',' and depth == 0:
                pieces.append(s[begin:j])
                begin = j + 1
        raise _ParseError(f"{name}: missing ')'")


def call_problem(profile: RobotProfile, call: SkillCall) -> str | None:
    """Why one skill call may not be sent to a robot of the profile; ``None`` if it may.

    Checks what the parser checks for a call: a known skill, exactly its arguments, each of
    its type, finite and within the profile's limits. For calls that did not come from this
    segmenter's parser (a received segment, a call built by hand).
    """
    skill = profile.skill_index.get(call.skill)
    if skill is None:
        return f'unknown skill {clip(str(call.skill))}'
    args = call.args if isinstance(call.args, dict) else {}
    if set(args) != {arg.name for arg in skill.args}:
        wanted = ', '.join(a.name for a in skill.args) or 'none'
        got = ', '.join(clip(str(name), 32) for name in args) or 'none'
        return f'{skill.short} takes argument(s) {wanted}, got {got}'
    for arg in skill.args:
        try:
            arg.check_value(args[arg.name])
        except ValueError as err:
            return str(err)
    return None


def statement_problem(profile: RobotProfile, statement: Statement) -> str | None:
    """Why a statement may not be executed on a robot of the profile; ``None`` if it may.

    Re-checks a parsed or hand-built statement tree the way the parser checks text: no parse
    error, every call valid (:func:`call_problem`), loop counts within ``1..max_loop_count``
    (nested counts multiplied), conditions calling a query skill, bodies nested at most
    ``max_nesting_depth`` deep. Never raises.
    """
    try:
        return _statement_problem(profile, statement, 0, 1)
    except Exception as err:  # noqa: BLE001 -- last resort: a problem, never an exception
        return f'statement could not be validated: {type(err).__name__}'


def _statement_problem(profile: RobotProfile, statement: Statement, depth: int,
                       repeats: int) -> str | None:
    if statement.error is not None:
        return f'malformed statement: {statement.error}'
    if depth > profile.max_nesting_depth:
        return f'nesting deeper than {profile.max_nesting_depth}'
    if statement.kind == 'text':
        return None
    repeat = statement.repeat
    if not isinstance(repeat, int) or isinstance(repeat, bool):
        return f'a loop count must be an integer, got {type(repeat).__name__}'
    if statement.kind == 'loop' and not 1 <= repeat <= profile.max_loop_count:
        return f'a loop count must be within 1..{profile.max_loop_count}, got {repeat}'
    repeats *= repeat
    if repeats > profile.max_loop_count:
        return (f'nested loops repeat their body {repeats} times, more than '
                f'{profile.max_loop_count}')
    if statement.kind != 'loop' and repeat != 1:
        return f'only a loop repeats, got repeat={repeat} for a {statement.kind}'
    if statement.kind == 'conditional':
        condition = statement.condition or next(iter(statement.calls), None)
        if condition is None:
            return 'a conditional needs a condition call'
        skill = profile.skill_index.get(condition.skill)
        if skill is not None and not skill.query:
            return f'condition must be a query skill, not {condition.short!r}'
    for call in statement.calls:
        problem = call_problem(profile, call)
        if problem is not None:
            text = str(call.text)
            return f'{text if len(text) <= 64 else clip(text)}: {problem}'
    for child in statement.body:
        problem = _statement_problem(profile, child, depth + 1, repeats)
        if problem is not None:
            return problem
    return None


def _flat_calls(statements: tuple[Statement, ...]) -> tuple[SkillCall, ...]:
    """Every call of the statements, in order."""
    return tuple(call for statement in statements for call in statement.calls)


def _literal_value(literal: str) -> int | float | str | bool:
    """The value of a condition literal matched by ``_LITERAL``.

    Raises:
        _ParseError: A number literal longer than ``MAX_NUMBER_CHARS`` characters.
    """
    if literal in ('True', 'False'):
        return literal == 'True'
    if literal[0] in '\'"':
        return literal[1:-1]
    if len(literal) > MAX_NUMBER_CHARS:
        raise _ParseError(f'number literal longer than {MAX_NUMBER_CHARS} characters '
                          f'({len(literal)}) in the condition')
    return float(literal) if '.' in literal else int(literal)


def _has_bracket(piece: str) -> bool:
    """Whether an argument holds a bracket outside quotes (a nested call or expression)."""
    quote = ''
    for char in piece:
        if quote:
            if char == quote:
                quote = ''
        elif char in '\'"':
            quote = char
        elif char in '()[]{}':
            return True
    return False


class Segmenter:
    """Cuts one request's streamed output into executable segments.

    Attributes:
        rejected: Every malformed statement met so far, in order (never dispatched).
    """

    def __init__(self, profile: RobotProfile) -> None:
        self.profile = profile
        self.rejected: list[Statement] = []
        self._text = ''
        self._pos = 0
        self._cut_end = 0
        self._finished = False
        self._done: list[tuple[int, Statement]] = []
        self._pending: list[tuple[int, Statement]] = []
        # skills-mode scanner state
        self._stmt_start: int | None = None
        self._stack: list[str] = []
        self._quote = ''
        self._braced: bool | None = None
        self._skip_error: str | None = None
        # text-mode scanner state
        self._unit_start = 0

    @property
    def text(self) -> str:
        """Everything fed so far."""
        return self._text

    def feed(self, delta: str) -> Cut | None:
        """Append newly detokenized text and cut when executable statements completed.

        Args:
            delta: The text generated since the previous call.

        Returns:
            A cut holding every executable statement completed since the previous cut (several
            statements completed in one delta make one cut), ending right after the last one;
            ``None`` if no executable statement completed. The text after the cut point stays
            buffered for the next segment. Malformed statements are returned in the
            ``rejected`` of the cut whose text holds them, and collected in :attr:`rejected`.

        Raises:
            SegmentationError: After :meth:`finish`.
        """
        if self._finished:
            raise SegmentationError('feed() after finish(): the generation has ended')
        if not delta:
            return None
        self._text += delta
        mode = self.profile.segmentation
        if mode == 'skills':
            self._scan_skills()
            reason: CutReason = 'skill'
        elif mode == 'sentence':
            self._scan_sentences()
            reason = 'sentence'
        else:
            self._scan_paragraphs()
            reason = 'paragraph'
        if not self._done:
            return None
        return self._make_cut(self._done[-1][0], final=False, reason=reason)

    def finish(self, reason: FinishReason = 'eos') -> Cut:
        """End of generation: the rest of the output forms the final cut.

        A trailing incomplete skill statement (unbalanced brackets, unterminated quote, missing
        ``)``) is rejected; in the text modes the remaining non-whitespace text is a final text
        statement.

        Args:
            reason: ``eos`` when the model stopped, ``length`` when the token limit cut it.

        Returns:
            The final cut (``final=True``), covering the output up to its end.

        Raises:
            SegmentationError: When called twice.
        """
        if self._finished:
            raise SegmentationError('finish() called twice')
        self._finished = True
        end = len(self._text)
        if self.profile.segmentation == 'skills':
            if self._stmt_start is not None:
                start = self._stmt_start
                if self._skip_error is not None:
                    error = self._skip_error
                else:
                    error = f'incomplete statement at end of generation ({reason})'
                    detail = self._incomplete_detail()
                    if detail:
                        error += f': {detail}'
                self._reject(start, Statement(text=self._text[start:].strip(), calls=(),
                                              error=error))
                self._reset_statement()
        else:
            rest = self._text[self._unit_start:].strip()
            if rest:
                self._done.append((end, Statement(text=rest, calls=(), kind='text')))
        return self._make_cut(end, final=True, reason=reason)

    # -- internals -------------------------------------------------------------------------

    def _make_cut(self, end: int, *, final: bool, reason: CutReason) -> Cut:
        start = self._cut_end
        rejected = tuple(st for pos, st in self._pending if pos < end or final)
        self._pending = [] if final else [(p, st) for p, st in self._pending if p >= end]
        cut = Cut(
            text=self._text[start:end],
            statements=tuple(st for _, st in self._done),
            rejected=rejected,
            start=start,
            end=end,
            final=final,
            reason=reason,
        )
        self._done = []
        self._cut_end = end
        return cut

    def _reject(self, start: int, statement: Statement) -> None:
        self._pending.append((start, statement))
        self.rejected.append(statement)

    def _reset_statement(self) -> None:
        self._stmt_start = None
        self._stack.clear()
        self._quote = ''
        self._braced = None
        self._skip_error = None

    def _incomplete_detail(self) -> str:
        if self._quote:
            return f'unterminated quote {self._quote}'
        if len(self._stack) > 8:
            return f'missing {len(self._stack)} closing brackets'
        if self._stack:
            return 'missing ' + ', '.join(repr(c) for c in reversed(self._stack))
        return ''

    def _complete(self, start: int, end: int) -> None:
        statement = _Parser(self.profile, self._text[start:end]).parse()
        if statement.executable:
            self._done.append((end, statement))
        else:
            self._reject(start, statement)
        self._reset_statement()

    def _reject_at_separator(self, start: int, sep: int, error: str | None) -> None:
        raw = self._text[start:sep]
        if error is None:
            parsed = _Parser(self.profile, raw).parse()
            error = parsed.error or 'incomplete statement'
        self._reject(start, Statement(text=raw.strip(), calls=(), error=error))
        self._reset_statement()

    def _scan_skills(self) -> None:
        text = self._text
        n = len(text)
        i = self._pos
        while i < n:
            if self._quote:
                close = text.find(self._quote, i)
                newline = text.find('\n', i, close if close >= 0 else n)
                if newline >= 0:
                    assert self._stmt_start is not None
                    self._reject_at_separator(self._stmt_start, newline,
                                              'unterminated quote at the end of the line')
                    i = newline + 1
                elif close < 0:
                    i = n
                else:
                    self._quote = ''
                    i = close + 1
                continue
            if self._skip_error is not None:
                sep = _SEPARATOR.search(text, i)
                if sep is None:
                    i = n
                else:
                    assert self._stmt_start is not None
                    self._reject_at_separator(self._stmt_start, sep.start(), self._skip_error)
                    i = sep.end()
                continue
            if self._stmt_start is None:
                first = _NONSPACE.search(text, i)
                if first is None:
                    i = n
                    continue
                i = first.start()
                self._stmt_start = i
                self._braced = True if text[i] == '?' else None
            special = _SPECIAL.search(text, i)
            if special is None:
                i = n
                continue
            j = special.start()
            char = text[j]
            i = j + 1
            if char in '\'"':
                self._quote = char
            elif char in '([{':
                if not self._stack and self._braced is None:
                    self._braced = char == '{'
                self._stack.append(_CLOSER[char])
            elif char in ')]}':
                if not self._stack:
                    self._skip_error = f'unbalanced {char!r}'
                elif self._stack[-1] != char:
                    self._skip_error = f'mismatched {char!r} (expected {self._stack[-1]!r})'
                    self._stack.clear()
                else:
                    self._stack.pop()
                    if not self._stack and (char == '}') == bool(self._braced) and char != ']':
                        assert self._stmt_start is not None
                        self._complete(self._stmt_start, i)
            elif not self._stack:  # ';' or newline at top level ends an unfinished statement
                assert self._stmt_start is not None
                self._reject_at_separator(self._stmt_start, j, None)
        self._pos = n

    def _scan_sentences(self) -> None:
        text = self._text
        n = len(text)
        pos = self._pos
        for match in _SENTENCE_END.finditer(text, pos):
            end = match.end()
            if end == n:
                pos = match.start()
                break
            pos = end
            if text[end].isspace():
                sentence = text[self._unit_start:end].strip()
                self._done.append((end, Statement(text=sentence, calls=(), kind='text')))
                self._unit_start = end
        else:
            pos = n
        self._pos = pos

    def _scan_paragraphs(self) -> None:
        text = self._text
        n = len(text)
        pos = self._pos
        for match in _BLANK_LINE.finditer(text, pos):
            body = text[self._unit_start:match.start()]
            paragraph = body.strip()
            pos = match.end()
            if paragraph:
                end = self._unit_start + len(body.rstrip())
                self._done.append((end, Statement(text=paragraph, calls=(), kind='text')))
                self._unit_start = end
        newline = text.rfind('\n', pos)
        if newline >= 0 and not text[newline + 1:].strip(' \t\r\f\v'):
            self._pos = newline
        else:
            self._pos = n


def segment_text(profile: RobotProfile, text: str, reason: FinishReason = 'eos') -> list[Cut]:
    """Segment a whole output offline: feed it in one piece, then finish.

    Args:
        profile: The robot profile whose segmentation rule applies.
        text: The complete generated text.
        reason: How the generation ended.

    Returns:
        The cuts, the final one last.
    """
    segmenter = Segmenter(profile)
    cuts = []
    cut = segmenter.feed(text)
    if cut is not None:
        cuts.append(cut)
    cuts.append(segmenter.finish(reason))
    return cuts


def segment_pieces(
    profile: RobotProfile, pieces: Sequence[str], reason: FinishReason = 'eos'
) -> list[tuple[int, Cut]]:
    """Feed detokenized token pieces one by one and record after which piece each cut happened.

    Args:
        profile: The robot profile whose segmentation rule applies.
        pieces: The text of each generated token, in order.
        reason: How the generation ended.

    Returns:
        ``(index of the piece after which the cut was made, cut)`` pairs; the final cut gets
        index ``len(pieces) - 1``.
    """
    segmenter = Segmenter(profile)
    out: list[tuple[int, Cut]] = []
    for index, piece in enumerate(pieces):
        cut = segmenter.feed(piece)
        if cut is not None:
            out.append((index, cut))
    out.append((len(pieces) - 1, segmenter.finish(reason)))
    return out
