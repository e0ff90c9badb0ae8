"""Robot controller node: one robot, its backend, and a PlanTask client to the planner.

A task arrives on ``task`` (std_msgs/String: the task text, or the JSON task object of
:func:`convert.task_payload`); the node sends the plan goal, executes the segments in order as
they stream in (the next one may arrive while one executes), publishes ``segment_done`` and one
``skill_executions`` record per skill, and on a backend failure aborts: the goal is cancelled
and the rest of the plan is dropped. Every task ends with one JSON line on ``plan_results``.

A robot executes one plan at a time: a task that arrives while a plan is generated or executed
waits in a FIFO queue of at most ``max_queued_tasks`` tasks (:class:`_tasks.TaskQueue`) and its
goal is sent when the tasks before it have ended; a task that finds the queue full is refused
(a warning and a ``plan_results`` line whose error starts with ``refused:``).
``drone_controller`` and ``arm_controller`` are this node with a different default robot kind.
"""

from __future__ import annotations

import queue
import threading
import time

import rclpy
from action_msgs.msg import GoalStatus
from builtin_interfaces.msg import Time
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from std_msgs.msg import String

from timelyllm_ros.action import PlanTask
from timelyllm_ros.clock import SystemClock
from timelyllm_ros.errors import GoalError, TimelyError
from timelyllm_ros.msg import SegmentDone, SkillExecution, TimeUtility
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes._tasks import TaskQueue
from timelyllm_ros.nodes.action_client import SafeActionClient
from timelyllm_ros.nodes.spin import spin_until_shutdown
from timelyllm_ros.profiles import load_profile
from timelyllm_ros.robots.executor import SkillExecutor
from timelyllm_ros.robots.factory import open_robot

_ENDED = (GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_CANCELED, GoalStatus.STATUS_ABORTED)

PLANNER_WATCH_S = 1.0
"""How often a controller checks that its planner is up (s)."""


