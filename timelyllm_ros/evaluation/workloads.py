"""Programmable workloads (paper 000 §6, Table 3) and the authors' published workloads.

Events arrive as a seeded Poisson process of rate ``eps`` (events/s) during ``duration_s``;
each event triggers 1…``max_tpe`` tasks on distinct agents out of ``agents``, each task drawn
from ``trace_ids`` — or, with an explicit ``composition`` such as ``"(1,2),8,9"``, the i-th
event triggers the i-th group (cycling), ``(1,2)`` meaning two robots start T1 and T2 together.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.core.tuf import Tuf, tuf_for_class
from timelyllm_ros.errors import ProfileError, TufError, WorkloadError
from timelyllm_ros.language.profiles import check_profile_name, load_profile
from timelyllm_ros.language.traces import DATA_DIR, TraceSet, approx_tokenize, load_trace_set
from timelyllm_ros.safe_files import (
    DATA_FILE,
    YAML_FILE,
    WorkloadInputError,
    load_json,
    load_yaml,
    validation_problems,
)

AUTHORS_DIR = DATA_DIR / 'authors'
AUTHORS_WORKLOADS = {
    'authors-drone': AUTHORS_DIR / 'data_sample_1.json',
    'authors-arm': AUTHORS_DIR / 'data_sample_robotarm_fltrnn.json',
}
CLASS_TUF = {'arm': 'normal'}
"""TUF class of task classes that are not TUF classes themselves (arm tasks are normal)."""

MAX_AGENTS = 10_000
"""Most robots (and so most tasks per event) a workload may have: a fleet, not a population."""
MAX_TASKS = 100_000
"""Most tasks a workload spec may draw, counted before drawing as events (``eps`` ×
``duration_s``) × tasks of the largest event. WID1–3 draw a few hundred; a spec that asks
for millions would take the process's memory and never finish generating."""


# Trace ids of at most 9 digits: no id is longer, and int() of thousands of digits raises.
_GROUP = re.compile(r'\s*(?:\(\s*(\d{1,9}(?:\s*,\s*\d{1,9})*)\s*\)|(\d{1,9}))\s*(,|$)')


def parse_composition(text: str) -> list[list[int]]:
    """Parse ``"(1,2),8,9"`` into ``[[1, 2], [8], [9]]``.

    Raises:
        WorkloadError: anything but trace ids, commas and one level of parentheses.
    """
    groups: list[list[int]] = []
    position = 0
    while position < len(text):
        match = _GROUP.match(text, position)
        if match is None or match.end() == position:
            raise WorkloadError(f'composition {text!r} is not like "(1,2),8,9" '
                                f'(at character {position})')
        inner = match.group(1) if match.group(1) is not None else match.group(2)
        groups.append([int(x) for x in re.split(r'\s*,\s*', inner)])
        position = match.end()
        if match.group(3) == ',' and position == len(text):
            raise WorkloadError(f'composition {text!r} ends with a comma')
    if not groups:
        raise WorkloadError('composition is empty')
    return groups


