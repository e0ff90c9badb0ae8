"""Stranded goals sharing the admission order (``timelyllm-share``, issue 28): the order it
gives, the KV room and batch slots that bound it, and what it changes on a fleet."""

from __future__ import annotations

import numpy as np
import pytest
from utils import make_spec, tiny_calibration

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.priority import interleave
from timelyllm_ros.core.queue import best_rows
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.replicas import SimulatedReplicas
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import PolicyError
from timelyllm_ros.policies import create_policy
from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy, TimelyLlmSharePolicy


def _arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=float)


def test_interleave_gives_the_promoted_rows_a_share_of_the_places() -> None:
    """Rows 0–2 earn (priorities 5, 3, 1), rows 3 and 4 are promoted, row 4 first. At share
    0.5 the promoted take places 2 and 4, the others 2, 4 and 6, a promoted row first at equal
    places: 4, 0, 3, 1, 2. At share 0.25 the promoted take places 4 and 8, the others 4/3,
    8/3 and 4: 0, 1, 4, 2, 3."""
    priority = _arr(5.0, 3.0, 1.0, -1.0, -2.0)
    seq = _arr(0, 1, 2, 3, 4)
    promoted = np.array([4, 3])

    def order(ranked: np.ndarray) -> list[int]:
        return [int(r) for r in np.argsort(-ranked)]

    assert order(interleave(priority, seq, promoted, 0.5)) == [4, 0, 3, 1, 2]
    assert order(interleave(priority, seq, promoted, 0.25)) == [0, 1, 4, 2, 3]
    # the others placed before the last promoted row are the best by priority, then seq;
    # the rest keep their priorities, below (here row 0, ranked by the scheduler's seq rule)
    tied = interleave(_arr(1.0, 1.0, 1.0, -1.0), _arr(2, 0, 1, 3), np.array([3]), 0.25)
    assert order(tied)[:3] == [1, 2, 3] and tied[0] == 1.0
    assert interleave(priority, seq, np.array([], dtype=np.intp), 0.5) is priority


def _queue_of_stranded_and_fresh(policy: TimelyLlmPolicy, engine: SimulatedEngine,
                                 stranded: int = 6, fresh: int = 6,
                                 prompt_tokens: int = 100) -> Scheduler:
    """A scheduler (batch of 4) whose queue holds ``stranded`` goals that waited 20 s and
    ``fresh`` ones that arrived now; nothing has run."""
    clock = SimClock()
    scheduler = Scheduler(policy, engine, clock, SchedulerConfig(max_batch=4,
                                                                 report_deadlines=False))
    for i in range(stranded):
        scheduler.submit(make_spec(f'late{i}', arrival=0.01 * i, prompt_tokens=prompt_tokens))
    clock.advance_to(20.0)
    for i in range(fresh):
        scheduler.submit(make_spec(f'fresh{i}', arrival=20.0, prompt_tokens=prompt_tokens))
    return scheduler


def _ranked(scheduler: Scheduler) -> list[str]:
    view = scheduler.queue.view(scheduler.config.comm_s)
    priority = scheduler.policy.priorities(view, scheduler.clock.now())
    return [view.task_ids[r] for r in np.argsort(-priority, kind='stable')]


