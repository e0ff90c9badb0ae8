"""planner node: the PlanTask action server over one scheduler + engine (PlannerService).

A lifecycle node (see :class:`PlannerNode`). Every goal is accepted; one that cannot be
served is aborted at once with ``rejected: <reason>`` in its result (``ros2 action send_goal``
prints it) and a ``PlanRejection`` on ``plan_rejections``. Each served goal streams its
segments as feedback the moment they are cut (and on ``segments``); ``segment_done`` reports
from robots correct the completion estimates; a cancel drops the generation and frees its
memory; an ended goal's ``TaskRecord`` goes to ``task_records`` (LRTrace); ``scheduler_state``
is published for observability. Names are relative: a namespaced planner serves its
namespace's fleet. Times are the node clock's (``use_sim_time`` works).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import rclpy
from builtin_interfaces.msg import Time
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.event_handler import PublisherEventCallbacks
from rclpy.exceptions import InvalidParameterValueException, ParameterException
from rclpy.lifecycle import LifecycleNode, State, TransitionCallbackReturn
from rclpy.qos import qos_profile_sensor_data

from timelyllm_ros.action import PlanTask
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import MISSED_REPORT
from timelyllm_ros.engines import ENGINES, parse_engine_options
from timelyllm_ros.errors import TimelyError
from timelyllm_ros.live.service import PlannerService
from timelyllm_ros.msg import (
    PlanRejection,
    PlanResult,
    SchedulerState,
    Segment,
    SegmentDone,
    TaskRecord,
    TimeUtility,
)
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes.action_client import (
    ACTION_QUEUE_DEPTH,
    PLAN_ACTION,
    action_qos,
    reliable,
)
from timelyllm_ros.nodes.node_clock import NodeClock
from timelyllm_ros.nodes.parameters import (
    BOOL,
    FLOAT,
    INT,
    STR,
    describe,
    refuse_outside_choices,
)
from timelyllm_ros.nodes.spin import spin_until_shutdown
from timelyllm_ros.nodes.task_journal import LOST_GOAL_PREFIX
from timelyllm_ros.policies import FLEET_POLICY


class PlannerNode(LifecycleNode):
    """Wires the PlanTask action, topics and parameters to a PlannerService.

    A managed (lifecycle) node: *configure* builds the engine and loads the model, *activate*
    starts the scheduler loop and offers the ``plan`` action, *deactivate* stops accepting
    goals and drains or aborts the active ones (``deactivate_mode``) before the action server
    goes away, *cleanup* frees the engine and the model. Readiness is the lifecycle state
    (``ros2 lifecycle get /planner``, ``planner/transition_event``) and ``scheduler_state``'s
    status.
    """

    def __init__(self, **node_options: object) -> None:
        super().__init__('planner', **node_options)
        self.add_on_set_parameters_callback(_refuse_bad_parameters)
        for name, default, descriptor in PARAMETERS:
            self.declare_parameter(name, default, descriptor)
        self.node_clock = NodeClock(self)           # the service's time and every stamp sent
        self.service: PlannerService | None = None
        self.action_server: ActionServer | None = None
        self._group = ReentrantCallbackGroup()
        self._interfaces: list[tuple[Callable[[Any], object], Any]] = []  # (destroy, entity)
        self._reported_failure = False
        self._tasks: dict[bytes, str] = {}     # goal id -> task id (for cancels)
        self._robots: dict[str, str] = {}      # active task id -> its robot id
        self._controllers_seen: set[str] = set()   # robots whose controller node was up
        self._active = 0                      # accepted goals not ended (threads held)
        self._active_lock = threading.Lock()
        self._accepting = False
        self._transition_lock = threading.Lock()
        self._goal_events: dict[str, _GoalEvents] = {}   # active task id -> its events
        self._orphans: set[str] = set()        # tasks failed because their controller left
        self._robot_results: dict[str, object] = {}   # robot id -> its plan_results publisher
        # Goals that ended failed with no PlanResult published by the planner: their result
        # may have gone to a dead client (a killed controller not noticed yet).
        self._unconfirmed: OrderedDict[bytes, _EndedGoal] = OrderedDict()
        self._answers = threading.Lock()       # paces goal responses (goal_callback)
        self._answer_tokens = float(ANSWER_BURST)
        self._answered_at = time.monotonic()
        self._rivals_since: float | None = None   # another server of the action seen since
        self.rivals: list[str] = []            # the nodes reported serving the action too

    def _guarded_change_state(self, transition_id: int) -> TransitionCallbackReturn:
        """Take a lifecycle transition, refusing with a warning one the current state does not
        have. rclpy (Jazzy) raises out of the ``change_state`` service for such a request and
        the node dies: a launch file's event handler sends ACTIVATE to a planner restarted by
        hand with ``autostart`` (already active), which killed the restarted planner. Installed
        in place of rclpy's private ``__change_state`` (see :data:`_RCLPY_CHANGE_STATE`),
        which both the service and ``trigger_*`` call."""
        with self._transition_lock:
            available = {t[0] for t in self._state_machine.available_transitions}
            if transition_id not in available:
                state = self._state_machine.current_state[1]
                self.get_logger().warning(f'lifecycle transition {transition_id} refused: the '
                                          f'planner is {state}')
                return TransitionCallbackReturn.FAILURE
            result: TransitionCallbackReturn = getattr(
                super(), _RCLPY_CHANGE_STATE)(transition_id)
            return result

    # -- lifecycle ---------------------------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        """Build the engine and load the model; a bad engine, model, option or policy fails
        the transition with the reason (the node stays unconfigured)."""
        param = self.get_parameter
        try:
            self.service = PlannerService.create(
                policy=param('policy').value, engine=param('engine').value,
                model=param('model').value or None,
                engine_options=_engine_options(param('engine_options').value,
                                               param('endpoints').value),
                calibration=param('calibration').value or None,
                max_batch=param('max_batch').value or None, comm_s=param('comm_s').value,
                profiles_dir=param('profiles_dir').value or None,
                grammar=param('grammar').value, clock=self.node_clock)
        except TimelyError as err:
            self.get_logger().fatal(f'the planner cannot be configured: {err}')
            return TransitionCallbackReturn.FAILURE
        group = self._group
        fleet_depth = ACTION_QUEUE_DEPTH
        self.segments_pub = self.create_publisher(Segment, 'segments', reliable(fleet_depth))
        self.records_pub = self.create_publisher(TaskRecord, 'task_records',
                                                 reliable(fleet_depth))
        self.rejections_pub = self.create_publisher(PlanRejection, 'plan_rejections',
                                                    reliable(fleet_depth))
        self.state_pub = self.create_publisher(SchedulerState, 'scheduler_state',
                                               qos_profile_sensor_data)
        self._interfaces = [
            *((self.destroy_publisher, pub) for pub in (
                self.segments_pub, self.records_pub, self.rejections_pub, self.state_pub)),
            (self.destroy_subscription, self.create_subscription(
                SegmentDone, 'segment_done', self.segment_done_callback, reliable(fleet_depth),
                callback_group=group)),
            (self.destroy_timer, self.create_timer(
                param('state_period_s').value, self.publish_state, callback_group=group)),
            (self.destroy_timer, self.create_timer(
                CONTROLLER_WATCH_S, self.watch_controllers, callback_group=group)),
            (self.destroy_timer, self.create_timer(
                RIVAL_WATCH_S, self.watch_rivals, callback_group=group))]
        self.get_logger().info(f"planner configured: engine {param('engine').value}, "
                               f"policy {param('policy').value}")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        """Start the scheduler loop and offer the ``plan`` action."""
        assert self.service is not None
        self.service.start()
        self._accepting = True
        self.action_server = ActionServer(
            self, PlanTask, PLAN_ACTION, execute_callback=self.execute_callback,
            goal_callback=self.goal_callback,
            cancel_callback=self.cancel_callback, callback_group=self._group,
            **action_server_qos())
        self.get_logger().info('planner active: serving plan goals')
        return super().on_activate(state)

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        """Stop accepting goals; drain the active ones (or abort them, ``deactivate_mode``),
        then withdraw the action server."""
        self._withdraw(self.get_parameter('deactivate_mode').value,
                       self.get_parameter('drain_timeout_s').value)
        self.get_logger().info('planner inactive: not accepting goals')
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        """Free the engine and the model."""
        self._release()
        self.get_logger().info('planner cleaned up: engine and model freed')
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        if self.action_server is not None:
            self._withdraw('abort', 0.0)
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def _withdraw(self, mode: str, timeout_s: float) -> None:
        """Stop accepting goals, end the active ones (:meth:`_end_active_goals`), and take
        the action server down once their results went out."""
        self._accepting = False
        self._end_active_goals(mode, timeout_s)
        time.sleep(RESULT_FLUSH_S)
        if self.action_server is not None:
            self.action_server.destroy()
            self.action_server = None

    def _release(self) -> None:
        for destroy, entity in self._interfaces:
            destroy(entity)
        self._interfaces = []
        self._robot_results.clear()
        self._stop_service()

    def _stop_service(self) -> None:
        """Stop the service (it fails the goals still active: "the planner service
        stopped"), let their callbacks return, then free the engine and the model."""
        self._accepting = False
        if self.service is not None:
            self.service.stop()
            self._wait_goals_ended(ABORT_WAIT_S)
            self.service.scheduler.engine.close()
            self.service = None

    def _end_active_goals(self, mode: str, timeout_s: float) -> None:
        """Wait for the active goals to end (``drain``), failing those still active after
        ``timeout_s``; or fail them at once (``abort``). Each ends with the reason."""
        if mode == 'drain':
            self._wait_goals_ended(timeout_s)
        if self._active and self.service is not None:
            reason = 'the planner was deactivated while the goal was active'
            self.get_logger().warning(f'{self._active} active goals: {reason}')
            for task_id in list(self._robots):
                self.service.fail(task_id, reason)
            self._wait_goals_ended(ABORT_WAIT_S)

    # -- the action --------------------------------------------------------------------------
    def goal_callback(self, goal_request) -> GoalResponse:  # type: ignore[no-untyped-def]
        """Accept every goal (one that cannot be served is aborted with the reason), the
        answer paced (:meth:`_pace`)."""
        self._pace()
        return GoalResponse.ACCEPT

    def _pace(self) -> None:
        """Pace the planner's answers (goal responses, results): :data:`ANSWER_BURST` at once,
        then one per :data:`ANSWER_GAP_S`. A client with rclpy's default QoS keeps 10
        responses; a burst of 200 answers at once lost a few, and their goals were never
        answered."""
        with self._answers:
            now = time.monotonic()
            self._answer_tokens = min(float(ANSWER_BURST), self._answer_tokens
                                      + (now - self._answered_at) / ANSWER_GAP_S)
            self._answered_at = now
            if self._answer_tokens < 1.0:
                time.sleep((1.0 - self._answer_tokens) * ANSWER_GAP_S)
                self._answered_at = time.monotonic()
                self._answer_tokens = 0.0
            else:
                self._answer_tokens -= 1.0

    def cancel_callback(self, goal_handle) -> CancelResponse:  # type: ignore[no-untyped-def]
        """A cancel reaches the service at once; the goal ends canceled through it."""
        task_id = self._tasks.get(bytes(goal_handle.goal_id.uuid))
        if task_id is not None and self.service is not None:
            self.service.cancel(task_id)
        return CancelResponse.ACCEPT

    def execute_callback(self, goal_handle):  # type: ignore[no-untyped-def]
        """Stream the goal's segments as feedback until it ends.

        Every goal is accepted; one that cannot be served (invalid, beyond
        :data:`MAX_ACTIVE_GOALS`, planner not active) is aborted at once with ``rejected:
        <reason>`` as its result's error, so that any action client learns why, and the
        reason is published on ``plan_rejections``.

        The goal's thread sleeps on a condition between the service's events (no polling).
        A thread per active goal, not a coroutine: rclpy's executor (Jazzy) re-polls every
        pending coroutine on each wake-up, which measured 12 s to answer a burst of 200
        goals and lost half of them to report deadlines, against 1 s and none this way.
        """
        with self._active_lock:
            full = self._active >= MAX_ACTIVE_GOALS
            if not full:
                self._active += 1
        if full:
            return self._reject(goal_handle, f'the planner serves {MAX_ACTIVE_GOALS} goals at '
                                             'once; send it again when one has ended')
        events = _GoalEvents()
        key = bytes(goal_handle.goal_id.uuid)
        try:
            service = self.service
            try:
                if not self._accepting or service is None:
                    raise TimelyError('the planner is not active')
                if self.node_clock.now() <= 0.0:
                    raise TimelyError('the planner clock has not started: use_sim_time is '
                                      'true and nothing has published /clock yet')
                task_id = service.submit(
                    convert.goal_from_msg(goal_handle.request),
                    on_segment=lambda g, s: events.put(('segment', g, s)),
                    on_end=lambda g: events.put(('end', g, None)))
            except TimelyError as err:
                return self._reject(goal_handle, str(err))
            self._tasks[key] = task_id
            self._goal_events[task_id] = events
            self._robots[task_id] = goal_handle.request.robot_id
            if goal_handle.request.wait_for_execution:      # a controller's goal
                try:
                    self._results_publisher(goal_handle.request.robot_id)
                except Exception as err:  # noqa: BLE001 - no topic for this robot id: logged
                    self.get_logger().warning(f'no plan_results publisher for '
                                              f'{goal_handle.request.robot_id!r}: {err}')
            if goal_handle.is_cancel_requested:       # canceled before it was submitted
                service.cancel(task_id)
            return self._stream(goal_handle, task_id, events)
        finally:
            task_id = self._tasks.pop(key, '')
            self._robots.pop(task_id, None)
            self._goal_events.pop(task_id, None)
            with self._active_lock:
                self._active -= 1

    def _reject(self, goal_handle, reason: str) -> PlanTask.Result:  # type: ignore[no-untyped-def]
        goal = goal_handle.request
        self.get_logger().warning(f'{goal.robot_id}: goal rejected'
                                  f'{f" (task {goal.task_id})" if goal.task_id else ""}: '
                                  f'{reason}')
        if self._interfaces:
            self.rejections_pub.publish(convert.rejection_to_msg(
                PlanRejection, Time, self.node_clock.now(), goal.robot_id, goal.task_id, reason))
        goal_handle.abort()
        return PlanTask.Result(success=False, error=convert.REJECTED_PREFIX + reason,
                               response_time_s=-1.0, waiting_time_s=-1.0)

    def _stream(self, goal_handle, task_id: str,  # type: ignore[no-untyped-def]
                events: _GoalEvents) -> PlanTask.Result:
        """Stream a goal's segments as feedback until it ends, then return its result.

        Feedback is a lossy channel for a client whose queue is shallower than a burst (an
        rclpy ActionClient keeps 10 by default): a segment its robot has not reported is sent
        again, :data:`RESEND_AFTER_S` past its estimated execution and every
        :data:`RESEND_EVERY_S` after (robots skip a segment index they already have)."""
        unreported: dict[int, tuple[float, Segment]] = {}   # index -> (when to resend, msg)
        while True:
            # Sleep until the next event or the first resend due (a goal with nothing
            # unreported wakes only for events: a thousand goals must not poll).
            wait_s = (max(0.0, min(due for due, _ in unreported.values()) - time.monotonic())
                      if unreported else None)
            event = events.get(timeout_s=wait_s)
            if event is None:
                self._resend(goal_handle, unreported)
                continue
            kind, generation, segment = event
            if kind == 'reported':
                unreported.pop(int(generation), None)   # type: ignore[call-overload]
                continue
            if kind == 'segment':
                msg = convert.segment_to_msg(generation, segment, 0.0, Segment, Time)
                self.segments_pub.publish(msg)
                goal_handle.publish_feedback(PlanTask.Feedback(segment=msg))
                if goal_handle.request.wait_for_execution and not convert.is_plan_end(msg):
                    due = time.monotonic() + msg.estimated_execution_s + RESEND_AFTER_S
                    unreported[msg.index] = (due, msg)
                continue
            result = PlanTask.Result(**convert.result_fields(generation))
            self.records_pub.publish(convert.task_record_to_msg(
                generation, goal_handle.request.task_id, TaskRecord, TimeUtility, Time))
            if not result.success:
                self.get_logger().warning(
                    f'goal {task_id} ({generation.status.name.lower()}): {result.error}')
            if task_id in self._orphans:
                self._orphans.discard(task_id)
                self._report_for_gone_controller(goal_handle.request, result)
            elif goal_handle.request.wait_for_execution:     # a controller's goal
                self._remember_unconfirmed(goal_handle, result)
            self._pace()                        # the result is an answer too
            if generation.status == TaskStatus.CANCELLED and goal_handle.is_cancel_requested:
                goal_handle.canceled()          # else a failure keeps its own outcome
            elif result.success:
                goal_handle.succeed()
            else:
                goal_handle.abort()
            return result

    def _resend(self, goal_handle, unreported: dict[int, tuple[float, Segment]]  # type: ignore[no-untyped-def]
                ) -> None:
        """Publish again the feedback of the segments whose report is overdue."""
        now = time.monotonic()
        for index, (due, msg) in sorted(unreported.items()):
            if due <= now:
                goal_handle.publish_feedback(PlanTask.Feedback(segment=msg))
                unreported[index] = (now + RESEND_EVERY_S, msg)

    def _report_for_gone_controller(self, goal, result) -> None:  # type: ignore[no-untyped-def]
        """Publish the task's ``PlanResult`` on its robot's ``plan_results`` in place of its
        controller, which left the graph mid-plan and cannot."""
        robot_id = goal.robot_id
        try:
            self._results_publisher(robot_id).publish(convert.plan_result_to_msg(
                PlanResult, Time, stamp_s=self.node_clock.now(), robot_id=robot_id,
                robot_kind=goal.robot_kind, task_id=goal.task_id,
                outcome='succeeded' if result.success else 'failed', result=result))
        except Exception as err:  # noqa: BLE001 - a robot id that is no topic name: logged
            self.get_logger().warning(f'no PlanResult for {robot_id}: {err}')

    def _results_publisher(self, robot_id: str):  # type: ignore[no-untyped-def]
        """The planner's publisher on a robot's ``plan_results`` (for results it reports in
        the controller's place). Opened when the robot's first goal arrives, not when a result
        must go out: a reliable message on a publisher its subscribers have not discovered yet
        is lost."""
        publisher = self._robot_results.get(robot_id)
        if publisher is None:
            # Without rclpy's default QoS-event handlers: each is a waitable that the executor
            # walks at every spin, and with a publisher per robot a fleet of 500 made the
            # executor's wait-set work outweigh the planner loop (it shares the GIL).
            publisher = self._robot_results[robot_id] = self.create_publisher(
                PlanResult, f'{robot_id}/plan_results', reliable(RESULTS_DEPTH),
                event_callbacks=PublisherEventCallbacks(use_default_callbacks=False))
            self._interfaces.append((self.destroy_publisher, publisher))
        return publisher

    def _remember_unconfirmed(self, goal_handle, result) -> None:  # type: ignore[no-untyped-def]
        """Keep an ended goal's result: if its controller turns out to have died before it
        got it (it restarted and names the goal as lost; or, for a missed report, it left the
        graph soon after), the planner reports it in its place."""
        key = bytes(goal_handle.goal_id.uuid)
        self._unconfirmed[key] = _EndedGoal(goal_handle.request, result, time.monotonic(),
                                            result.error.startswith(MISSED_REPORT))
        while len(self._unconfirmed) > MAX_UNCONFIRMED:
            self._unconfirmed.popitem(last=False)

    def _report_unconfirmed(self, key: bytes) -> bool:
        ended = self._unconfirmed.pop(key, None)
        if ended is None:
            return False
        self._report_for_gone_controller(ended.request, ended.result)
        return True

    def watch_controllers(self) -> None:
        """Fail the goals of a robot whose controller node was up and has left the graph
        (killed, crashed): nobody will execute or report their segments. Goals of that robot
        that failed shortly before (a missed report deadline comes before DDS notices a killed
        process) get their result reported too."""
        present = {namespace.rsplit('/', 1)[-1] for name, namespace in
                   self.get_node_names_and_namespaces() if name == 'controller'}
        gone = self._controllers_seen - present
        now = time.monotonic()
        for key, ended in list(self._unconfirmed.items()) if gone else ():
            robot_id = ended.request.robot_id
            if (robot_id in gone and ended.missed_report
                    and now - ended.ended_at <= UNCONFIRMED_KEEP_S):
                self.get_logger().warning(f'{robot_id}: its controller left the ROS graph '
                                          'after a goal of it missed a report: result '
                                          'reported')
                self._report_unconfirmed(key)
        self._controllers_seen |= present
        for task_id, robot_id in list(self._robots.items()):
            if robot_id in self._controllers_seen and robot_id not in present:
                self.get_logger().warning(f'goal {task_id}: the controller of {robot_id} is '
                                          'gone; the goal is failed')
                if self.service is not None:
                    self._orphans.add(task_id)
                    self.service.fail(task_id,
                                      f'the controller of {robot_id} left the ROS graph')
        self._controllers_seen &= present | set(self._robots.values())

    def segment_done_callback(self, msg: SegmentDone) -> None:
        if self.service is None:
            return
        if msg.goal_id.startswith(LOST_GOAL_PREFIX):
            self._end_lost_goal(msg)
            return
        task_id, index, start, end, success, error = convert.segment_done_from_msg(msg, 0.0)
        self.service.report_segment(task_id, index, start, end, success, error)
        events = self._goal_events.get(task_id)
        if events is not None:
            events.put(('reported', index, None))      # no need to send it again

    def _end_lost_goal(self, msg: SegmentDone) -> None:
        """A restarted controller lost this goal (named by its action goal UUID) with its
        previous process: fail it with the controller's reason and report its result in the
        controller's place. A goal already ended (its controller was seen leaving) is
        ignored: its result was reported then."""
        try:
            key = bytes.fromhex(msg.goal_id[len(LOST_GOAL_PREFIX):])
        except ValueError:
            self.get_logger().warning(f'SegmentDone names no goal UUID: {msg.goal_id!r}')
            return
        task_id = self._tasks.get(key)
        if task_id is None or self._robots.get(task_id) != msg.robot_id:
            ended = self._unconfirmed.get(key)
            if ended is not None and ended.request.robot_id == msg.robot_id:
                self.get_logger().warning(f'{msg.robot_id}: {msg.error}: the result of its '
                                          'failed goal is reported')
                self._report_unconfirmed(key)
            else:
                self.get_logger().info(f'{msg.robot_id}: a lost goal was already reported')
            return
        self.get_logger().warning(f'goal {task_id}: {msg.error}')
        if self.service is not None:
            self._orphans.add(task_id)
            self.service.fail(task_id, msg.error or f'the controller of {msg.robot_id} '
                                                    'lost the goal')

    def watch_rivals(self) -> None:
        """Log an error, naming them, while other nodes offer this planner's ``plan``
        action too (for longer than a killed process's DDS lease): each of them receives every
        goal request, so two planners both serve every goal and stream two plans to its
        robot (a planner left running by a killed ``ros2 run`` wrapper, a second launch).
        Said once per appearance; :attr:`rivals` holds the nodes named."""
        service = self.resolve_service_name(PLAN_ACTION + SEND_GOAL_SUFFIX)
        if self.action_server is None or self.count_services(service) <= 1:
            self._rivals_since, self.rivals = None, []
            return
        now = time.monotonic()
        if self._rivals_since is None:
            self._rivals_since = now
        if self.rivals or now - self._rivals_since < RIVAL_GRACE_S:
            return
        me = (self.get_name(), self.get_namespace())
        servers = [(name, namespace) for name, namespace in self.get_node_names_and_namespaces()
                   if any(found == service for found, _ in
                          self.get_service_names_and_types_by_node(name, namespace))]
        others = [_full_name(node) for node in servers if node != me]
        twins = servers.count(me) - 1           # a stale copy of this node has its name
        if twins > 0:
            others.append(f'{twins} other node{"s" if twins > 1 else ""} named '
                          f'{_full_name(me)} as this one')
        self.rivals = others or ['a server of no node found in the graph']
        self.get_logger().error(
            f'{", ".join(self.rivals)} also serve{"s" if len(self.rivals) == 1 else ""} '
            f'the plan action '
            f'({service.removesuffix(SEND_GOAL_SUFFIX)}): every goal reaches each of them and '
            'each streams its own plan to the robot; stop all but one planner')

    def publish_state(self) -> None:
        if self.service is None:
            return
        state = self.service.state()
        if state.status == 'failed' and not self._reported_failure:
            self._reported_failure = True
            self.get_logger().error(f'planner service failed, refusing goals: {state.error}')
        self.state_pub.publish(SchedulerState(
            stamp=convert.stamp(self.node_clock.now(), Time), queued=state.queued,
            running=state.running, batch_size=state.last_batch_size,
            executing=state.executing, active_goals=self._active,
            status=state.status if self._accepting else 'inactive', error=state.error,
            goal_ids=list(state.priorities), priorities=list(state.priorities.values()),
            loop_iterations=state.loop.iterations, engine_share=state.loop.engine_share,
            loop_overhead_max_s=state.loop.max_overhead_s,
            replica_names=[r.name for r in state.replicas],
            replica_up=[r.up for r in state.replicas],
            replica_running=[r.running for r in state.replicas],
            replica_kv_usage=[float(r.kv_cache_usage) for r in state.replicas],
            replica_errors=[r.last_error for r in state.replicas]))

    def destroy_node(self) -> None:
        """End every active goal and let its callback return before the node's handles
        go."""
        self._stop_service()
        super().destroy_node()

    def _wait_goals_ended(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.02)


def _rclpy_change_state_name() -> str:
    """The mangled name of rclpy's private ``__change_state`` (in ``LifecycleNodeMixin`` on
    Jazzy, ``LifecycleNode`` before)."""
    for cls in LifecycleNode.__mro__:
        name = f'_{cls.__name__}__change_state'
        if name in vars(cls):
            return name
    raise RuntimeError("rclpy LifecycleNode has no __change_state: update the planner's "
                       'lifecycle transition guard for this rclpy')


_RCLPY_CHANGE_STATE = _rclpy_change_state_name()
setattr(PlannerNode, _RCLPY_CHANGE_STATE, PlannerNode._guarded_change_state)


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

    def get(self, timeout_s: float | None = None) -> tuple | None:  # type: ignore[type-arg]
        """The next event; None if none came within ``timeout_s``."""
        with self._ready:
            if not self._events and not self._ready.wait_for(lambda: bool(self._events),
                                                             timeout_s):
                return None
            return self._events.popleft()


def _engine_options(text: str, endpoints: str) -> dict[str, str]:
    """The engine's options from the ``engine_options`` parameter, with ``endpoints`` (its own
    parameter: its URLs are comma-separated, which ``engine_options`` splits on)."""
    options = parse_engine_options(text.replace(',', ' ').split())
    if endpoints.strip():
        options['endpoints'] = endpoints.strip()
    return options


PARAMETERS: tuple[tuple[str, object, ParameterDescriptor], ...] = (
    ('engine', 'sim', describe(f'LLM engine: {" | ".join(ENGINES)} (sim: the calibrated '
                                  f'simulator)', STR)),
    ('model', '', describe('model of a real engine (cpu: smollm2, gemma3-270m or a .gguf '
                              'path; transformers/vllm: a local model folder)', STR)),
    ('engine_options', '', describe(
        "the engine's own options, KEY=VALUE separated by spaces or commas (e.g. 'threads=2 "
        "kv_tokens=8192'); an option the engine does not take stops the planner with the "
        'reason', STR)),
    ('endpoints', '', describe(
        'engine vllm-server: the vllm serve replicas, comma-separated base URLs (e.g. '
        "'http://gpu1:8000,http://gpu2:8000'); model names a local copy of their model "
        'folder (its tokenizer)', STR)),
    ('grammar', True, describe(
        "constrain robot plans to their profile's grammar on a real engine, so that every "
        'plan parses and stays within the robot limits (false: free generation, for '
        'comparison)', BOOL)),
    ('calibration', '', describe('latency calibration of the simulator (name or YAML '
                                    'path; empty: the bundled default)', STR)),
    ('policy', FLEET_POLICY, describe('scheduling policy (timelyllm-share, timelyllm, '
                                              'vllm, seg-edf, semantic, autellix-plas, '
                                              'timebill, slice, ...)', STR)),
    ('max_batch', 0, describe('fixed batch cap (0: the engine limit)', INT,
                                 integer=(0, 4096))),
    ('comm_s', 0.008, describe('one-way network latency to the robots (s)', FLOAT,
                                  floating=(0.0, 10.0))),
    ('profiles_dir', '', describe('folder of robot profile YAMLs (empty: the bundled ones)',
                                     STR)),
    ('state_period_s', 0.2, describe('period of scheduler_state (s)', FLOAT,
                                        floating=(0.01, 60.0))),
    ('deactivate_mode', 'drain', describe(
        'what deactivate does with active goals: drain (wait for them to end, at most '
        'drain_timeout_s, then abort the rest) | abort (end them at once, with the reason)',
        STR, read_only=False)),
    ('drain_timeout_s', 30.0, describe('longest wait for active goals when deactivating '
                                          '(s)', FLOAT, read_only=False,
                                          floating=(0.0, 3600.0))),
    ('autostart', False, describe('configure and activate at start (without a launch '
                                     'file or lifecycle manager driving the node)', BOOL)),
)
"""The planner's parameters, with their ranges; those that need a restart are read-only."""

_refuse_bad_parameters = refuse_outside_choices({'engine': ENGINES,
                                                 'deactivate_mode': ('drain', 'abort')})


RESULT_FLUSH_S = 0.5
"""Time left to rclpy, once the last goal's execute callback returned, to answer its result
requests before the action server is destroyed (s)."""

ABORT_WAIT_S = 5.0
"""Longest wait for aborted goals to end when deactivating (s)."""

@dataclass(frozen=True, slots=True)
class _EndedGoal:
    """An ended goal whose result may have gone to a dead client."""

    request: Any
    result: Any
    ended_at: float
    missed_report: bool        # it ended because its robot missed a report deadline


MAX_UNCONFIRMED = 4096
"""Ended goals whose results the planner keeps (the oldest go first), for a restarted
controller that names one of them as lost."""

UNCONFIRMED_KEEP_S = 60.0
"""How long (s) after a goal missed a report its controller leaving the graph is taken for
its death (longer than a DDS liveliness lease); later, only a restarted controller naming the
goal reports it."""

CONTROLLER_WATCH_S = 1.0
"""How often the planner looks for controllers that left the ROS graph (s)."""

SEND_GOAL_SUFFIX = '/_action/send_goal'    # the action's goal service, one per server

RIVAL_WATCH_S = 5.0
"""How often the planner looks for other servers of its action (s)."""

RIVAL_GRACE_S = 15.0
"""How long another server must have been seen before the planner reports it (s): a killed
planner's server stays in the graph until its DDS lease ends (about 8 s here), and a planner
restarted at once must not report its own predecessor."""

ANSWER_BURST = 4
"""Goal responses sent at once before the planner paces them."""

ANSWER_GAP_S = 0.01
"""Then one goal response per this many seconds (500 goals answered in about 5 s)."""

RESULTS_DEPTH = 64
"""Depth of the plan_results publisher the planner opens for a robot whose controller left."""

RESEND_AFTER_S = 1.0
"""A segment not reported this long after its estimated execution is sent again (s)."""

RESEND_EVERY_S = 2.0
"""... and again this often until it is reported or the goal ends (s)."""

MAX_ACTIVE_GOALS = 1024
"""Goals the planner serves at once (streaming or waiting on their robots); more are rejected
with the reason, never left unanswered."""

EXECUTOR_THREADS = MAX_ACTIVE_GOALS + 16
"""Each active goal's execute callback sleeps on its own thread between events; the rest run
the short callbacks (goal checks, reports, cancels, timers). Threads start on demand."""


def _full_name(node: tuple[str, str]) -> str:
    """``/namespace/name`` of a ``(name, namespace)`` pair from the ROS graph."""
    name, namespace = node
    return f'{namespace.rstrip("/")}/{name}'


def main(args: list[str] | None = None) -> None:
    rclpy.init(args=args)
    logger = rclpy.logging.get_logger('planner')
    try:
        node = PlannerNode()
    except (ParameterException, InvalidParameterValueException) as err:   # say why, no trace
        logger.fatal(f'the planner cannot start: {err}')
        rclpy.try_shutdown()
        raise SystemExit(1) from None
    if node.get_parameter('autostart').value:
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            node.destroy_node()
            rclpy.try_shutdown()
            raise SystemExit(1)
        node.trigger_activate()
    spin_until_shutdown(node, num_threads=EXECUTOR_THREADS)
