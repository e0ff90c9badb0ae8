"""Whether a statement may be executed on a robot: the profile's rules, re-checked.

The parser checks text as it parses it; these functions check statement trees and calls that
did not come from it (a received segment, a call built by hand) with the same rules, before a
robot backend or the executor runs them.
"""

from __future__ import annotations

from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.profiles import RobotProfile, clip


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
