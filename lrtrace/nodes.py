"""lrtrace_recorder and lrtrace_replayer nodes: thin ROS bridges over the LRTrace library.

* ``lrtrace_recorder`` subscribes to ``segments``, ``segment_done``, ``skill_executions``
  and the planner's ``task_records`` (relative names: run it in the planner's namespace) and
  writes them into an MCAP rosbag2 bag (``bag`` parameter), flushing in chunks so that a
  killed recorder leaves a readable bag.
* ``lrtrace_replayer`` draws a workload (``workload`` or ``workload_file``, ``seed``),
  publishes each task (a ``Task`` with its id, TUF class and TUF) on the ``task`` topic of a
  robot of the right kind at its arrival time (``robots``: namespaces such as ``drone_0``,
  relative to the replayer's namespace, with their ``robot_kinds``), collects the
  controllers' ``PlanResult``s, logs the metrics at the end and exits (0: every sent task
  reported back).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.node import Node
from rclpy.serialization import serialize_message
from rclpy.task import Future
from timelyllm_ros.msg import (
    PlanResult,
    Segment,
    SegmentDone,
    SkillExecution,
    Task,
    TaskRecord,
    TimeUtility,
)

from lrtrace import format as fmt
from lrtrace.recorder import TraceRecorder
from lrtrace.replay import LiveReplay
from timelyllm_ros.errors import TimelyError
from timelyllm_ros.evaluation.workloads import resolve_workload
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes.action_client import ACTION_QUEUE_DEPTH, reliable
from timelyllm_ros.nodes.spin import spin_until_shutdown


class LrtraceRecorderNode(Node):
    """Writes the fleet's segment, execution and skill topics into a bag."""

    def __init__(self, **node_options: object) -> None:
        super().__init__('lrtrace_recorder', **node_options)
        self.declare_parameter('bag', f'lrtrace_{time.strftime("%Y%m%d_%H%M%S")}')
        self.declare_parameter('chunk_size', 32 * 1024)
        path = self.get_parameter('bag').value
        self.recorder = TraceRecorder(path, chunk_size=self.get_parameter('chunk_size').value,
                                      source='ros2 fleet', start_time=time.time())
        self.recorder.open()
        qos = reliable(ACTION_QUEUE_DEPTH)
        self.create_subscription(Segment, 'segments', self.segment_callback, qos)
        self.create_subscription(SegmentDone, 'segment_done', self.done_callback, qos)
        self.create_subscription(SkillExecution, 'skill_executions', self.skill_callback, qos)
        self.create_subscription(TaskRecord, 'task_records', self.task_callback, qos)
        self.get_logger().info(f'recording into {path}')

    def segment_callback(self, msg: Segment) -> None:
        if convert.is_plan_end(msg):
            return
        self.recorder.record_segment_fields(
            msg.robot_id, msg.goal_id, msg.index, msg.text, list(msg.skills), msg.is_last,
            convert.seconds(msg.generated_stamp), msg.estimated_execution_s)

    def done_callback(self, msg: SegmentDone) -> None:
        self.recorder.record_segment_done(
            msg.robot_id, msg.goal_id, msg.index, convert.seconds(msg.start_stamp),
            convert.seconds(msg.end_stamp), msg.success, msg.error)

    def task_callback(self, msg: TaskRecord) -> None:
        """The planner's record of an ended task: same message type and serialization as
        the bag's, written as it came."""
        self.recorder.record_serialized(fmt.TASKS_TOPIC, serialize_message(msg),
                                        convert.seconds(msg.done_stamp))

    def skill_callback(self, msg: SkillExecution) -> None:
        self.recorder.record_skill(msg.robot_id, msg.goal_id, msg.segment_index,
                                   convert.skill_record_from_msg(msg))

    def destroy_node(self) -> None:
        self.recorder.close()
        super().destroy_node()


