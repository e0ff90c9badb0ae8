"""Overload (issue 13, item 7): a fleet whose goals are nearly all late keeps its throughput,
and goals that can still be saved keep their precedence. Simulated time only."""

from __future__ import annotations

from types import ModuleType

import pytest
from utils import load_benchmark, make_spec

from timelyllm_ros.core.admission import AdmissionContext, lost
from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.policies import create_policy
from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy


@pytest.fixture(scope='module')
def overload() -> ModuleType:
    return load_benchmark('overload')


def test_overload_throughput_is_within_20_percent_of_vllm(overload: ModuleType) -> None:
    # 400 robots send their goals within 5 simulated seconds: nearly every goal is late
    # (95 % earn no utility under vllm). Before the fix timelyllm generated 30.1 goals/s
    # against vllm's 62.7 (ratio 0.48), its batch held back by goals already late.
    report = overload.run_overload(400, 0, burst_s=5.0)
    vllm, timely = report['policies']['vllm'], report['policies']['timelyllm']
    assert vllm['late_share'] > 0.9
    assert timely['generated'] == vllm['generated'] == report['tasks'] == 400
    assert timely['goals_per_s'] >= 0.8 * vllm['goals_per_s']
    ratios = report['ratios_to_vllm']
    assert set(ratios) == {'timelyllm', 'timelyllm-share'}      # the default policies
    assert ratios['timelyllm']['goals_per_s'] == pytest.approx(
        timely['goals_per_s'] / vllm['goals_per_s'])
    assert ratios['timelyllm']['decide_mean'] == pytest.approx(
        timely['decide_mean_ms'] / vllm['decide_mean_ms'])
    assert ratios['timelyllm']['finished_per_s'] == pytest.approx(
        timely['finished_per_s'] / vllm['finished_per_s'])
    # the fleet's throughput counts until the last robot finished: after the last generation
    for figures in (vllm, timely):
        assert figures['makespan_s'] > figures['generation_span_s']
        assert figures['finished_per_s'] == pytest.approx(400 / figures['makespan_s'])
    # and it still serves urgent goals better than vllm
    assert timely['urgent_utility'] > vllm['urgent_utility']


def test_run_overload_reports_every_figure(overload: ModuleType) -> None:
    report = overload.run_overload(20, 1, policies=('vllm', 'timelyllm', 'seg-edf'), burst_s=0.5)
    assert report['robots'] == 20 and report['tasks'] == 20 and report['seed'] == 1
    assert set(report['policies']) == {'vllm', 'timelyllm', 'seg-edf'}
    for figures in report['policies'].values():
        for key in ('goals_per_s', 'response_p50_s', 'response_p99_s', 'mean_batch_size',
                    'urgent_utility', 'finished_per_s', 'late_share'):
            assert figures[key] is not None, key
        assert figures['response_p50_s'] <= figures['response_p99_s']
    assert overload.main(['--robots', '10', '--policies', 'vllm', '--json']) == 0


def test_prefill_iterations_are_counted_from_the_engine_iterations(
        overload: ModuleType) -> None:
    """The engine's prefill iterations and their time, as the run's iterations add up: every
    goal is prefilled once, in as many iterations as its policy started rounds of goals."""
    tasks = overload.overload_tasks(30, 0, burst_s=0.5)
    for policy in ('vllm', 'timelyllm-share'):
        result = overload.simulate(tasks, policy, seed=0)
        figures = overload.policy_figures(result)
        prefills = [i for i in result.iterations if i.prefill_tokens]
        assert figures['prefill_iterations'] == len(prefills) > 0
        assert figures['prefill_iterations'] < figures['engine_iterations'] == len(
            result.iterations)
        assert (figures['prefill_iterations'] + figures['decode_iterations']
                == len(result.iterations))
        assert figures['prefill_busy_s'] == pytest.approx(sum(i.duration_s for i in prefills))
        assert 0 < figures['prefill_busy_s'] < figures['engine_busy_s'] == pytest.approx(
            sum(i.duration_s for i in result.iterations))
        assert sum(i.prefill_tokens for i in prefills) > 0


