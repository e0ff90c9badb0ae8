"""Whether a valid plan does what its task asks: ``useful``, ``partly`` or ``useless``.

A plan that parses and runs on a cooperative emulator can still be worthless: it may name
objects the scene does not hold, pick three things at once, or fly a drone's stock opening
whatever was asked. This judge reads a plan against its task and the task's reference plan
(the trace's answer) in a world that is not cooperative:

* **grounded** -- every object a plan names (a skill argument called ``object`` or ``where``)
  is one the task's scene line or its text mentions, or its reference plan uses; an object
  that is not there cannot be seen, reached or picked;
* **the arm's world** -- a robot with a gripper rule (the profile's ``gripper``: the Indy7)
  holds one thing at a time: ``pick`` needs an empty gripper and the arm at that object
  (``move_to`` it first); ``place`` what it holds, where the arm went;
* **flight** -- a robot with a flight rule (the profile's ``flight``: the Tello) does only
  what needs no flight after ``ld()`` until ``to()``, and lands at the plan's top level only;
* **coverage of the reference** -- the share of the reference's skills the plan uses, and of
  its objects the plan names; and its first movement: where the reference opens with a move
  (an evasion, "move up and then ...") another first move makes the plan useless, elsewhere
  only partly useful.

``useful``: grounded, possible, every object of the reference named, every one of its acting
skills used (looking may differ: ``s`` for ``iv``), its first movement the reference's, and for
a robot with a gripper every put of the reference made (that object, at that place: the ball
on the box, not the box on the ball).
``partly``: grounded and possible, and something of the reference in it (a skill beyond the
drone's take-off and landing, or an object). ``useless``: anything else, with the first
reason found. The judge is a rule, stated here and tested: it does not know what the task
means beyond those names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from timelyllm_ros.language.grounding import OBJECT_ARGS, PLACE_PREFIXES, scene_objects, words
from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.profiles import FlightRule, GripperRule, RobotProfile
from timelyllm_ros.language.segmenter import segment_text

Verdict = Literal['useful', 'partly', 'useless']
VERDICTS: tuple[Verdict, ...] = ('useful', 'partly', 'useless')

ROUTINE_SKILLS = frozenset({'takeoff', 'land', 'log', 're_plan'})
"""Skills that say nothing about the task: a drone's opening and closing, a log line."""

PERCEPTION = frozenset({'scan', 'scan_abstract', 'is_visible', 'probe', 'detect', 'check'})
"""Skills that look for something: a plan may look another way than the reference (``s`` for
``iv``). Measuring (``od``, ``ox``, …) answers what a task asks and is required like acting."""

MOVEMENTS = frozenset({'move_forward', 'move_backward', 'move_left', 'move_right', 'move_up',
                       'move_down', 'turn_cw', 'turn_ccw', 'goto', 'move_to'})

_PLACES = frozenset({'near', 'on', 'in', 'into', 'onto', 'the', 'top', 'of', 'under', 'next',
                     'to', 'a', 'an', 'side', 'at', 'behind', 'front', 'above', 'below'})


@dataclass(frozen=True, slots=True)
class Judgement:
    """A plan's verdict and why."""

    verdict: Verdict
    reason: str
    skill_coverage: float      # share of the reference's skills the plan uses
    object_coverage: float     # share of the reference's objects the plan names


def calls_of(statements: Iterable[Statement]) -> list[SkillCall]:
    """Every skill call of a plan, nested ones included, in order."""
    return [call for statement in statements for call in statement.calls]


def plan_calls(profile: RobotProfile, plan: str) -> list[SkillCall]:
    """The skill calls of a plan text (the reference's, for instance), as the segmenter
    reads it with the robot's profile."""
    return calls_of(s for cut in segment_text(profile, plan, 'eos') for s in cut.statements)


def _singular(word: str) -> str:
    return word[:-1] if word.endswith('s') and len(word) > 3 else word


def object_names(calls: Sequence[SkillCall]) -> list[str]:
    """The objects the calls name, in order."""
    return [str(call.args[name]) for call in calls for name in OBJECT_ARGS if name in call.args]


def _name(name: str) -> frozenset[str]:
    """An object name's words, singular, less place words (``near_pencil`` is ``pencil``)."""
    return frozenset(_singular(w) for w in words(name) - _PLACES)


def grounded(name: str, known: set[str]) -> bool:
    """Whether an object name refers to something the task knows: each of its words (less
    place words such as ``near``, digits and punctuation) is one the task mentions."""
    named = words(name) - _PLACES
    return bool(named) and all(w in known or _singular(w) in known for w in named)


