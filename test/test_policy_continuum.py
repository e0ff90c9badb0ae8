"""Continuum / CacheTTL (issue 28's fifth rival): Eq. 2's TTL, its cold start, the
memoryfulness factor, and the policy on the scheduler: a turn's request arrives when the robot
reports, program-level FCFS, pins and the deadlock rule that evicts them."""

from __future__ import annotations

import math

import pytest
from utils import make_spec, tiny_calibration

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import PolicyError
from timelyllm_ros.policies import POLICIES, create_policy
from timelyllm_ros.policies.continuum import (
    ContinuumPolicy,
    cold_start_ttl,
    memoryfulness,
    ttl_from_history,
)


def test_eq2_picks_the_duration_with_the_best_expected_saving() -> None:
    """Durations 0.5, 1, 2, 4 s and a benefit of 3 s: P(τ)·3 − τ is 0.25, 0.5, 0.25 and −1 at
    the four durations (0 at τ = 0), so τ* = 1 s. With a benefit of 0.4 s no τ gains: 0.
    Repeated durations count once each time they were seen: (1, 1, 3) with 2 s gives
    2/3·2 − 1 = 1/3 at 1 s and −1 at 3 s."""
    assert ttl_from_history([4.0, 0.5, 2.0, 1.0], 3.0) == 1.0
    assert ttl_from_history([4.0, 0.5, 2.0, 1.0], 0.4) == 0.0
    assert ttl_from_history([1.0, 3.0, 1.0], 2.0) == 1.0
    assert ttl_from_history([], 5.0) == 0.0


def test_the_cold_start_is_eq2s_optimum_for_exponential_durations() -> None:
    """(1 − e^{−τ/μ})·B − τ is largest at τ = μ·ln(B/μ) when B > μ: ln 3 for B = 3 s and
    μ = 1 s, 2·ln 3 for B = 6 s and μ = 2 s, and 0 when pinning cannot pay (B ≤ μ)."""
    assert cold_start_ttl(3.0) == pytest.approx(math.log(3.0))
    assert cold_start_ttl(6.0, 2.0) == pytest.approx(2.0 * math.log(3.0))
    assert cold_start_ttl(0.5) == 0.0 and cold_start_ttl(1.0) == 0.0
    tau = cold_start_ttl(3.0)
    reward = [(1 - math.exp(-t)) * 3.0 - t for t in (tau - 0.01, tau, tau + 0.01)]
    assert reward[1] > max(reward[0], reward[2])


def test_memoryfulness_is_one_for_fixed_turns_and_zero_when_unrelated() -> None:
    fixed = [(k, 4 - k) for k in range(1, 5)] * 3           # every program has 4 turns
    assert memoryfulness(fixed) == pytest.approx(1.0)
    assert memoryfulness([(1, 1), (1, 2), (2, 1), (2, 2)]) == pytest.approx(0.0)
    assert memoryfulness([(1, 3)]) is None


def _scheduler(policy: ContinuumPolicy, **calibration: object) -> tuple[Scheduler, SimClock,
                                                                        SimulatedEngine]:
    clock = SimClock()
    engine = SimulatedEngine(tiny_calibration(**calibration), prefix_caching=False)
    scheduler = Scheduler(policy, engine, clock, SchedulerConfig(report_deadlines=False))
    return scheduler, clock, engine


def _tick_until_cut(scheduler: Scheduler, *task_ids: str, limit: int = 200) -> None:
    """Tick until each goal has had a segment cut and left the batch (suspended once its
    next statement began)."""
    waiting = set(task_ids)
    cut: set[str] = set()
    for _ in range(limit):
        cut |= {d.task_id for d in scheduler.tick().dispatches}
        waiting -= {t for t in cut if scheduler.generations[t].status != TaskStatus.RUNNING}
        if not waiting:
            return
    raise AssertionError(f'{sorted(waiting)} never cut')


def _report(scheduler: Scheduler, clock: SimClock, task_id: str, seconds: float) -> None:
    """The robot ran the last dispatched segment for ``seconds`` and reports it now."""
    start = clock.now()
    clock.advance_to(start + seconds)
    generation = scheduler.generations[task_id]
    scheduler.report_segment(task_id, len(generation.segments) - 1, start, clock.now())


