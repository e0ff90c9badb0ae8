"""Simulated replicas: N calibrated engines behind one queue and one scheduler (issue 30)."""

from __future__ import annotations

import pytest
from utils import load_benchmark

from timelyllm_ros.cli import main
from timelyllm_ros.engines.replicas import SimulatedReplicas
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import ConfigError
from timelyllm_ros.evaluation.bench import EngineOptions
from timelyllm_ros.evaluation.metrics import task_metrics
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import resolve_workload

# ranking only, preemption and KV eviction, KV compression and kills, a decode mask
POLICIES = ('vllm', 'timelyllm', 'semantic', 'timebill', 'slice')


def _tasks(workload: str = 'wid1', count: int = 60):
    return sorted(resolve_workload(workload, seed=0)[1], key=lambda t: t.arrival_time)[:count]


@pytest.mark.parametrize('policy', POLICIES)
def test_one_replica_is_the_engine_itself(policy: str) -> None:
    tasks = _tasks()
    alone = simulate(tasks, policy, engine=SimulatedEngine())
    pooled = simulate(tasks, policy, engine=SimulatedReplicas([SimulatedEngine()]))
    assert [task_metrics(g) for g in pooled.generations] == [
        task_metrics(g) for g in alone.generations]
    assert pooled.sim_time_s == alone.sim_time_s


@pytest.mark.parametrize('policy', POLICIES)
def test_replicas_lose_nothing_and_keep_each_plan_on_one_replica(policy: str) -> None:
    """Replicas iterate at their own pace; whatever the timing, every goal gets the plan it
    gets alone, and each generation's tokens all come from one replica (its KV is there)."""
    tasks = _tasks('wid2', 120)
    replicas = [SimulatedEngine() for _ in range(3)]
    producers: dict[str, set[int]] = {}
    for index, replica in enumerate(replicas):
        step = replica.step

        def recording_step(only=None, step=step, index=index):  # type: ignore[no-untyped-def]
            result = step(only)
            for request_id in result.text:
                producers.setdefault(request_id, set()).add(index)
            return result

        replica.step = recording_step  # type: ignore[method-assign]
    pooled = simulate(tasks, policy, engine=SimulatedReplicas(replicas))
    alone = simulate(tasks, policy, engine=SimulatedEngine())
    plans = {g.task_id: ''.join(s.text for s in g.segments) for g in alone.generations}
    for generation in pooled.generations:
        if generation.status.name == 'FINISHED':
            assert ''.join(s.text for s in generation.segments) == plans[generation.task_id]
    assert all(len(used) == 1 for used in producers.values())
    assert {i for used in producers.values() for i in used} == {0, 1, 2}   # load is spread


def test_replicas_iterate_side_by_side() -> None:
    """Two replicas, each busy: the fleet's clock runs about half the engines' time."""
    tasks = _tasks('wid2', 200)
    replicas = [SimulatedEngine(), SimulatedEngine()]
    result = simulate(tasks, 'vllm', engine=SimulatedReplicas(replicas))
    busy = [r.busy_s for r in replicas]
    assert min(busy) > 0.3 * max(busy)
    assert result.engine_busy_s == pytest.approx(max(busy))
    alone = simulate(tasks, 'vllm', engine=SimulatedEngine())
    # the same work done by two: the backlog clears sooner, nothing is served later
    late = [task_metrics(g).completion_time_s for g in result.generations]
    late_alone = [task_metrics(g).completion_time_s for g in alone.generations]
    assert sum(late) < sum(late_alone)


