"""The objects a task speaks of: what a plan for it may name.

A task arrives as ``Scene: [name x:… y:… …], [...] Task: [A] text``. The objects a plan may name
in a skill argument that names a thing (``object``, ``where``) are the scene's objects and the
things the task text mentions: its words that are not function words or verbs of command, and
each two neighbouring such words joined by ``_`` (``pen holder`` → ``pen_holder``), as the plan
language writes names. The plan grammar built from them
(:func:`~timelyllm_ros.language.grammar.plan_grammar`) lets a model name nothing else; the plan
judge reads a plan's objects against the same words.
"""

from __future__ import annotations

import re

OBJECT_ARGS = ('object', 'where')
"""Skill arguments that name a thing in the world (the profiles' naming)."""

PLACE_PREFIXES = ('near_', 'on_')
"""How a ``where`` argument names a place by an object (``near_carrot``)."""

_SCENE = re.compile(r'Scene:\s*(.*?)\s*,?\s*Task:', re.S)
_TASK_TEXT = re.compile(r'Task:\s*(?:\[[A-Z]\])?\s*(.*)', re.S)
_WORD = re.compile(r'[a-z]+')

NOT_OBJECTS = frozenset("""
a an the and or but then if so of on in into onto to at by for from with without up down over
under near next top side front behind above below is are was were be been there here it its
this that these those what which who how far much many some any all each every one two three
four five six seven eight nine ten you your me my i we our us please could can would will
should may must do does did have has had not no yes again also just only now first second last
move moving pick picking drop put place take took fly flying go going find look looking check
checking see turn turning hand give bring tell show try land takeoff take off make let keep
stop wait back forward left right cm m mm degrees metre metres meter meters plan failure
encountered provided execution history because whether where when while trying attempting
walking passing jumped way whose finally approaching toward towards around catch cutting
sides square open closed
""".split())
"""Words of a task that name no object: function words, verbs of command, units, and the
words of the tasks' fixed phrases (``You provided me with plan …``)."""


def words(text: str) -> set[str]:
    """The lower-case words of a text or of a plan's name (``pen_holder``: pen, holder)."""
    return set(_WORD.findall(text.lower().replace('_', ' ')))


def scene_objects(task: str) -> list[str]:
    """The object names of a task's scene line (``Scene: [cabinet_1 x:0.48 …], [...]``)."""
    match = _SCENE.search(task)
    if not match:
        return []
    names = []
    for entry in re.findall(r'\[([^\]]*)\]', match.group(1)):
        head = entry.strip().split(' ')[0].split(':')[0]
        if head:
            names.append(head)
    return names


def task_text(task: str) -> str:
    """A task's text, after its scene line and tag (the whole text if it has neither)."""
    match = _TASK_TEXT.search(task)
    return match.group(1) if match else task


def task_objects(task: str) -> tuple[str, ...]:
    """The objects a plan for this task may name, in order of first mention, without
    duplicates: the scene's, then the task text's words of three letters or more (a skill's
    short name in an execution history is not a thing) and neighbouring word pairs."""
    names = [name.lower() for name in scene_objects(task)]
    text = task_text(task)
    run: list[str] = []
    for token in re.findall(r'[A-Za-z]+|[^A-Za-z\s]', text):
        word = token.lower()
        if _WORD.fullmatch(word) and word not in NOT_OBJECTS and len(word) > 2:
            names.append(word)
            if run:
                names.append(f'{run[-1]}_{word}')
            run.append(word)
        else:
            run = []
    return tuple(dict.fromkeys(names))