def test_the_rows_the_share_puts_first_lead_the_order_the_decision_would_sort() -> None:
    """``ranked()`` hands the decision the interleaved head: the first rows of the order that
    ``best_rows`` gives over its priorities, none tied with another row (so the decision
    need not sort the queue again); ``timelyllm`` and a queue with no stranded goal hand
    none."""
    engine = SimulatedEngine(tiny_calibration(gpu_kv_tokens=1600, host_kv_tokens=1600,
                                              max_num_seqs=8), prefix_caching=False)
    scheduler = _queue_of_stranded_and_fresh(TimelyLlmSharePolicy(), engine)
    view = scheduler.queue.view(scheduler.config.comm_s)
    now = scheduler.clock.now()
    priority, leading = scheduler.policy.ranked(view, now)
    assert leading is not None and len(leading) == 7     # 4 promoted, 3 fresh before the last
    assert best_rows(priority, view.seq, len(leading)).tolist() == leading.tolist()
    assert priority[leading].min() > np.delete(priority, leading).max()
    assert priority.tolist() == scheduler.policy.priorities(view, now).tolist()
    assert [view.task_ids[r] for r in leading[:2]] == ['late0', 'fresh0']
    plain = _queue_of_stranded_and_fresh(TimelyLlmPolicy(), SimulatedEngine(
        tiny_calibration(max_num_seqs=8)))
    plain_view = plain.queue.view(plain.config.comm_s)
    assert plain.policy.ranked(plain_view, plain.clock.now())[1] is None
    fresh_only = _queue_of_stranded_and_fresh(TimelyLlmSharePolicy(), SimulatedEngine(
        tiny_calibration(max_num_seqs=8)), stranded=0)
    assert fresh_only.policy.ranked(fresh_only.queue.view(0.008), 20.0)[1] is None
    # the decision admits in that order
    admitted = [g.task_id for g in scheduler.decide()]
    assert admitted == [view.task_ids[r] for r in leading[:len(admitted)]]


def test_with_no_plan_under_way_a_batch_of_stranded_goals_shares_the_order() -> None:
    """No plan is under way, so the batch's 4 slots bound the promotion: the 4 goals that
    lost most (the earliest) alternate with the fresh goals, the other stranded ones stay
    below every earning goal, as Eq. 4 ranks them."""
    engine = SimulatedEngine(tiny_calibration(gpu_kv_tokens=1600, host_kv_tokens=1600,
                                              max_num_seqs=8), prefix_caching=False)
    ranked = _ranked(_queue_of_stranded_and_fresh(TimelyLlmSharePolicy(), engine))
    assert ranked[:8] == ['late0', 'fresh0', 'late1', 'fresh1', 'late2', 'fresh2', 'late3',
                          'fresh3']
    assert ranked[8:10] == ['fresh4', 'fresh5']
    assert sorted(ranked[10:]) == ['late4', 'late5']
    eq4 = _ranked(_queue_of_stranded_and_fresh(
        TimelyLlmPolicy(), SimulatedEngine(tiny_calibration(max_num_seqs=8))))
    assert eq4[:6] == [f'fresh{i}' for i in range(6)]


def test_with_the_batch_taken_by_plans_under_way_the_kv_room_bounds_it() -> None:
    """Four plans are under way (the batch of 4 is theirs): only the stranded goals whose
    context and ``stranded_plan_tokens`` fit in the KV room go ahead. Room: 320 tokens (10
    GPU and 10 host blocks of 16, all free); each goal needs 100 + 50: two fit, a third would
    need 450."""
    policy = TimelyLlmSharePolicy(stranded_plan_tokens=50)
    engine = SimulatedEngine(tiny_calibration(max_num_seqs=8), prefix_caching=False)
    scheduler = _queue_of_stranded_and_fresh(policy, engine)
    assert engine.kv_room_tokens() == 320
    for i in range(4):
        policy.on_cut(scheduler.generations[f'fresh{i}'], 20.0)
    ranked = _ranked(scheduler)
    assert ranked[:4] == ['late0', 'fresh0', 'late1', 'fresh1']
    assert ranked[4:8] == ['fresh2', 'fresh3', 'fresh4', 'fresh5']
    # plans that ended free 3 slots, but 6 stranded goals are more than those: a backlog
    # (overload), so the KV room still decides
    for i in range(4):
        policy.on_end(scheduler.generations[f'fresh{i}'], 20.0)
    policy.on_cut(scheduler.generations['fresh5'], 20.0)
    assert _ranked(scheduler)[:5] == ['late0', 'fresh0', 'late1', 'fresh1', 'fresh2']