class RobotControllerNode(Node):
    """Wires one robot backend to the planner's action server and the report topics."""

    def __init__(self, node_name: str, default_kind: str, **node_options: object) -> None:
        super().__init__(node_name, **node_options)
        self.declare_parameter('robot_id', node_name)
        self.declare_parameter('robot_kind', default_kind)
        self.declare_parameter('backend', 'sim')
        self.declare_parameter('address', '')
        self.declare_parameter('urgency', 'normal')
        self.declare_parameter('profiles_dir', '')
        self.declare_parameter('plan_action', '/plan')
        self.declare_parameter('max_queued_tasks', 8)
        param = self.get_parameter
        self.robot_id = param('robot_id').value
        self.profile = load_profile(param('robot_kind').value,
                                    param('profiles_dir').value or None)
        self.robot_clock = SystemClock()
        self.robot = open_robot(self.profile, param('backend').value,
                                param('address').value or None, self.robot_clock)
        self.backend = self.robot.backend
        self.skill_executor = SkillExecutor(self.backend, self.robot_clock)
        group = ReentrantCallbackGroup()
        self.plan_client = SafeActionClient(self, PlanTask, param('plan_action').value,
                                        callback_group=group)
        self.done_pub = self.create_publisher(SegmentDone, '/segment_done', 50)
        self.skills_pub = self.create_publisher(SkillExecution, '/skill_executions', 100)
        self.result_pub = self.create_publisher(String, 'plan_results', 10)
        self.create_subscription(String, 'task', self.task_callback, 10, callback_group=group)
        self.tasks: TaskQueue[convert.TaskRequest] = TaskQueue(
            int(param('max_queued_tasks').value))
        self._queued_s = 0.0                # how long the active task waited in the queue
        self._segments: queue.Queue = queue.Queue()
        self._goal_handle = None
        self._unsent: convert.TaskRequest | None = None   # the active task, not sent yet
        self._leaving = threading.Lock()
        self._active_goal_id = ''                # the planner's id of the streaming goal
        self._aborted_goal = ''
        self.create_timer(PLANNER_WATCH_S, self.watch_planner, callback_group=group)
        self._worker = threading.Thread(target=self._execute_segments, daemon=True)
        self._worker.start()
        self.get_logger().info(f'{self.robot_id}: {self.profile.name} on the '
                               f'{param("backend").value} backend, one plan at a time, '
                               f'up to {self.tasks.max_waiting} tasks queued')

    @staticmethod
    def _label(request: convert.TaskRequest | None) -> str:
        if request is None:
            return '-'
        text = request.task if len(request.task) <= 40 else request.task[:37] + '...'
        return f'{request.task_id} ({text!r})' if request.task_id else repr(text)

    def _publish_result(self, report: str) -> None:
        self.result_pub.publish(String(data=report))

    def task_callback(self, msg: String) -> None:
        """Start, queue or refuse a task (non-blocking: callbacks chain the rest)."""
        try:
            request = convert.parse_task(msg.data)
        except GoalError as err:
            self.get_logger().error(f'{self.robot_id}: refused an invalid task message: {err}')
            self._publish_result(convert.refusal_report(self.robot_id, '', str(err)))
            return
        admission = self.tasks.offer(request, time.monotonic())
        if admission.outcome == 'refused':
            reason = (f'task queue full ({admission.waiting} waiting, '
                      f'max_queued_tasks {self.tasks.max_waiting})')
            self.get_logger().warning(
                f'{self.robot_id}: busy with {self._label(self.tasks.active)}: refused task '
                f'{self._label(request)}: {reason}')
            self._publish_result(convert.refusal_report(self.robot_id, request.task_id, reason))
        elif admission.outcome == 'queued':
            self.get_logger().info(
                f'{self.robot_id}: busy with {self._label(self.tasks.active)}: task '
                f'{self._label(request)} queued ({admission.position} of '
                f'{self.tasks.max_waiting})')
        else:
            self._start(request, 0.0)

    def _start(self, request: convert.TaskRequest | None, queued_s: float) -> None:
        """Send the plan goal of the active task. With no planner action server up the task
        waits, queue and all, and is sent when a planner is back (:meth:`watch_planner`)."""
        if request is None:
            return
        self._queued_s = queued_s
        if not self.plan_client.server_is_ready():
            if self._unsent is not request:
                self.get_logger().warning(f'{self.robot_id}: no planner action server: task '
                                          f'{self._label(request)} waits for one')
            self._unsent = request
            return
        self._unsent = None
        goal = convert.goal_to_msg(self.robot_id, self.profile.name, request,
                                   self.get_parameter('urgency').value, PlanTask.Goal,
                                   TimeUtility)
        future = self.plan_client.send_goal_async(goal, feedback_callback=self.feedback_callback)
        future.add_done_callback(self.goal_response_callback)

    def watch_planner(self) -> None:
        """Send a waiting task once a planner is up; end the active task when the planner
        left while serving it (killed, crashed, restarted: its goal is gone with it)."""
        ready = self.plan_client.server_is_ready()
        if self._unsent is not None and ready:
            self.get_logger().info(f'{self.robot_id}: a planner is up: sending task '
                                   f'{self._label(self._unsent)}')
            self._start(self._unsent, self._queued_s)
        elif self._goal_handle is not None and not ready:
            self._planner_left(self._goal_handle)

    def _planner_left(self, handle) -> None:  # type: ignore[no-untyped-def]
        """End the active task: its planner left while serving it (once: the watch timer and
        the goal's result may both notice)."""
        with self._leaving:
            if handle is None or self._goal_handle is not handle:
                return
            self._goal_handle = None
        self._aborted_goal = self._active_goal_id     # the rest of its plan is dropped
        while True:      # and its segments not started yet (a new planner reuses ids)
            try:
                self._segments.get_nowait()
            except queue.Empty:
                break
        request = self.tasks.active
        reason = 'the planner left while the task was active (its action server is gone)'
        self.get_logger().error(f'{self.robot_id}: task {self._label(request)}: {reason}')
        self._publish_result(convert.failure_report(
            self.robot_id, request.task_id if request is not None else '',
            self._queued_s, reason))
        self._next()

    def _next(self) -> None:
        """The active task ended: start the next waiting one, if any."""
        self._goal_handle = None
        started = self.tasks.finish(time.monotonic())
        if started is not None:
            self.get_logger().info(
                f'{self.robot_id}: starting queued task {self._label(started.item)} after '
                f'{started.queued_s:.2f} s in the queue ({self.tasks.waiting} still waiting)')
            self._start(started.item, started.queued_s)

    def goal_response_callback(self, future) -> None:  # type: ignore[no-untyped-def]
        handle = future.result()
        request = self.tasks.active
        task_id = request.task_id if request is not None else ''
        if not handle.accepted:
            self.get_logger().warning(f'{self.robot_id}: the planner rejected task '
                                      f'{self._label(request)}')
            self._publish_result(convert.rejection_report(self.robot_id, task_id,
                                                           self._queued_s))
            self._next()
            return
        self._goal_handle = handle
        self._aborted_goal = ''        # a new goal: its id may repeat an ended one's
        handle.get_result_async().add_done_callback(
            lambda result, handle=handle: self.result_callback(result, handle))

    def feedback_callback(self, feedback) -> None:  # type: ignore[no-untyped-def]
        self._active_goal_id = feedback.feedback.segment.goal_id
        self._segments.put(feedback.feedback.segment)

    def result_callback(self, future, handle) -> None:  # type: ignore[no-untyped-def]
        if handle is not self._goal_handle:
            return       # a goal already ended here (its planner left): nothing to report
        response = future.result()
        if response.status not in _ENDED or not (response.result.success
                                                 or response.result.error):
            # No status, or a failure without a reason (our planner always gives one): the
            # action server went away with the goal.
            self._planner_left(handle)
            return
        request = self.tasks.active
        report = convert.result_report(
            self.robot_id, self.profile.name, future.result().result,
            request.task_id if request is not None else '', self._queued_s)
        self.get_logger().info(f'{self.robot_id}: {report}')
        self._publish_result(report)
        self._next()

    def _execute_segments(self) -> None:
        while rclpy.ok():
            try:
                msg = self._segments.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg.goal_id == self._aborted_goal:
                continue
            try:
                segment = convert.segment_from_msg(self.profile, msg)
            except TimelyError as err:
                now = self.robot_clock.now()
                self._abort(msg, msg.index, str(err), now, now)
                continue
            run = self.skill_executor.execute(segment)
            for record in run.skills:
                self.skills_pub.publish(convert.skill_record_to_msg(
                    self.robot_id, msg.goal_id, run.index, record, SkillExecution, Time))
            if not run.success:
                self._abort(msg, run.index, run.error, run.start_time, run.end_time)
                continue
            self.done_pub.publish(convert.segment_done_to_msg(
                self.robot_id, msg.goal_id, run.index, run.start_time, run.end_time, True, '',
                SegmentDone, Time))

    def _abort(self, msg, index: int, error: str, start: float, end: float) -> None:  # type: ignore[no-untyped-def]
        """Backend failure: report it, cancel the goal, drop the rest of the plan."""
        self.get_logger().error(f'{self.robot_id}: segment {index} failed: {error}')
        self._aborted_goal = msg.goal_id
        self.done_pub.publish(convert.segment_done_to_msg(
            self.robot_id, msg.goal_id, index, start, end, False, error, SegmentDone, Time))
        if self._goal_handle is not None:
            self._goal_handle.cancel_goal_async()

    def destroy_node(self) -> None:
        dropped = self.tasks.drain()
        if dropped:
            self.get_logger().warning(f'{self.robot_id}: shutting down with {len(dropped)} '
                                      f'queued tasks not started')
        self.robot.close()
        super().destroy_node()


def run(node_name: str, default_kind: str, args: list[str] | None = None) -> None:
    """Spin a controller node until shutdown."""
    rclpy.init(args=args)
    spin_until_shutdown(RobotControllerNode(node_name, default_kind))
