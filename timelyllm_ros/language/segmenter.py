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
  matching their first ``{``. Completed statements are parsed and checked against the profile
  by :mod:`timelyllm_ros.language.parser`; malformed ones are rejected, never dispatched. Nothing a
  model writes makes the segmenter raise.
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
from timelyllm_ros.language.parser import parse_statement
from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.profiles import RobotProfile

CutReason = Literal['skill', 'sentence', 'paragraph', 'eos', 'length']
FinishReason = Literal['eos', 'length']

_CLOSER = {'(': ')', '[': ']', '{': '}'}
_NONSPACE = re.compile(r'[^\s;]')
_SPECIAL = re.compile(r'[()\[\]{};\n\'"]')
_SEPARATOR = re.compile(r'[;\n]')
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

    @property
    def between_statements(self) -> bool:
        """Whether nothing but separators (``;``, whitespace) came since the last cut: the
        next statement has not begun (or the output has none yet)."""
        return _NONSPACE.search(self._text, self._cut_end) is None

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
        statement = parse_statement(self.profile, self._text[start:end])
        if statement.executable:
            self._done.append((end, statement))
        else:
            self._reject(start, statement)
        self._reset_statement()

    def _reject_at_separator(self, start: int, sep: int, error: str | None) -> None:
        raw = self._text[start:sep]
        if error is None:
            parsed = parse_statement(self.profile, raw)
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
