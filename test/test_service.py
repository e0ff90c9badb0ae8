"""The live planner service: goals in from any thread, segments and ends out, on a wall clock."""

from __future__ import annotations

import threading
import time

import pytest

from timelyllm_ros.core.tuf import Tuf
from timelyllm_ros.engines.scripts import TraceScripts
from timelyllm_ros.errors import GoalError, TufError
from timelyllm_ros.live.service import PlanGoal, PlannerService

CAT = 'Scene: [] Task: [A] Could you find the cat? If so, go to it.'


class Recorder:
    """Collects a goal's events; `ended` is set when its end listener runs."""

    def __init__(self) -> None:
        self.segments: list = []
        self.closing: list = []        # plan-end markers (closing_segment)
        self.ended = threading.Event()
        self.generation = None

    def on_segment(self, generation, segment) -> None:
        if segment.statements:
            self.segments.append((time.monotonic(), segment))
        else:
            self.closing.append(segment)

    def on_end(self, generation) -> None:
        self.generation = generation
        self.ended.set()


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.01)


@pytest.fixture
def service():
    with PlannerService.create() as running:
        yield running


def report_all(service: PlannerService, goal_id: str, recorder: Recorder, done: set) -> None:
    for _, segment in recorder.segments:
        if segment.index not in done:
            done.add(segment.index)
            now = service.now()
            service.report_segment(goal_id, segment.index, now, now + 0.01)


def test_a_goal_streams_its_segments_then_ends_when_executed(service):
    recorder = Recorder()
    goal_id = service.submit(PlanGoal('drone_0', 'tello', CAT), recorder.on_segment,
                             recorder.on_end)
    wait_for(lambda: len(recorder.segments) == 2)
    assert [s.text.lstrip(';') for _, s in recorder.segments] == [
        "s('cat')", "?iv('cat')==True{g('cat')}"]
    assert not recorder.ended.is_set()          # the robot has not executed anything yet
    done: set = set()
    wait_for(lambda: (report_all(service, goal_id, recorder, done), recorder.ended.is_set())[1])
    generation = recorder.generation
    assert generation.status.name == 'FINISHED' and generation.task_id == goal_id
    assert goal_id not in service.scheduler.generations   # forgotten once reported


def test_a_goals_request_is_prepared_in_its_own_thread_and_registered_on_the_loop(
        service, monkeypatch):
    # What registration computes (a real engine's plan grammar) is done in the goal's thread,
    # before the loop registers the same request: a burst of goals does not stall the loop.
    engine = service.scheduler.engine
    calls: dict[str, list] = {'prepare_request': [], 'register': []}
    def spy(inner, made):
        def call(request):
            made.append((request, threading.get_ident()))
            return inner(request)
        return call

    for name, made in calls.items():
        monkeypatch.setattr(engine, name, spy(getattr(engine, name), made))
    recorder = Recorder()
    service.submit(PlanGoal('drone_0', 'tello', CAT), recorder.on_segment, recorder.on_end)
    wait_for(lambda: recorder.segments)
    [(prepared, preparing)] = calls['prepare_request']
    [(registered, registering)] = calls['register']
    assert preparing == threading.get_ident() != registering
    assert prepared == registered


def test_bad_goals_are_refused_at_once_with_the_reason(service):
    with pytest.raises(GoalError, match='unknown robot kind'):
        service.submit(PlanGoal('x', 'submarine', 'dive'), print, print)
    with pytest.raises(GoalError, match='empty'):
        service.submit(PlanGoal('x', 'tello', '   '), print, print)
    with pytest.raises(GoalError, match='no robot id'):
        service.submit(PlanGoal(' ', 'tello', 'go'), print, print)
    with pytest.raises(TufError):
        service.submit(PlanGoal('x', 'tello', 'go', urgency='someday'), print, print)
    with pytest.raises(TufError):
        service.submit(PlanGoal('x', 'tello', 'go', tuf=Tuf(1.0, 1.0, 1.0)), print, print)


def test_cancel_ends_the_goal_and_frees_the_engine(service):
    recorder = Recorder()
    goal_id = service.submit(PlanGoal('drone_0', 'tello', CAT), recorder.on_segment,
                             recorder.on_end)
    wait_for(lambda: len(recorder.segments) >= 1)
    service.cancel(goal_id)
    assert recorder.ended.wait(2.0)
    assert recorder.generation.status.name == 'CANCELLED'
    wait_for(lambda: goal_id not in service.scheduler.engine.running)


def test_robot_failure_fails_the_goal(service):
    recorder = Recorder()
    goal_id = service.submit(PlanGoal('drone_0', 'tello', CAT), recorder.on_segment,
                             recorder.on_end)
    wait_for(lambda: len(recorder.segments) >= 1)
    now = service.now()
    service.report_segment(goal_id, 0, now, now, success=False, error='motor stalled')
    assert recorder.ended.wait(2.0)
    assert recorder.generation.status.name == 'FAILED'
    assert 'motor stalled' in recorder.generation.error


