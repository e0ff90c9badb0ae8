"""Faults stay with their goal: segmenter and engine failures, silent robots, a failing loop.

Regression tests of issue 13 items 1–3 on the scheduler (virtual clock) and the live service.
"""

from __future__ import annotations

import math
import threading

import pytest
from utils import make_scheduler, make_spec

from timelyllm_ros.core import scheduler as scheduler_module
from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig, TickResult
from timelyllm_ros.engines.faults import FaultInjectingEngine, InjectedFault
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import ConfigError, EngineError, GoalError
from timelyllm_ros.language.segmenter import Segmenter
from timelyllm_ros.live.service import PlanGoal, PlannerService
from timelyllm_ros.policies import create_policy

PLANS = {f'g{i}': plan for i, plan in enumerate(
    ['mr(50);mf(100)', 'mf(50);tc(90);mf(20)', 'u(30);d(30)', 'tc(45);mb(60)'])}


def drain(scheduler: Scheduler, max_ticks: int = 500) -> list[TickResult]:
    outs = []
    for _ in range(max_ticks):
        if not scheduler.has_work:
            return outs
        outs.append(scheduler.tick())
        assert scheduler.invariant_violations() == []
    raise AssertionError('scheduler did not drain')


def dispatched(scheduler: Scheduler, outs: list[TickResult]) -> dict[str, str]:
    texts: dict[str, str] = {}
    for out in outs:
        for d in out.dispatches:
            texts[d.task_id] = texts.get(d.task_id, '') + d.segment.text
    return texts


def reference_plans(policy: str) -> dict[str, str]:
    scheduler, _, _ = make_scheduler(policy)
    for task_id, plan in PLANS.items():
        scheduler.submit(make_spec(task_id, plan=plan))
    return dispatched(scheduler, drain(scheduler))


class ExplodingSegmenter(Segmenter):
    """Raises on any piece containing BOOM, as a segmenter bug on one goal's text would."""

    def feed(self, delta: str):  # type: ignore[no-untyped-def]
        if 'BOOM' in delta:
            raise RecursionError('maximum recursion depth exceeded')
        return super().feed(delta)


@pytest.mark.parametrize('policy', ['timelyllm', 'vllm', 'vllm-stream'])
def test_one_goals_segmenter_failure_ends_only_that_goal(policy, monkeypatch) -> None:
    reference = reference_plans(policy)
    monkeypatch.setattr(scheduler_module, 'Segmenter', ExplodingSegmenter)
    scheduler, _, engine = make_scheduler(policy)
    generations = {t: scheduler.submit(make_spec(t, plan=p)) for t, p in PLANS.items()}
    bad = scheduler.submit(make_spec('bad', plan='mf(50);BOOM;mf(20)'))
    plans = dispatched(scheduler, drain(scheduler))
    assert bad.status == TaskStatus.FAILED
    assert 'RecursionError' in bad.error and 'internal error' in bad.error
    for task_id, generation in generations.items():
        assert generation.status == TaskStatus.GENERATED, generation.error
        assert plans[task_id] == reference[task_id]    # every other token was still fed
    assert engine.running == ()


@pytest.mark.parametrize(('call', 'rate'), [
    ('step', 0.02), ('run', 0.15), ('pause', 0.15), ('release', 0.15), ('register', 0.15)])
def test_engine_exceptions_of_any_type_end_only_the_goals_they_concern(call, rate) -> None:
    engine = FaultInjectingEngine(SimulatedEngine(), {call: rate}, seed=3)
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    generations = []
    for i in range(12):
        if call == 'step' and i == 6:
            drain(scheduler)                    # a second wave: one failed step ends a batch
        try:
            generations.append(scheduler.submit(make_spec(f't{i}', plan=PLANS['g1'])))
        except EngineError as err:             # register failed: refused, nothing queued
            assert 'InjectedFault' in str(err)
            assert f't{i}' not in scheduler.generations
    drain(scheduler)
    assert engine.injected[call] > 0
    for generation in generations:
        assert generation.status in (TaskStatus.GENERATED, TaskStatus.FAILED)
        if generation.status == TaskStatus.FAILED:
            assert 'InjectedFault' in generation.error
        else:
            assert ''.join(s.text for s in generation.segments) == 'mf(50);tc(90);mf(20)'
    if call == 'release':   # the plan was complete: a failed release is logged, not fatal
        assert all(g.status == TaskStatus.GENERATED for g in generations)
    elif call != 'register':
        assert any(g.status == TaskStatus.FAILED for g in generations)
    assert any(g.status == TaskStatus.GENERATED for g in generations)