class WorkloadSpec(BaseModel):
    """A programmable workload (one row of Table 3, or your own)."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    name: str = Field(max_length=200)
    description: str = Field(default='', max_length=10_000)
    eps: float = Field(gt=0, allow_inf_nan=False, description='Events per second (Poisson rate).')
    max_tpe: int = Field(ge=1, le=MAX_AGENTS, description='Maximum tasks per event.')
    trace_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=10_000)
    agents: int = Field(ge=1, le=MAX_AGENTS, description='Number of robots (agents).')
    duration_s: float = Field(gt=0, allow_inf_nan=False)
    composition: str | None = None
    profile: str | None = Field(
        default=None, description="Robot profile serving every task instead of its trace's "
                                  '(same kind), e.g. chatbot_paragraph.')

    @field_validator('composition')
    @classmethod
    def _composition(cls, value: str | None) -> str | None:
        if value is not None:
            parse_composition(value)
        return value

    @field_validator('profile')
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                check_profile_name(value)
            except ProfileError as err:
                raise ValueError(str(err)) from None
        return value

    @model_validator(mode='after')
    def _bounded(self) -> WorkloadSpec:
        problem = task_bound_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def task_bound_problem(spec: WorkloadSpec) -> str | None:
    """Why the spec would draw more than :data:`MAX_TASKS` tasks (None: it would not)."""
    events = spec.eps * spec.duration_s
    if spec.composition is not None:
        per_event = max(len(group) for group in parse_composition(spec.composition))
        what = 'tasks of the largest composition group'
    else:
        per_event, what = spec.max_tpe, 'max_tpe'
    tasks = events * per_event
    if tasks > MAX_TASKS:
        return (f'eps x duration_s x {what} = {tasks:.3g} tasks, more than {MAX_TASKS}: '
                f'a shorter duration_s or a lower eps')
    return None


BUILTIN_WORKLOADS: dict[str, WorkloadSpec] = {
    'wid1': WorkloadSpec(name='wid1', description='Table 3 WID 1: mixed TUF (drones)',
                         eps=0.25, max_tpe=8, trace_ids=list(range(1, 9)), agents=25,
                         duration_s=260),
    'wid2': WorkloadSpec(name='wid2', description='Table 3 WID 2: parallel degree (drones)',
                         eps=0.25, max_tpe=16, trace_ids=list(range(1, 9)), agents=42,
                         duration_s=300),
    'wid3': WorkloadSpec(name='wid3', description='Table 3 WID 3: different robot (arms)',
                         eps=0.1, max_tpe=8, trace_ids=[9, 10, 11], agents=40,
                         duration_s=900),
    'chat': WorkloadSpec(name='chat', description='chatbot answers read at 300 wpm',
                         eps=0.25, max_tpe=8, trace_ids=[12, 13, 14], agents=25,
                         duration_s=260),
    'story': WorkloadSpec(name='story', description='Fig. 10: stories, a sentence a segment',
                          eps=0.25, max_tpe=8, trace_ids=[15, 16, 17], agents=25,
                          duration_s=260),
    'story-para': WorkloadSpec(name='story-para',
                               description='Fig. 10: stories, a paragraph a segment',
                               eps=0.25, max_tpe=8, trace_ids=[15, 16, 17], agents=25,
                               duration_s=260, profile='chatbot_paragraph'),
}


def workload_names() -> list[str]:
    return [*BUILTIN_WORKLOADS, *AUTHORS_WORKLOADS, *OVERLOAD_WORKLOADS]


def _tuf_of(task_class: str) -> Tuf:
    return tuf_for_class(CLASS_TUF.get(task_class, task_class))


def _task(index: int, trace_id: int, agent: int, arrival: float, traces: TraceSet,
          tuf: Tuf | None = None, task_text: str | None = None,
          skill_times: tuple[tuple[str, float], ...] | None = None,
          profile: str | None = None) -> TaskSpec:
    trace = traces.get(trace_id)
    text = task_text or trace.task
    # The task line plus its "Task: … Plan:" frame; the rest of the prompt is the fixed prefix.
    task_tokens = min(len(approx_tokenize(text)) + 4, trace.prompt_tokens)
    return TaskSpec(
        task_id=f'task-{index:04d}', robot_id=f'{trace.robot}-{agent:02d}',
        profile=profile or trace.robot,
        task_class=trace.task_class, task_type=trace.task_type,
        tuf=tuf if tuf is not None else _tuf_of(trace.task_class), arrival_time=arrival,
        task=text, prompt_tokens=trace.prompt_tokens, task_tokens=task_tokens,
        script=trace.pieces,
        skill_times=skill_times,
    )


def generate_tasks(spec: WorkloadSpec, seed: int, traces: TraceSet | None = None
                   ) -> list[TaskSpec]:
    """Draw the tasks of a workload; the same seed always gives the same tasks."""
    traces = traces or load_trace_set()
    for trace_id in spec.trace_ids:
        try:
            traces.get(trace_id)
        except WorkloadError as err:
            raise WorkloadInputError(spec.name, str(err), 'trace_ids') from None
    # Checked again here: model_copy (a --compose override) and model_construct skip validators.
    problem = task_bound_problem(spec)
    if problem:
        raise WorkloadInputError(spec.name, problem, 'workload')
    if spec.max_tpe > spec.agents:
        raise WorkloadInputError(spec.name, f'max_tpe {spec.max_tpe} > agents {spec.agents}')
    _check_profile_override(spec, traces)
    groups = parse_composition(spec.composition) if spec.composition else None
    rng = np.random.default_rng(seed)
    tasks: list[TaskSpec] = []
    now = 0.0
    event = 0
    while True:
        now += float(rng.exponential(1.0 / spec.eps))
        if now > spec.duration_s:
            break
        if groups is not None:
            chosen = groups[event % len(groups)]
            if len(chosen) > spec.agents:
                raise WorkloadInputError(spec.name, f'event of {len(chosen)} tasks > agents',
                                         'composition')
        else:
            count = int(rng.integers(1, spec.max_tpe + 1))
            chosen = [int(t) for t in rng.choice(spec.trace_ids, size=count)]
        agents = rng.choice(spec.agents, size=len(chosen), replace=False)
        for trace_id, agent in zip(chosen, agents, strict=True):
            tasks.append(_task(len(tasks), trace_id, int(agent), now, traces,
                               profile=spec.profile))
        event += 1
    return tasks


def _check_profile_override(spec: WorkloadSpec, traces: TraceSet) -> None:
    """The override, if any, must name a profile of the same robot kind as each trace's own."""
    if spec.profile is None:
        return
    try:
        kind = load_profile(spec.profile).kind
        for trace_id in spec.trace_ids:
            own = load_profile(traces.get(trace_id).robot).kind
            if own != kind:
                raise WorkloadInputError(spec.name, f'profile {spec.profile!r} is a {kind}, '
                                         f'trace {trace_id} is for a {own}')
    except ProfileError as err:
        raise WorkloadInputError(spec.name, str(err), 'profile') from None