def arm_problem(calls: Sequence[SkillCall], gripper: GripperRule | None = None) -> str:
    """Why an arm could not do these calls in order ('' if it could) under its gripper rule
    (default: the Indy7's skill names): one thing held at a time, taken where the arm went,
    put while held where the arm went (``near_x`` and ``on_x`` are at ``x``)."""
    rule = gripper if gripper is not None else GripperRule()
    holding: str | None = None
    at: str | None = None
    for call in calls:
        target = str(call.args.get('object', ''))
        if call.skill == rule.reach:
            at = target
        elif call.skill == rule.take:
            if holding is not None:
                return f'{call.text}: already holding {holding!r}'
            if at != target:
                return f'{call.text}: the arm is not at {target!r} (no {rule.reach} it before)'
            holding = target
        elif call.skill == rule.put:
            if holding != target:
                return (f'{call.text}: places {target!r} while holding '
                        f'{holding!r}' if holding else f'{call.text}: holds nothing')
            where = str(call.args.get('where', ''))
            spot = next((where[len(p):] for p in PLACE_PREFIXES if where.startswith(p)), where)
            if at != spot:
                return f'{call.text}: the arm is not at {spot!r} (no {rule.reach} it before)'
            holding = None
        elif call.skill == rule.open:
            holding = None
    return ''


def flight_problem(statements: Sequence[Statement], rule: FlightRule) -> str:
    """Why a flying robot could not do these statements in order ('' if it could) under its
    flight rule: after landing only the skills done on the ground until it takes off, and no
    landing inside a loop or condition (the drone would fly on after it)."""
    landed_by = ''
    for statement in statements:
        if statement.kind != 'skill' and any(c.skill == rule.land for c in statement.calls):
            return f'{statement.text}: lands inside a loop or condition'
        for call in statement.calls:
            if call.skill == rule.takeoff:
                landed_by = ''
            elif landed_by and call.skill not in rule.on_ground:
                return f'{call.text}: the drone landed at {landed_by} and has not taken off'
            elif call.skill == rule.land:
                landed_by = call.text
    return ''


def _put(call: SkillCall) -> tuple[frozenset[str], frozenset[str]]:
    """What a put call puts where, as the names' words (``near_x`` is at ``x``)."""
    return _name(str(call.args.get('object', ''))), _name(str(call.args.get('where', '')))


def judge_plan(profile: RobotProfile, task: str, reference: str,
               statements: Sequence[Statement]) -> Judgement:
    """The verdict on a plan (its parsed statements) for a task with its reference plan."""
    calls = calls_of(statements)
    ref_calls = plan_calls(profile, reference)
    ref_objects = object_names(ref_calls)
    known = {_singular(w) for w in words(task)} | {
        _singular(w) for name in scene_objects(task) + ref_objects for w in words(name)}
    ref_skills = {c.skill for c in ref_calls} - ROUTINE_SKILLS
    skills = {c.skill for c in calls}
    ref_names = {_name(n) for n in ref_objects} - {frozenset()}
    names = {_name(n) for n in object_names(calls)}
    skill_coverage = len(ref_skills & skills) / len(ref_skills) if ref_skills else 1.0
    object_coverage = len(ref_names & names) / len(ref_names) if ref_names else 1.0

    def verdict(label: Verdict, reason: str) -> Judgement:
        return Judgement(label, reason, round(skill_coverage, 3), round(object_coverage, 3))

    if not calls:
        return verdict('useless', 'no skill call')
    for name in object_names(calls):
        if not grounded(name, known):
            return verdict('useless', f'names {name!r}, which the scene and task do not hold')
    if profile.gripper is not None:
        problem = arm_problem(calls, profile.gripper)
        if problem:
            return verdict('useless', problem)
    if profile.flight is not None:
        problem = flight_problem(statements, profile.flight)
        if problem:
            return verdict('useless', problem)
    if not (ref_skills & skills) and not (ref_names & names):
        return verdict('useless', "nothing of the reference's skills or objects")
    first_ref = next((c.skill for c in ref_calls if c.skill in MOVEMENTS), None)
    first = next((c.skill for c in calls if c.skill in MOVEMENTS), None)
    if first_ref is not None and first != first_ref:
        why = f'first movement {first or "none"}, the reference\'s {first_ref}'
        # a reference that opens with a movement is a task whose first act is that move (an
        # evasion, "move up and then ..."): going another way defeats it
        return verdict('useless' if ref_calls[0].skill in MOVEMENTS else 'partly', why)
    if object_coverage < 1.0:
        return verdict('partly', f"names {object_coverage:.0%} of the reference's objects")
    if profile.gripper is not None:
        made = {_put(c) for c in calls if c.skill == profile.gripper.put}
        missed = [c for c in ref_calls if c.skill == profile.gripper.put and _put(c) not in made]
        if missed:
            return verdict('partly', f"does not make the reference's {missed[0].text}")
    missing = sorted(ref_skills - PERCEPTION - skills)
    if missing:
        return verdict('partly', f"lacks the reference's skills {', '.join(missing)}")
    return verdict('useful', '')
