"""Robot profiles: the skill language, execution-time models and fixed prompt of one robot kind.

A profile is a YAML file in ``robot_profiles/`` validated with pydantic. It holds everything
that is fixed per robot kind (paper 000 §4.1: "users pre-store the fixed components of requests
like robot skill sets, guidance for plan generation, and case examples on the server"): the
skills with their typed arguments and statement pattern, each skill's execution-time model, the
segmentation rule, the per-segment generation time G and the segment length bound used by the
latency-guided batching.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.examples import ExamplePool
from timelyllm_ros.language.exec_time import ExecTimeModel
from timelyllm_ros.safe_files import Limits, ProfileInputError, load_yaml

NEXT_TASK = '\nTask:'
"""Where a few-shot transcript goes on to another task: a model that writes it after its answer
(a model without a chat template continues the transcript) has ended its answer there."""


def _bundled_profiles_dir() -> Path:
    """Where the bundled profiles are: ``$TIMELYLLM_PROFILES_DIR``, the source checkout
    (editable install), ``<prefix>/share/timelyllm_ros/robot_profiles`` (pip install) or the
    colcon install's share directory above the installed package."""
    override = os.environ.get('TIMELYLLM_PROFILES_DIR')
    if override:
        return Path(override)
    here = Path(__file__).resolve().parents[1]   # the timelyllm_ros package
    candidates = [here.parent / 'robot_profiles',
                  Path(sys.prefix) / 'share' / 'timelyllm_ros' / 'robot_profiles']
    candidates += [parent / 'share' / 'timelyllm_ros' / 'robot_profiles'
                   for parent in here.parents]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    return candidates[0]


PROFILES_DIR = _bundled_profiles_dir()
"""Bundled profiles (see :func:`_bundled_profiles_dir`)."""

_ARG_PATTERNS = {
    'int': r'[+-]?\d+',
    'float': r'[+-]?(?:\d+\.?\d*|\.\d+)',
    'str': r"'[^']*'|\"[^\"]*\"|[A-Za-z_][\w ]*",
}

MAX_NUMBER_CHARS = 32
"""Longest number literal accepted in a plan (skill argument, loop count, condition value)."""

_NUMBER_LITERAL = {
    'int': re.compile(r'[+-]?[0-9]+'),
    'float': re.compile(r'[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?'),
}

PROFILE_NAME = re.compile(r'[A-Za-z][A-Za-z0-9_-]{0,63}')
"""What a robot kind may be: a profile name (fully matched), never a path."""

MAX_PROFILE_BYTES = 1 << 20
"""Largest profile file read (bytes)."""
PROFILE_FILE = Limits(max_bytes=MAX_PROFILE_BYTES)
"""How much of a profile file is parsed (see :mod:`timelyllm_ros.safe_files`)."""


def clip(text: str, limit: int = 64) -> str:
    """``repr(text)`` cut to about ``limit`` characters, for error messages.

    Args:
        text: Any text (it may hold control characters or lone surrogates).
        limit: Characters of the repr kept before ``...``.

    Returns:
        The repr, with ``...`` (and the full length) appended when it was cut.
    """
    shown = repr(text)
    if len(shown) <= limit:
        return shown
    return f'{shown[:limit]}... ({len(text)} chars)'