def load_workload_spec(path: str | Path) -> WorkloadSpec:
    """Load a workload spec YAML file (the fields of :class:`WorkloadSpec`), bounded by
    :mod:`timelyllm_ros.safe_files`.

    Raises:
        WorkloadError: the file cannot be read.
        WorkloadInputError: too large, not UTF-8 YAML, or a field missing or out of range
            (finite rates and durations, at most :data:`MAX_AGENTS` agents and
            :data:`MAX_TASKS` tasks).
    """
    try:
        data = load_yaml(path, WorkloadInputError, YAML_FILE)
    except OSError as err:
        raise WorkloadError(f'{path}: cannot read workload: {err.strerror}') from None
    if not isinstance(data, dict):
        raise WorkloadInputError(str(path), f'invalid workload spec: a mapping of the fields '
                                 f'of a workload, got {type(data).__name__}')
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as err:
        raise WorkloadInputError(str(path), f'invalid workload spec: '
                                 f'{validation_problems(err)}') from None


_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class AuthorsRecord(BaseModel):
    """One task record of the authors' JSON format (the fields this project uses)."""

    model_config = ConfigDict(extra='ignore', frozen=True, populate_by_name=True,
                              allow_inf_nan=False)

    trigger_time: _Seconds = Field(alias='trigger time')
    agent_id: int = Field(ge=0, lt=MAX_AGENTS)
    trace_id: int = Field(ge=0, le=1_000_000)
    task_input: str = Field(max_length=100_000)
    exe_time_detail: list[tuple[Annotated[str, Field(max_length=200)], _Seconds]] = Field(
        max_length=10_000)
    tuf: tuple[float, float, float]       # [U_max, ERT, t_zero]; Tuf checks finite and order


def load_authors_workload(path: str | Path, traces: TraceSet | None = None) -> list[TaskSpec]:
    """Load a workload file in the authors' JSON format (exact arrivals, measured skill times).

    Drone records (trace ids 0–7) map to traces 1–8, robot-arm records (skills move_to / take /
    drop, trace ids 0–2) to traces 9–11; TUFs come from the records.

    Raises:
        WorkloadError: unreadable file or a record that does not fit the format.
    """
    traces = traces or load_trace_set()
    try:
        # NaN and Infinity parse, so that the record's model names the field holding one.
        data = load_json(path, WorkloadInputError, DATA_FILE, finite=False)
    except OSError as err:
        raise WorkloadError(f'{path}: cannot read workload: {err.strerror}') from None
    if not isinstance(data, list) or not data:
        raise WorkloadInputError(str(path), 'expected a non-empty list of task records')
    if len(data) > MAX_TASKS:
        raise WorkloadInputError(str(path), f'{len(data)} task records, more than {MAX_TASKS}')
    # Every record is checked before any is used: sorting by trigger time needs them all
    # numeric, and a NaN time or skill time would keep a simulation from ever ending.
    records: list[tuple[int, AuthorsRecord]] = []
    for position, raw in enumerate(data):
        if not isinstance(raw, dict):
            raise WorkloadInputError(str(path), f'a record is an object, got '
                                     f'{type(raw).__name__}', f'record {position}')
        try:
            records.append((position, AuthorsRecord.model_validate(raw)))
        except ValidationError as err:
            raise WorkloadInputError(str(path), validation_problems(err),
                                     f'record {position}') from None
    is_arm = any(skill == 'move_to' for _, r in records for skill, _ in r.exe_time_detail)
    offset = 9 if is_arm else 1
    tasks: list[TaskSpec] = []
    for index, (position, record) in enumerate(sorted(records,
                                                      key=lambda r: r[1].trigger_time)):
        try:
            tuf = Tuf.from_zero_time(*record.tuf)
            tasks.append(_task(index, record.trace_id + offset, record.agent_id,
                               record.trigger_time, traces, tuf=tuf,
                               task_text=record.task_input,
                               skill_times=tuple(record.exe_time_detail)))
        except (TufError, WorkloadError) as err:    # a TUF out of order, an unknown trace
            raise WorkloadInputError(str(path), str(err), f'record {position}') from None
    return tasks