def test_a_failing_run_leaves_the_candidate_queued_nowhere() -> None:
    engine = FaultInjectingEngine(SimulatedEngine(), {'run': 1.0})
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    generation = scheduler.submit(make_spec())
    out = scheduler.tick()
    assert generation.status == TaskStatus.FAILED and out.ended == [generation]
    assert 'could not start' in generation.error
    assert not scheduler.has_work and scheduler.invariant_violations() == []


def test_preempt_failure_ends_only_that_goal() -> None:
    class PreemptFirst(type(create_policy('timelyllm'))):  # type: ignore[misc]
        def preempt(self, ctx):  # type: ignore[no-untyped-def]
            return {g.task_id: 'keep' for g in list(ctx.running)[:1]}

    engine = FaultInjectingEngine(SimulatedEngine(), {'pause': 1.0})
    scheduler = Scheduler(PreemptFirst(), engine, SimClock())
    a = scheduler.submit(make_spec('a'))
    scheduler.tick()
    out = scheduler.tick()
    assert a.status == TaskStatus.FAILED and a in out.ended
    assert 'could not preempt' in a.error
    assert scheduler.invariant_violations() == []


def test_a_silent_robot_ends_its_goal_after_the_deadline() -> None:
    config = SchedulerConfig(report_timeout_factor=2.0, report_timeout_margin_s=1.0)
    scheduler, clock, _ = make_scheduler('timelyllm', config=config)
    silent = scheduler.submit(make_spec('silent', plan='mf(50)'))
    talking = scheduler.submit(make_spec('talking', plan='mf(50)'))
    drain(scheduler)
    assert silent.status == talking.status == TaskStatus.GENERATED
    segment = silent.segments[0]
    scheduler.report_segment('talking', 0, clock.now(), clock.now() + 1.0)
    due = (segment.dispatch_time + 2 * config.comm_s + 2.0 * segment.longest_exec_s
           + config.report_timeout_margin_s)
    clock.advance_to(due - 0.01)
    assert scheduler.expire_overdue() == []
    clock.advance_to(due + 0.01)
    assert scheduler.expire_overdue() == [silent]
    assert silent.status == TaskStatus.FAILED
    assert silent.error == 'robot did not report segment 0 in time'
    assert talking.status == TaskStatus.FINISHED


def test_the_deadline_of_a_later_segment_runs_from_the_previous_end() -> None:
    config = SchedulerConfig(report_timeout_factor=1.0, report_timeout_margin_s=0.5)
    scheduler, clock, _ = make_scheduler('vllm-stream', config=config)
    generation = scheduler.submit(make_spec(plan='mf(50);mf(50)'))
    drain(scheduler)
    first, second = generation.segments
    # The robot works on segment 0 far longer than its estimate but reports it in time...
    late_end = first.dispatch_time + first.longest_exec_s + 0.4
    clock.advance_to(late_end)
    scheduler.report_segment(generation.task_id, 0, first.dispatch_time, late_end)
    # ...so segment 1 is given its full time from then on.
    clock.advance_to(late_end + second.longest_exec_s + 0.4)
    assert scheduler.expire_overdue() == []
    clock.advance_to(late_end + second.longest_exec_s + 0.6 + 2 * config.comm_s)
    assert scheduler.expire_overdue() == [generation]
    assert generation.error == 'robot did not report segment 1 in time'


def test_no_deadline_when_disabled() -> None:
    scheduler, clock, _ = make_scheduler('timelyllm',
                                         config=SchedulerConfig(report_deadlines=False))
    generation = scheduler.submit(make_spec(plan='mf(50)'))
    drain(scheduler)
    clock.advance_to(1e6)
    assert scheduler.expire_overdue() == [] and generation.status == TaskStatus.GENERATED