def test_each_decision_counts_the_generations_it_admitted(overload: ModuleType) -> None:
    """With ``record_decisions`` (as ``simulate()`` runs it) the scheduler keeps, beside each
    decision's CPU time, how many generations it admitted (what its ticks' decisions say):
    whole plans once each for ``vllm``; for a segmented policy every resume too, so it admits
    more than one generation per goal. Without (a live planner) it keeps neither."""
    tasks = overload.overload_tasks(30, 0, burst_s=0.5)
    for policy in ('vllm', 'timelyllm-share'):
        clock = SimClock()
        scheduler = Scheduler(create_policy(policy), SimulatedEngine(), clock,
                              SchedulerConfig(record_decisions=True))
        for task in sorted(tasks, key=lambda t: t.arrival_time)[:8]:
            scheduler.submit(task)
        admitted = []
        while scheduler.has_work and len(admitted) < 40:
            out = scheduler.tick()
            assert out.decision is not None
            admitted.append(len(out.decision.admitted))
        assert list(scheduler.decision_admissions) == admitted
        assert len(scheduler.decision_admissions) == len(scheduler.decision_cpu_s)
        # a live planner's scheduler (the default) keeps nothing per decision
        quiet = Scheduler(create_policy(policy), SimulatedEngine(), SimClock())
        for task in tasks[:3]:
            quiet.submit(task)
        for _ in range(5):
            quiet.tick()
        assert quiet.ticks == 5 and not quiet.decision_cpu_s and not quiet.decision_admissions
        assert quiet.decision_s > 0.0
        result = overload.simulate(tasks, policy, seed=0)
        figures = overload.policy_figures(result)
        assert len(result.decision_admissions) == len(result.decision_cpu_s) == result.ticks
        assert figures['admissions'] == sum(result.decision_admissions)
        assert figures['decisions'] == result.ticks
        if policy == 'vllm':
            assert figures['admissions'] == len(tasks)
        else:
            assert figures['admissions'] > len(tasks)
        assert figures['decide_per_admission_us'] == pytest.approx(
            1e6 * sum(result.decision_cpu_s) / figures['admissions'])
        assert figures['decide_ms_per_engine_s'] == pytest.approx(
            1e3 * sum(result.decision_cpu_s) / result.engine_busy_s)


def test_repeats_pool_the_decisions_of_every_round(overload: ModuleType) -> None:
    """--repeats N: the simulated figures of one round, the decide figures over every round's
    decisions; rounds that disagree are an error, not a mean."""
    once = overload.run_overload(20, 1, policies=('vllm', 'timelyllm'), burst_s=0.5)
    thrice = overload.run_overload(20, 1, policies=('vllm', 'timelyllm'), burst_s=0.5,
                                   repeats=3)
    assert once['repeats'] == 1 and thrice['repeats'] == 3
    timings = ('decide_mean_ms', 'decide_p99_ms', 'decide_max_ms', 'decide_per_admission_us',
               'decide_ms_per_engine_s', 'wall_time_s')
    for policy in ('vllm', 'timelyllm'):
        one, three = once['policies'][policy], thrice['policies'][policy]
        assert {k: v for k, v in one.items() if k not in timings} == {
            k: v for k, v in three.items() if k not in timings}
        assert 0.0 < three['decide_mean_ms'] <= three['decide_p99_ms'] <= three['decide_max_ms']
    tasks = overload.overload_tasks(20, 1, burst_s=0.5)
    runs = [overload.simulate(tasks, 'timelyllm', seed=seed) for seed in (1, 1)]
    pooled = overload.pooled_figures(runs)
    assert pooled['decide_mean_ms'] == pytest.approx(
        1000 * sum(c for run in runs for c in run.decision_cpu_s)
        / sum(len(run.decision_cpu_s) for run in runs))
    assert pooled['admissions'] == sum(runs[0].decision_admissions)      # one round's
    assert pooled['decide_per_admission_us'] == pytest.approx(
        1e6 * sum(c for run in runs for c in run.decision_cpu_s)
        / sum(a for run in runs for a in run.decision_admissions))
    assert pooled['decide_ms_per_engine_s'] == pytest.approx(
        1e3 * sum(c for run in runs for c in run.decision_cpu_s)
        / sum(run.engine_busy_s for run in runs))
    other = overload.simulate(overload.overload_tasks(20, 2, burst_s=0.5), 'timelyllm', seed=2)
    with pytest.raises(RuntimeError, match='different figures'):
        overload.pooled_figures([runs[0], other])
    assert overload._same(float('nan'), float('nan'))   # a figure with nothing to measure
    assert not overload._same(float('nan'), 0.0) and overload._same(None, None)
    with pytest.raises(ValueError, match='repeats'):
        overload.run_overload(5, 0, policies=('vllm',), repeats=0)
    with pytest.raises(SystemExit):
        overload.main(['--robots', '5', '--repeats', '0'])
    assert overload.main(['--robots', '5', '--policies', 'vllm', '--repeats', '2']) == 0


