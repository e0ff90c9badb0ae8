"""Side-by-side benchmark of scheduling policies on one workload, plus overhead measurements.

Every policy runs on the same tasks (same seed, same arrivals) over a fresh engine; results
go to ``summary.json`` (per class, per task type, overall), ``tasks.csv`` (one row per task and
policy) and PNG figures in the style of the paper.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from timelyllm_ros.core.admission import BatchMode
from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.core.tuf import NORMAL, URGENT
from timelyllm_ros.engines import Engine, create_engine, engine_class, engine_options
from timelyllm_ros.engines.replicas import SimulatedReplicas
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import ConfigError
from timelyllm_ros.evaluation.metrics import (
    TaskMetrics,
    aggregate,
    as_row,
    group_by,
    task_metrics,
)
from timelyllm_ros.evaluation.plots import batch_sweep, metric_figures, paper_figures
from timelyllm_ros.evaluation.simulation import SimulationResult, simulate
from timelyllm_ros.policies import create_policy

SWEEP_BATCH_MODE: BatchMode = 'fixed'
"""The batch-size sweeps (Fig. 7 and 8) fix the batch size as the paper (§7.3.1) and the
authors' artifact do: admission by the cap and memory only, for every policy."""

# Figures every policy is compared on, TimelyLLM's and those the rival schedulers optimise.
COMPARED_METRICS = ('utility_mean', 'utility_floored_mean', 'slo_attainment', 'completion_rate',
                    'response_time_mean_s', 'response_time_p95_s', 'response_time_p99_s',
                    'waiting_time_mean_s', 'completion_time_p99_s')


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the engine of each run is built: the calibrated simulator, or a real engine by name
    (``cpu``, …) whose measured iteration times advance the simulated clock."""

    calibration: str | None = None
    prefix_caching: bool = True
    name: str = 'sim'                               # engine name for create_engine
    options: tuple[tuple[str, object], ...] = ()    # extra keyword options of a real engine
    replicas: int = 1                               # simulated replicas behind one queue
    request_latency_s: float = 0.0                  # ... the network's share of a request

    def build(self) -> Engine:
        """The engine, through :func:`~timelyllm_ros.engines.create_engine` (EngineError for an
        option it does not take), warmed up; ``replicas`` simulated engines behind one
        (:class:`~timelyllm_ros.engines.replicas.SimulatedReplicas`) when more than one.

        Raises:
            ConfigError: replicas below 1, or several of a real engine (a pool of servers is
                the vllm-server engine's, issue 30).
        """
        if self.replicas < 1:
            raise ConfigError(f'replicas must be >= 1, got {self.replicas}')
        if self.request_latency_s and self.replicas == 1:
            raise ConfigError('a request latency is modelled for a replica pool (--replicas '
                              '2 or more)')
        if self.replicas > 1 and not issubclass(engine_class(self.name), SimulatedEngine):
            raise ConfigError(f'--replicas simulates replicas of the calibrated simulator; '
                              f'engine {self.name} runs one')
        options: dict[str, Any] = dict(self.options)
        if self.calibration is not None:
            options['calibration'] = self.calibration
        if not self.prefix_caching:
            options['prefix_caching'] = False
        engines = [create_engine(self.name, **options) for _ in range(self.replicas)]
        engine = engines[0] if len(engines) == 1 else SimulatedReplicas(
            [e for e in engines if isinstance(e, SimulatedEngine)],
            request_latency_s=self.request_latency_s)
        engine.warmup()          # first-call allocations stay out of the measured run
        return engine

    def describe(self) -> dict[str, object]:
        """The engine block of summary.json (a calibrated engine names its calibration)."""
        described: dict[str, object] = {'name': self.name}
        if 'calibration' in engine_options(self.name):
            described['calibration'] = self.calibration or 'default'
        if self.replicas > 1:
            described['replicas'] = self.replicas
            described['request_latency_s'] = self.request_latency_s
        return {**described, 'prefix_caching': self.prefix_caching, **dict(self.options)}


PAPER_CALIBRATION = 'llama3-8b-fp16_rtx4090_vllm054'
"""The paper's setup as the authors' artifact configures it (vLLM 0.5.4 on an RTX 4090)."""

REGIMES: dict[str, str] = {
    'default': 'the engine as configured',
    'contended': 'the same engine without prefix caching: every prompt and every resume is '
                 'prefilled whole, so the engine, not the queue, decides who is late. On the '
                 'default engine every segmented policy ends within 0.002 of the maximum urgent '
                 'utility on WID1 and WID2 (issue 26): that regime cannot tell them apart',
    'paper': "the paper's setup: the authors' vLLM 0.5.4 calibration on an RTX 4090 "
             f'({PAPER_CALIBRATION}); the calibrated simulator only',
}
"""Engine regimes ``bench --regimes`` runs the policies in, by name."""


def regime_engine(regime: str, engine: EngineOptions) -> EngineOptions:
    """The engine options of a regime (:data:`REGIMES`) derived from the configured ones.

    Raises:
        ConfigError: an unknown regime, or ``paper`` on a real engine.
    """
    if regime == 'default':
        return engine
    if regime == 'contended':
        return replace(engine, prefix_caching=False)
    if regime == 'paper':
        if engine.name != 'sim':
            raise ConfigError(f"the paper regime is the paper's calibration, for the simulator;"
                              f' engine {engine.name} has none')
        return replace(engine, calibration=PAPER_CALIBRATION)
    raise ConfigError(f'unknown regime {regime!r}; known: {", ".join(REGIMES)}')


def rows_summary(rows: Sequence[TaskMetrics]) -> dict[str, Any]:
    """The per class, per task type and overall summaries of a run's tasks."""
    return {'by_class': group_by(rows, 'task_class'), 'by_type': group_by(rows, 'task_type'),
            'overall': aggregate(rows)}


def run_summary(result: SimulationResult) -> dict[str, Any]:
    """A run's :func:`rows_summary` and its figures (times, iterations, batch, deciding)."""
    batches = result.batch_sizes
    return {
        **rows_summary([task_metrics(g) for g in result.generations]),
        'run': {
            'wall_time_s': result.wall_time_s,
            'sim_time_s': result.sim_time_s,
            'speedup': result.sim_time_s / result.wall_time_s if result.wall_time_s else None,
            'engine_iterations': result.ticks,
            'decision_ms_mean': (1000.0 * result.decision_s / result.ticks
                                 if result.ticks else None),
            'mean_batch_size': sum(batches) / len(batches) if batches else 0.0,
            'rejected_goals': len(result.rejected),
        },
    }


def run_bench(
    workload: str,
    tasks: Sequence[TaskSpec],
    policies: Sequence[str],
    out: Path,
    seed: int = 0,
    config: SchedulerConfig | None = None,
    engine: EngineOptions | None = None,
    batch_sizes: Sequence[int] = (),
    progress: Callable[[str], None] | None = None,
    robot_jitter: float = 0.0,
    regime: str = 'default',
    figures: bool = True,
) -> dict[str, Any]:
    """Run every policy on the tasks; write summary.json, tasks.csv and (``figures``) the
    figures (``robot_jitter``: :func:`~timelyllm_ros.evaluation.simulation.simulate`'s)."""
    config = config or SchedulerConfig()
    engine = engine or EngineOptions()
    out.mkdir(parents=True, exist_ok=True)
    per_policy: dict[str, dict[str, Any]] = {}
    summary: dict[str, object] = {
        'workload': workload, 'regime': regime, 'seed': seed, 'robot_jitter': robot_jitter,
        'tasks': len(tasks),
        'comm_s': config.comm_s, 'max_batch': config.max_batch,
        'batch_mode': config.batch_mode,
        'engine': engine.describe(),
        'policies': per_policy,
    }
    rows: list[dict[str, object]] = []
    by_type: dict[str, dict[str, dict[str, float | int]]] = {}
    by_class: dict[str, dict[str, dict[str, float | int]]] = {}
    classes: set[str] = set()
    for policy in policies:
        if progress:
            progress(policy)
        result = simulate(tasks, policy, seed=seed, config=config, engine=engine.build(),
                          robot_jitter=robot_jitter)
        policy_summary: dict[str, Any] = run_summary(result)
        per_policy[policy] = policy_summary
        by_type[policy] = policy_summary['by_type']
        by_class[policy] = {**policy_summary['by_class'], 'overall': policy_summary['overall']}
        classes.update(policy_summary['by_class'])
        for generation in result.generations:
            rows.append({'policy': policy, **as_row(task_metrics(generation))})
    if batch_sizes:
        sweep: dict[str, dict[int, float]] = {}
        sweep_completion: dict[str, dict[int, float]] = {}
        for policy in [p for p in ('vllm', 'timelyllm') if p in policies] or list(policies):
            for size in batch_sizes:
                if progress:
                    progress(f'{policy} batch {size}')
                sized = replace(config, max_batch=size, batch_mode=SWEEP_BATCH_MODE)
                result = simulate(tasks, policy, seed=seed, config=sized,
                                  engine=engine.build(), robot_jitter=robot_jitter)
                overall = aggregate([task_metrics(g) for g in result.generations])
                sweep.setdefault(policy, {})[size] = float(overall['utility_mean'])
                sweep_completion.setdefault(policy, {})[size] = float(overall['completion_rate'])
        summary['batch_sweep'] = {p: {str(k): v for k, v in s.items()} for p, s in sweep.items()}
        summary['batch_sweep_completion'] = {p: {str(k): v for k, v in s.items()}
                                             for p, s in sweep_completion.items()}
        summary['batch_sweep_mode'] = SWEEP_BATCH_MODE
        batch_sweep(out / 'fig7_batch_sweep.png', sweep,
                    f'{workload}: utility vs batch size ({SWEEP_BATCH_MODE} batch)',
                    sweep_completion)
    (out / 'summary.json').write_text(json.dumps(_finite(summary), indent=2) + '\n')
    with (out / 'tasks.csv').open('w', newline='') as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ['policy'])
        writer.writeheader()
        writer.writerows(rows)
    if figures:
        paper_figures(out, workload, by_type, sorted(classes))
        metric_figures(out, workload, by_class, COMPARED_METRICS)
    return summary