class SkillArg(BaseModel):
    """One typed argument of a skill, with the robot's limits."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    name: str = Field(pattern=r'^[A-Za-z_]\w*$')
    type: Literal['int', 'float', 'str']
    min: float | None = None
    max: float | None = None
    unit: str = ''

    @model_validator(mode='after')
    def _limits(self) -> SkillArg:
        if self.type == 'str' and (self.min is not None or self.max is not None):
            raise ValueError('string arguments take no min/max')
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f'min {self.min} > max {self.max}')
        return self

    def parse(self, literal: str) -> int | float | str:
        """Convert one argument literal to its value.

        Numbers are plain decimal literals of at most :data:`MAX_NUMBER_CHARS` characters
        (``nan``, ``inf``, ``1_000`` or a 5,000-digit literal are not numbers here), and the
        value must pass :meth:`check_value`.

        Raises:
            ValueError: The literal is not of the argument's type or outside its limits.
        """
        text = literal.strip()
        if self.type == 'str':
            if len(text) >= 2 and text[0] == text[-1] and text[0] in '\'"':
                return text[1:-1]
            if re.fullmatch(r'[A-Za-z_][\w ]*', text):
                return text
            raise ValueError(f'{self.name}: {clip(text)} is not a string')
        if len(text) > MAX_NUMBER_CHARS:
            raise ValueError(f'{self.name}: number literal longer than {MAX_NUMBER_CHARS} '
                             f'characters ({len(text)})')
        if not _NUMBER_LITERAL[self.type].fullmatch(text):
            raise ValueError(f'{self.name}: {clip(text)} is not {self.type}')
        value: int | float = int(text) if self.type == 'int' else float(text)
        self.check_value(value)
        return value

    def check_value(self, value: object) -> None:
        """Check one argument value: its type, finite, within the robot's limits.

        Raises:
            ValueError: naming the argument and the problem.
        """
        if self.type == 'str':
            if not isinstance(value, str):
                raise ValueError(f'{self.name} must be a string, got {type(value).__name__}')
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f'{self.name} must be {self.type}, got {type(value).__name__}')
        if not math.isfinite(value):
            raise ValueError(f'{self.name}={value} is not a finite number')
        if self.type == 'int' and not float(value).is_integer():
            raise ValueError(f'{self.name}={value} is not an integer')
        if self.min is not None and value < self.min:
            raise ValueError(f'{self.name}={value} below the minimum {self.min:g} {self.unit}')
        if self.max is not None and value > self.max:
            raise ValueError(f'{self.name}={value} above the maximum {self.max:g} {self.unit}')


class Skill(BaseModel):
    """One executable skill: ``short(arg, ...)`` in plans, with its execution-time model."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    name: str = Field(pattern=r'^[A-Za-z_]\w*$')
    short: str = Field(pattern=r'^[A-Za-z_]\w*$')
    description: str = ''
    aliases: list[str] = Field(
        default_factory=list, description='Other names recorded workloads use for this skill.'
    )
    args: list[SkillArg] = Field(default_factory=list)
    query: bool = Field(
        default=False,
        description='A query (perception, state): its result may be the condition of a ?{...}.',
    )
    pattern: str | None = Field(
        default=None,
        description='Regex that fully matches one complete call; derived from args if omitted.',
    )
    exec_time: ExecTimeModel

    @model_validator(mode='after')
    def _pattern_compiles(self) -> Skill:
        try:
            re.compile(self.statement_pattern)
        except re.error as err:
            raise ValueError(f'pattern does not compile: {err}') from None
        return self

    @property
    def statement_pattern(self) -> str:
        """The regex recognising one complete call of this skill."""
        if self.pattern is not None:
            return self.pattern
        arg_res = [rf'\s*(?:{_ARG_PATTERNS[a.type]})\s*' for a in self.args]
        inner = ','.join(arg_res) if arg_res else r'\s*'
        return rf'{re.escape(self.short)}\({inner}\)'

    @cached_property
    def compiled(self) -> re.Pattern[str]:
        return re.compile(self.statement_pattern)

    def usage(self) -> str:
        """The one-line signature shown in prompts, e.g. ``mf(distance:int cm)``."""
        args = ', '.join(f'{a.name}:{a.type}{" " + a.unit if a.unit else ""}' for a in self.args)
        return f'{self.short}({args})'


class GripperRule(BaseModel):
    """How a robot that holds one thing at a time uses its gripper, by skill name: it reaches a
    thing (``reach(object)``), takes the thing it reached (``take(object)``) when it holds
    nothing, puts what it holds where it reached (``put(object, where)``; a ``where`` of
    ``near_x`` or ``on_x`` is at ``x``), and ``open()`` lets go of it. The plan judge checks plans
    against it, and a grounded plan grammar lets a model write only plans that keep it."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    reach: str = 'move_to'
    take: str = 'pick'
    put: str = 'place'
    open: str = 'release'


class FlightRule(BaseModel):
    """How a robot that flies lands, by skill name: after ``land()`` it does only what needs no
    flight (``on_ground``: logging, a picture, a wait) until ``takeoff()`` lifts it again, and a
    loop or condition does not land (its next repetition or the plan after it would fly on).
    The plan judge checks plans against it, and the plan grammar lets a model write only plans
    that keep it (a drone told to move on the ground refuses: the segment would fail)."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    takeoff: str = 'takeoff'
    land: str = 'land'
    on_ground: tuple[str, ...] = ('log', 'take_picture', 'delay')