def test_batch_mode_fixed_admits_by_cap_and_memory_only(overload: ModuleType) -> None:
    """--batch-mode fixed: timelyllm's batch is no longer held back by the latency test, so
    under overload it holds more generations; vllm (no latency test) is unchanged."""
    guided = overload.run_overload(300, 0, burst_s=2.0)
    fixed = overload.run_overload(300, 0, burst_s=2.0, batch_mode='fixed')
    assert guided['batch_mode'] == 'latency-guided' and fixed['batch_mode'] == 'fixed'
    assert fixed['policies']['vllm'] == {**guided['policies']['vllm'],
                                         **{k: v for k, v in fixed['policies']['vllm'].items()
                                            if k.startswith('decide') or k == 'wall_time_s'}}
    assert (fixed['policies']['timelyllm']['mean_batch_size']
            > guided['policies']['timelyllm']['mean_batch_size'])
    assert overload.main(['--robots', '10', '--batch-mode', 'fixed', '--json']) == 0
    with pytest.raises(SystemExit):
        overload.main(['--robots', '10', '--batch-mode', 'bold'])


def test_overload_tasks_are_one_burst_per_robot(overload: ModuleType) -> None:
    tasks = overload.overload_tasks(50, 3, burst_s=2.0, tasks_per_robot=2)
    assert len(tasks) == 100 and len({t.task_id for t in tasks}) == 100
    assert all(0.0 <= t.arrival_time < 2.0 for t in tasks)
    robots = [t.robot_id for t in tasks]
    assert len(set(robots)) == 50 and all(robots.count(r) == 2 for r in set(robots))
    assert [t.task_id for t in tasks] == [t.task_id for t in
                                          overload.overload_tasks(50, 3, 2.0, 2)]


class RecordingPolicy(TimelyLlmPolicy):
    """TimelyLLM that records, in order, each generation it admitted (and whether it was
    still savable then)."""

    def __init__(self) -> None:
        super().__init__()
        self.admitted: list[tuple[str, bool]] = []

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        ok = super().admit(candidate, ctx)
        if ok and candidate.k == 0:
            self.admitted.append((candidate.task_id, not lost(candidate, ctx)))
        return ok


def test_savable_urgent_goals_are_admitted_before_normal_and_lost_ones() -> None:
    policy = RecordingPolicy()
    clock = SimClock()
    scheduler = Scheduler(policy, SimulatedEngine(), clock,
                          SchedulerConfig(max_batch=4, report_deadlines=False))
    # 30 goals that waited 20 s (far past their zero-utility time), then a fresh event of
    # normal and urgent goals that can still be saved
    for i in range(30):
        scheduler.submit(make_spec(f'late{i}', task_class='urgent' if i % 3 else 'normal'))
    clock.advance_to(20.0)
    for i in range(3):
        scheduler.submit(make_spec(f'normal{i}', arrival=20.0))
        scheduler.submit(make_spec(f'urgent{i}', task_class='urgent', arrival=20.0))
    while scheduler.has_work:
        scheduler.tick()
    assert all(g.status == TaskStatus.GENERATED for g in scheduler.generations.values())
    order = [task_id for task_id, _ in policy.admitted]
    first = {task_id: order.index(task_id) for task_id in order}
    urgent = [first[f'urgent{i}'] for i in range(3)]
    normal = [first[f'normal{i}'] for i in range(3)]
    late = [first[f'late{i}'] for i in range(30)]
    assert max(urgent) < min(normal)          # urgent first among the goals still savable
    assert max(normal) < min(late)            # and those before the goals already lost
    saved = dict(policy.admitted)
    assert all(saved[f'urgent{i}'] for i in range(3))
    assert not any(saved[f'late{i}'] for i in range(30))


def test_the_overloads_are_named_workloads(overload: ModuleType) -> None:
    """`bench --workloads overload-1000` runs the benchmark's fleet (issue 28's matrix)."""
    from timelyllm_ros.evaluation.workloads import resolve_workload, workload_names

    assert {'overload-1000', 'overload-5000'} <= set(workload_names())
    name, tasks = resolve_workload('overload-1000', seed=4)
    assert name == 'overload-1000' and tasks == overload.overload_tasks(1000, 4)
    assert len({t.robot_id for t in tasks}) == 1000
