"""Throughput under overload: a fleet whose goals all arrive in one burst (issue 13, item 7).

    python3 benchmarks/overload.py [--robots 1000] [--seed 0] [--burst-s 2] [--tasks-per-robot 1]
                                   [--policies vllm,timelyllm,timelyllm-share] [--batch-mode fixed]
                                   [--repeats 1] [--suspend-at-cut] [--json]

Every robot of the fleet (a Tello drone running one of the drone traces T1–T8: T1–T5 normal,
T6–T8 urgent) sends its goals within ``burst_s`` simulated seconds, far more than the engine
(the calibrated simulator, prefix caching on) can generate in time, so nearly every goal is past
its zero-utility time before its generation can start. The fleet runs on the project's own
discrete-event simulation (:func:`timelyllm_ros.evaluation.simulation.simulate`), one run per
policy over the same goals, all on the simulated clock.

Per policy it reports the CPU time of one scheduling decision (``decide_mean_ms``, p99, max:
the scheduler's own ``decide`` with its admission tests and hooks, as the fleet runs it) and
per generation admitted (``decide_per_admission_us``, with the ``admissions``: a segmented
policy admits each resume too) and per second of the engine's busy time
(``decide_ms_per_engine_s``: a decision precedes each iteration of the simulated GPU),
``goals_per_s`` (completed goals per simulated second, from the first
arrival to the end of the last plan's generation: the engine's throughput), ``finished_per_s``
(goals per simulated second from the first arrival until the last robot finished its plan:
the fleet's; a segmented policy generates each next segment for when its robot needs it, so
its last generation ends later than an engine that generates whole plans at once, while its
robots need not finish later), the p50 / p99 / max response time, the mean batch size, the
mean utility of urgent goals (signed, and with late goals floored at 0) and of all goals, the
completion rate, and how many urgent goals earned any utility; how many of the engine's
iterations prefilled and how many decoded, and the prefills' share of its busy time (every
prefill iteration pays the engine's fixed cost of an iteration, and on an engine that
prefills whole it stalls every running generation: a policy that starts goals in many small
rounds spends more of the engine's time there than one that starts them in a few large ones);
then each policy's goals/s, finished/s and decide mean over the ``vllm`` policy's. By default
it runs ``vllm``, the paper's ``timelyllm`` and the fleet's default policy.
:func:`run_overload` returns the same as a dict (the fault campaign calls it).

A single run's decision times move by up to 30 % from one run to the next on a shared machine;
``--repeats N`` runs the policies N times in turn (each round every policy once, so a slower
stretch of the machine falls on all of them) and pools every decision of every round into the
decide figures. The simulated figures are the same in every round (the fleet is deterministic);
a round that differs is an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from timelyllm_ros.core.admission import BATCH_MODES, BatchMode
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.evaluation.bench import EngineOptions
from timelyllm_ros.evaluation.metrics import TaskMetrics, task_metrics
from timelyllm_ros.evaluation.simulation import SimulationResult, simulate
from timelyllm_ros.evaluation.validate_sim import iteration_figures
from timelyllm_ros.evaluation.workloads import DEFAULT_BURST_S, overload_tasks
from timelyllm_ros.policies import FLEET_POLICY
from timelyllm_ros.safe_files import int_arg

DEFAULT_POLICIES = ('vllm', 'timelyllm', FLEET_POLICY)


def generation_end_s(generation: Generation) -> float:
    """When the goal's plan was fully generated (its last segment cut), NaN if it never was."""
    if generation.status not in (TaskStatus.GENERATED, TaskStatus.FINISHED):
        return math.nan
    return generation.segments[-1].cut_time if generation.segments else math.nan


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def decision_figures(cpu_s: Sequence[float], admissions: Sequence[int],
                     engine_busy_s: float) -> dict[str, float]:
    """Mean, p99 and max CPU time of one scheduling decision (ms), the decisions' CPU time
    per generation they admitted (µs; ``admissions``: each decision's count, in the same
    order): a decision's cost grows with the generations it admits, each taking its own
    admission test, and a segmented policy admits every resume too; and their CPU time per
    second the engine iterated over the same runs (ms; ``engine_busy_s``): each decision
    precedes one iteration, so this is how much a loop that decides and then waits for the
    engine adds to the engine's time, here against the calibrated simulator's GPU."""
    ms = np.asarray(cpu_s, dtype=float) * 1000.0
    total_ms = float(ms.sum())
    admitted = sum(admissions)
    per_admission = total_ms * 1000.0 / admitted if admitted else 0.0
    per_engine_s = total_ms / engine_busy_s if engine_busy_s > 0 else 0.0
    if not len(ms):
        return {'decide_mean_ms': 0.0, 'decide_p99_ms': 0.0, 'decide_max_ms': 0.0,
                'decide_per_admission_us': per_admission, 'decide_ms_per_engine_s': per_engine_s}
    return {'decide_mean_ms': float(ms.mean()), 'decide_p99_ms': float(np.percentile(ms, 99)),
            'decide_max_ms': float(ms.max()), 'decide_per_admission_us': per_admission,
            'decide_ms_per_engine_s': per_engine_s}