class PromptParts(BaseModel):
    """The parts of a planning prompt for one robot kind: fixed ones, and examples chosen per
    task from a pool (:mod:`~timelyllm_ros.language.examples`)."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    system: str
    guidance: str = ''
    examples: list[dict[str, str]] = Field(
        default_factory=list,
        description='Examples every prompt shows (the cacheable prefix), each {task, plan}.')
    example_pool: list[dict[str, str]] = Field(
        default_factory=list,
        description='Examples of which each task is shown the closest ones, after the fixed '
                    'examples, the closest last.')
    pool_examples: int = Field(
        default=0, ge=0, le=16,
        description='How many examples of the pool each task is shown.')

    @model_validator(mode='after')
    def _examples_complete(self) -> PromptParts:
        for example in (*self.examples, *self.example_pool):
            if set(example) != {'task', 'plan'}:
                raise ValueError(f'an example has the keys task and plan, not {sorted(example)}')
        if self.pool_examples > len(self.example_pool):
            raise ValueError(f'pool_examples is {self.pool_examples} but the example_pool '
                             f'holds {len(self.example_pool)}')
        return self

    @property
    def all_examples(self) -> list[dict[str, str]]:
        """The fixed examples and the pool's."""
        return [*self.examples, *self.example_pool]

    @cached_property
    def pool(self) -> ExamplePool:
        """The example pool with its words counted (once)."""
        return ExamplePool.build(self.example_pool)

    def examples_for(self, task: str) -> list[Mapping[str, str]]:
        """The examples a task's prompt shows: the fixed ones, then the pool's closest."""
        return [*self.examples, *self.pool.closest(task, self.pool_examples)]