def test_stranded_goals_that_the_free_slots_hold_all_go_ahead() -> None:
    """One plan under way leaves 3 of the batch's 4 slots free; 3 stranded goals go ahead
    all, though the KV room holds two (the slots rescue a few goals that would starve)."""
    policy = TimelyLlmSharePolicy(stranded_plan_tokens=50)
    engine = SimulatedEngine(tiny_calibration(max_num_seqs=8), prefix_caching=False)
    scheduler = _queue_of_stranded_and_fresh(policy, engine, stranded=3)
    policy.on_cut(scheduler.generations['fresh5'], 20.0)
    assert _ranked(scheduler)[:6] == ['late0', 'fresh0', 'late1', 'fresh1', 'late2', 'fresh2']


def test_stranded_urgent_goals_take_the_share_before_normal_ones_that_lost_more() -> None:
    """Two normal goals stranded for 20 s (each lost 2·(20.09 − 1) − 1 ≈ 37) and two urgent
    ones stranded for 1 s (each ≈ 3.9), with a fresh goal; the batch's 4 slots hold the 4
    stranded ones, so all are promoted, alternating with the fresh one. By loss rate (the
    default) the urgent ones, which lose 20/3 per second of waiting against the normal ones'
    2, take the first places; ``stranded_order='most-lost'`` puts the ones that have lost
    most first, the normal ones."""
    def queue(policy: TimelyLlmPolicy) -> Scheduler:
        clock = SimClock()
        engine = SimulatedEngine(tiny_calibration(max_num_seqs=8), prefix_caching=False)
        scheduler = Scheduler(policy, engine, clock, SchedulerConfig(max_batch=4,
                                                                     report_deadlines=False))
        for i in range(2):
            scheduler.submit(make_spec(f'normal{i}', arrival=0.01 * i, prompt_tokens=100))
        clock.advance_to(19.0)
        for i in range(2):
            scheduler.submit(make_spec(f'urgent{i}', task_class='urgent', arrival=19.0,
                                       prompt_tokens=100))
        clock.advance_to(20.0)
        scheduler.submit(make_spec('fresh', arrival=20.0, prompt_tokens=100))
        return scheduler

    assert _ranked(queue(TimelyLlmSharePolicy())) == [
        'urgent0', 'fresh', 'urgent1', 'normal0', 'normal1']
    assert _ranked(queue(TimelyLlmSharePolicy(stranded_order='most-lost'))) == [
        'normal0', 'fresh', 'normal1', 'urgent0', 'urgent1']
    with pytest.raises(PolicyError, match='stranded_order'):
        TimelyLlmSharePolicy(stranded_order='oldest')  # type: ignore[arg-type]


class _SilentEngine(SimulatedEngine):
    """A simulator that, like the vLLM engines, does not tell its KV room."""

    def kv_room_tokens(self) -> None:  # type: ignore[override]
        return None


def test_an_engine_that_does_not_tell_its_room_gets_eq4s_order() -> None:
    share = _queue_of_stranded_and_fresh(TimelyLlmSharePolicy(), _SilentEngine())
    eq4 = _queue_of_stranded_and_fresh(TimelyLlmPolicy(), SimulatedEngine())
    view = share.queue.view(share.config.comm_s)
    assert share.policy.priorities(view, 20.0).tolist() == eq4.policy.priorities(
        eq4.queue.view(eq4.config.comm_s), 20.0).tolist()


def test_the_share_policy_is_registered_with_checked_parameters() -> None:
    policy = create_policy('timelyllm-share')
    assert isinstance(policy, TimelyLlmSharePolicy)
    assert (policy.stranded, policy.stranded_share, policy.stranded_plan_tokens,
            policy.stranded_order) == ('share', 0.5, 256, 'loss-rate')
    assert create_policy('timelyllm').stranded == 'eq4'  # type: ignore[attr-defined]
    with pytest.raises(PolicyError, match='stranded_share'):
        TimelyLlmSharePolicy(stranded_share=1.0)
    with pytest.raises(PolicyError, match='stranded_plan_tokens'):
        TimelyLlmSharePolicy(stranded_plan_tokens=-1)


