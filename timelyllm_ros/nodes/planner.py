"""planner node: the PlanTask action server over one scheduler + engine (PlannerService).

Goals are validated at goal time (bad ones are rejected, the reason logged and published on
``plan_rejections``); each accepted goal streams its segments as feedback the moment they are
cut (and on ``segments``); ``segment_done`` reports from robots correct the completion
estimates; a cancel drops the generation and frees its memory; ``scheduler_state`` is
published for observability.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import rclpy
from builtin_interfaces.msg import Time
from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    ParameterType,
)
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from std_msgs.msg import String

from timelyllm_ros.action import PlanTask
from timelyllm_ros.engines import ENGINES, parse_engine_options
from timelyllm_ros.errors import TimelyError
from timelyllm_ros.msg import SchedulerState, Segment, SegmentDone
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes.action_client import ACTION_QUEUE_DEPTH, action_qos
from timelyllm_ros.nodes.spin import spin_until_shutdown
from timelyllm_ros.service import PlannerService


class PlannerNode(Node):
    """Wires the PlanTask action, topics and parameters to a PlannerService."""

    def __init__(self, **node_options: object) -> None:
        super().__init__('planner', **node_options)
        for name, default, descriptor in PARAMETERS:
            self.declare_parameter(name, default, descriptor)
        param = self.get_parameter
        self.service = PlannerService.create(
            policy=param('policy').value, engine=param('engine').value,
            model=param('model').value or None,
            engine_options=parse_engine_options(
                param('engine_options').value.replace(',', ' ').split()),
            calibration=param('calibration').value or None,
            max_batch=param('max_batch').value or None, comm_s=param('comm_s').value,
            profiles_dir=param('profiles_dir').value or None, grammar=param('grammar').value)
        self.origin_s = time.time() - self.service.now()
        group = ReentrantCallbackGroup()
        self.segments_pub = self.create_publisher(Segment, 'segments', 50)
        self.state_pub = self.create_publisher(SchedulerState, 'scheduler_state', 10)
        self.rejections_pub = self.create_publisher(String, 'plan_rejections', 10)
        self.create_subscription(SegmentDone, 'segment_done', self.segment_done_callback,
                                 ACTION_QUEUE_DEPTH,
                                 callback_group=group)
        self.create_timer(param('state_period_s').value, self.publish_state,
                          callback_group=group)
        self.action_server = ActionServer(
            self, PlanTask, 'plan', execute_callback=self.execute_callback,
            goal_callback=self.goal_callback, cancel_callback=self.cancel_callback,
            callback_group=group, **action_server_qos())
        self._reported_failure = False
        self._tasks: dict[bytes, str] = {}     # goal id -> task id (for cancels)
        self._robots: dict[str, str] = {}      # active task id -> its robot id
        self._controllers_seen: set[str] = set()   # robots whose controller node was up
        self.create_timer(CONTROLLER_WATCH_S, self.watch_controllers, callback_group=group)
        self._active = 0                      # accepted goals not ended (threads held)
        self._active_lock = threading.Lock()
        self.service.start()
        self.get_logger().info(
            f"planner ready: engine {param('engine').value}, policy {param('policy').value}")

    def goal_callback(self, goal: PlanTask.Goal) -> GoalResponse:
        """Reject bad goals now, and goals beyond :data:`MAX_ACTIVE_GOALS`, with the reason
        logged and published."""
        try:
            self.service.make_spec(convert.goal_from_msg(goal))
            with self._active_lock:
                if self._active >= MAX_ACTIVE_GOALS:
                    raise TimelyError(f'the planner serves {MAX_ACTIVE_GOALS} goals at once; '
                                      'send it again when one has ended')
                self._active += 1
        except TimelyError as err:
            reason = f'{goal.robot_id}: rejected: {err}'
            self.get_logger().warning(reason)
            self.rejections_pub.publish(String(data=reason))
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def cancel_callback(self, goal_handle) -> CancelResponse:  # type: ignore[no-untyped-def]
        """A cancel reaches the service at once; the goal ends canceled through it."""
        task_id = self._tasks.get(bytes(goal_handle.goal_id.uuid))
        if task_id is not None:
            self.service.cancel(task_id)
        return CancelResponse.ACCEPT

    def execute_callback(self, goal_handle):  # type: ignore[no-untyped-def]
        """Stream the goal's segments as feedback until it ends.

        The goal's thread sleeps on a condition between the service's events (no polling).
        A thread per active goal, not a coroutine: rclpy's executor (Jazzy) re-polls every
        pending coroutine on each wake-up, which measured 12 s to answer a burst of 200
        goals and lost half of them to report deadlines, against 1 s and none this way.
        """
        events = _GoalEvents()
        key = bytes(goal_handle.goal_id.uuid)
        try:
            try:
                task_id = self.service.submit(
                    convert.goal_from_msg(goal_handle.request),
                    on_segment=lambda g, s: events.put(('segment', g, s)),
                    on_end=lambda g: events.put(('end', g, None)))
            except TimelyError as err:
                goal_handle.abort()
                return PlanTask.Result(success=False, error=str(err))
            self._tasks[key] = task_id
            self._robots[task_id] = goal_handle.request.robot_id
            if goal_handle.is_cancel_requested:       # canceled before it was submitted
                self.service.cancel(task_id)
            return self._stream(goal_handle, task_id, events)
        finally:
            self._robots.pop(self._tasks.pop(key, ''), None)
            with self._active_lock:
                self._active -= 1

    def _stream(self, goal_handle, task_id: str,  # type: ignore[no-untyped-def]
                events: _GoalEvents) -> PlanTask.Result:
        while True:
            kind, generation, segment = events.get()
            if kind == 'segment':
                msg = convert.segment_to_msg(generation, segment, self.origin_s, Segment, Time)
                self.segments_pub.publish(msg)
                goal_handle.publish_feedback(PlanTask.Feedback(segment=msg))
                continue
            result = PlanTask.Result(**convert.result_fields(generation))
            if not result.success:
                self.get_logger().warning(
                    f'goal {task_id} ({generation.status.name.lower()}): {result.error}')
            if goal_handle.is_cancel_requested:
                goal_handle.canceled()
            elif result.success:
                goal_handle.succeed()
            else:
                goal_handle.abort()
            return result

    def watch_controllers(self) -> None:
        """Fail the goals of a robot whose controller node was up and has left the graph
        (killed, crashed): nobody will execute or report their segments."""
        present = {namespace.strip('/') for name, namespace in
                   self.get_node_names_and_namespaces() if name == 'controller'}
        self._controllers_seen |= present
        for task_id, robot_id in list(self._robots.items()):
            if robot_id in self._controllers_seen and robot_id not in present:
                self.get_logger().warning(f'goal {task_id}: the controller of {robot_id} is '
                                          'gone; the goal is failed')
                self.service.fail(task_id, f'the controller of {robot_id} left the ROS graph')
        self._controllers_seen &= present | set(self._robots.values())

    def segment_done_callback(self, msg: SegmentDone) -> None:
        task_id, index, start, end, success, error = convert.segment_done_from_msg(
            msg, self.origin_s)
        self.service.report_segment(task_id, index, start, end, success, error)

    def publish_state(self) -> None:
        state = self.service.state()
        if state.status == 'failed' and not self._reported_failure:
            self._reported_failure = True
            self.get_logger().error(f'planner service failed, refusing goals: {state.error}')
        self.state_pub.publish(SchedulerState(
            stamp=convert.stamp(self.origin_s + state.time, Time), queued=state.queued,
            running=state.running, batch_size=state.last_batch_size,
            executing=state.executing, active_goals=self._active, status=state.status,
            error=state.error,
            goal_ids=list(state.priorities), priorities=list(state.priorities.values())))

    def destroy_node(self) -> None:
        self.service.stop()
        super().destroy_node()


def action_server_qos() -> dict[str, object]:
    """The fleet's action QoS for the server side (feedback is published, not subscribed)."""
    qos = action_qos()
    qos['feedback_pub_qos_profile'] = qos.pop('feedback_sub_qos_profile')
    return dict(qos)


