"""A real engine's runs kept as test data, so the simulator is checked against them anywhere.

``validate-sim`` compares the simulator with a real engine. Live, that needs the engine (a GPU
for vLLM on a datacenter card); a recording keeps what the comparison needs, so the
simulator's fidelity to that hardware is checked offline, in CI included
(``timelyllm validate-sim --real FILE``):

* the engine's calibration, measured on it just before the runs: the simulator runs on it;
* per policy, every task as the simulator replays it (the real output, one piece per
  iteration, over a prompt of the real engine's token count, :func:`validate_sim.sim_twin`)
  and its real outcome (:class:`~timelyllm_ros.evaluation.metrics.TaskMetrics`);
* every engine iteration of the policy's run (measured time, batch size, prefilled and cached
  tokens), to see where the simulator's model of the engine is off;
* the scheduler settings, seed and robot jitter of the runs, where and how they were recorded,
  and what the recording lacks (``missing``: one made from another source says so).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.core.tuf import Tuf
from timelyllm_ros.engines.calibration import Calibration
from timelyllm_ros.evaluation.metrics import TaskMetrics
from timelyllm_ros.evaluation.simulation import Iteration, SimulationResult
from timelyllm_ros.safe_files import DATA_FILE, WorkloadInputError, load_json, validation_problems

RECORDING_DIR = Path(__file__).resolve().parent.parent / 'data' / 'recordings'
"""Recordings shipped with the package (``validate-sim --real NAME``)."""

_FROZEN = ConfigDict(extra='forbid', frozen=True, allow_inf_nan=False)
Outcome = dict[str, float | int | str | bool | None]


class RecordedTask(BaseModel):
    """One task: its simulator twin's spec and its real outcome."""

    model_config = _FROZEN

    task_id: str
    robot_id: str
    profile: str
    task_class: str
    task_type: str
    tuf: tuple[float, float, float] = Field(description='beta, ert_s, alpha')
    arrival_time: float
    task: str
    prompt_tokens: int = Field(ge=1)
    task_tokens: int = Field(ge=0)
    pieces: tuple[str, ...] | None = None           # the real output, one piece per iteration
    skill_times: tuple[tuple[str, float], ...] | None = None
    outcome: Outcome = Field(description='TaskMetrics fields; null where undefined')

    @classmethod
    def of(cls, twin: TaskSpec, metrics: TaskMetrics) -> RecordedTask:
        tuf = twin.tuf
        return cls(task_id=twin.task_id, robot_id=twin.robot_id, profile=twin.profile,
                   task_class=twin.task_class, task_type=twin.task_type,
                   tuf=(tuf.beta, tuf.ert_s, tuf.alpha), arrival_time=twin.arrival_time,
                   task=twin.task, prompt_tokens=twin.prompt_tokens,
                   task_tokens=twin.task_tokens, pieces=twin.script,
                   skill_times=twin.skill_times,
                   outcome={k: None if isinstance(v, float) and not math.isfinite(v) else v
                            for k, v in dataclasses.asdict(metrics).items()})

    def spec(self) -> TaskSpec:
        """The task as the simulator replays it."""
        beta, ert_s, alpha = self.tuf
        return TaskSpec(task_id=self.task_id, robot_id=self.robot_id, profile=self.profile,
                        task_class=self.task_class, task_type=self.task_type,
                        tuf=Tuf(beta=beta, ert_s=ert_s, alpha=alpha),
                        arrival_time=self.arrival_time, task=self.task,
                        prompt_tokens=self.prompt_tokens, task_tokens=self.task_tokens,
                        script=self.pieces, skill_times=self.skill_times)

    def metrics(self) -> TaskMetrics:
        """The real outcome (undefined times as NaN)."""
        fields = {f.name: f for f in dataclasses.fields(TaskMetrics)}
        values = {k: math.nan if v is None and fields[k].type == 'float' else v
                  for k, v in self.outcome.items() if k in fields}
        return TaskMetrics(**values)  # type: ignore[arg-type]