def test_placement_prefers_room_then_a_cached_prefix() -> None:
    from timelyllm_ros.engines.base import EngineRequest

    pool = SimulatedReplicas([SimulatedEngine(max_num_seqs=2), SimulatedEngine(max_num_seqs=2)])

    def request(name: str) -> str:
        pool.register(EngineRequest(request_id=name, prompt='p', prompt_tokens=64,
                                    max_tokens=8, script=(' a',) * 8, prefix_id='tello',
                                    prefix_tokens=48))
        return name

    pool.run(request('a'))
    assert pool.placement('a') == 0
    assert pool.placement(request('b')) == 1          # more room there, cold prefix or not
    pool.run('b')
    assert pool.placement(request('c')) == 0          # equal room: the lower index
    pool.run('c')
    assert pool.placement(request('d')) == 1
    pool.pause('a')
    assert pool.placement('a') == 0                   # a generation stays where its KV is


def test_replicas_are_options_of_the_simulator_only() -> None:
    with pytest.raises(ConfigError, match='replicas must be >= 1'):
        EngineOptions(replicas=0).build()
    with pytest.raises(ConfigError, match='simulates replicas of the calibrated simulator'):
        EngineOptions(name='cpu', replicas=2).build()
    engine = EngineOptions(replicas=4).build()
    assert isinstance(engine, SimulatedReplicas) and len(engine.replicas) == 4
    assert engine.max_num_seqs == 4 * engine.replicas[0].max_num_seqs
    assert EngineOptions(replicas=4).describe()['replicas'] == 4


def test_run_command_takes_replicas(capsys) -> None:
    assert main(['run', '--workload', 'wid1', '--replicas', '2', '--tasks', '30']) == 0
    assert '30' in capsys.readouterr().out


def test_simspeed_runs_the_engine_it_is_given(capsys) -> None:
    """simspeed builds its engine from the options (replicas, calibration), as run does."""
    import json

    assert main(['simspeed', '--workload', 'wid1', '--tasks', '20', '--policies', 'vllm',
                 '--repeats', '1', '--replicas', '2', '--json']) == 0
    speeds = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert speeds['vllm'] > 0


def test_the_latency_test_weighs_the_candidates_replica_only() -> None:
    """A replica's iterations are not slowed by another's batch: the test sees the candidate's
    replica (its running generations), not the whole pool."""
    from dataclasses import replace as with_

    from timelyllm_ros.core.admission import _on_replica
    from timelyllm_ros.core.clock import SimClock
    from timelyllm_ros.core.scheduler import Scheduler
    from timelyllm_ros.engines.base import EngineView
    from timelyllm_ros.policies import create_policy

    pool = SimulatedReplicas([SimulatedEngine(), SimulatedEngine()])
    scheduler = Scheduler(create_policy('timelyllm'), pool, SimClock())
    tasks = _tasks('wid2', 12)
    for spec in tasks:
        scheduler.submit(with_(spec, arrival_time=0.0))
    scheduler.tick()
    running = list(scheduler.generations.values())
    on = {g.task_id: pool.placement(g.task_id) for g in running if g.task_id in pool.running}
    assert set(on.values()) == {0, 1}
    ctx = scheduler._context(0.0)
    view = EngineView(pool)
    replica = view.cohort(next(iter(on)))
    assert replica is not None
    local = _on_replica(ctx, replica)
    assert {g.task_id for g in local.running} == set(replica.running)
    assert 0 < len(local.running) < len(pool.running)
    assert local.max_batch == pool.replicas[0].max_num_seqs
    assert EngineView(SimulatedEngine()).cohort('anything') is None    # one engine: no cohort


