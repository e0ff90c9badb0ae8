"""Autellix PLAS / ATLAS (paper 002): the paper's toy example, the process table, the queues,
anti-starvation, capacity and a whole WID1 run."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import numpy as np
import pytest
from utils import make_spec

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines.base import Engine, EngineRequest, EngineStats, EvictTo, StepResult
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import resolve_workload
from timelyllm_ros.policies import POLICIES, create_policy
from timelyllm_ros.policies.autellix import AutellixAtlasPolicy, AutellixPolicy
from timelyllm_ros.policies.base import Policy


# -- a unit-step engine: every iteration is 1 s and emits one piece per running generation ----
class UnitEngine(Engine):
    """Decode steps are the time unit (the paper's toy example): no prefill iteration, no KV
    limit but the batch cap; evicting only takes a generation out of the batch."""

    capabilities = frozenset({'evict'})

    def __init__(self, max_num_seqs: int) -> None:
        self._scripts: dict[str, tuple[str, ...]] = {}
        self._emitted: dict[str, int] = {}
        self._running: dict[str, None] = {}
        self._max = max_num_seqs
        self.batch_sizes: list[int] = []
        self.evictions: list[tuple[str, str]] = []

    def register(self, request: EngineRequest) -> None:
        self._scripts[request.request_id] = request.script or ()
        self._emitted[request.request_id] = 0

    def can_run(self, request_id: str) -> bool:
        return request_id in self._running or len(self._running) < self._max

    def run_cost_s(self, request_id: str) -> float:
        return 0.0

    def run(self, request_id: str) -> None:
        assert self.can_run(request_id)
        self._running[request_id] = None

    def pause(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def evict(self, request_id: str, to: EvictTo) -> None:
        self.evictions.append((request_id, to))
        self._running.pop(request_id, None)

    def decode_step_s(self, batch_size: int) -> float:
        return 1.0

    def stats(self) -> EngineStats:
        return EngineStats(model='unit steps', hardware='none', steps=len(self.batch_sizes),
                           busy_s=float(len(self.batch_sizes)))

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._running)

    @property
    def max_num_seqs(self) -> int:
        return self._max

    def step(self, only: Collection[str] | None = None) -> StepResult:
        tokens: dict[str, str] = {}
        finished: dict[str, str] = {}
        for request_id in list(self._running):
            i = self._emitted[request_id]
            tokens[request_id] = self._scripts[request_id][i]
            self._emitted[request_id] = i + 1
            if i + 1 == len(self._scripts[request_id]):
                finished[request_id] = 'eos'
        for request_id in finished:
            self._running.pop(request_id)
        self.batch_sizes.append(len(tokens))
        assert len(tokens) <= self._max
        return StepResult(duration_s=1.0, text=tokens, finished=finished,  # type: ignore[arg-type]
                          batch_size=len(tokens))


def call_pieces(calls: Sequence[int]) -> tuple[str, ...]:
    """Script whose segments (calls) are exactly ``calls`` tokens long: ``l('a…a')`` each."""
    pieces: list[str] = []
    for index, length in enumerate(calls):
        head = "l('" if index == 0 else ";l('"
        pieces += [head + "a')"] if length == 1 else [head, *['a'] * (length - 2), "')"]
    return tuple(pieces)


def run_programs(policy: Policy, programs: Sequence[tuple[str, float, Sequence[int], str]],
                 batch: int, limit: int = 5000) -> tuple[dict[str, Generation], UnitEngine]:
    """Run (task id, arrival, call lengths, robot id) on the unit engine; segments are
    re-queued at once (the robots' execution, Autellix's interrupt, takes no time). No robot
    reports, so the scheduler's report deadlines are off. A call ends at its cut, as in the
    paper's model (the scheduler's default suspends it once its next call began; the toy
    example's figures are those of calls interrupted at their end), and the end of a program
    is an empty call of its own."""
    engine = UnitEngine(batch)
    clock = SimClock()
    scheduler = Scheduler(policy, engine, clock, SchedulerConfig(
        report_deadlines=False, suspend_on_next_statement=False))
    pending = sorted(programs, key=lambda p: p[1])
    generations: dict[str, Generation] = {}
    for _ in range(limit):
        while pending and pending[0][1] <= clock.now():
            task_id, arrival, calls, robot = pending.pop(0)
            spec = replace(make_spec(task_id, arrival=arrival, robot_id=robot),
                           script=call_pieces(calls))
            generations[task_id] = scheduler.submit(spec)
        if not scheduler.has_work:
            if not pending:
                break
            clock.advance_to(pending[0][1])
            continue
        scheduler.tick()
    else:
        raise AssertionError('programs did not finish')
    for task_id, _, calls, _ in programs:
        assert [s.tokens for s in generations[task_id].segments] == list(calls)
    return generations, engine


TOY = {'A': [4, 3, 1, 1], 'B': [3, 3, 4], 'C': [1, 2], 'D': [4]}
TOY_PROGRAMS = [(name, 0.0, calls, f'robot-{name}') for name, calls in TOY.items()]


def total_waiting(generations: dict[str, Generation]) -> float:
    """Σ over programs of (completion − service): with unit steps and no interrupt time this
    is the time their calls spent queued."""
    return sum(g.segments[-1].cut_time - sum(s.tokens for s in g.segments)
               for g in generations.values())


class CallFcfs(Policy):
    """Call-level FCFS (each segment call ranked by its own arrival; ties by submission)."""

    name = 'call-fcfs'

    def __init__(self) -> None:
        self.arrival: dict[int, float] = {}

    def on_submit(self, generation, now):
        self.arrival[generation.seq] = now

    def on_cut(self, generation, now):
        self.arrival[generation.seq] = now

    def priorities(self, queue, now):
        return -np.array([self.arrival[int(s)] for s in queue.seq])


# -- the paper's toy example (Fig. 2) ---------------------------------------------------------
def test_toy_example_fcfs_waits_18_with_ties_a_b_c_d() -> None:
    generations, engine = run_programs(CallFcfs(), TOY_PROGRAMS, batch=2)
    assert total_waiting(generations) == 18.0
    assert max(engine.batch_sizes) == 2


@pytest.mark.parametrize('cls', [AutellixPolicy, AutellixAtlasPolicy])
def test_toy_example_plas_waits_less_than_fcfs(cls: type[AutellixPolicy]) -> None:
    # Fine queues (q0 = one decode step): the digest's check gives 13–14 with ties A, B, C, D
    # (not the figure's 12, which needs another tie order).
    policy = cls(num_queues=8, q0_s=1.0, starvation_ratio=math.inf)
    generations, engine = run_programs(policy, TOY_PROGRAMS, batch=2)
    waiting = total_waiting(generations)
    assert waiting <= 14.0 < 18.0
    assert max(engine.batch_sizes) == 2
    assert all(to == 'host' for _, to in engine.evictions)       # preemption swaps out
    # Process table: single-threaded programs, so PLAS = ATLAS = the sum of their calls.
    for name, calls in TOY.items():
        assert policy.table[f'robot-{name}'].service == pytest.approx(sum(calls))
        assert policy.table[f'robot-{name}'].calls == len(calls) + 1   # + the empty EOS call


def test_one_wide_queue_degenerates_to_fcfs() -> None:
    policy = AutellixPolicy(num_queues=1, q0_s=100.0, starvation_ratio=math.inf)
    generations, _ = run_programs(policy, TOY_PROGRAMS, batch=2)
    assert total_waiting(generations) == 18.0


# -- the process table: PLAS sums, ATLAS takes the critical path ----------------------------
@pytest.mark.parametrize(('cls', 'service'), [(AutellixPolicy, 8.0), (AutellixAtlasPolicy, 5.0)])
def test_parallel_calls_of_one_program(cls: type[AutellixPolicy], service: float) -> None:
    # One robot runs two tasks at once (a two-threaded program): calls of 3 and 5 steps.
    policy = cls(q0_s=1.0, starvation_ratio=math.inf)
    run_programs(policy, [('x1', 0.0, [3], 'robot-x'), ('x2', 0.0, [5], 'robot-x')], batch=2)
    assert policy.table['robot-x'].service == pytest.approx(service)


def test_program_id_can_be_the_task() -> None:
    policy = AutellixPolicy(q0_s=1.0, program='task')
    generations, _ = run_programs(policy, [('x1', 0.0, [3], 'robot-x'),
                                           ('x2', 0.0, [5], 'robot-x')], batch=2)
    assert policy.table == {}                                       # sessions ended
    assert all(g.status == TaskStatus.GENERATED for g in generations.values())


def test_later_tasks_of_a_robot_inherit_its_service() -> None:
    # robot-a already got 6 steps of service; its next task starts in a lower queue than a
    # fresh robot's, so the fresh robot's call goes first even though it arrived later.
    policy = AutellixPolicy(num_queues=4, q0_s=1.0, starvation_ratio=math.inf)
    generations, _ = run_programs(policy, [('a1', 0.0, [6], 'robot-a'),
                                           ('a2', 6.0, [2], 'robot-a'),
                                           ('b1', 6.0, [2], 'robot-b')], batch=1)
    assert generations['b1'].segments[-1].cut_time < generations['a2'].segments[-1].cut_time


def test_queue_bounds_are_geometric() -> None:
    policy = AutellixPolicy(num_queues=4, q0_s=0.5)
    assert [policy.queue_bounds(i) for i in range(4)] == [
        (0.0, 0.5), (0.5, 1.5), (1.5, 3.5), (3.5, math.inf)]
    assert [policy.quantum(i) for i in range(4)] == [0.5, 1.0, 2.0, math.inf]
    assert [policy.queue_of(s) for s in (0.0, 0.49, 0.5, 1.49, 1.5, 3.5, 1e9)] == [
        0, 0, 1, 1, 2, 3, 3]
    with pytest.raises(ValueError):
        AutellixPolicy(num_queues=0)
    with pytest.raises(ValueError):
        AutellixPolicy(program='fleet')  # type: ignore[arg-type]


def test_a_call_that_uses_up_its_quantum_is_demoted() -> None:
    policy = AutellixPolicy(num_queues=4, q0_s=1.0, starvation_ratio=math.inf)
    # A long call and, later, a fresh one-step call: after the long call used its quanta it
    # sits in a lower queue, so the fresh call preempts it (batch 1).
    generations, engine = run_programs(policy, [('long', 0.0, [8], 'robot-l'),
                                                ('short', 3.0, [1], 'robot-s')], batch=1)
    assert policy.demotions >= 2
    assert generations['short'].segments[0].cut_time == 4.0          # ran at once
    assert ('long', 'host') in engine.evictions


# -- anti-starvation -----------------------------------------------------------------------
def starving_workload() -> list[tuple[str, float, list[int], str]]:
    """A robot whose program already has service (so it sits in a low queue), against a
    stream of fresh two-step programs that alone keeps a batch of one busy until t = 80."""
    programs = [('long', 0.0, [4, 4, 4], 'robot-long')]
    programs += [(f's{i:02d}', 2.0 * i, [2], f'robot-s{i:02d}') for i in range(40)]
    return programs


def test_without_anti_starvation_the_long_program_waits_for_the_stream() -> None:
    policy = AutellixPolicy(num_queues=4, q0_s=1.0, starvation_ratio=math.inf)
    generations, _ = run_programs(policy, starving_workload(), batch=1)
    assert policy.promotions == []
    assert generations['long'].segments[-1].cut_time > 80.0


class CheckedAutellix(AutellixPolicy):
    """Checks after every round that no waiting call below Q_1 is past the β threshold."""

    rounds = 0

    def preempt(self, ctx):
        decisions = super().preempt(ctx)
        self.rounds += 1
        for call in self.calls.values():
            generation = self._gens[call.task_id]
            if call.queue <= 0 or generation.status == TaskStatus.RUNNING:
                continue
            entry = self.table[call.pid]
            ratio = (entry.wait + call.wait) / max(entry.service + call.run, self.min_service_s)
            assert ratio < self.starvation_ratio, (call, ratio)
        return decisions


@pytest.mark.parametrize('beta', [2.0, 4.0])
def test_anti_starvation_promotes_within_one_round_of_the_bound(beta: float) -> None:
    policy = CheckedAutellix(num_queues=4, q0_s=1.0, starvation_ratio=beta)
    generations, _ = run_programs(policy, starving_workload(), batch=1)
    assert policy.rounds > 80
    assert policy.promotions, 'the starving call was never promoted'
    long_promotions = [p for p in policy.promotions if p.task_id == 'long']
    assert long_promotions
    for promotion in policy.promotions:
        floor = max(promotion.service_s, policy.min_service_s)
        assert promotion.wait_s / floor >= beta and promotion.from_queue > 0
    # Each round adds one step of waiting, so a call waiting below Q_1 is promoted at most one
    # round after its ratio reaches β: the long program's calls (which wait only below Q_1
    # until promoted) wait at most β × the program's service plus one round.
    for promotion in long_promotions:
        assert promotion.call_wait_s <= beta * max(promotion.service_s,
                                                   policy.min_service_s) + 1.0
    shorts_end = max(g.segments[-1].cut_time for t, g in generations.items() if t != 'long')
    assert generations['long'].segments[-1].cut_time < shorts_end   # not left to the end


def test_zero_service_guard() -> None:
    # A call of a program with no service yet never divides by zero (T floored).
    policy = AutellixPolicy(num_queues=2, q0_s=1.0, starvation_ratio=2.0)
    generations, _ = run_programs(policy, [(f't{i}', 0.0, [3], f'r{i}') for i in range(5)],
                                  batch=1)
    assert all(g.status == TaskStatus.GENERATED for g in generations.values())


# -- through the simulator ------------------------------------------------------------------
@pytest.fixture(scope='module')
def wid1():
    return resolve_workload('wid1', seed=0)[1]


@pytest.mark.parametrize('name', ['autellix-plas', 'autellix-atlas'])
def test_registered_and_completes_every_task_of_wid1(name: str, wid1) -> None:
    assert name in POLICIES and isinstance(create_policy(name), AutellixPolicy)
    result = simulate(wid1, policy=name, seed=0)
    assert not result.rejected
    assert len(result.generations) == len(wid1)
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)


class CheckedEngine(SimulatedEngine):
    """Asserts the capacity invariants at every iteration."""

    def __init__(self, max_batch: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_batch = max_batch
        self.peak_batch = 0

    def step(self, only=None):
        assert len(self.running) <= min(self.max_batch, self.max_num_seqs)
        self.peak_batch = max(self.peak_batch, len(self.running))
        result = super().step(only)
        kv = self.kv
        assert 0 <= kv.gpu_free <= kv.gpu_blocks
        assert 0 <= kv._host_used <= kv.host_blocks
        return result


@pytest.mark.parametrize('name', ['autellix-plas', 'autellix-atlas'])
def test_capacity_is_never_exceeded_under_memory_pressure(name: str) -> None:
    tasks = resolve_workload('wid2', seed=1)[1][:150]
    calibration = load_calibration().model_copy(update={'gpu_kv_tokens': 8192,
                                                        'host_kv_tokens': 8192})
    engine = CheckedEngine(6, calibration=calibration, prefix_caching=False)
    result = simulate(tasks, policy=name, engine=engine, config=SchedulerConfig(max_batch=6))
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)
    assert max(result.batch_sizes) <= 6 and engine.peak_batch >= 2
    assert engine.kv.swaps_out > 0                                  # memory was contended


# -- bounded state (issue 13, item 8) ---------------------------------------------------------
def _run_waves(policy: AutellixPolicy, waves: int, per_wave: int,
               robot: Callable[[int, int], str], keep: str | None = None,
               probe: Callable[[Scheduler], None] | None = None) -> dict[str, int]:
    """Submit ``waves`` waves of ``per_wave`` goals (robot id ``robot(wave, i)``) through a real
    scheduler over the simulated engine, each wave run until its goals are generated; with
    ``keep`` a long goal of that robot is submitted first. ``probe`` runs after every tick.
    Returns the largest size of each internal structure seen after any tick."""
    clock = SimClock()
    scheduler = Scheduler(policy, SimulatedEngine(), clock,
                          SchedulerConfig(report_deadlines=False))
    if keep is not None:
        scheduler.submit(make_spec('keep', plan=';'.join(['mf(50)'] * 40), robot_id=keep))
    sizes: dict[str, int] = {}
    for wave in range(waves):
        ids = [f'w{wave}-{i}' for i in range(per_wave)]
        for i, task_id in enumerate(ids):
            scheduler.submit(make_spec(task_id, arrival=clock.now(), robot_id=robot(wave, i)))
        while any(scheduler.generations[t].status < TaskStatus.GENERATED for t in ids):
            scheduler.tick()
            if probe is not None:
                probe(scheduler)
            queued = sum(len(q) for q in policy.queues)
            for name, size in (('table', len(policy.table)), ('calls', len(policy.calls)),
                               ('queues', queued), ('gens', len(policy._gens))):
                sizes[name] = max(sizes.get(name, 0), size)
    return sizes


def test_process_table_stays_bounded_by_the_live_programs() -> None:
    # 400 goals from 400 distinct robots, at most 10 live at a time
    per_wave, waves, idle = 10, 40, 8
    policy = AutellixPolicy(idle_programs=idle)
    sizes = _run_waves(policy, waves, per_wave, robot=lambda w, i: f'r{w}-{i}')
    assert sizes['table'] <= 2 * per_wave + idle < waves * per_wave
    for name in ('calls', 'queues', 'gens'):
        assert sizes[name] <= per_wave, name
    assert len(policy.table) <= idle + 1 and not policy.calls and not policy._gens


def test_a_live_program_keeps_its_attained_service() -> None:
    # robot-keep's long goal stays live while other robots come and go and are forgotten
    policy = AutellixPolicy(idle_programs=0)
    seen: list[tuple[float, int]] = []            # (robot-keep's service, table size)

    def probe(scheduler: Scheduler) -> None:
        if scheduler.generations['keep'].status < TaskStatus.GENERATED:
            assert 'robot-keep' in policy.table
            seen.append((policy.table['robot-keep'].service, len(policy.table)))

    _run_waves(policy, 6, 10, robot=lambda w, i: f'r{w}-{i}', keep='robot-keep', probe=probe)
    services = [service for service, _ in seen]
    assert services == sorted(services) and services[-1] > 0      # never reset
    sizes = [size for _, size in seen]
    assert any(b < a for a, b in itertools.pairwise(sizes)), 'no program was forgotten'


def test_recently_idle_robots_are_remembered() -> None:
    # the same 5 robots send every wave: their entries, idle between waves, are kept
    policy = AutellixPolicy(idle_programs=8)
    _run_waves(policy, 10, 5, robot=lambda w, i: f'r{i}')
    assert set(policy.table) == {f'r{i}' for i in range(5)}
    assert all(entry.calls >= 10 for entry in policy.table.values())


def test_idle_programs_is_checked() -> None:
    with pytest.raises(ValueError, match='idle_programs'):
        AutellixPolicy(idle_programs=-1)