@pytest.mark.parametrize('kwargs', [
    {'max_batch': -3}, {'max_batch': 0}, {'comm_s': float('nan')}, {'comm_s': -1.0},
    {'report_timeout_factor': 0.5}, {'report_timeout_margin_s': float('inf')},
    {'step_smoothing': 0.0},
])
def test_scheduler_parameters_are_checked(kwargs) -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(**kwargs)


def test_non_finite_report_times_are_refused() -> None:
    scheduler, _, _ = make_scheduler('timelyllm')
    scheduler.submit(make_spec(plan='mf(50)'))
    drain(scheduler)
    with pytest.raises(GoalError, match='finite'):
        scheduler.report_segment('t0', 0, 0.0, float('nan'))


# -- the live service -------------------------------------------------------------------------
class Ends:
    def __init__(self) -> None:
        self.generations: dict[str, object] = {}
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.expected = 0

    def on_end(self, generation) -> None:  # type: ignore[no-untyped-def]
        with self.lock:
            assert generation.task_id not in self.generations, 'ended twice'
            self.generations[generation.task_id] = generation
            if len(self.generations) >= self.expected:
                self.all_done.set()


def test_service_ends_a_goal_whose_robot_never_reports() -> None:
    config = SchedulerConfig(report_timeout_factor=1.0, report_timeout_margin_s=0.05)
    with PlannerService.create(config=config) as service:
        ends = Ends()
        ends.expected = 1
        service.submit(PlanGoal('drone_0', 'tello', 'take off and fly forward'),
                       lambda g, s: None, ends.on_end)
        assert ends.all_done.wait(60.0), 'the goal never ended'
    [generation] = ends.generations.values()
    assert generation.status == TaskStatus.FAILED                 # type: ignore[attr-defined]
    assert 'did not report segment' in generation.error           # type: ignore[attr-defined]


def test_a_raising_listener_affects_no_other_goal() -> None:
    with PlannerService.create(config=SchedulerConfig(report_deadlines=False)) as service:
        ends = Ends()
        ends.expected = 2

        def bad_segment_listener(generation, segment):  # type: ignore[no-untyped-def]
            raise ValueError('listener bug')

        for i, listener in enumerate((bad_segment_listener, lambda g, s: None)):
            service.submit(PlanGoal(f'drone_{i}', 'tello', 'take off and fly forward',
                                    wait_for_execution=False), listener, ends.on_end)
        assert ends.all_done.wait(60.0)
    assert all(g.status == TaskStatus.GENERATED for g in ends.generations.values())


def test_repeated_loop_failures_fail_every_goal_and_stop_the_loop() -> None:
    service = PlannerService.create(config=SchedulerConfig(report_deadlines=False))
    service.max_loop_failures = 3
    ends = Ends()
    ends.expected = 3
    for i in range(3):
        service.submit(PlanGoal(f'drone_{i}', 'tello', 'take off'), lambda g, s: None,
                       ends.on_end)

    def broken_tick():  # type: ignore[no-untyped-def]
        raise InjectedFault('scheduler bug')

    service.scheduler.tick = broken_tick  # type: ignore[method-assign]
    service.start()
    try:
        assert ends.all_done.wait(60.0), 'goals were left running'
        service._thread.join(10.0)  # type: ignore[union-attr]
        assert not service._thread.is_alive()  # type: ignore[union-attr]
    finally:
        service.stop()
    assert all(g.status == TaskStatus.FAILED and 'failed 3 times in a row' in g.error
               for g in ends.generations.values())
    state = service.state()
    assert state.status == 'failed' and 'scheduler bug' in state.error
    with pytest.raises(GoalError, match='not serving'):
        service.submit(PlanGoal('drone_9', 'tello', 'take off'), print, print)


def test_stopping_the_service_ends_every_goal() -> None:
    service = PlannerService.create(config=SchedulerConfig(report_deadlines=False))
    ends = Ends()
    ends.expected = 4
    for i in range(4):
        service.submit(PlanGoal(f'drone_{i}', 'tello', 'take off'), lambda g, s: None,
                       ends.on_end)
    service.start()
    service.stop()
    assert ends.all_done.is_set()
    assert service.state().status == 'stopped'
    with pytest.raises(GoalError, match='not serving'):
        service.submit(PlanGoal('drone_9', 'tello', 'take off'), print, print)