def test_a_rounds_replica_split_is_the_fresh_split_at_every_test() -> None:
    """Within an admission round each replica's share is found once and then follows the
    round's admissions: at every step it is what :func:`_on_replica` finds anew (the same
    generations in batch order), and views of one replica are one key."""
    from dataclasses import replace as with_

    from timelyllm_ros.core.admission import ReplicaBatches, _on_replica
    from timelyllm_ros.core.clock import SimClock
    from timelyllm_ros.core.request import TaskStatus
    from timelyllm_ros.core.scheduler import Scheduler
    from timelyllm_ros.engines.base import EngineView
    from timelyllm_ros.policies import create_policy

    pool = SimulatedReplicas([SimulatedEngine(), SimulatedEngine()])
    scheduler = Scheduler(create_policy('timelyllm'), pool, SimClock())
    for spec in _tasks('wid2', 12):
        scheduler.submit(with_(spec, arrival_time=0.0))
    scheduler.tick()
    view = EngineView(pool)
    first = pool.running[0]
    assert view.cohort(first) == view.cohort(first) and len(
        {view.cohort(t) for t in pool.running}) == 2
    ctx = scheduler._context(0.0)
    split = ReplicaBatches()
    queued = list(scheduler.queue.generations)
    assert len(queued) >= 4
    for generation in queued:                              # admit the queue one by one
        replica = view.cohort(generation.task_id)
        assert replica is not None
        kept, fresh = split.on_replica(ctx, replica), _on_replica(ctx, replica)
        assert list(kept.running) == list(fresh.running)
        pool.run(generation.task_id)
        scheduler.queue.remove(generation.task_id)
        generation.status = TaskStatus.RUNNING
        scheduler._running[generation.task_id] = generation
    for task_id in pool.running:
        replica = view.cohort(task_id)
        assert replica is not None
        assert list(split.on_replica(ctx, replica).running) == list(
            _on_replica(ctx, replica).running)


def test_pool_decisions_are_those_of_a_fresh_replica_split() -> None:
    """A whole overloaded fleet over three replicas decides as when every test splits the
    batch anew (the split kept through a round changes the cost, not a decision)."""
    from timelyllm_ros.core import admission
    from timelyllm_ros.evaluation.workloads import overload_tasks

    def outcome() -> list[tuple[str, str, int, float]]:
        result = simulate(overload_tasks(240, 0), 'timelyllm', seed=0,
                          engine=EngineOptions(replicas=3).build())
        return sorted((g.task_id, g.status.name, len(g.segments), g.done_time)
                      for g in result.generations)

    kept = outcome()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(admission.ReplicaBatches, 'on_replica',
                      lambda self, ctx, replica: admission._on_replica(ctx, replica))
        assert outcome() == kept


def test_a_goal_whose_utility_ends_soon_goes_where_its_segment_is_done_first() -> None:
    """A normal goal goes where there is most room; an urgent one (zero utility within
    ``soon_s``) where it would join an iteration soonest and finish its segment first."""
    from timelyllm_ros.engines.base import EngineRequest

    pool = SimulatedReplicas([SimulatedEngine(), SimulatedEngine()])

    def request(name: str, prompt_tokens: int = 64, zero: float | None = None) -> str:
        pool.register(EngineRequest(request_id=name, prompt='p', prompt_tokens=prompt_tokens,
                                    max_tokens=8, script=(' a',) * 8, zero_utility_s=zero))
        return name

    pool.run(request('long', prompt_tokens=2800))     # replica 0: a long prefill
    pool.run(request('short'))                        # replica 1: more room
    assert (pool.placement('long'), pool.placement('short')) == (0, 1)
    pool.step()                 # replica 1's short iteration ends first; replica 0 still busy
    assert 0 in pool._ends and 1 not in pool._ends
    assert pool.placement(request('normal', zero=1.5)) == 0     # equal room: the lower index
    assert pool.placement(request('urgent', zero=0.5)) == 1     # joins now, done first


def test_a_generation_that_never_ran_is_handled_like_one_engine_handles_it() -> None:
    from timelyllm_ros.engines.base import EngineRequest
    from timelyllm_ros.errors import EngineError

    pool = SimulatedReplicas([SimulatedEngine(), SimulatedEngine()])
    alone = SimulatedEngine()
    for engine in (pool, alone):
        engine.register(EngineRequest(request_id='q', prompt='p', prompt_tokens=64,
                                      max_tokens=8, script=(' a',) * 8))
        engine.pause('q')                   # queued, never run: nothing to keep, no error
        engine.evict('q', 'none')
        engine.release('q')
        with pytest.raises(EngineError, match='unknown request'):
            engine.pause('q')


