"""A parsed plan's data types: skill calls and the statements that hold them.

The segmenter (:mod:`timelyllm_ros.language.segmenter`) builds them from the LLM's text, the
robots' executor runs them; plain data, so the lowest modules (:mod:`timelyllm_ros.core.request`)
can hold them without depending on the parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StatementKind = Literal['skill', 'conditional', 'loop', 'text']

__all__ = ['SkillCall', 'Statement', 'StatementKind']


@dataclass(frozen=True, slots=True)
class SkillCall:
    """One validated call of a robot skill.

    Attributes:
        skill: Canonical skill name (``Skill.name``).
        short: The skill identifier as written in the output (short form, name or alias).
        args: Typed, validated argument values by argument name.
        text: The call's text as written, e.g. ``mf(50)``.
    """

    skill: str
    short: str
    args: dict[str, int | float | str]
    text: str


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of the output: a top-level one, or one nested in a conditional or loop.

    Attributes:
        text: The stripped statement text.
        calls: Every skill call in it, in order, nested ones included (a conditional's
            condition first, then its body): what to validate and what the estimates count.
        error: Why the statement is malformed; ``None`` when it is valid.
        kind: ``skill`` (one call), ``conditional``, ``loop`` or ``text`` (chatbot).
        repeat: The loop count when ``kind == 'loop'``, else 1.
        condition_op: For a conditional, the comparison of its condition (``==``, ``!=``,
            ``<``, ``<=``, ``>``, ``>=``); ``None`` for a bare condition (truthy) and for
            other kinds.
        condition_value: For a conditional with a comparison, the literal compared with
            (``True``/``False``, a number or a string); else ``None``.
        condition: For a parsed conditional, its condition call (``calls[0]``); else ``None``.
        body: For a parsed conditional or loop, the statements of its body in order, each
            with its own kind, repeat, condition and body; empty for other kinds and for
            statements built by hand from a flat call list.
    """

    text: str
    calls: tuple[SkillCall, ...]
    error: str | None = None
    kind: StatementKind = 'skill'
    repeat: int = 1
    condition_op: str | None = None
    condition_value: int | float | str | bool | None = None
    condition: SkillCall | None = None
    body: tuple[Statement, ...] = ()

    @property
    def executable(self) -> bool:
        """Whether the statement may be dispatched to the robot."""
        return self.error is None and (bool(self.calls) or self.kind == 'text')
