"""Validation of the simulator against a real engine, side by side in one run.

The same tasks run twice per policy: on the real engine (simulated robots, the clock advanced
by the engine's measured iteration times, as ``timelyllm bench --engine …`` does) and on the
simulator calibrated from that very engine a moment before
(:func:`timelyllm_ros.evaluation.calibrate. measure`). So that both runs plan the same thing, the
simulator's twin of each task replays what the real engine produced, iteration by iteration, over
a prompt of the real engine's token count. Per policy the result holds the per-task response,
waiting and completion times of both runs, their median absolute relative error, and each run's
bench summary; and whether the policies rank the same (by mean utility) on both.

The two halves are apart: :func:`record` runs the real engine and keeps its runs as a
:class:`~timelyllm_ros.evaluation.recording.Recording`, :func:`compare` replays a recording on
the simulator, now or later and anywhere (``validate-sim --record`` / ``--real``).
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from timelyllm_ros.core.request import Generation, TaskSpec
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.engines.base import Engine
from timelyllm_ros.engines.calibration import Calibration
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.bench import EngineOptions, rows_summary, run_summary
from timelyllm_ros.evaluation.calibrate import hardware_label, measure
from timelyllm_ros.evaluation.metrics import task_metrics
from timelyllm_ros.evaluation.recording import (
    RecordedRun,
    Recording,
    recorded_run,
    scheduler_fields,
)
from timelyllm_ros.evaluation.simulation import Iteration, simulate
from timelyllm_ros.language.profiles import load_profile

COMPARED = ('response', 'waiting', 'completion')
"""Per-task times compared (``TaskMetrics`` fields ``<name>_time_s``)."""


def _engine_prompt_tokens(spec: TaskSpec, count_tokens: Callable[[str], int]) -> int:
    """The task's whole prompt (its profile's preamble and the task) in the engine's tokens."""
    return count_tokens(load_profile(spec.profile).build_prompt(spec.task))


def sim_twin(spec: TaskSpec, real: Generation, count_tokens: Callable[[str], int] | None
             ) -> TaskSpec:
    """The task as the simulator should replay it: the real engine's output, one piece per
    iteration, over a prompt of the real engine's token count (when it can count)."""
    twin = replace(spec, script=tuple(real.pieces) or spec.script)
    if count_tokens is None:
        return twin
    prompt = max(2, _engine_prompt_tokens(spec, count_tokens))
    task = min(prompt - 1, max(1, count_tokens(spec.task)))
    return replace(twin, prompt_tokens=prompt, task_tokens=task)


def _typical_prompt_tokens(tasks: Sequence[TaskSpec],
                           count_tokens: Callable[[str], int] | None) -> int:
    """Median prompt length of the tasks in the engine's tokens (their recorded count when
    the engine cannot count)."""
    if count_tokens is None:
        return int(statistics.median(t.prompt_tokens for t in tasks))
    return int(statistics.median(_engine_prompt_tokens(t, count_tokens) for t in tasks))


def _token_counter(engine: Engine) -> Callable[[str], int] | None:
    """The engine's token count of a text, when it has a tokenizer."""
    return engine.count_tokens if engine.supports('tokenizer') else None


def median_abs_rel_error(real: Sequence[float], sim: Sequence[float]) -> float | None:
    """Median over tasks of |sim − real| / real (tasks where either is undefined or the real
    time is 0 are left out; None when none is left)."""
    errors = [abs(s - r) / r for r, s in zip(real, sim, strict=True)
              if math.isfinite(r) and math.isfinite(s) and r > 0]
    return statistics.median(errors) if errors else None