class RobotProfile(BaseModel):
    """A robot kind: language, segmentation rule, timing parameters and prompt."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    name: str = Field(pattern=r'^[a-z][a-z0-9_]*$')
    kind: str = Field(
        pattern=r'^[a-z][a-z0-9_]{0,63}$',
        description='What the robot is: drone, arm, chatbot, or the category of a new robot '
                    'kind (open: the robot kind that serves it is looked up when a backend is '
                    'opened or a task classed, see timelyllm_ros.robots.kind).',
    )
    driver: str | None = Field(
        default=None, max_length=200, pattern=r'^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$',
        description="The robot kind that drives this profile: a registered name (tello) or "
                    "'package.module:Class' (imported: code, as trusted as the profile "
                    "directory); default: the kind registered under the profile's name, else "
                    'the first one registered for its kind.',
    )
    description: str = ''
    segmentation: Literal['skills', 'sentence', 'paragraph'] = 'skills'
    segment_generation_s: float = Field(gt=0, description='G: mean generation time per segment.')
    max_segment_tokens: int = Field(gt=0, description='Segment length bound for batching.')
    max_tokens: int = Field(gt=0, description='Token limit of one whole generation.')
    max_nesting_depth: int = Field(
        default=4, ge=1, le=16,
        description='How deep conditionals and loops may nest (a top-level body is depth 1).',
    )
    max_loop_count: int = Field(
        default=20, ge=1, le=1_000_000,
        description='Most times loops N{...} may repeat a statement (nested counts multiplied).',
    )
    words_per_minute: float | None = Field(
        default=None, gt=0, description='Reading speed that times chatbot segments.'
    )
    exec_time_provenance: str = Field(
        min_length=1, description='Says which figures were measured and which are derived.'
    )
    skills: list[Skill] = Field(default_factory=list)
    gripper: GripperRule | None = Field(
        default=None,
        description='The robot holds one thing at a time with these skills (an arm).')
    flight: FlightRule | None = Field(
        default=None,
        description='The robot flies: after landing it moves only once it took off (a drone).')
    prompt: PromptParts

    @model_validator(mode='after')
    def _consistent(self) -> RobotProfile:
        if self.segmentation == 'skills' and not self.skills:
            raise ValueError('a skills-segmented profile needs at least one skill')
        if self.segmentation != 'skills' and self.words_per_minute is None:
            raise ValueError('a text-segmented profile needs words_per_minute')
        seen: dict[str, str] = {}
        for skill in self.skills:
            for key in (skill.name, skill.short, *skill.aliases):
                if seen.get(key, skill.name) != skill.name:
                    raise ValueError(f'skill key {key!r} used by {seen[key]} and {skill.name}')
                seen[key] = skill.name
        by_name = {s.name: s for s in self.skills}
        if self.gripper is not None:
            self._check_gripper(self.gripper, by_name)
        if self.flight is not None:
            if self.gripper is not None:
                raise ValueError('a profile has a gripper rule or a flight rule, not both: the '
                                 'plan grammar follows one of them')
            self._check_flight(self.flight, by_name)
        return self

    @staticmethod
    def _check_flight(flight: FlightRule, skills: dict[str, Skill]) -> None:
        for name in (flight.takeoff, flight.land):
            skill = skills.get(name)
            if skill is None:
                raise ValueError(f'flight: no skill named {name!r}')
            if skill.args:
                raise ValueError(f'flight: {name} must take no arguments')
        for name in flight.on_ground:
            if name not in skills:
                raise ValueError(f'flight: on_ground names no skill {name!r}')
            if name in (flight.takeoff, flight.land):
                raise ValueError(f'flight: on_ground holds {name!r}, the takeoff or the landing')

    @staticmethod
    def _check_gripper(gripper: GripperRule, skills: dict[str, Skill]) -> None:
        wanted = {gripper.reach: ('object',), gripper.take: ('object',),
                  gripper.put: ('object', 'where'), gripper.open: ()}
        for name, args in wanted.items():
            skill = skills.get(name)
            if skill is None:
                raise ValueError(f'gripper: no skill named {name!r}')
            if tuple(a.name for a in skill.args) != args or any(
                    a.type != 'str' for a in skill.args):
                raise ValueError(f'gripper: {name} must take the string arguments '
                                 f'({", ".join(args)})')

    @cached_property
    def skill_index(self) -> dict[str, Skill]:
        """Every skill by name, short form and alias."""
        index: dict[str, Skill] = {}
        for skill in self.skills:
            for key in (skill.name, skill.short, *skill.aliases):
                index[key] = skill
        return index

    def skill(self, key: str) -> Skill:
        """Look a skill up by name, short form or alias (recorded workloads write ``s(``)."""
        found = self.skill_index.get(key) or self.skill_index.get(key.rstrip('('))
        if found is None:
            raise ProfileError(f'{self.name}: unknown skill {key!r}')
        return found

    def reading_time_s(self, text: str) -> float:
        """Time a person needs to read ``text`` (chatbot execution)."""
        assert self.words_per_minute is not None
        return len(text.split()) * 60.0 / self.words_per_minute

    def build_prompt(self, task: str) -> str:
        """The full planning prompt: the fixed parts (:attr:`prompt_prefix`), the pool's
        examples closest to the task, then the task line."""
        examples = map(_example_text, self.prompt.examples_for(task))
        return '\n\n'.join([self.instructions, *examples, f'Task: {task}\nPlan:'])

    def build_messages(self, task: str) -> tuple[tuple[str, str], ...]:
        """The planning prompt as chat turns ``(role, content)`` for a model's chat template:
        the instructions as the system turn, each example as a user turn answered by an
        assistant turn, then the task. The instructions and fixed examples are the same for
        every task of the robot kind (a cacheable prefix); the pool's examples follow."""
        turns = [('system', self.instructions)]
        for example in self.prompt.examples_for(task):
            turns += [('user', example['task']), ('assistant', example['plan'])]
        turns.append(('user', task))
        return tuple(turns)

    @cached_property
    def instructions(self) -> str:
        """The system text of a prompt: role, skills with their signatures, rules."""
        parts = [self.prompt.system.strip()]
        if self.skills:
            lines = [f'- {s.usage()}: {s.name}. {s.description}'.rstrip() for s in self.skills]
            parts.append('Skills:\n' + '\n'.join(lines))
        if self.prompt.guidance:
            parts.append(self.prompt.guidance.strip())
        return '\n\n'.join(parts)

    @cached_property
    def prompt_prefix(self) -> str:
        """The fixed part of every plain-text prompt of this robot kind (cacheable by the
        engine): the instructions and the examples."""
        return '\n\n'.join([self.instructions, *map(_example_text, self.prompt.examples)])


def _example_text(example: Mapping[str, str]) -> str:
    """An example as a plain-text prompt writes it."""
    return f"Task: {example['task']}\nPlan: {example['plan']}"


def _format_location(loc: tuple[int | str, ...], data: object) -> str:
    """Name a validation error's field the way the YAML file spells it (skills[3].exec_time)."""
    out = ''
    node = data
    for part in loc:
        if isinstance(part, int):
            name = node[part].get('name') if isinstance(node, list) and isinstance(
                node[part], dict) else None
            out += f'[{part}]' + (f'({name})' if name else '')
            node = node[part] if isinstance(node, list) and part < len(node) else None
        else:
            out += f'.{part}' if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out


def load_profile_file(path: str | Path) -> RobotProfile:
    """Load and validate one profile YAML file given on purpose by its path.

    Robot kinds that arrive from outside (goals, task messages) go through
    :func:`load_profile`, which accepts only a profile name. Error messages name the file,
    the field and the problem, never the file's content.

    Raises:
        ProfileError: the file cannot be read.
        ProfileInputError: too large, not UTF-8, not valid YAML (bounded as every file, see
            :mod:`timelyllm_ros.safe_files`), or invalid, naming the offending field.
    """
    path = Path(path)
    try:
        data = load_yaml(path, ProfileInputError, PROFILE_FILE)
    except OSError as err:
        raise ProfileError(f'{path}: cannot read profile: {err.strerror}') from None
    if not isinstance(data, dict):
        raise ProfileInputError(str(path), f'a profile must be a mapping, got '
                                f'{type(data).__name__}')
    try:
        return RobotProfile.model_validate(data)
    except ValidationError as err:
        problems = '; '.join(
            f"{_format_location(e['loc'], data) or '<root>'}: {e['msg'][:200]}"
            for e in err.errors(include_input=False, include_url=False)
        )
        raise ProfileInputError(str(path), f'invalid profile: {problems}') from None


def check_profile_name(name: object) -> str:
    """Check that a robot kind is a profile name (``tello``), never a path.

    Args:
        name: The robot kind as received.

    Returns:
        The name.

    Raises:
        ProfileError: not a string, or not ``[A-Za-z][A-Za-z0-9_-]{0,63}``; the reason quotes
            the kind (repr, cut to about 64 characters).
    """
    if not isinstance(name, str):
        raise ProfileError(f'a robot kind must be a profile name, got {type(name).__name__}')
    if not PROFILE_NAME.fullmatch(name):
        raise ProfileError(f'invalid robot kind {clip(name)}: a profile name is a letter then '
                           'up to 63 letters, digits, "_" or "-" (no path)')
    return name


_CACHE: dict[tuple[str, str], RobotProfile] = {}


def load_profile(name: str, profiles_dir: str | Path | None = None) -> RobotProfile:
    """Load a profile by name (``tello``) from a profiles directory (cached until edited).

    The name must pass :func:`check_profile_name` (no separator, no ``..``), and the file
    ``<name>.yaml`` must be an entry of the directory itself (checked on the resolved
    directory; an entry that is a symbolic link, as a colcon ``--symlink-install`` makes, is
    followed). Load a file given on purpose by its path with :func:`load_profile_file` (or
    :func:`load_profile_name_or_file` for a command-line argument that may be either).

    Args:
        name: The profile name, e.g. ``tello``.
        profiles_dir: Where the profiles are (default: the bundled ones).

    Raises:
        ProfileError: an invalid name, an unknown profile (the reason lists the available
            ones) or an invalid profile file.
    """
    check_profile_name(name)
    directory = Path(profiles_dir) if profiles_dir is not None else PROFILES_DIR
    try:
        root = directory.resolve()
        path = root / f'{name}.yaml'
        inside = path.parent == root and path.is_file()
        key = (str(path), str(path.stat().st_mtime_ns) if inside else '')
    except (OSError, RuntimeError, ValueError):
        inside, key = False, ('', '')
    if not inside:
        available = ', '.join(available_profiles(directory)) or 'none'
        raise ProfileError(f'unknown robot profile {clip(name)}; available: {available}')
    if key not in _CACHE:
        _CACHE[key] = load_profile_file(path)
    return _CACHE[key]


def load_profile_name_or_file(value: str | Path,
                              profiles_dir: str | Path | None = None) -> RobotProfile:
    """Load a profile named on purpose by an operator: a name, or a path to a YAML file.

    For command-line arguments (``--robot tello`` or ``--robot my_indy7.yaml``) only; robot
    kinds received from goals or task messages go through :func:`load_profile`.

    Raises:
        ProfileError: an unknown name or an unreadable or invalid file.
    """
    text = str(value)
    if isinstance(value, Path) or text.endswith(('.yaml', '.yml')) or '/' in text or (
            os.sep in text):
        return load_profile_file(value)
    return load_profile(text, profiles_dir)


def available_profiles(profiles_dir: str | Path | None = None) -> list[str]:
    """Names of the profiles in a directory (default: the bundled ones)."""
    directory = Path(profiles_dir) if profiles_dir is not None else PROFILES_DIR
    try:
        return sorted(p.stem for p in directory.glob('*.yaml') if PROFILE_NAME.fullmatch(p.stem))
    except OSError:
        return []