def policy_figures(result: SimulationResult) -> dict[str, Any]:
    """The overload figures of one simulated run (times in simulated seconds)."""
    generations = result.generations
    rows: list[TaskMetrics] = [task_metrics(g) for g in generations]
    engine = iteration_figures(result.sim_time_s, result.iterations)
    ends = [e for e in (generation_end_s(g) for g in generations) if not math.isnan(e)]
    first_arrival = min((g.spec.arrival_time for g in generations), default=0.0)
    span = max(ends) - first_arrival if ends else 0.0
    done = [r for r in rows if r.completed]
    finished = [g.done_time for g in generations if g.status == TaskStatus.FINISHED]
    makespan = max(finished) - first_arrival if finished else 0.0
    responses = [r.response_time_s for r in done]
    urgent = [r for r in rows if r.task_class == 'urgent']
    batches = result.batch_sizes
    return {
        'tasks': len(rows),
        'completed': len(done),
        'generated': len(ends),
        'generation_span_s': span,
        'goals_per_s': len(ends) / span if span > 0 else 0.0,
        'makespan_s': makespan,
        'finished_per_s': len(finished) / makespan if makespan > 0 else 0.0,
        'late_share': (sum(not r.completed or r.utility <= 0 for r in rows) / len(rows)
                       if rows else 0.0),
        'response_p50_s': _percentile(responses, 50),
        'response_p99_s': _percentile(responses, 99),
        'response_max_s': max(responses) if responses else None,
        'mean_batch_size': sum(batches) / len(batches) if batches else 0.0,
        'max_batch_size': max(batches) if batches else 0,
        'urgent_tasks': len(urgent),
        'urgent_utility': _mean([r.utility for r in urgent]),
        'urgent_utility_floored': _mean([max(r.utility, 0.0) for r in urgent]),
        'completion_rate': len(done) / len(rows) if rows else 0.0,
        'urgent_saved': sum(r.completed and r.utility > 0 for r in urgent),
        'utility_mean': _mean([r.utility for r in rows]),
        'engine_iterations': result.ticks,
        'decisions': len(result.decision_admissions),
        'admissions': sum(result.decision_admissions),
        **{key: engine[key] for key in ('engine_busy_s', 'prefill_iterations',
                                        'decode_iterations', 'prefill_busy_s')},
        **decision_figures(result.decision_cpu_s, result.decision_admissions,
                           engine['engine_busy_s']),
        'sim_time_s': result.sim_time_s,
        'wall_time_s': result.wall_time_s,
    }


_TIMINGS = ('decide_mean_ms', 'decide_p99_ms', 'decide_max_ms', 'decide_per_admission_us',
            'decide_ms_per_engine_s', 'wall_time_s')