def test_urgent_goal_is_served_before_queued_normal_ones(service):
    normal = [Recorder() for _ in range(6)]
    for i, recorder in enumerate(normal):
        service.submit(PlanGoal(f'drone_{i}', 'tello', CAT), recorder.on_segment,
                       recorder.on_end)
    urgent = Recorder()
    service.submit(PlanGoal('drone_9', 'tello', 'a dog is chasing me', urgency='urgent'),
                   urgent.on_segment, urgent.on_end)
    wait_for(lambda: urgent.segments and all(r.segments for r in normal))
    first_urgent = urgent.segments[0][0]
    assert sum(r.segments[0][0] < first_urgent for r in normal) < len(normal)


def test_the_simulator_prefers_the_matching_trace_then_the_class():
    scripts = TraceScripts()
    assert scripts.plan_for('tello', CAT, 'normal').task_type == 'T1'
    urgent = scripts.plan_for('tello', 'unseen emergency', 'urgent')
    assert urgent.task_type in {'T6', 'T7', 'T8'}
    with pytest.raises(GoalError, match='no recorded plan'):
        scripts.plan_for('rover', 'go', 'normal')


def test_state_reports_queue_and_priorities(service):
    recorders = [Recorder() for _ in range(3)]
    for i, recorder in enumerate(recorders):
        service.submit(PlanGoal(f'drone_{i}', 'tello', CAT), recorder.on_segment,
                       recorder.on_end)
    wait_for(lambda: all(r.segments for r in recorders))
    state = service.state()
    assert state.time > 0 and state.queued + state.running <= 3
    assert all(isinstance(v, float) for v in state.priorities.values())


def test_a_goal_that_does_not_wait_for_execution_ends_when_generated(service):
    recorder = Recorder()
    goal_id = service.submit(PlanGoal('drone_0', 'tello', CAT, wait_for_execution=False),
                             recorder.on_segment, recorder.on_end)
    assert recorder.ended.wait(5.0)
    assert recorder.generation.status.name == 'GENERATED' and len(recorder.segments) == 2
    assert goal_id not in service.scheduler.generations


def test_fail_ends_an_active_goal_with_the_reason_once(service):
    recorder = Recorder()
    goal_id = service.submit(PlanGoal('drone_0', 'tello', CAT), recorder.on_segment,
                             recorder.on_end)
    wait_for(lambda: recorder.segments)
    service.fail(goal_id, 'the controller of drone_0 left the ROS graph')
    assert recorder.ended.wait(5.0)
    assert recorder.generation.status.name == 'FAILED'
    assert recorder.generation.error == 'the controller of drone_0 left the ROS graph'
    service.fail(goal_id, 'again')                       # ended: nothing happens
    service.fail('no-such-goal', 'unknown')
    assert service.state().status != 'failed'


def test_state_reports_how_much_the_engine_waits_for_the_loop(service):
    """Over the iterations that ran the engine: their wall time, the engine's own part of it
    (the live simulator sleeps through each step) and the longest the engine waited for the
    loop's own work."""
    from timelyllm_ros.live.service import LoopLoad

    assert service.state().loop.iterations == 0 and service.state().loop.engine_share == 0.0
    recorder = Recorder()
    service.submit(PlanGoal('drone_0', 'tello', CAT), recorder.on_segment, recorder.on_end)
    wait_for(lambda: len(recorder.segments) == 2)
    loop = service.state().loop
    assert loop.iterations > 0
    assert 0.0 < loop.engine_s <= loop.wall_s and 0.0 < loop.engine_share <= 1.0
    assert 0.0 <= loop.max_overhead_s <= loop.wall_s - loop.engine_s + 1e-12
    load = LoopLoad()
    load.record(0.030, 0.025)
    load.record(0.021, 0.020)
    assert load.iterations == 2 and load.engine_share == pytest.approx(0.045 / 0.051)
    assert load.max_overhead_s == pytest.approx(0.005)


def test_a_serving_planner_keeps_its_start_up_heap_out_of_the_collectors_scans() -> None:
    """While a planner serves, what was alive when it started (the engine, the libraries) is
    frozen out of the garbage collector's scans; once the last serving planner stops, it is
    tracked again (a closed engine's reference cycles can then be collected). A second
    planner keeps it frozen until it stops too; a planner started again freezes again."""
    import gc

    from timelyllm_ros.live import startup_heap

    if startup_heap.serving():
        pytest.skip('another planner of this process is still serving')
    first, second = PlannerService.create(), PlannerService.create()
    alive = len(gc.get_objects())
    try:
        first.start()
        assert startup_heap.serving() == 1
        assert gc.get_freeze_count() >= alive // 2      # the heap alive at start is frozen
        second.start()
        first.stop()
        assert startup_heap.serving() == 1 and gc.get_freeze_count() > 0
        second.stop()
        assert startup_heap.serving() == 0 and gc.get_freeze_count() == 0
        first.start()                                    # a stopped service may start anew
        assert startup_heap.serving() == 1 and gc.get_freeze_count() > 0
        first.stop()
        first.stop()                                     # a second stop releases nothing more
        assert startup_heap.serving() == 0 and gc.get_freeze_count() == 0
    finally:
        first.stop()
        second.stop()
