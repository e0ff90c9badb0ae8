"""The optional policy hooks the rival schedulers steer the loop with, and the engine
capabilities behind them (evict, KV compression, decode mask)."""

from __future__ import annotations

from collections import Counter

import pytest
from utils import make_spec

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import Scheduler
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import EngineError
from timelyllm_ros.policies.base import Policy


class Recording(Policy):
    """FCFS, segmented, recording every observer call; hooks configurable per test."""

    name = 'recording'

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.kill: dict[str, str] = {}
        self.preempt_once: dict[str, str] = {}
        self.mask: set[str] | None = None
        self.ratio: float | None = None
        self.stepped: list[tuple[str, ...]] = []

    def priorities(self, queue, now):
        return -queue.seq

    def overruns(self, ctx):
        return self.kill

    def preempt(self, ctx):
        running = {g.task_id for g in ctx.running}
        chosen = {t: w for t, w in self.preempt_once.items() if t in running}
        for task_id in chosen:
            del self.preempt_once[task_id]
        return chosen

    def kv_evict_ratio(self, generation, ctx):
        return self.ratio

    def decode_mask(self, ctx):
        return self.mask

    def on_submit(self, generation, now):
        self.calls['submit'] += 1

    def on_step(self, result, stepped, ctx):
        self.calls['step'] += 1
        self.stepped.append(tuple(g.task_id for g in stepped))

    def on_cut(self, generation, now):
        self.calls['cut'] += 1

    def on_suspend(self, generation, now):
        self.calls['suspend'] += 1

    def on_end(self, generation, now):
        self.calls['end'] += 1


def _scheduler(policy: Policy, **engine_kwargs) -> tuple[Scheduler, SimulatedEngine]:
    engine = SimulatedEngine(**engine_kwargs)
    return Scheduler(policy, engine, SimClock()), engine


def _run_until_generated(scheduler: Scheduler, limit: int = 2000) -> None:
    for _ in range(limit):
        if not scheduler.has_work:
            return
        scheduler.tick()
    raise AssertionError('generation did not end')


def test_observers_see_every_submit_step_cut_and_end() -> None:
    policy = Recording()
    scheduler, _ = _scheduler(policy)
    generation = scheduler.submit(make_spec('a', plan='mf(50);tc(90);mf(20)'))
    _run_until_generated(scheduler)
    assert generation.status == TaskStatus.GENERATED
    assert policy.calls['submit'] == 1
    # each cut heard at the cut; suspended after the first two (the plan ended after the last)
    assert policy.calls['cut'] == len(generation.segments) == 3
    assert policy.calls['suspend'] == generation.suspensions == 2
    assert policy.calls['end'] == 1
    assert policy.calls['step'] == generation.tokens + 1           # + the EOS iteration
    assert all(s == ('a',) for s in policy.stepped)


def test_a_step_observer_set_on_the_instance_is_told_every_step() -> None:
    # The scheduler skips building each step's context for a policy that keeps the base
    # class's on_step; one assigned to the instance (a mock, a wrapper) must still be told.
    class Quiet(Recording):
        on_step = Policy.on_step

    policy = Quiet()
    steps: list[float] = []
    policy.on_step = lambda result, stepped, ctx: steps.append(ctx.now)  # type: ignore[method-assign]
    scheduler, _ = _scheduler(policy)
    generation = scheduler.submit(make_spec('a', plan='mf(50);tc(90)'))
    _run_until_generated(scheduler)
    assert generation.status == TaskStatus.GENERATED
    assert len(steps) == generation.tokens + 1 and steps == sorted(steps)
    assert steps[-1] == scheduler.clock.now()       # the clock already moved past the step


def test_overrun_kill_ends_the_generation_and_frees_its_memory() -> None:
    policy = Recording()
    scheduler, engine = _scheduler(policy)
    generation = scheduler.submit(make_spec('a'))
    scheduler.tick()
    assert generation.status == TaskStatus.RUNNING
    policy.kill = {'a': 'overran its 1.0 s budget', 'unknown': 'ignored'}
    out = scheduler.tick()
    assert generation.status == TaskStatus.KILLED and generation.status.terminal
    assert generation.error == 'overran its 1.0 s budget'
    assert out.ended == [generation]
    assert engine.running == () and engine.kv.gpu_free == engine.kv.gpu_blocks
    assert policy.calls['end'] == 1
    policy.kill = {'a': 'again'}
    scheduler.tick()                                               # already ended: no-op
    assert generation.error == 'overran its 1.0 s budget'


@pytest.mark.parametrize(('where', 'location', 'reprefill'),
                         [('keep', 'gpu', False), ('host', 'host', False), ('none', 'none', True)])