def record(tasks: Sequence[TaskSpec], policies: Sequence[str], engine: EngineOptions,
           config: SchedulerConfig | None = None, seed: int = 0, robot_jitter: float = 0.0,
           calibration: Calibration | None = None, workload: str = '',
           progress: Callable[[str], None] | None = None) -> Recording:
    """Run every policy on the real engine and keep what the simulator is compared with.

    Args:
        tasks: the workload's tasks.
        policies: policy names.
        engine: how to build the real engine (one fresh engine per run).
        config: scheduler configuration of every run.
        seed: seeds the simulated robots of every run.
        robot_jitter: relative spread of the robots' execution times (the same draws in the
            real and the simulated run of a policy).
        calibration: the real engine's calibration (default: measured now, on a fresh engine).
        workload: the workload's name, for the record.
        progress: called with a short label before each step.
    """
    say = progress or (lambda _label: None)
    config = config or SchedulerConfig()
    hardware = model = ''
    origin = 'calibration measured on the same engine just before'
    if calibration is not None:
        origin = f'calibration given: {calibration.source}'
    else:
        say('calibrate')
        probe = engine.build()
        try:
            # Decode steps measured at the workload's own prompt length: their cost grows
            # with the context, which a short reference context extrapolates poorly.
            context = _typical_prompt_tokens(tasks, _token_counter(probe))
            calibration = measure(probe, probe.stats().model, engine.name,
                                  lengths=(16, 128, 512, 1024), batch_sizes=(1, 2, 4, 8),
                                  context_words=context, long_context_words=2 * context,
                                  steps=4, repeats=1)
        finally:
            probe.close()
    runs: list[RecordedRun] = []
    for policy in policies:
        say(f'{policy} on {engine.name}')
        real_engine = engine.build()
        counter = _token_counter(real_engine)
        try:
            real = simulate(tasks, policy, seed=seed, config=config, engine=real_engine,
                            robot_jitter=robot_jitter)
            stats = real_engine.stats()
            hardware, model = stats.hardware, stats.model
            by_id = {g.task_id: g for g in real.generations}
            twins = [sim_twin(spec, by_id[spec.task_id], counter) if spec.task_id in by_id
                     else spec for spec in tasks]
        finally:
            real_engine.close()
        runs.append(recorded_run(policy, twins, real,
                                 [task_metrics(g) for g in real.generations]))
    date = datetime.date.today().isoformat()
    options = ', '.join(f'{k}={v}' for k, v in engine.options)
    return Recording(
        source=(f'Recorded by `timelyllm validate-sim --record` on {date}: engine '
                f'{engine.name}{f" ({options})" if options else ""}, model {model}, on '
                f'{hardware_label(hardware)}; {len(tasks)} tasks of {workload or "a workload"},'
                f' seed {seed}; {origin}'),
        engine={'name': engine.name, 'model': model, 'hardware': hardware},
        workload=workload, seed=seed, robot_jitter=robot_jitter,
        scheduler=scheduler_fields(config), calibration=calibration, runs=tuple(runs))


