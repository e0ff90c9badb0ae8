"""launch_testing: the whole simulated fleet from fleet.launch.py plans, executes and records.

Run in a ROS 2 workspace after ``colcon build``: ``launch_test test/ros/fleet_launch_test.py``
(``colcon test`` runs it too). Two drones and one arm on the simulated backend, the simulated
engine, and the LRTrace recorder. The launch file drives the lifecycle planner to active.
"""

import os
import tempfile
import time
import unittest

import pytest

pytest.importorskip('launch_testing', reason='launch_testing missing: run in a ROS 2 workspace')

import launch  # noqa: E402
import launch_testing  # noqa: E402
import launch_testing.actions  # noqa: E402
import launch_testing.asserts  # noqa: E402
import rclpy  # noqa: E402
from ament_index_python.packages import get_package_share_directory  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from lifecycle_msgs.msg import State  # noqa: E402
from lifecycle_msgs.srv import GetState  # noqa: E402
from timelyllm_ros.msg import PlanResult, Task  # noqa: E402

BAG = os.path.join(tempfile.mkdtemp(prefix='fleet_launch_test_'), 'bag')
TASKS = {
    'drone_0': 'Scene: [] Task: [A] Could you find the cat? If so, go to it.',
    'drone_1': 'a dog is chasing me',
    'arm_0': 'Pick up the red box and drop it on the blue box.',
}


@pytest.mark.launch_test
def generate_test_description():
    fleet = launch.actions.IncludeLaunchDescription(
        PythonLaunchDescriptionSource(os.path.join(
            get_package_share_directory('timelyllm_ros'), 'launch', 'fleet.launch.py')),
        launch_arguments={'drones': '2', 'arms': '1', 'backend': 'sim', 'record': 'true',
                          'bag': BAG}.items())
    return launch.LaunchDescription([fleet, launch_testing.actions.ReadyToTest()])


class TestFleet(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        rclpy.init()
        cls.node = rclpy.create_node('fleet_test')

    @classmethod
    def tearDownClass(cls):
        cls.node.destroy_node()
        rclpy.shutdown()

    def test_the_launch_file_brings_the_planner_to_active(self):
        client = self.node.create_client(GetState, '/planner/get_state')
        self.assertTrue(client.wait_for_service(timeout_sec=60.0))
        deadline = time.monotonic() + 60.0
        state = None
        while time.monotonic() < deadline:
            future = client.call_async(GetState.Request())
            rclpy.spin_until_future_complete(self.node, future, timeout_sec=5.0)
            state = future.result().current_state if future.done() else None
            if state is not None and state.id == State.PRIMARY_STATE_ACTIVE:
                break
            time.sleep(0.2)
        self.assertIsNotNone(state)
        self.assertEqual(state.label, 'active')

    def test_every_robot_gets_and_executes_a_plan(self):
        reports = {}
        for robot in TASKS:
            self.node.create_subscription(
                PlanResult, f'/{robot}/plan_results',
                lambda msg, robot=robot: reports.setdefault(robot, msg), 10)
        publishers = {r: self.node.create_publisher(Task, f'/{r}/task', 10) for r in TASKS}
        # discovery: the nodes take seconds to start on a busy machine, and a task published
        # before its controller subscribed is lost (volatile QoS)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not all(
                publishers[r].get_subscription_count() > 0
                and self.node.count_publishers(f'/{r}/plan_results') > 0 for r in TASKS):
            rclpy.spin_once(self.node, timeout_sec=0.1)
        for robot, task in TASKS.items():
            publishers[robot].publish(Task(task=task, task_id=f'{robot}-t0'))
        deadline = time.monotonic() + 120.0  # the arm plan takes ~30 s of simulated motion
        while len(reports) < len(TASKS) and time.monotonic() < deadline:
            rclpy.spin_once(self.node, timeout_sec=0.1)
        self.assertEqual(set(reports), set(TASKS))
        for robot, report in reports.items():
            self.assertEqual(report.outcome, PlanResult.SUCCEEDED, f'{robot}: {report}')
            self.assertEqual(report.task_id, f'{robot}-t0')
            self.assertGreater(report.segment_count, 0)


@launch_testing.post_shutdown_test()
class TestAfterShutdown(unittest.TestCase):

    def test_processes_exited_cleanly(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info, allowable_exit_codes=[0, -2, -15])

    def test_the_recorded_bag_holds_every_robot(self):
        from lrtrace.reader import read_bag

        trace = read_bag(BAG)
        self.assertEqual({s.robot_id for s in trace.segment_done}, set(TASKS))
        self.assertEqual({(t.robot_id, t.task_id, t.status) for t in trace.tasks},
                         {(r, f'{r}-t0', 'FINISHED') for r in TASKS})