class RecordedRun(BaseModel):
    """One policy's run on the real engine."""

    model_config = _FROZEN

    policy: str
    sim_time_s: float = Field(ge=0)
    tasks: tuple[RecordedTask, ...]
    iterations: tuple[tuple[float, int, int, int], ...] = Field(
        default=(), description='duration_s, batch_size, prefill_tokens, cached_tokens')

    @property
    def engine_iterations(self) -> list[Iteration]:
        return [Iteration(*i) for i in self.iterations]


class Recording(BaseModel):
    """Runs of every policy on one real engine, with the engine's calibration."""

    model_config = _FROZEN

    schema_version: Literal[1] = 1
    source: str = Field(description='where, when and how it was recorded')
    missing: tuple[str, ...] = Field(default=(), description='what it lacks, and why')
    engine: dict[str, str] = Field(description='name, model, hardware')
    workload: str
    seed: int = Field(ge=0)
    robot_jitter: float = Field(default=0.0, ge=0)
    scheduler: dict[str, float | int | str | bool | None] = Field(
        description='the SchedulerConfig of the runs')
    calibration: Calibration
    runs: tuple[RecordedRun, ...]

    def config(self) -> SchedulerConfig:
        """The scheduler settings the runs had (a recording from before
        ``suspend_on_next_statement`` suspended its generations at each cut)."""
        fields = {'suspend_on_next_statement': False, **self.scheduler}
        return SchedulerConfig(**fields)  # type: ignore[arg-type]


def recorded_run(policy: str, twins: Sequence[TaskSpec], real: SimulationResult,
                 metrics: Sequence[TaskMetrics]) -> RecordedRun:
    """A policy's real run: the twins (task order), their real metrics, its iterations."""
    by_id = {m.task_id: m for m in metrics}
    return RecordedRun(policy=policy, sim_time_s=real.sim_time_s,
                       tasks=tuple(RecordedTask.of(t, by_id[t.task_id]) for t in twins
                                   if t.task_id in by_id),
                       iterations=tuple((i.duration_s, i.batch_size, i.prefill_tokens,
                                         i.cached_tokens) for i in real.iterations))


def scheduler_fields(config: SchedulerConfig) -> dict[str, Any]:
    """A SchedulerConfig as the recording keeps it."""
    return dataclasses.asdict(config)


def write_recording(recording: Recording, path: str | Path) -> Path:
    """Write a recording as JSON (indented), gzip-compressed where the name ends in ``.gz``
    (a GPU run of hundreds of tasks is a few MB of text, a tenth of that compressed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(recording.model_dump(mode='json'), indent=1) + '\n').encode('utf-8')
    out.write_bytes(gzip.compress(data, mtime=0) if out.suffix == '.gz' else data)
    return out


def shipped_recordings() -> dict[str, Path]:
    """The recordings shipped with the package, by name (``.json`` or ``.json.gz``)."""
    return {path.name.removesuffix('.gz').removesuffix('.json'): path
            for pattern in ('*.json', '*.json.gz') for path in RECORDING_DIR.glob(pattern)}


def load_recording(name_or_path: str | Path) -> Recording:
    """A shipped recording by name, or any recording file.

    Raises:
        WorkloadInputError: missing, too large, not JSON, or not a recording (the message
            names the file and the fields).
    """
    candidate = Path(name_or_path)
    shipped = shipped_recordings()
    path = (candidate if candidate.suffix in ('.json', '.gz')
            else shipped.get(str(name_or_path), RECORDING_DIR / f'{candidate}.json'))
    if not path.is_file():
        known = ', '.join(sorted(shipped))
        raise WorkloadInputError(str(path), f'no such recording (shipped: {known})')
    try:
        data = load_json(path, WorkloadInputError, DATA_FILE)
    except OSError as err:
        raise WorkloadInputError(str(path), f'cannot read: {err.strerror}') from None
    try:
        return Recording.model_validate(data)
    except ValidationError as err:
        raise WorkloadInputError(str(path), f'not a recording: {validation_problems(err)}'
                                 ) from None