def pooled_figures(results: Sequence[SimulationResult]) -> dict[str, Any]:
    """:func:`policy_figures` of rounds of one policy on the same goals: the decide figures
    over every decision of every round, the wall time a round's mean.

    Raises:
        RuntimeError: a round's simulated figures differ from the first round's.
    """
    figures = policy_figures(results[0])
    for result in results[1:]:
        again = policy_figures(result)
        if any(not _same(again[key], value) for key, value in figures.items()
               if key not in _TIMINGS):
            raise RuntimeError('the simulated fleet gave different figures in two rounds on '
                               'the same goals')
    figures.update(decision_figures(
        [cpu for result in results for cpu in result.decision_cpu_s],
        [admitted for result in results for admitted in result.decision_admissions],
        len(results) * figures['engine_busy_s']))     # every round's, checked the same
    figures['wall_time_s'] = sum(result.wall_time_s for result in results) / len(results)
    return figures


def _same(a: object, b: object) -> bool:
    """Equal figures, NaN equal to NaN (a figure with nothing to measure)."""
    return a == b or (isinstance(a, float) and isinstance(b, float)
                      and math.isnan(a) and math.isnan(b))


def run_overload(robots: int, seed: int, *, policies: Sequence[str] = DEFAULT_POLICIES,
                 burst_s: float = DEFAULT_BURST_S, tasks_per_robot: int = 1,
                 prefix_caching: bool = True, replicas: int = 1,
                 request_latency_s: float = 0.0,
                 batch_mode: BatchMode = 'latency-guided', repeats: int = 1,
                 suspend_at_cut: bool = False) -> dict[str, Any]:
    """Run every policy on the same overload burst; the figures of each, side by side.

    Args:
        robots: fleet size (1,000 in issue 13).
        seed: seeds the goals and the simulated robots.
        policies: policy names; with ``vllm`` among them, the others get ``ratios_to_vllm``.
        burst_s: simulated seconds over which the goals arrive.
        tasks_per_robot: goals each robot sends within the burst.
        prefix_caching: whether the simulated engine shares the robot prompt's KV.
        replicas: simulated engines behind one queue (a replica pool).
        request_latency_s: the network's share of each segment request to a replica.
        batch_mode: TimelyLLM's admission: ``latency-guided`` (§4.4) or ``fixed`` (the batch
            cap and memory only).
        repeats: rounds of every policy, in turn; the decide figures pool the decisions of
            every round, ``wall_time_s`` is a round's mean.
        suspend_at_cut: suspend segmented generations at each cut (the paper's mechanism),
            not once their next statement begins (the scheduler's default).

    Raises:
        ValueError: ``repeats`` below 1.
        RuntimeError: a round's simulated figures differ from the first round's.

    Returns:
        ``{'robots', 'seed', 'tasks', 'burst_s', 'tasks_per_robot', 'repeats', 'policies':
        {name: figures of :func:`policy_figures`}, 'ratios_to_vllm'}`` where
        ``ratios_to_vllm`` maps each other policy to its ``goals_per_s``, ``finished_per_s``
        and ``decide_mean`` over the ``vllm`` policy's (empty unless ``vllm`` ran; a ratio is
        None where vllm's figure is 0).
    """
    if repeats < 1:
        raise ValueError(f'repeats must be >= 1, got {repeats}')
    tasks = overload_tasks(robots, seed, burst_s=burst_s, tasks_per_robot=tasks_per_robot)
    rounds: dict[str, list[SimulationResult]] = {policy: [] for policy in policies}
    for _ in range(repeats):
        for policy in policies:
            rounds[policy].append(simulate(
                tasks, policy, seed=seed,
                config=SchedulerConfig(batch_mode=batch_mode,
                                       suspend_on_next_statement=not suspend_at_cut),
                engine=EngineOptions(prefix_caching=prefix_caching, replicas=replicas,
                                     request_latency_s=request_latency_s).build()))
    figures = {policy: pooled_figures(results) for policy, results in rounds.items()}
    ratios = {}
    if 'vllm' in figures:
        ratios = {policy: {'goals_per_s': _ratio(mine['goals_per_s'],
                                                 figures['vllm']['goals_per_s']),
                           'finished_per_s': _ratio(mine['finished_per_s'],
                                                    figures['vllm']['finished_per_s']),
                           'decide_mean': _ratio(mine['decide_mean_ms'],
                                                 figures['vllm']['decide_mean_ms'])}
                  for policy, mine in figures.items() if policy != 'vllm'}
    return {'robots': robots, 'seed': seed, 'tasks': len(tasks), 'burst_s': burst_s,
            'tasks_per_robot': tasks_per_robot, 'repeats': repeats,
            'prefix_caching': prefix_caching,
            'replicas': replicas,
            'request_latency_s': request_latency_s, 'batch_mode': batch_mode,
            'suspend_at_cut': suspend_at_cut,
            'policies': figures,
            'ratios_to_vllm': ratios}


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _table(report: dict[str, Any]) -> str:
    columns = ('goals_per_s', 'finished_per_s', 'response_p50_s', 'response_p99_s',
               'mean_batch_size', 'urgent_utility', 'urgent_utility_floored',
               'completion_rate', 'utility_mean', 'decide_mean_ms', 'decide_p99_ms',
               'decide_max_ms', 'wall_time_s')
    rounds = f", {report['repeats']} rounds" if report['repeats'] > 1 else ''
    lines = [f"{report['tasks']} goals from {report['robots']} robots within "
             f"{report['burst_s']} s, seed {report['seed']}{rounds}",
             f"{'policy':>16} " + ' '.join(f'{c:>15}' for c in columns)]
    for policy, figures in report['policies'].items():
        cells = ' '.join(f'{figures[c]:15.3f}' if figures[c] is not None else f"{'-':>15}"
                         for c in columns)
        lines.append(f'{policy:>16} {cells}')
    for policy, figures in report['policies'].items():
        lines.append(f"{policy}: {figures['prefill_iterations']} prefill and "
                     f"{figures['decode_iterations']} decode iterations, "
                     f"{figures['prefill_busy_s']:.2f} of {figures['engine_busy_s']:.2f} busy s "
                     f"prefilling; {figures['admissions']} admissions in "
                     f"{figures['decisions']} decisions, "
                     f"{figures['decide_per_admission_us']:.1f} µs of deciding per admission, "
                     f"{figures['decide_ms_per_engine_s']:.1f} ms per engine-busy s")
    for policy, ratios in report['ratios_to_vllm'].items():
        cells = ', '.join(f'{name} {value:.3f}' if value is not None else f'{name} -'
                          for name, value in ratios.items())
        lines.append(f'{policy} / vllm: {cells}')
    return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--robots', type=int, default=1000)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--burst-s', type=float, default=DEFAULT_BURST_S)
    parser.add_argument('--tasks-per-robot', type=int, default=1)
    parser.add_argument('--policies', default=','.join(DEFAULT_POLICIES))
    parser.add_argument('--no-prefix-cache', action='store_true',
                        help='engine without prefix caching (every prompt fully prefilled)')
    parser.add_argument('--replicas', type=int, default=1,
                        help='simulated engines behind one queue (a replica pool)')
    parser.add_argument('--request-latency-ms', type=float, default=0.0,
                        help="the network's share of each segment request to a replica")
    parser.add_argument('--batch-mode', choices=BATCH_MODES, default='latency-guided',
                        help="TimelyLLM's admission: latency-guided (§4.4) or fixed (batch cap "
                             'and memory only)')
    parser.add_argument('--repeats', type=int_arg(1), default=1,
                        help='rounds of every policy, in turn; the decide figures pool them')
    parser.add_argument('--suspend-at-cut', action='store_true',
                        help='suspend segmented generations at each cut (the paper), not once '
                             'their next statement begins')
    parser.add_argument('--json', action='store_true', help='print the figures as JSON')
    args = parser.parse_args(argv)
    report = run_overload(args.robots, args.seed,
                          policies=[p for p in args.policies.split(',') if p],
                          burst_s=args.burst_s, tasks_per_robot=args.tasks_per_robot,
                          prefix_caching=not args.no_prefix_cache, replicas=args.replicas,
                          request_latency_s=args.request_latency_ms / 1000,
                          batch_mode=args.batch_mode, repeats=args.repeats,
                          suspend_at_cut=args.suspend_at_cut)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == '__main__':
    sys.exit(main())