def test_preempted_generation_requeues_and_resumes_to_the_same_plan(
        where: str, location: str, reprefill: bool) -> None:
    reference, _ = _scheduler(Recording())
    ref = reference.submit(make_spec('a', plan='mf(50);tc(90);mf(20)'))
    _run_until_generated(reference)

    policy = Recording()
    scheduler, engine = _scheduler(policy)
    generation = scheduler.submit(make_spec('a', plan='mf(50);tc(90);mf(20)'))
    scheduler.tick()                                               # prefill
    scheduler.tick()                                               # one decode step
    policy.preempt_once = {'a': where}
    policy.mask = set()                                            # an empty mask means all
    scheduler.decide = lambda ctx=None: []  # type: ignore[method-assign]   # keep it out for a tick
    scheduler.tick()
    assert generation.status == TaskStatus.WAITING and generation.preemptions == 1
    assert 'a' in scheduler.queue and engine.running == ()
    assert engine.kv.location('a') == location
    del scheduler.decide
    out = scheduler.tick()                                         # re-admitted
    assert (out.duration_s > engine.decode_step_s(1)) == reprefill or where == 'host'
    _run_until_generated(scheduler)
    assert [s.text for s in generation.segments] == [s.text for s in ref.segments]


def test_decode_mask_steps_only_the_masked_generations() -> None:
    policy = Recording()
    scheduler, engine = _scheduler(policy)
    a = scheduler.submit(make_spec('a'))
    b = scheduler.submit(make_spec('b'))
    scheduler.tick()                                               # both prefill together
    policy.mask = {'a'}
    before = (a.tokens, b.tokens)
    out = scheduler.tick()
    assert (a.tokens, b.tokens) == (before[0] + 1, before[1])
    assert out.batch_size == 1 and policy.stepped[-1] == ('a',)
    assert out.duration_s == pytest.approx(engine.decode_step_s(1), rel=0.05)
    assert set(engine.running) == {'a', 'b'}                       # b idles, resident


def test_kv_compression_shrinks_context_and_decode_cost() -> None:
    plain, plain_engine = _scheduler(Recording(), prefix_caching=False)
    plain.submit(make_spec('a', prompt_tokens=8000))
    plain.tick()
    plain_decode = plain.tick().duration_s

    policy = Recording()
    policy.ratio = 0.75
    scheduler, engine = _scheduler(policy, prefix_caching=False)
    scheduler.submit(make_spec('a', prompt_tokens=8000))
    scheduler.tick()
    assert engine.kv.tokens('a') == 8000 - 6000 + 1                # prompt evicted, 1 token out
    decode = scheduler.tick().duration_s
    cal = engine.calibration
    assert plain_decode - decode == pytest.approx(6000 * cal.decode_ms_per_context_token / 1000)
    assert plain_engine.kv.tokens('a') == 8002


def test_engine_capability_errors() -> None:
    engine = SimulatedEngine()
    engine.register(EngineRequest('a', 'p', 100, 10, script=('x',)))
    with pytest.raises(EngineError, match='evict ratio'):
        engine.compress_kv('a', 1.0)
    with pytest.raises(EngineError, match='unknown request'):
        engine.evict('nope', 'host')

    class NoCapabilities(SimulatedEngine):
        capabilities = frozenset()
        evict = SimulatedEngine.__mro__[1].evict                   # the Engine default
        compress_kv = SimulatedEngine.__mro__[1].compress_kv

    bare = NoCapabilities()
    with pytest.raises(EngineError, match='cannot evict'):
        bare.evict('a', 'host')
    with pytest.raises(EngineError, match='cannot compress'):
        bare.compress_kv('a', 0.5)


def test_preempt_on_an_engine_that_cannot_evict_keeps_the_kv() -> None:
    class NoEvict(SimulatedEngine):
        capabilities = SimulatedEngine.capabilities - {'evict'}
        evict = SimulatedEngine.__mro__[1].evict

    policy = Recording()
    scheduler = Scheduler(policy, NoEvict(), SimClock())
    generation = scheduler.submit(make_spec('a'))
    scheduler.tick()
    policy.preempt_once = {'a': 'none'}
    scheduler.decide = lambda ctx=None: []  # type: ignore[method-assign]
    scheduler.tick()
    assert scheduler.engine.kv.location('a') == 'gpu'
    assert generation.preemptions == 1


def test_swap_out_respects_host_capacity() -> None:
    engine = SimulatedEngine()
    kv = engine.kv
    kv.add('a', 100)
    kv.place('a', 0)
    used = kv.gpu_blocks - kv.gpu_free
    assert kv.swap_out('a') and kv.location('a') == 'host'
    assert kv.gpu_blocks - kv.gpu_free == used - kv.blocks(100)
    assert kv.swap_out('a')                                        # already there
    kv.add('big', kv.host_blocks * kv.block_size)
    kv.place('big', 0)
    assert not kv.swap_out('big') and kv.location('big') == 'gpu'
    kv.shrink('a', 50)
    assert kv.tokens('a') == 50
