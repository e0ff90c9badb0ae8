"""rclpy test of a controller killed mid-plan and restarted with its one documented command.

The controller runs as its own process (``ros2 run timelyllm_ros drone_controller``), the
planner and a probe in this one. The controller is killed (SIGKILL) while its robot executes
the first of three tasks: the active task must end with one ``PlanResult`` (failed, with the
reason) and a ``TaskRecord``; the two queued tasks, kept in the controller's task journal,
must be taken up and served by the restarted process. Both timings are tried: a restart
at once (the new process names the goal it lost, unless the planner ended it already), and
one after the goal ended on the planner (its missed report deadline, or the controller seen
leaving the graph): the planner reports the kept result then, once.

Needs a ROS 2 workspace where this package was built and installed with ``colcon build`` and
its ``install/setup.bash`` sourced; skipped otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run inside a ROS 2 workspace')
pytest.importorskip('timelyllm_ros.msg',
                    reason='interfaces not generated: colcon build this package first')

from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from ros_helpers import activated, kill_group, until  # noqa: E402
from timelyllm_ros.msg import PlanResult, Segment, Task, TaskRecord  # noqa: E402

from timelyllm_ros.language.traces import load_trace_set  # noqa: E402
from timelyllm_ros.nodes import convert  # noqa: E402
from timelyllm_ros.nodes.planner import EXECUTOR_THREADS, PlannerNode  # noqa: E402

pytestmark = pytest.mark.ros
FLEET = '/crestart'
ROBOTS = {'at once': 'cr_drone_now', 'after the goal ended': 'cr_drone_later'}
RESTART_LATE_S = 20.0
# one robot per case: a killed controller's subscriptions stay in the graph until its DDS
# lease ends, and a task published to a robot whose stale reader still counts would be lost
TASKS = 3


def _controller_process(robot: str) -> subprocess.Popen:
    """The README's restart command for a controller, in this test's fleet."""
    if shutil.which('ros2') is None:
        pytest.skip('ros2 is not on PATH: source the workspace (install/setup.bash)')
    return subprocess.Popen(
        ['ros2', 'run', 'timelyllm_ros', 'drone_controller', '--ros-args',
         '-r', f'__ns:={FLEET}/{robot}'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)




@pytest.fixture
def fleet():
    initialized = not rclpy.ok()
    if initialized:
        rclpy.init()
    planner = activated(PlannerNode(namespace=FLEET))
    probe = rclpy.create_node('controller_restart_probe')
    lock = threading.Lock()
    seen: dict[str, list] = {'results': [], 'records': [], 'segments': []}

    def keep(store: list):
        def callback(msg) -> None:
            with lock:
                store.append(msg)
        return callback

    for robot in ROBOTS.values():
        probe.create_subscription(PlanResult, f'{FLEET}/{robot}/plan_results',
                                  keep(seen['results']), 50)
    probe.create_subscription(TaskRecord, f'{FLEET}/task_records', keep(seen['records']), 50)
    probe.create_subscription(Segment, f'{FLEET}/segments', keep(seen['segments']), 100)
    publishers = {robot: probe.create_publisher(Task, f'{FLEET}/{robot}/task', 50)
                  for robot in ROBOTS.values()}
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    for node in (planner, probe):
        executor.add_node(node)
    threading.Thread(target=executor.spin, daemon=True).start()
    processes: list[subprocess.Popen] = []
    try:
        yield planner, publishers, seen, lock, processes
    finally:
        for process in processes:
            kill_group(process)
        executor.shutdown()
        for node in (planner, probe):
            node.destroy_node()
        if initialized:
            rclpy.try_shutdown()


@pytest.mark.parametrize('restart', list(ROBOTS))
def test_a_controller_killed_mid_plan_is_restarted_and_loses_no_task(fleet, restart):
    planner, publishers, seen, lock, processes = fleet
    robot = ROBOTS[restart]
    publisher = publishers[robot]
    book = load_trace_set().get(3).task          # mu(50);?iv('book')==True{tp()}: ~2.6 s
    prefix = f'{restart.split()[0]}-'
    processes.append(_controller_process(robot))
    until(lambda: publisher.get_subscription_count() > 0, 60.0, 'the controller')
    for n in range(TASKS):
        publisher.publish(convert.task_to_msg(convert.TaskRequest(book, f'{prefix}{n}'),
                                              Task, None))
    until(lambda: any(s.robot_id == robot for s in list(seen['segments'])), 60.0,
          'the first segment')
    kill_group(processes.pop())           # the robot executes task 0, tasks 1 and 2 wait
    first = f'{prefix}0'
    if restart != 'at once':
        # past the robot's report deadline and the DDS lease: the planner has ended the goal
        # (the result went to the dead client, or was published when the node was seen gone)
        time.sleep(RESTART_LATE_S)
    processes.append(_controller_process(robot))
    expected = {f'{prefix}{n}' for n in range(TASKS)}
    until(lambda: {r.task_id for r in list(seen['results'])} >= expected, 120.0,
          ('every task to be reported', [(r.task_id, r.outcome) for r in seen['results']]))
    until(lambda: {r.task_id for r in list(seen['records'])} >= expected, 30.0,
          'a task record for every task')
    time.sleep(1.0)                  # a second result would come within this
    with lock:
        results = [r for r in seen['results'] if r.task_id.startswith(prefix)]
        records = {r.task_id: r for r in seen['records'] if r.task_id.startswith(prefix)}
    by_task: dict[str, object] = {}
    for result in results:
        assert result.task_id not in by_task, f'{result.task_id} reported twice: {results}'
        by_task[result.task_id] = result
    lost = by_task[first]
    assert lost.outcome == 'failed', lost
    # the goal ends at the first of: its robot's missed report deadline, the planner noticing
    # the controller left (DDS lease), the restarted controller naming the goal it lost
    reasons = ('did not report segment', 'left the ROS graph', 'restarted')
    assert any(reason in lost.error for reason in reasons), lost
    assert lost.segment_count >= 1 and lost.plan, lost          # what had streamed
    assert records[first].status == 'FAILED'
    for n in range(1, TASKS):        # taken up from the journal by the new process
        assert by_task[f'{prefix}{n}'].outcome == 'succeeded', by_task[f'{prefix}{n}']
        assert records[f'{prefix}{n}'].status == 'FINISHED'
