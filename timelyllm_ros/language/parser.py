"""The parser of one completed statement of the robots' skill language (TimelyLLM §4.2).

The language is TypeFly MiniSpec-like: a simple statement ``short(args)``, a conditional
``?COND{BODY}`` and a loop ``N{BODY}``. :func:`parse_statement` turns the text of one
statement the segmenter found complete into a :class:`~timelyllm_ros.language.plan.Statement`,
checked against the robot's profile as it parses (known skill, argument count, typed, finite
arguments within the robot's limits, a condition that calls a query skill, loop counts up to
``max_loop_count``, nesting up to ``max_nesting_depth``, number literals up to
``MAX_NUMBER_CHARS`` characters). Malformed text gives a statement with its ``error`` set;
nothing a model writes makes it raise: the depth is checked before the parser descends.
"""

from __future__ import annotations

import re

from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.profiles import MAX_NUMBER_CHARS, RobotProfile, clip

_IDENT = re.compile(r'[A-Za-z_]\w*')
_WS = re.compile(r'\s*')
_INT = re.compile(r'[+-]?[0-9]+(?![\w.])')
_COMPARISON = re.compile(r'==|!=|<=|>=|<|>')
_LITERAL = re.compile(
    r"""(?:True|False)(?!\w)|[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?![\w.])|'[^']*'|"[^"]*\""""
)


class _ParseError(Exception):
    """A completed skill statement does not follow the grammar or the profile."""


class StatementParser:
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


def parse_statement(profile: RobotProfile, text: str) -> Statement:
    """One completed statement, parsed and checked against the profile (never raises)."""
    return StatementParser(profile, text).parse()