def _finite(value: object) -> object:
    """JSON has no NaN: write null for undefined means."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class DecisionCost:
    """What one scheduling decision cost, medians over the repeats."""

    queued: int
    decision_ms: float          # CPU time of one decide()
    admitted: float             # generations it admitted
    per_admission_ms: float     # decision_ms / admitted (decision_ms when none)


def scheduling_overhead(queued: int, repeats: int = 30, policy: str = 'timelyllm',
                        running: int = 8) -> DecisionCost:
    """CPU time of the scheduler's real ``decide()`` with a batch that has room.

    The state of a fleet behind its load: ``running`` generations run, one of them urgent and
    already past its deadline, so the latency-guided test weighs every candidate's delay
    against the queue's losses; the queue holds ``queued`` generations (initial ones past
    their zero-utility time, suspended ones on time; normal and urgent). The decision ranks
    them and admits while its policy, the batch cap and KV memory allow. Each repeat builds
    that state afresh (not timed) and times one decision.
    """
    from timelyllm_ros.core.request import TaskStatus

    script = ('mf', '(', '50', ')')
    decisions, admitted, per_admission = [], [], []
    for _ in range(repeats):
        scheduler = Scheduler(create_policy(policy), create_engine('sim'), SimClock(100.0))
        for r in range(running):
            urgent = r == 0
            scheduler.submit(TaskSpec(
                f'running-{r}', f'tello-r{r}', 'tello', 'urgent' if urgent else 'normal', 'T6',
                URGENT if urgent else NORMAL, 99.0 if urgent else 99.5, 'avoid', 1331,
                script=script))
        scheduler.decide()
        for i in range(queued):
            tuf = URGENT if i % 3 == 0 else NORMAL
            spec = TaskSpec(f'q{i}', f'tello-{i}', 'tello',
                            'urgent' if tuf is URGENT else 'normal', 'T1', tuf,
                            98.0 + i * 1e-6, 'find the cat', 1331, script=script)
            generation = scheduler.submit(spec)
            if i % 2:
                # A suspended generation: its robot needs the next segment a little later.
                scheduler.queue.remove(spec.task_id)
                generation.k, generation.need_time = 1, 100.5 + (i % 50) * 0.1
                generation.status = TaskStatus.SUSPENDED
                scheduler.queue.push(generation, 0.09)
        started = time.thread_time()
        admitted_now = len(scheduler.decide())
        cost_ms = (time.thread_time() - started) * 1000.0
        decisions.append(cost_ms)
        admitted.append(admitted_now)
        per_admission.append(cost_ms / admitted_now if admitted_now else cost_ms)
    return DecisionCost(queued, statistics.median(decisions), statistics.median(admitted),
                        statistics.median(per_admission))