def test_engines_tell_their_kv_room_and_a_contexts_tokens() -> None:
    """The simulator: free GPU plus free host blocks, in tokens, less the contexts it dropped;
    a context is its prompt less a cached prefix. A pool: the least of its replicas' rooms
    (where a context goes is decided when it runs); a context not yet placed, as a replica
    would hold it."""
    engine = SimulatedEngine(tiny_calibration(), prefix_caching=True)
    request = EngineRequest('a', 'robot prefix + task', prompt_tokens=100, max_tokens=64,
                            prefix_id='tello', prefix_tokens=60)
    engine.register(request)
    assert engine.kv_room_tokens() == 320 and engine.context_tokens('a') == 40
    engine.run('a')
    assert engine.kv_room_tokens() == 320 - 16 * 3             # 40 tokens fill 3 blocks
    pool = SimulatedReplicas([SimulatedEngine(tiny_calibration(), prefix_caching=True)
                              for _ in range(2)])
    pool.register(request)
    assert pool.context_tokens('a') == 40
    pool.run('a')
    assert pool.kv_room_tokens() == engine.kv_room_tokens()     # one replica holds it
    # a context the engine dropped keeps its room: it is rebuilt before anything new
    engine.register(EngineRequest('b', 'robot prefix + other task', prompt_tokens=100,
                                  max_tokens=64, prefix_id='tello', prefix_tokens=60))
    engine.run('b')
    engine.pause('b')
    engine.evict('b', 'none')
    assert engine.kv.location('b') == 'none' and engine.kv.dropped_tokens == 40
    assert engine.kv_room_tokens() == 320 - 16 * 3 - 40
    engine.run('b')                                             # rebuilt: its blocks again
    assert engine.kv.dropped_tokens == 0 and engine.kv_room_tokens() == 320 - 16 * 6
    assert SimulatedEngine().kv_room_tokens() == 2 * 32768      # the default calibration


def test_on_the_authors_arm_workload_no_burst_waits_behind_the_fleet() -> None:
    """Issue 28's finding, on the paper's setup (seed 0, jitter 0.1): under Eq. 4 eleven goals
    of one burst wait 34–39 s behind the arm fleet's earning resume segments; with stranded
    goals sharing the order none waits 5 s, and the mean utility rises above TimeBill-Skip's
    (0.29 there)."""
    from timelyllm_ros.engines.calibration import load_calibration
    from timelyllm_ros.evaluation.metrics import task_metrics
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import resolve_workload

    _, tasks = resolve_workload('authors-arm', seed=0)
    results = {}
    for policy in ('timelyllm', 'timelyllm-share'):
        engine = SimulatedEngine(load_calibration('llama3-8b-fp16_rtx4090_vllm054'))
        rows = [task_metrics(g) for g in simulate(tasks, policy, seed=0, engine=engine,
                                                  robot_jitter=0.1).generations]
        assert all(r.completed for r in rows)
        results[policy] = (max(r.response_time_s for r in rows),
                           float(np.mean([r.utility for r in rows])))
    assert results['timelyllm'][0] > 30.0
    assert results['timelyllm-share'][0] < 5.0
    assert results['timelyllm-share'][1] > 0.29 > results['timelyllm'][1]


def test_an_overload_without_a_prefix_cache_keeps_its_plans_in_flight() -> None:
    """400 robots' goals in 5 s on an engine without a prefix cache: the batch is bound by KV
    memory, so the stranded backlog (more goals than free slots) starts only as far as the KV
    room holds, and the mean utility stays within 15 % of Eq. 4's (seed 0: −95.3 against
    −87.6; started by free slots, 207 plans were in flight at once, against 52, and it lost
    42 %: −124.6)."""
    from timelyllm_ros.evaluation.bench import EngineOptions
    from timelyllm_ros.evaluation.metrics import task_metrics
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import overload_tasks

    def mean_utility(policy: str) -> float:
        result = simulate(overload_tasks(400, 0), policy, seed=0,
                          engine=EngineOptions(prefix_caching=False).build())
        rows = [task_metrics(g) for g in result.generations]
        assert all(r.completed for r in rows)
        return float(np.mean([r.utility for r in rows]))

    eq4, share = mean_utility('timelyllm'), mean_utility('timelyllm-share')
    assert eq4 < 0.0 and share >= 1.15 * eq4