def test_a_request_latency_delays_each_segment_request() -> None:
    """With a request latency L, a generation holds its slot at once but joins its replica's
    iterations L later, at every segment request: one generation paused once ends 2 L later
    than without; the plan is the same."""
    from timelyllm_ros.engines.base import EngineRequest

    def run(latency: float) -> tuple[float, str]:
        pool = SimulatedReplicas([SimulatedEngine(), SimulatedEngine()],
                                 request_latency_s=latency)
        pool.register(EngineRequest('g', 'p', 200, 64, script=('mf(50)', ';', 'ld()')))
        pool.run('g')
        assert pool.running == ('g',)                  # its slot is held while in flight
        elapsed, text, paused = 0.0, '', False
        while 'g' in pool.running:
            result = pool.step()
            elapsed += result.duration_s
            text += result.text.get('g', '')
            if text == 'mf(50)' and not paused:
                pool.pause('g')
                pool.run('g')
                paused = True
        return elapsed, text

    base, plan = run(0.0)
    delayed, same = run(0.05)
    assert same == plan == 'mf(50);ld()'
    assert delayed == pytest.approx(base + 2 * 0.05, abs=1e-9)
    with pytest.raises(Exception, match='request_latency_s must be >= 0'):
        SimulatedReplicas([SimulatedEngine()], request_latency_s=-1)
    with pytest.raises(ConfigError, match='replica pool'):
        EngineOptions(request_latency_s=0.01).build()


def test_overload_over_replicas_with_a_request_latency() -> None:
    """benchmarks/overload.py's fleet over two replicas 20 ms away: every goal is still
    completed, later than over replicas next door, and the latency is reported."""

    module = load_benchmark('overload')
    near, far = (module.run_overload(60, 0, policies=['timelyllm'], replicas=2,
                                     request_latency_s=latency) for latency in (0.0, 0.02))
    assert far['replicas'] == 2 and far['request_latency_s'] == 0.02
    near_run, far_run = near['policies']['timelyllm'], far['policies']['timelyllm']
    assert near_run['completed'] == far_run['completed'] == 60
    assert far_run['response_p50_s'] > near_run['response_p50_s']


def test_a_refused_generation_tries_the_other_replicas_before_it_waits() -> None:
    """place_elsewhere: a generation that has not run goes to its next best replica for the
    rest of the decision, each replica once; the pool's next iteration forgets the refusals;
    one that ran keeps its home."""
    from timelyllm_ros.engines.base import EngineRequest

    pool = SimulatedReplicas([SimulatedEngine() for _ in range(3)])
    for name in ('a', 'b'):
        pool.register(EngineRequest(name, 'p', 64, 8, script=(' a',) * 8))
    tried = [pool.placement('b')]
    while pool.place_elsewhere('b'):
        tried.append(pool.placement('b'))
    assert sorted(tried) == [0, 1, 2]
    pool.run('a')
    pool.step()
    assert pool.place_elsewhere('b')             # forgotten at the pool's iteration
    assert not pool.place_elsewhere('a')         # its KV has a home
    assert not SimulatedEngine().place_elsewhere('a')


def test_the_fault_wrapper_passes_the_pool_through() -> None:
    """A pool under FaultInjectingEngine keeps its cohorts, re-placement and replica states."""
    from timelyllm_ros.engines.base import EngineRequest
    from timelyllm_ros.engines.faults import FaultInjectingEngine

    pool = SimulatedReplicas([SimulatedEngine(), SimulatedEngine()])
    wrapped = FaultInjectingEngine(pool, {})
    wrapped.register(EngineRequest('a', 'p', 64, 8, script=(' a',) * 8))
    assert wrapped.cohort('a') is pool.replica_of('a')
    assert [r.name for r in wrapped.replica_states()] == ['0', '1']
    assert wrapped.place_elsewhere('a') and not wrapped.place_elsewhere('a')
