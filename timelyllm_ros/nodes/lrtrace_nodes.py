"""lrtrace_recorder and lrtrace_replayer nodes: thin ROS bridges over the LRTrace library.

* ``lrtrace_recorder`` subscribes to ``/segments``, ``/segment_done`` and
  ``/skill_executions`` and writes them into an MCAP rosbag2 bag (``bag`` parameter), flushing
  in chunks so that a killed recorder leaves a readable bag.
* ``lrtrace_replayer`` draws a workload (``workload``, ``seed``), publishes each task on the
  ``task`` topic of a robot of the right kind at its arrival time (``robots``: namespaces such
  as ``drone_0``), collects the controllers' ``plan_results`` and logs the metrics at the end.
"""

from __future__ import annotations

import time
from collections import defaultdict

import rclpy
from rclpy.node import Node
from std_msgs.msg import String

from lrtrace.recorder import TraceRecorder
from lrtrace.workloads import resolve_workload
from timelyllm_ros.msg import Segment, SegmentDone, SkillExecution
from timelyllm_ros.nodes import _convert
from timelyllm_ros.nodes._spin import spin_until_shutdown


class LrtraceRecorderNode(Node):
    """Writes the fleet's segment, execution and skill topics into a bag."""

    def __init__(self, **node_options: object) -> None:
        super().__init__('lrtrace_recorder', **node_options)
        self.declare_parameter('bag', f'lrtrace_{time.strftime("%Y%m%d_%H%M%S")}')
        self.declare_parameter('chunk_size', 32 * 1024)
        path = self.get_parameter('bag').value
        self.recorder = TraceRecorder(path, chunk_size=self.get_parameter('chunk_size').value,
                                      source='ros2 fleet')
        self.recorder.open()
        self.create_subscription(Segment, '/segments', self.segment_callback, 100)
        self.create_subscription(SegmentDone, '/segment_done', self.done_callback, 100)
        self.create_subscription(SkillExecution, '/skill_executions', self.skill_callback, 100)
        self.get_logger().info(f'recording into {path}')

    def segment_callback(self, msg: Segment) -> None:
        self.recorder.record_segment_fields(
            msg.robot_id, msg.goal_id, msg.index, msg.text, list(msg.skills), msg.is_last,
            _convert.seconds(msg.generated_stamp), msg.estimated_execution_s)

    def done_callback(self, msg: SegmentDone) -> None:
        self.recorder.record_segment_done(
            msg.robot_id, msg.goal_id, msg.index, _convert.seconds(msg.start_stamp),
            _convert.seconds(msg.end_stamp), msg.success, msg.error)

    def skill_callback(self, msg: SkillExecution) -> None:
        self.recorder.record_skill(msg.robot_id, msg.goal_id, msg.segment_index,
                                   _convert.skill_record_from_msg(msg))

    def destroy_node(self) -> None:
        self.recorder.close()
        super().destroy_node()


class LrtraceReplayerNode(Node):
    """Triggers a workload's tasks on robot nodes and reports the outcome."""

    def __init__(self, **node_options: object) -> None:
        super().__init__('lrtrace_replayer', **node_options)
        self.declare_parameter('workload', 'wid1')
        self.declare_parameter('seed', 0)
        self.declare_parameter('robots', ['drone_0'])
        self.declare_parameter('robot_kinds', ['tello'])
        self.declare_parameter('duration_s', 0.0)
        param = self.get_parameter
        _, tasks = resolve_workload(param('workload').value, seed=param('seed').value)
        limit = param('duration_s').value
        self.tasks = [t for t in tasks if not limit or t.arrival_time <= limit]
        robots = list(param('robots').value)
        kinds = list(param('robot_kinds').value)
        self.by_kind: dict[str, list[str]] = defaultdict(list)
        for robot, kind in zip(robots, kinds, strict=True):
            self.by_kind[kind].append(robot)
        self.publishers_ = {r: self.create_publisher(String, f'/{r}/task', 10) for r in robots}
        for robot in robots:
            self.create_subscription(String, f'/{robot}/plan_results', self.result_callback, 50)
        self.reports: list[dict[str, object]] = []
        self.sent = 0
        self.skipped = 0
        self.start = time.monotonic()
        self.create_timer(0.01, self.tick)

    def tick(self) -> None:
        now = time.monotonic() - self.start
        while self.sent + self.skipped < len(self.tasks) and (
                self.tasks[self.sent + self.skipped].arrival_time <= now):
            task = self.tasks[self.sent + self.skipped]
            robots = self.by_kind.get(task.profile)
            if not robots:
                self.skipped += 1
                continue
            robot = robots[int(task.robot_id.rsplit('-', 1)[-1]) % len(robots)]
            self.publishers_[robot].publish(String(data=task.task))
            self.sent += 1

    def result_callback(self, msg: String) -> None:
        try:
            self.reports.append(_convert.parse_report(msg.data))
        except ValueError as err:
            self.get_logger().warning(str(err))
            return
        if len(self.reports) == self.sent and self.sent + self.skipped == len(self.tasks):
            self.get_logger().info(self.summary())

    def summary(self) -> str:
        done = [r for r in self.reports if r.get('success')]
        mean = (lambda key: sum(float(r[key]) for r in done) / len(done)) if done else None
        return (f'replayed {self.sent} tasks ({self.skipped} without a robot of their kind): '
                f'{len(done)} succeeded' + (
                    f', utility {mean("utility"):.3f}, response {mean("response_time_s"):.3f} s,'
                    f' waiting {mean("waiting_time_s"):.3f} s' if mean else ''))


def recorder_main(args: list[str] | None = None) -> None:
    rclpy.init(args=args)
    spin_until_shutdown(LrtraceRecorderNode())


def replayer_main(args: list[str] | None = None) -> None:
    rclpy.init(args=args)
    spin_until_shutdown(LrtraceReplayerNode())