def test_a_turn_arrives_when_the_robot_reports_and_its_duration_is_recorded() -> None:
    policy = ContinuumPolicy()
    scheduler, clock, _ = _scheduler(policy, gpu_kv_tokens=1600, host_kv_tokens=1600)
    scheduler.submit(make_spec('a', prompt_tokens=100))
    _tick_until_cut(scheduler, 'a')
    generation = scheduler.generations['a']
    cut = generation.segments[-1].cut_time
    for _ in range(5):                        # the robot executes: the plan waits
        scheduler.tick()
    assert generation.status == TaskStatus.SUSPENDED and generation.k == 1
    _report(scheduler, clock, 'a', 0.7)
    arrived = clock.now()
    scheduler.tick()
    assert generation.status == TaskStatus.RUNNING
    tool = generation.segments[0].calls[0].skill        # the skill the robot ran
    assert list(policy._history[tool]) == pytest.approx([arrived - cut])


def test_an_older_programs_turn_goes_before_a_newer_programs_first_request() -> None:
    """Batch of one. Goal ``old`` arrived at 0 and ran its first turn; goal ``new`` arrives
    at 1 s, before ``old``'s robot reports at 1.5 s. Request order would serve ``new`` first;
    program-level FCFS serves ``old``'s turn first."""
    policy = ContinuumPolicy()
    scheduler, clock, _ = _scheduler(policy, gpu_kv_tokens=1600, host_kv_tokens=1600,
                                     max_num_seqs=1)
    scheduler.submit(make_spec('old', prompt_tokens=100))
    _tick_until_cut(scheduler, 'old')
    clock.advance_to(1.0)
    scheduler.submit(make_spec('new', arrival=1.0, prompt_tokens=100))
    start = clock.now()
    clock.advance_to(1.5)
    scheduler.report_segment('old', 0, start, 1.5)
    scheduler.tick()
    assert scheduler.generations['old'].status == TaskStatus.RUNNING
    assert scheduler.generations['new'].status == TaskStatus.WAITING


def test_a_pinned_turn_keeps_its_kv_and_the_latest_program_is_unpinned_first() -> None:
    """The cold start: T = 2 s (preset: no history yet), η = 1, so each turn's KV is pinned
    for about ln 2 s (a swap-in of 100 tokens adds 1 ms). GPU: 20 blocks of 16 tokens. Goals
    ``a`` then ``b`` each hold 7 blocks while their robots execute; goal ``c`` needs 8 and
    finds 6 free: the pinned context of the program that arrived latest, ``b``, is unpinned
    and swapped out, ``a`` keeps its pin and its KV."""
    policy = ContinuumPolicy()
    policy._delays.append(2.0)
    scheduler, clock, engine = _scheduler(policy, gpu_kv_tokens=320, host_kv_tokens=1600)
    scheduler.submit(make_spec('a', prompt_tokens=100))
    scheduler.submit(make_spec('b', arrival=0.0, prompt_tokens=100))
    _tick_until_cut(scheduler, 'a', 'b')
    assert set(policy._pins) == {'a', 'b'}
    ttl = policy._pins['a'] - scheduler.generations['a'].segments[-1].cut_time
    assert ttl == pytest.approx(math.log(2.0 + 0.001), abs=1e-3)
    assert engine.kv.location('a') == engine.kv.location('b') == 'gpu'
    assert engine.kv.gpu_free == 6
    scheduler.submit(make_spec('c', arrival=clock.now(), prompt_tokens=100))
    scheduler.tick()
    assert scheduler.generations['c'].status == TaskStatus.RUNNING
    assert engine.kv.location('b') == 'host' and 'b' not in policy._pins
    assert engine.kv.location('a') == 'gpu' and 'a' in policy._pins


def test_a_pin_expires_only_while_its_programs_next_turn_has_not_arrived() -> None:
    policy = ContinuumPolicy()
    policy._delays.append(2.0)
    scheduler, clock, _ = _scheduler(policy, gpu_kv_tokens=1600, host_kv_tokens=1600)
    scheduler.submit(make_spec('a', prompt_tokens=100))
    _tick_until_cut(scheduler, 'a')
    expiry = policy._pins['a']
    clock.advance_to(expiry - 0.01)
    scheduler.tick()
    assert 'a' in policy._pins
    clock.advance_to(expiry + 0.01)
    scheduler.tick()
    assert 'a' not in policy._pins


def test_continuum_serves_a_whole_fleet_and_is_a_registered_rival() -> None:
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import resolve_workload

    assert POLICIES['continuum'] is ContinuumPolicy
    _, tasks = resolve_workload('wid1', seed=0)
    result = simulate(tasks[:40], 'continuum', seed=0, robot_jitter=0.1)
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)
    policy = create_policy('continuum')
    assert isinstance(policy, ContinuumPolicy) and policy.history_threshold == 100
    for bad in ({'history_threshold': 0}, {'queue_delay_window': 0}, {'history_window': 0},
                {'cold_start_mean_s': 0.0}, {'reload_s_per_token': float('nan')}):
        with pytest.raises(PolicyError):
            ContinuumPolicy(**bad)  # type: ignore[arg-type]