class _GoalEvents:
    """A goal's events from the service's thread, taken by its execute callback."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._events: deque[tuple[str, object, object]] = deque()

    def put(self, event: tuple[str, object, object]) -> None:
        with self._ready:
            self._events.append(event)
            self._ready.notify()

    def get(self) -> tuple:  # type: ignore[type-arg]
        with self._ready:
            while not self._events:
                self._ready.wait()
            return self._events.popleft()


def _descriptor(description: str, kind: int, read_only: bool = True,
                integer: tuple[int, int] | None = None,
                floating: tuple[float, float] | None = None) -> ParameterDescriptor:
    descriptor = ParameterDescriptor(description=description, type=kind, read_only=read_only)
    if integer is not None:
        descriptor.integer_range = [IntegerRange(from_value=integer[0], to_value=integer[1],
                                                 step=1)]
    if floating is not None:
        descriptor.floating_point_range = [FloatingPointRange(
            from_value=floating[0], to_value=floating[1], step=0.0)]
    return descriptor


_STR, _INT, _FLOAT, _BOOL = (ParameterType.PARAMETER_STRING, ParameterType.PARAMETER_INTEGER,
                             ParameterType.PARAMETER_DOUBLE, ParameterType.PARAMETER_BOOL)
PARAMETERS: tuple[tuple[str, object, ParameterDescriptor], ...] = (
    ('engine', 'sim', _descriptor(f'LLM engine: {" | ".join(ENGINES)} (sim: the calibrated '
                                  f'simulator)', _STR)),
    ('model', '', _descriptor('model of a real engine (cpu: smollm2, gemma3-270m or a .gguf '
                              'path; transformers/vllm: a local model folder)', _STR)),
    ('engine_options', '', _descriptor(
        "the engine's own options, KEY=VALUE separated by spaces or commas (e.g. 'threads=2 "
        "kv_tokens=8192'); an option the engine does not take stops the planner with the "
        'reason', _STR)),
    ('grammar', True, _descriptor(
        "constrain robot plans to their profile's grammar on a real engine, so that every "
        'plan parses and stays within the robot limits (false: free generation, for '
        'comparison)', _BOOL)),
    ('calibration', '', _descriptor('latency calibration of the simulator (name or YAML '
                                    'path; empty: the bundled default)', _STR)),
    ('policy', 'timelyllm', _descriptor('scheduling policy (timelyllm, vllm, seg-edf, '
                                        'semantic, autellix-plas, timebill, slice, ...)', _STR)),
    ('max_batch', 0, _descriptor('fixed batch cap (0: the engine limit)', _INT,
                                 integer=(0, 4096))),
    ('comm_s', 0.008, _descriptor('one-way network latency to the robots (s)', _FLOAT,
                                  floating=(0.0, 10.0))),
    ('profiles_dir', '', _descriptor('folder of robot profile YAMLs (empty: the bundled ones)',
                                     _STR)),
    ('state_period_s', 0.2, _descriptor('period of scheduler_state (s)', _FLOAT,
                                        floating=(0.01, 60.0))),
)
"""The planner's parameters: each needs a restart to change (read-only), with its range."""


CONTROLLER_WATCH_S = 1.0
"""How often the planner looks for controllers that left the ROS graph (s)."""

MAX_ACTIVE_GOALS = 1024
"""Goals the planner serves at once (streaming or waiting on their robots); more are rejected
with the reason, never left unanswered."""

EXECUTOR_THREADS = MAX_ACTIVE_GOALS + 16
"""Each active goal's execute callback sleeps on its own thread between events; the rest run
the short callbacks (goal checks, reports, cancels, timers). Threads start on demand."""


def main(args: list[str] | None = None) -> None:
    rclpy.init(args=args)
    try:
        node = PlannerNode()
    except TimelyError as err:   # a bad engine, model, option or policy: say why, no traceback
        rclpy.logging.get_logger('planner').fatal(f'the planner cannot start: {err}')
        rclpy.try_shutdown()
        raise SystemExit(1) from None
    spin_until_shutdown(node, num_threads=EXECUTOR_THREADS)
