"""rclpy tests of the lrtrace_replayer node and of the controllers' task queue, in one process:
a planner (simulated engine), drone controllers on the simulated backend, the replayer.

Needs a ROS 2 workspace where this package was built with ``colcon build`` (rclpy and the
generated ``timelyllm_ros.msg`` / ``.action``); skipped otherwise. Robots take the modelled
time to move (real seconds): the module runs in about half a minute.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run inside a ROS 2 workspace')
pytest.importorskip('timelyllm_ros.msg',
                    reason='interfaces not generated: colcon build this package first')

from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from ros_helpers import activated  # noqa: E402
from timelyllm_ros.msg import PlanResult, SegmentDone, Task, TimeUtility  # noqa: E402

from lrtrace.nodes import LrtraceReplayerNode  # noqa: E402
from timelyllm_ros.language.traces import load_trace_set  # noqa: E402
from timelyllm_ros.nodes import convert  # noqa: E402
from timelyllm_ros.nodes.controller import RobotControllerNode, fleet_name  # noqa: E402
from timelyllm_ros.nodes.planner import EXECUTOR_THREADS, PlannerNode  # noqa: E402

pytestmark = pytest.mark.ros

# Events alternate T3+T6 and T2+T9 on two agents; seed 0 gives four events within 2 s: 6 drone
# tasks (T3, T2 normal, T6 urgent) and 2 arm tasks (T9), which the replayer skips (no arm here).
WORKLOAD = """\
name: ros-replay-test
eps: 1.0
max_tpe: 2
trace_ids: [2, 3, 6, 9]
agents: 2
duration_s: 4
composition: "(3,6),(2,9)"
"""
DRONES = ['rt_drone_0', 'rt_drone_1']
QUEUED = 'rt_drone_q'          # the robot of the queue test: at most two tasks wait
def controller(robot: str, max_queued: int) -> RobotControllerNode:
    return RobotControllerNode('controller', 'tello', namespace=robot,
                               parameter_overrides=[Parameter('robot_id', value=robot),
                                                    Parameter('max_queued_tasks',
                                                              value=max_queued)])


class Probe:
    """Listens to every controller's plan_results and to /segment_done."""

    def __init__(self, robots: list[str]) -> None:
        self.node = rclpy.create_node('replayer_test_probe')
        self.reports: list[dict] = []
        self.done: list[SegmentDone] = []
        self.lock = threading.Lock()
        for robot in robots:
            self.node.create_subscription(PlanResult, f'/{robot}/plan_results', self._report, 50)
        self.node.create_subscription(SegmentDone, '/segment_done', self._done, 100)

    def _report(self, msg: PlanResult) -> None:
        with self.lock:
            self.reports.append(convert.plan_result_fields(msg))

    def _done(self, msg: SegmentDone) -> None:
        with self.lock:
            self.done.append(msg)

    def of(self, robot: str) -> list[dict]:
        with self.lock:
            return [r for r in self.reports if r['robot_id'] == robot]


@pytest.fixture(scope='module')
def fleet():
    rclpy.init()
    planner = activated(PlannerNode())
    robots = [controller(r, 8) for r in DRONES] + [controller(QUEUED, 2)]
    probe = Probe([*DRONES, QUEUED])
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    for node in (planner, *robots, probe.node):
        executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    assert robots[0].plan_client.wait_for_server(timeout_sec=10.0)
    yield executor, probe
    executor.shutdown()
    for node in (planner, *robots, probe.node):
        node.destroy_node()
    rclpy.try_shutdown()


def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.05)


def test_the_replayer_triggers_the_workload_on_the_robots_and_sums_up(fleet, tmp_path):
    executor, probe = fleet
    spec = tmp_path / 'workload.yaml'
    spec.write_text(WORKLOAD, encoding='utf-8')
    summary_file = tmp_path / 'summary.json'
    replayer = LrtraceReplayerNode(parameter_overrides=[
        Parameter('workload_file', value=str(spec)),
        Parameter('robots', value=DRONES),
        Parameter('robot_kinds', value=['tello', 'tello']),
        Parameter('summary_file', value=str(summary_file)),
        Parameter('result_timeout_s', value=60.0)])
    executor.add_node(replayer)
    try:
        until(replayer.finished.done, 120.0, 'the replay to end')
    finally:
        executor.remove_node(replayer)
        replayer.destroy_node()
    assert replayer.finished.result() == 0 == replayer.exit_code
    summary = json.loads(summary_file.read_text(encoding='utf-8'))
    assert (summary['tasks'], summary['sent'], summary['skipped'], summary['missing']) == (
        8, 6, 2, 0)
    overall = summary['overall']
    assert overall['succeeded'] == 6 and overall['refused'] == overall['failed'] == 0
    assert set(summary['by_class']) == {'normal', 'urgent'}
    assert summary['by_class']['urgent']['sent'] == 2
    # what the robots reported is what the replayer counted, task by task
    reports = [r for robot in DRONES for r in probe.of(robot)]
    assert sorted(r['task_id'] for r in reports) == sorted(
        d.task.task_id for d in replayer.replay.sent)
    assert all(r['success'] and r['segment_count'] > 0 for r in reports)