@pytest.mark.parametrize('policy', ['timelyllm', 'vllm-stream'])
def test_the_reported_outputs_reject_only_their_own_statements(policy) -> None:
    # Issue 13 item 1 as reported: 12 goals beside one with a 5,000-digit loop count and one
    # with 400 nested loops. The two are refused (no executable skill); the 12 plans are intact.
    scheduler, _, _ = make_scheduler(policy)
    normal = [scheduler.submit(make_spec(f'n{i}', plan='mr(50);mf(100)')) for i in range(12)]
    digits = scheduler.submit(make_spec('digits', plan='9' * 5000 + '{tp()}'))
    nested = scheduler.submit(make_spec('nested', plan='1{' * 400 + 'tp()' + '}' * 400))
    plans = dispatched(scheduler, drain(scheduler))
    for generation in (digits, nested):
        assert generation.status == TaskStatus.FAILED
        assert generation.error.startswith('no executable skill'), generation.error
    for generation in normal:
        assert generation.status == TaskStatus.GENERATED
        assert plans[generation.task_id] == 'mr(50);mf(100)'


# -- robot report times (issue 31, item 3) ----------------------------------------------------
def test_a_report_ending_in_the_future_is_refused_and_the_goal_keeps_its_deadline() -> None:
    config = SchedulerConfig(report_timeout_factor=2.0, report_timeout_margin_s=1.0)
    scheduler, clock, _ = make_scheduler('timelyllm', config=config)
    generation = scheduler.submit(make_spec('t0', plan='mf(50);mf(50)'))
    for _ in range(200):
        if generation.segments:
            break
        scheduler.tick()
    first = generation.segments[0]
    due = (first.dispatch_time + 2 * config.comm_s + 2.0 * first.longest_exec_s
           + config.report_timeout_margin_s)
    with pytest.raises(GoalError, match='another clock'):
        scheduler.report_segment('t0', 0, clock.now(), clock.now() + 1e6)
    assert math.isnan(first.end_time) and math.isnan(first.start_time)
    assert generation.need_time < 1e5            # the refused end did not become need_time
    drain(scheduler)
    clock.advance_to(due + 0.01)
    assert generation in scheduler.expire_overdue()
    assert generation.error == 'robot did not report segment 0 in time'


@pytest.mark.parametrize(('start', 'end', 'why'), [
    (-100.0, 0.0, 'before it was dispatched'),       # a robot on a clock 100 s behind
    (0.5, 0.2, 'before it starts'),
    (0.0, 50.0, 'after the planner'),                  # a robot on a clock 50 s ahead
])
def test_impossible_report_times_are_refused_with_the_reason(start, end, why) -> None:
    scheduler, clock, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec(plan='mf(50)'))
    drain(scheduler)
    clock.advance_to(max(clock.now(), 1.0))
    dispatched = generation.segments[0].dispatch_time
    with pytest.raises(GoalError, match=why):
        scheduler.report_segment('t0', 0, dispatched + start, dispatched + end)
    assert generation.status == TaskStatus.GENERATED


def test_report_times_within_the_clock_tolerance_are_accepted() -> None:
    config = SchedulerConfig(report_clock_tolerance_s=0.5)
    scheduler, clock, _ = make_scheduler('timelyllm', config=config)
    generation = scheduler.submit(make_spec(plan='mf(50)'))
    drain(scheduler)
    dispatched = generation.segments[0].dispatch_time
    now = clock.now()
    # A robot clock 0.4 s off either way is tolerated.
    scheduler.report_segment('t0', 0, dispatched - 0.4, now + 0.4)
    assert generation.status == TaskStatus.FINISHED