class LrtraceReplayerNode(Node):
    """Triggers a workload's tasks on robot nodes and reports the outcome.

    Parameters: ``workload`` (a built-in or the authors' workload name) or ``workload_file``
    (a workload spec YAML, or the authors' JSON format), ``composition``, ``seed``,
    ``duration_s`` (only the tasks arriving by then; 0: all), ``robots`` (controller
    namespaces) with their ``robot_kinds`` (profile names), ``discovery_timeout_s`` (how long to
    wait for the robots' topics before the clock starts), ``result_timeout_s`` (how long to wait
    for missing results once every task is sent), ``exit_when_done`` and ``summary_file`` (the
    summary as JSON). The logic lives in :class:`lrtrace.replay.LiveReplay`.
    """

    def __init__(self, **node_options: object) -> None:
        super().__init__('lrtrace_replayer', **node_options)
        self.declare_parameter('workload', 'wid1')
        self.declare_parameter('workload_file', '')
        self.declare_parameter('composition', '')
        self.declare_parameter('seed', 0)
        self.declare_parameter('robots', ['drone_0'])
        self.declare_parameter('robot_kinds', ['tello'])
        self.declare_parameter('duration_s', 0.0)
        self.declare_parameter('discovery_timeout_s', 10.0)
        self.declare_parameter('result_timeout_s', 300.0)
        self.declare_parameter('exit_when_done', True)
        self.declare_parameter('summary_file', '')
        param = self.get_parameter
        self.workload, tasks = resolve_workload(
            param('workload').value, seed=param('seed').value,
            workload_file=param('workload_file').value or None,
            composition=param('composition').value or None)
        limit = float(param('duration_s').value)
        robots = list(param('robots').value)
        self.replay = LiveReplay.from_lists(
            [t for t in tasks if not limit or t.arrival_time <= limit], robots,
            list(param('robot_kinds').value))
        qos = reliable(ACTION_QUEUE_DEPTH)
        self.publishers_ = {r: self.create_publisher(Task, f'{r}/task', qos) for r in robots}
        for robot in robots:
            self.create_subscription(PlanResult, f'{robot}/plan_results', self.result_callback,
                                     qos)
        self.finished = Future()     # done (with the exit status) once the summary is out
        self.done = False
        self.exit_code = 1
        self.created = time.monotonic()
        self.start: float | None = None
        self.last_activity = self.created
        self.create_timer(0.01, self.tick)

    def _unready(self) -> list[str]:
        return [r for r, pub in self.publishers_.items()
                if pub.get_subscription_count() == 0
                or self.count_publishers(self.resolve_topic_name(f'{r}/plan_results')) == 0]

    def tick(self) -> None:
        if self.done:
            return
        now = time.monotonic()
        if self.start is None:
            unready = self._unready()
            if unready and now - self.created < self.get_parameter('discovery_timeout_s').value:
                return
            if unready:
                self.get_logger().warning(f'no controller found for {", ".join(unready)}: '
                                          f'their tasks will get no result')
            self.start = self.last_activity = now
            self.get_logger().info(
                f'replaying {len(self.replay.tasks)} tasks of {self.workload} on '
                f'{", ".join(f"{r} ({k})" for r, k in self.replay.robots.items())}')
        for dispatch in self.replay.due(now - self.start):
            task = dispatch.task
            self.publishers_[dispatch.robot].publish(convert.task_to_msg(
                convert.TaskRequest(task.task, task.task_id, dispatch.urgency, task.tuf),
                Task, TimeUtility))
            self.last_activity = now
            self.get_logger().info(f'{task.task_id} ({task.task_type}, {task.task_class}) at '
                                   f'{task.arrival_time:.2f} s -> {dispatch.robot}')
        if self.replay.complete:
            self._finish()
        elif self.replay.all_sent and (
                now - self.last_activity > self.get_parameter('result_timeout_s').value):
            self.get_logger().warning(f'{self.replay.missing} results did not arrive')
            self._finish()

    def result_callback(self, msg: PlanResult) -> None:
        if self.done:
            return
        self.replay.record(convert.plan_result_fields(msg))
        self.last_activity = time.monotonic()

    def _finish(self) -> None:
        self.done = True
        for line in self.replay.summary_lines():
            self.get_logger().info(line)
        path = self.get_parameter('summary_file').value
        if path:
            Path(path).write_text(json.dumps(self.replay.summary(), indent=2), encoding='utf-8')
        self.exit_code = 0 if self.replay.sent and not self.replay.missing else 1
        if self.get_parameter('exit_when_done').value:
            self.finished.set_result(self.exit_code)

    def destroy_node(self) -> None:
        if not self.done and self.start is not None:
            self.get_logger().info('stopped before the end; so far:')
            for line in self.replay.summary_lines():
                self.get_logger().info(line)
        super().destroy_node()


def recorder_main(args: list[str] | None = None) -> None:
    rclpy.init(args=args)
    spin_until_shutdown(LrtraceRecorderNode())


def replayer_main(args: list[str] | None = None) -> int:
    """Replay, print the summary and return 0 once every sent task has its result."""
    rclpy.init(args=args)
    try:
        node = LrtraceReplayerNode()
    except (TimelyError, ParameterException) as err:
        rclpy.logging.get_logger('lrtrace_replayer').error(str(err))
        rclpy.try_shutdown()
        return 2
    spin_until_shutdown(node, until=node.finished)
    return node.exit_code