# -- overload: a whole fleet in one burst ------------------------------------------------------
DRONE_TRACES = tuple(range(1, 9))          # T1–T5 normal, T6–T8 urgent (Tello)
DEFAULT_BURST_S = 5.0


def overload_tasks(robots: int, seed: int, burst_s: float = DEFAULT_BURST_S,
                   tasks_per_robot: int = 1,
                   trace_ids: Sequence[int] = DRONE_TRACES) -> list[TaskSpec]:
    """Goals of ``robots`` robots, each sending ``tasks_per_robot`` goals within the burst.

    Args:
        robots: fleet size (robot ids ``tello-0000`` …).
        seed: seeds the traces drawn and the arrival times.
        burst_s: every goal arrives uniformly at random in ``[0, burst_s)`` simulated seconds.
        tasks_per_robot: goals per robot (all within the burst).
        trace_ids: drone traces to draw from.

    Returns:
        The goals in arrival order.
    """
    if robots < 1 or tasks_per_robot < 1:
        raise ValueError('need at least one robot and one task per robot')
    if not burst_s >= 0:
        raise ValueError(f'burst_s must be >= 0, got {burst_s}')
    traces = load_trace_set()
    rng = np.random.default_rng(seed)
    count = robots * tasks_per_robot
    arrivals = np.sort(rng.uniform(0.0, burst_s, size=count)) if burst_s else np.zeros(count)
    chosen = rng.choice(list(trace_ids), size=count)
    robot_of = rng.permutation(np.repeat(np.arange(robots), tasks_per_robot))
    tasks: list[TaskSpec] = []
    for index in range(count):
        trace = traces.get(int(chosen[index]))
        task_tokens = min(len(approx_tokenize(trace.task)) + 4, trace.prompt_tokens)
        tasks.append(TaskSpec(
            task_id=f'goal-{index:05d}', robot_id=f'{trace.robot}-{int(robot_of[index]):04d}',
            profile=trace.robot, task_class=trace.task_class, task_type=trace.task_type,
            tuf=tuf_for_class(CLASS_TUF.get(trace.task_class, trace.task_class)),
            arrival_time=float(arrivals[index]), task=trace.task,
            prompt_tokens=trace.prompt_tokens, task_tokens=task_tokens, script=trace.pieces))
    return tasks


OVERLOAD_WORKLOADS = {'overload-1000': 1000, 'overload-5000': 5000}
"""Named overloads (:func:`overload_tasks`): that many robots, one goal each, in 5 s."""


def resolve_workload(name: str | None = None, seed: int = 0, workload_file: str | None = None,
                     composition: str | None = None) -> tuple[str, list[TaskSpec]]:
    """Tasks of a built-in workload, an authors' workload or a workload file."""
    if workload_file is not None:
        path = Path(workload_file)
        if path.suffix == '.json':
            return path.stem, load_authors_workload(path)
        spec = load_workload_spec(path)
    elif name in AUTHORS_WORKLOADS:
        return name, load_authors_workload(AUTHORS_WORKLOADS[name])
    elif name in OVERLOAD_WORKLOADS:
        return name, overload_tasks(OVERLOAD_WORKLOADS[name], seed)
    elif name in BUILTIN_WORKLOADS:
        spec = BUILTIN_WORKLOADS[name]
    else:
        raise WorkloadError(f'unknown workload {name!r}; known: {", ".join(workload_names())}')
    if composition is not None:
        spec = spec.model_copy(update={'composition': composition})
        parse_composition(composition)
    return spec.name, generate_tasks(spec, seed)