def test_a_busy_robot_queues_urgent_first_refuses_when_full_and_runs_one_plan_at_a_time(
        fleet):
    executor, probe = fleet
    node = rclpy.create_node('queue_test_sender')
    executor.add_node(node)
    try:
        publisher = node.create_publisher(Task, f'/{QUEUED}/task', 10)
        until(lambda: publisher.get_subscription_count() > 0, 10.0, 'the controller')
        book = load_trace_set().get(3).task        # mu(50);?iv('book')==True{tp()}: ~2.6 s
        for task_id, urgency in (('q1', ''), ('q2', ''), ('q3', 'urgent'), ('q4', '')):
            publisher.publish(convert.task_to_msg(convert.TaskRequest(book, task_id, urgency),
                                                  Task, TimeUtility))
        until(lambda: len(probe.of(QUEUED)) >= 4, 90.0, 'four results')
    finally:
        executor.remove_node(node)
        node.destroy_node()
    reports = probe.of(QUEUED)
    # q4 found the queue full; the urgent q3 overtook the waiting q2
    assert [r['task_id'] for r in reports] == ['q4', 'q1', 'q3', 'q2']
    refused, first, urgent, last = reports
    assert refused['outcome'] == 'refused' and refused['error'].startswith('task queue full')
    assert all(r['outcome'] == 'succeeded' for r in (first, urgent, last))
    assert first['queued_s'] == 0.0 and urgent['queued_s'] > 1.0   # waited for q1's plan
    with probe.lock:
        done = [d for d in probe.done if d.robot_id == QUEUED]
    spans: dict[str, tuple[float, float]] = {}
    for msg in done:
        start, end = convert.seconds(msg.start_stamp), convert.seconds(msg.end_stamp)
        low, high = spans.get(msg.goal_id, (start, end))
        spans[msg.goal_id] = (min(low, start), max(high, end))
    assert len(spans) == 3, spans                  # the refused task never became a goal
    ordered = sorted(spans.values())
    assert all(later[0] >= earlier[1] for earlier, later in zip(ordered, ordered[1:],
                                                                strict=False))


def test_controller_parameters_are_described_ranged_and_checked(fleet):
    from rclpy.exceptions import InvalidParameterValueException

    node = controller('param_drone', 2)
    try:
        for name in ('robot_id', 'robot_kind', 'backend', 'address', 'urgency', 'profiles_dir',
                     'max_queued_tasks'):
            assert node.describe_parameter(name).description, name
        assert not node.describe_parameter('urgency').read_only     # takes effect live
        assert node.set_parameters([Parameter('urgency', value='urgent')])[0].successful
        refused = node.set_parameters([Parameter('urgency', value='panic')])[0]
        assert not refused.successful and 'normal, urgent, chatbot' in refused.reason
        assert not node.set_parameters([Parameter('max_queued_tasks', value=3)])[0].successful
    finally:
        node.destroy_node()
    for name, value in (('max_queued_tasks', -1), ('backend', 'warp'), ('urgency', 'panic')):
        with pytest.raises(InvalidParameterValueException, match=name):
            RobotControllerNode('controller', 'tello', namespace='bad_param',
                                parameter_overrides=[Parameter(name, value=value)])


def test_a_controller_finds_its_fleet_in_the_namespace_above_its_own():
    assert fleet_name('/fleet_a/drone_0', 'plan') == '/fleet_a/plan'
    assert fleet_name('/drone_0', 'segment_done') == '/segment_done'
    assert fleet_name('/', 'plan') == '/plan'
    assert fleet_name('/fleet_a/', 'skill_executions') == '/fleet_a/skill_executions'


@pytest.mark.parametrize(('namespace', 'fleet', 'expected'), [
    ('/fleet_q/drone_0', '', '/fleet_q/segment_done'),        # the namespace above its own
    ('/drone_0', '/fleet_p', '/fleet_p/segment_done'),        # the parameter, no slash
    ('/drone_0', '/fleet_p/', '/fleet_p/segment_done'),       # ... or with one
])
def test_a_controller_reports_to_its_fleet(fleet, namespace, expected):
    node = RobotControllerNode('controller', 'tello', namespace=namespace,
                               parameter_overrides=[Parameter('robot_id', value='drone_0'),
                                                    Parameter('fleet', value=fleet)])
    try:
        assert node.done_pub.topic_name == expected
    finally:
        node.destroy_node()
