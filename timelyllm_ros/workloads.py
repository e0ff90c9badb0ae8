"""Programmable workloads (paper 000 §6, Table 3) and the authors' published workloads.

Events arrive as a seeded Poisson process of rate ``eps`` (events/s) during ``duration_s``;
each event triggers 1…``max_tpe`` tasks on distinct agents out of ``agents``, each task drawn
from ``trace_ids`` — or, with an explicit ``composition`` such as ``"(1,2),8,9"``, the i-th
event triggers the i-th group (cycling), ``(1,2)`` meaning two robots start T1 and T2 together.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from timelyllm_ros.errors import ProfileError, TufError, WorkloadError
from timelyllm_ros.profiles import check_profile_name, load_profile
from timelyllm_ros.request import TaskSpec
from timelyllm_ros.traces import DATA_DIR, TraceSet, approx_tokenize, load_trace_set
from timelyllm_ros.tuf import Tuf, tuf_for_class

AUTHORS_DIR = DATA_DIR / 'authors'
AUTHORS_WORKLOADS = {
    'authors-drone': AUTHORS_DIR / 'data_sample_1.json',
    'authors-arm': AUTHORS_DIR / 'data_sample_robotarm_fltrnn.json',
}
CLASS_TUF = {'arm': 'normal'}
"""TUF class of task classes that are not TUF classes themselves (arm tasks are normal)."""


_GROUP = re.compile(r'\s*(?:\(\s*(\d+(?:\s*,\s*\d+)*)\s*\)|(\d+))\s*(,|$)')


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

    name: str
    description: str = ''
    eps: float = Field(gt=0, description='Events per second (Poisson rate).')
    max_tpe: int = Field(ge=1, description='Maximum tasks per event.')
    trace_ids: list[int] = Field(min_length=1)
    agents: int = Field(ge=1, description='Number of robots (agents).')
    duration_s: float = Field(gt=0)
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
    return [*BUILTIN_WORKLOADS, *AUTHORS_WORKLOADS]


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
        traces.get(trace_id)
    if spec.max_tpe > spec.agents:
        raise WorkloadError(f'{spec.name}: max_tpe {spec.max_tpe} > agents {spec.agents}')
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
                raise WorkloadError(f'{spec.name}: event of {len(chosen)} tasks > agents')
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
                raise WorkloadError(f'{spec.name}: profile {spec.profile!r} is a {kind}, '
                                    f'trace {trace_id} is for a {own}')
    except ProfileError as err:
        raise WorkloadError(f'{spec.name}: profile: {err}') from None


def load_workload_spec(path: str | Path) -> WorkloadSpec:
    """Load a workload spec YAML file (the fields of :class:`WorkloadSpec`)."""
    try:
        return WorkloadSpec.model_validate(yaml.safe_load(Path(path).read_text('utf-8')))
    except OSError as err:
        raise WorkloadError(f'{path}: cannot read workload: {err.strerror}') from None
    except (yaml.YAMLError, ValidationError, WorkloadError) as err:
        raise WorkloadError(f'{path}: invalid workload spec: {err}') from None


def load_authors_workload(path: str | Path, traces: TraceSet | None = None) -> list[TaskSpec]:
    """Load a workload file in the authors' JSON format (exact arrivals, measured skill times).

    Drone records (trace ids 0–7) map to traces 1–8, robot-arm records (skills move_to / take /
    drop, trace ids 0–2) to traces 9–11; TUFs come from the records.

    Raises:
        WorkloadError: unreadable file or a record that does not fit the format.
    """
    traces = traces or load_trace_set()
    try:
        records = json.loads(Path(path).read_text(encoding='utf-8'))
    except OSError as err:
        raise WorkloadError(f'{path}: cannot read workload: {err.strerror}') from None
    except json.JSONDecodeError as err:
        raise WorkloadError(f'{path}: not valid JSON: {err}') from None
    if not isinstance(records, list) or not records:
        raise WorkloadError(f'{path}: expected a non-empty list of task records')
    is_arm = any(skill == 'move_to' for r in records if isinstance(r, dict)
                 for skill, _ in r.get('exe_time_detail', []))
    offset = 9 if is_arm else 1
    tasks: list[TaskSpec] = []
    for position, record in enumerate(sorted(records, key=lambda r: r.get('trigger time', 0))):
        try:
            beta, ert, zero = record['tuf']
            tuf = Tuf.from_zero_time(float(beta), float(ert), float(zero))
            detail = tuple((str(s), float(t)) for s, t in record['exe_time_detail'])
            tasks.append(_task(position, int(record['trace_id']) + offset,
                               int(record['agent_id']), float(record['trigger time']), traces,
                               tuf=tuf, task_text=str(record['task_input']),
                               skill_times=detail))
        except (KeyError, TypeError, ValueError, TufError, WorkloadError) as err:
            raise WorkloadError(f'{path}: record {position}: {err}') from None
    return tasks


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
    elif name in BUILTIN_WORKLOADS:
        spec = BUILTIN_WORKLOADS[name]
    else:
        raise WorkloadError(f'unknown workload {name!r}; known: {", ".join(workload_names())}')
    if composition is not None:
        spec = spec.model_copy(update={'composition': composition})
        parse_composition(composition)
    return spec.name, generate_tasks(spec, seed)
