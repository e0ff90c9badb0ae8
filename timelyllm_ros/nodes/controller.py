"""Robot controller node: one robot, its backend, and a PlanTask client to the planner.

A task arrives on ``task`` (std_msgs/String); the node sends the plan goal, executes the
segments in order as they stream in (the next one may arrive while one executes), publishes
``segment_done`` and one ``skill_executions`` record per skill, and on a backend failure
aborts: the goal is cancelled and the rest of the plan is dropped. ``drone_controller`` and
``arm_controller`` are this node with a different default robot kind.
"""

from __future__ import annotations

import queue
import threading

import rclpy
from builtin_interfaces.msg import Time
from rclpy.action import ActionClient
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from std_msgs.msg import String

from timelyllm_ros.action import PlanTask
from timelyllm_ros.clock import SystemClock
from timelyllm_ros.errors import TimelyError
from timelyllm_ros.msg import SegmentDone, SkillExecution
from timelyllm_ros.nodes import _convert
from timelyllm_ros.nodes._spin import spin_until_shutdown
from timelyllm_ros.profiles import load_profile
from timelyllm_ros.robots.executor import SkillExecutor
from timelyllm_ros.robots.factory import open_backend


class RobotControllerNode(Node):
    """Wires one robot backend to the planner's action server and the report topics."""

    def __init__(self, node_name: str, default_kind: str) -> None:
        super().__init__(node_name)
        self.declare_parameter('robot_id', node_name)
        self.declare_parameter('robot_kind', default_kind)
        self.declare_parameter('backend', 'sim')
        self.declare_parameter('address', '')
        self.declare_parameter('urgency', 'normal')
        self.declare_parameter('profiles_dir', '')
        self.declare_parameter('plan_action', '/plan')
        param = self.get_parameter
        self.robot_id = param('robot_id').value
        self.profile = load_profile(param('robot_kind').value,
                                    param('profiles_dir').value or None)
        self.robot_clock = SystemClock()
        self.backend, self._close_backend = open_backend(
            self.profile, param('backend').value, param('address').value or None, self.robot_clock)
        self.skill_executor = SkillExecutor(self.backend, self.robot_clock)
        group = ReentrantCallbackGroup()
        self.plan_client = ActionClient(self, PlanTask, param('plan_action').value,
                                        callback_group=group)
        self.done_pub = self.create_publisher(SegmentDone, '/segment_done', 50)
        self.skills_pub = self.create_publisher(SkillExecution, '/skill_executions', 100)
        self.result_pub = self.create_publisher(String, 'plan_results', 10)
        self.create_subscription(String, 'task', self.task_callback, 10, callback_group=group)
        self._segments: queue.Queue = queue.Queue()
        self._goal_handle = None
        self._aborted_goal = ''
        self._worker = threading.Thread(target=self._execute_segments, daemon=True)
        self._worker.start()
        self.get_logger().info(f'{self.robot_id}: {self.profile.name} on the '
                               f'{param("backend").value} backend')

    def task_callback(self, msg: String) -> None:
        """Send a plan goal for a task (non-blocking: callbacks chain the rest)."""
        goal = PlanTask.Goal(robot_id=self.robot_id, robot_kind=self.profile.name,
                             task=msg.data, urgency=self.get_parameter('urgency').value,
                             wait_for_execution=True)
        if not self.plan_client.wait_for_server(timeout_sec=5.0):
            self.get_logger().error('no planner action server')
            return
        future = self.plan_client.send_goal_async(goal, feedback_callback=self.feedback_callback)
        future.add_done_callback(self.goal_response_callback)

    def goal_response_callback(self, future) -> None:  # type: ignore[no-untyped-def]
        handle = future.result()
        if not handle.accepted:
            self.get_logger().warning(f'{self.robot_id}: the planner rejected the task')
            self.result_pub.publish(String(data=_convert.rejection_report(self.robot_id)))
            return
        self._goal_handle = handle
        handle.get_result_async().add_done_callback(self.result_callback)

    def feedback_callback(self, feedback) -> None:  # type: ignore[no-untyped-def]
        self._segments.put(feedback.feedback.segment)

    def result_callback(self, future) -> None:  # type: ignore[no-untyped-def]
        report = _convert.result_report(self.robot_id, self.profile.name, future.result().result)
        self.get_logger().info(f'{self.robot_id}: {report}')
        self.result_pub.publish(String(data=report))

    def _execute_segments(self) -> None:
        while rclpy.ok():
            try:
                msg = self._segments.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg.goal_id == self._aborted_goal:
                continue
            try:
                segment = _convert.segment_from_msg(self.profile, msg)
            except TimelyError as err:
                now = self.robot_clock.now()
                self._abort(msg, msg.index, str(err), now, now)
                continue
            run = self.skill_executor.execute(segment)
            for record in run.skills:
                self.skills_pub.publish(_convert.skill_record_to_msg(
                    self.robot_id, msg.goal_id, run.index, record, SkillExecution, Time))
            if not run.success:
                self._abort(msg, run.index, run.error, run.start_time, run.end_time)
                continue
            self.done_pub.publish(_convert.segment_done_to_msg(
                self.robot_id, msg.goal_id, run.index, run.start_time, run.end_time, True, '',
                SegmentDone, Time))

    def _abort(self, msg, index: int, error: str, start: float, end: float) -> None:  # type: ignore[no-untyped-def]
        """Backend failure: report it, cancel the goal, drop the rest of the plan."""
        self.get_logger().error(f'{self.robot_id}: segment {index} failed: {error}')
        self._aborted_goal = msg.goal_id
        self.done_pub.publish(_convert.segment_done_to_msg(
            self.robot_id, msg.goal_id, index, start, end, False, error, SegmentDone, Time))
        if self._goal_handle is not None:
            self._goal_handle.cancel_goal_async()

    def destroy_node(self) -> None:
        self._close_backend()
        super().destroy_node()


def run(node_name: str, default_kind: str, args: list[str] | None = None) -> None:
    """Spin a controller node until shutdown."""
    rclpy.init(args=args)
    spin_until_shutdown(RobotControllerNode(node_name, default_kind))