# -- stopping from a listener (issue 31, item 4) ----------------------------------------------
@pytest.mark.parametrize('stop_from', ['end', 'segment'])
def test_stopping_from_a_listener_ends_every_goal_and_refuses_new_ones(stop_from) -> None:
    service = PlannerService.create(config=SchedulerConfig(report_deadlines=False))
    ends = Ends()
    ends.expected = 4
    stopped = threading.Event()

    def stop_once() -> None:
        if not stopped.is_set():
            stopped.set()
            service.stop()            # on the loop thread

    def on_end(generation) -> None:  # type: ignore[no-untyped-def]
        ends.on_end(generation)
        if stop_from == 'end':
            stop_once()

    def on_segment(generation, segment) -> None:  # type: ignore[no-untyped-def]
        if stop_from == 'segment':
            stop_once()

    loop = None
    try:
        service.start()
        loop = service._thread
        service.submit(PlanGoal('drone_0', 'tello', 'take off', wait_for_execution=False),
                       on_segment, on_end)
        for i in range(1, 4):
            service.submit(PlanGoal(f'drone_{i}', 'tello', 'take off and fly forward'),
                           on_segment, on_end)
        assert ends.all_done.wait(60.0), 'goals were left running after a stop'
        assert loop is not None
        loop.join(10.0)
        assert not loop.is_alive()
        assert service.state().status == 'stopped'
        with pytest.raises(GoalError, match='not serving'):
            service.submit(PlanGoal('drone_9', 'tello', 'take off'), print, print)
    finally:
        service.stop()
    statuses = sorted(g.status.name for g in ends.generations.values())  # type: ignore[attr-defined]
    assert len(statuses) == 4 and statuses.count('FAILED') >= 3


def test_a_stop_racing_a_stop_from_a_listener_ends_every_goal_once() -> None:
    service = PlannerService.create(config=SchedulerConfig(report_deadlines=False))
    ends = Ends()
    ends.expected = 3
    for i in range(3):
        service.submit(PlanGoal(f'drone_{i}', 'tello', 'take off'), lambda g, s: None,
                       lambda g: (ends.on_end(g), service.stop()))
    service.start()
    service.stop()                        # the listeners stop it again, on the loop thread
    assert ends.all_done.is_set()         # Ends asserts each goal ends once
    assert service.state().status == 'stopped'


# -- memory never fails a goal under way (issue 31, item 2) -----------------------------------
class OutgrownEngine(SimulatedEngine):
    """A simulator whose memory stops fitting one generation once ``outgrown`` holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.outgrown: set[str] = set()

    def can_run(self, request_id: str) -> bool:
        return request_id not in self.outgrown and super().can_run(request_id)

    def fits_when_idle(self, request_id: str) -> bool:
        return request_id not in self.outgrown and super().fits_when_idle(request_id)


def test_a_goal_whose_robot_runs_a_segment_is_never_failed_for_memory() -> None:
    engine = OutgrownEngine()
    clock = SimClock()
    scheduler = Scheduler(create_policy('timelyllm'), engine, clock)
    generation = scheduler.submit(make_spec('t0', plan='mf(50);tc(90);mf(20)'))
    for _ in range(100):
        scheduler.tick()
        if generation.status == TaskStatus.SUSPENDED:   # once its second statement began
            break
    assert len(generation.segments) == 1
    engine.outgrown.add('t0')            # its KV grew past what the engine can hold
    results = drain(scheduler)
    assert generation.status == TaskStatus.GENERATED, generation.error
    assert generation.finish_reason == 'length' and generation.segments[-1].is_last
    assert any(generation in r.closed for r in results)     # the robot is told the plan ended
    fresh = scheduler.submit(make_spec('t1', plan='mf(50)'))
    engine.outgrown.add('t1')
    drain(scheduler)
    assert fresh.status == TaskStatus.FAILED          # nothing of it ran: refused as before
    assert fresh.error == 'the prompt does not fit in the engine KV memory'
    assert not scheduler.invariant_violations()


def test_a_failure_report_ends_the_goal_with_the_robots_reason_whatever_its_times() -> None:
    """A robot on another clock that fails a segment: the failure is not refused for its times
    (the goal would wait for a deadline), it ends the goal with the robot's reason."""
    scheduler = Scheduler(create_policy('timelyllm'), SimulatedEngine(), SimClock())
    generation = scheduler.submit(make_spec('t0'))
    while not generation.segments:
        scheduler.tick()
    scheduler.report_segment('t0', 0, 1e9, 1e9 + 1, success=False,
                             error="skill 'scan' is not supported")
    assert generation.status == TaskStatus.FAILED
    assert generation.error == "robot failed segment 0: skill 'scan' is not supported"
    assert math.isnan(generation.segments[0].end_time)      # impossible times not kept
    with pytest.raises(GoalError, match='another clock'):     # a success report still is
        scheduler.report_segment('t0', 0, 1e9, 1e9 + 1)