def compare(recording: Recording, calibration: Calibration | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replay every recorded run on the simulator and compare it with the real one, per task.

    Args:
        recording: the real runs.
        calibration: the simulator's latency model (default: the recording's, measured on
            the real engine).
        progress: called with a short label before each run.

    Returns:
        The calibration; per policy the median absolute relative error of each compared
        time, both runs' summaries and every task's times; the ranking by mean utility on
        both, and whether it is the same.
    """
    say = progress or (lambda _label: None)
    calibration = calibration or recording.calibration
    config = recording.config()
    out: dict[str, Any] = {'calibration': calibration.model_dump(mode='json'),
                           'recording': {'source': recording.source,
                                         'missing': list(recording.missing),
                                         'engine': recording.engine,
                                         'workload': recording.workload},
                           'policies': {}}
    utility: dict[str, dict[str, float]] = {'real': {}, 'sim': {}}
    for run in recording.runs:
        say(f'{run.policy} on the simulator')
        sim = simulate([t.spec() for t in run.tasks], run.policy, seed=recording.seed,
                       config=config, engine=SimulatedEngine(calibration),
                       robot_jitter=recording.robot_jitter)
        real_metrics = {t.task_id: t.metrics() for t in run.tasks}
        sim_metrics = {g.task_id: task_metrics(g) for g in sim.generations}
        ids = [t for t in real_metrics if t in sim_metrics]
        per_task = {t: {f'{name}_s': {'real': getattr(real_metrics[t], f'{name}_time_s'),
                                      'sim': getattr(sim_metrics[t], f'{name}_time_s')}
                        for name in COMPARED} for t in ids}
        errors = {name: median_abs_rel_error(
            [getattr(real_metrics[t], f'{name}_time_s') for t in ids],
            [getattr(sim_metrics[t], f'{name}_time_s') for t in ids]) for name in COMPARED}
        real_summary = rows_summary(list(real_metrics.values()))
        real_summary['run'] = iteration_figures(run.sim_time_s, run.engine_iterations)
        sim_summary = run_summary(sim)
        sim_summary['run'].update(iteration_figures(sim.sim_time_s, sim.iterations))
        utility['real'][run.policy] = float(real_summary['overall']['utility_mean'])
        utility['sim'][run.policy] = float(sim_summary['overall']['utility_mean'])
        out['policies'][run.policy] = {'median_abs_rel_error': errors, 'real': real_summary,
                                       'sim': sim_summary, 'tasks': per_task}

    def ranking(values: dict[str, float]) -> list[str]:
        return sorted(values, key=lambda p: -values[p])

    out['ranking'] = {'real': ranking(utility['real']), 'sim': ranking(utility['sim'])}
    out['ranking_same'] = out['ranking']['real'] == out['ranking']['sim']
    return out


def iteration_figures(sim_time_s: float, iterations: Sequence[Iteration]) -> dict[str, Any]:
    """What a run's engine iterations add up to: their count and time, the count and time of
    those that prefilled (each pays the engine's fixed cost of an iteration however few tokens
    it prefills, and stalls every running generation on an engine that prefills whole) and
    the count of the decodes, and the median ms of the iterations that prefilled, of the
    decodes right after the batch changed (a join, an end, a prefill before), and of the
    decodes of an unchanged batch: where a latency model is off shows in which of them
    differ."""
    prefill: list[float] = []
    changed: list[float] = []
    steady: list[float] = []
    prefill_s = 0.0
    previous: Iteration | None = None
    for iteration in iterations:
        ms = 1000.0 * iteration.duration_s
        if iteration.prefill_tokens:
            prefill.append(ms)
            prefill_s += iteration.duration_s
        elif previous is None or previous.prefill_tokens or (
                previous.batch_size != iteration.batch_size):
            changed.append(ms)
        else:
            steady.append(ms)
        previous = iteration

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {'sim_time_s': sim_time_s, 'engine_iterations': len(iterations),
            'engine_busy_s': sum(i.duration_s for i in iterations),
            'prefill_iterations': len(prefill),
            'decode_iterations': len(changed) + len(steady),
            'prefill_busy_s': prefill_s,
            'prefill_iteration_ms_median': median(prefill),
            'decode_after_change_ms_median': median(changed),
            'decode_iteration_ms_median': median(steady),
            'prefill_tokens': sum(i.prefill_tokens for i in iterations),
            'cached_tokens': sum(i.cached_tokens for i in iterations)}


def validate(tasks: Sequence[TaskSpec], policies: Sequence[str], engine: EngineOptions,
             config: SchedulerConfig | None = None, seed: int = 0, robot_jitter: float = 0.0,
             calibration: Calibration | None = None, workload: str = '',
             progress: Callable[[str], None] | None = None) -> tuple[dict[str, Any], Recording]:
    """Record every policy on the real engine (:func:`record`), then compare the simulator
    with the recording (:func:`compare`); returns the comparison and the recording."""
    recording = record(tasks, policies, engine, config=config, seed=seed,
                       robot_jitter=robot_jitter, calibration=calibration, workload=workload,
                       progress=progress)
    return compare(recording, progress=progress), recording
