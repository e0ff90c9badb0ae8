"""Robot controller node: one robot, its backend, and a PlanTask client to the planner.

A task arrives on ``task`` (``timelyllm_ros/msg/Task``); the node sends the plan goal on the
``plan`` action, executes the segments in order as they stream in (the next one may arrive
while one executes), publishes ``segment_done`` and one ``skill_executions`` record per
skill, and on a backend failure reports it (the planner ends the goal as failed with the
robot's reason) and drops the rest of the plan. Every task ends with one ``PlanResult`` on
``plan_results`` (its ``outcome``: succeeded, failed, canceled, rejected by the planner,
refused by the controller).

A robot executes one plan at a time: a task that arrives while a plan is generated or executed
waits in a queue of at most ``max_queued_tasks`` tasks, urgent ones first and otherwise in
arrival order (:class:`_tasks.TaskQueue`); a task that finds the queue full is refused.
The queue is kept in a journal file (:mod:`task_journal`, under ``state_dir``): a controller
killed and started again takes up its waiting tasks (those younger than ``resume_within_s``)
and has the planner end its lost active goal with a result; a controller whose planner left
reports the active task failed with a ``PlanResult`` and a ``TaskRecord`` of what it ran.
A plan goal the planner has not answered within ``answer_within_s`` is sent again (a request
or its answer can be lost in the middleware: the planner left, or had not matched this node
yet); an answer to the first that comes after all cancels that goal.
The robot's own names are relative (``task``, ``plan_results``); the planner's (the ``plan``
action, ``segment_done``, ``skill_executions``) are the fleet's, the namespace above the
robot's (:func:`fleet_name`: ``/drone_0`` -> ``/plan``, ``/fleet_a/drone_0`` ->
``/fleet_a/plan``; the ``fleet`` parameter overrides it), so a controller restarts with one
command and no remaps (see the README); stamps come from the node clock.
Every executable names its node ``controller``, as the launch file does, so a controller
restarted by hand keeps its journal and is the node the planner watches.
``drone_controller`` and ``arm_controller`` are this node with a different default robot kind
(tello, indy7); ``controller`` is this node for a robot of any kind, named by its
``robot_kind`` parameter (a profile name): the profile's robot kind
(:func:`~timelyllm_ros.robots.kind.kind_of`) opens its backend, so a new kind needs no node of
its own.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import rclpy
from action_msgs.msg import GoalStatus
from builtin_interfaces.msg import Time
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.exceptions import InvalidParameterValueException, ParameterException
from rclpy.node import Node
from unique_identifier_msgs.msg import UUID

from timelyllm_ros.action import PlanTask
from timelyllm_ros.core.tuf import TUF_CLASSES
from timelyllm_ros.errors import GoalError, ProfileError, TimelyError
from timelyllm_ros.language.profiles import available_profiles, load_profile
from timelyllm_ros.msg import (
    PlanResult,
    SegmentDone,
    SkillExecution,
    Task,
    TaskRecord,
    TimeUtility,
)
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes._tasks import TaskQueue
from timelyllm_ros.nodes.action_client import (
    ACTION_QUEUE_DEPTH,
    PLAN_ACTION,
    SafeActionClient,
    reliable,
)
from timelyllm_ros.nodes.node_clock import NodeClock
from timelyllm_ros.nodes.parameters import FLOAT, INT, STR, describe, refuse_outside_choices
from timelyllm_ros.nodes.spin import spin_until_shutdown
from timelyllm_ros.nodes.task_journal import (
    LOST_GOAL_PREFIX,
    JournalError,
    JournalState,
    KeptTask,
    TaskJournal,
    default_state_dir,
    journal_path,
)
from timelyllm_ros.robots.executor import SkillExecutor
from timelyllm_ros.robots.factory import BACKENDS, open_robot

_ENDED = (GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_CANCELED, GoalStatus.STATUS_ABORTED)

PLANNER_WATCH_S = 1.0
"""How often a controller checks that its planner is up (s)."""

ANSWER_WITHIN_S = 15.0
"""Default of ``answer_within_s``: how long a controller waits for the planner to answer a
plan goal before it sends the goal again (s). Above the planner's paced answers to the most
goals it takes at once (1,024, one answer per 10 ms: 10.2 s), so a fleet's burst is not sent
twice; a goal that never reached the planner costs its robot this long, not forever."""

ABANDONED_KEPT = 64
"""Goals given up for unanswered whose feedback a controller still recognises and drops (one
per resend; a planner answers a lost request within seconds, if ever)."""


class RobotControllerNode(Node):
    """Wires one robot backend to the planner's action server and the report topics."""

    def __init__(self, node_name: str, default_kind: str, **node_options: object) -> None:
        super().__init__(node_name, **node_options)
        self.add_on_set_parameters_callback(refuse_outside_choices(
            {'backend': BACKENDS, 'urgency': TUF_CLASSES}))
        # the robot id defaults to the robot's namespace (/fleet_a/drone_0 -> drone_0)
        robot_id = self.get_namespace().rstrip('/').rsplit('/', 1)[-1] or node_name
        for name, default, descriptor in controller_parameters(robot_id, default_kind):
            self.declare_parameter(name, default, descriptor)
        param = self.get_parameter
        self.robot_id = param('robot_id').value
        if not param('robot_kind').value:
            known = available_profiles(param('profiles_dir').value or None)
            raise ProfileError('no robot_kind parameter: set it to a robot profile name '
                               f'({", ".join(known) or "none found"})')
        self.profile = load_profile(param('robot_kind').value,
                                    param('profiles_dir').value or None)
        self.robot_clock = NodeClock(self)
        self.robot = open_robot(self.profile, param('backend').value,
                                param('address').value or None, self.robot_clock)
        self.backend = self.robot.backend
        self.skill_executor = SkillExecutor(self.backend, self.robot_clock)
        group = ReentrantCallbackGroup()
        given = param('fleet').value     # the fleet's own namespace: '/fleet_a' or '/fleet_a/'
        fleet = given.rstrip('/') + '/' if given else self.get_namespace()
        self.plan_client = SafeActionClient(self, PlanTask, fleet_name(fleet, PLAN_ACTION),
                                            callback_group=group)
        self._feedback_topic = fleet_name(fleet, PLAN_ACTION) + '/_action/feedback'
        self._serving: set[tuple[int, ...]] = set()   # the planner endpoints of the goal
        self._sent: tuple | None = None   # (future, planner endpoints, task, monotonic s when
                                          # sent, goal UUID bytes) not answered
        self._sent_lock = threading.Lock()    # the answer and a resend of one request
        # goals given up for unanswered: the planner may still accept one and stream a segment
        # before the cancel reaches it; its feedback is dropped (the last ABANDONED_KEPT)
        self._abandoned: OrderedDict[bytes, None] = OrderedDict()
        self._segment_done_topic = fleet_name(fleet, 'segment_done')
        self.done_pub = self.create_publisher(SegmentDone, self._segment_done_topic,
                                              reliable(ACTION_QUEUE_DEPTH))
        self.skills_pub = self.create_publisher(SkillExecution,
                                                fleet_name(fleet, 'skill_executions'),
                                                reliable(ACTION_QUEUE_DEPTH))
        self.records_pub = self.create_publisher(TaskRecord, fleet_name(fleet, 'task_records'),
                                                 reliable(RESULTS_DEPTH_SPARE))
        max_queued = int(param('max_queued_tasks').value)
        self.result_pub = self.create_publisher(PlanResult, 'plan_results',
                                                reliable(max_queued + RESULTS_DEPTH_SPARE))
        self.create_subscription(Task, 'task', self.task_callback,
                                 reliable(max_queued + RESULTS_DEPTH_SPARE),
                                 callback_group=group)
        self.tasks: TaskQueue[KeptTask] = TaskQueue(max_queued, rank=self._rank)
        self._queued_s = 0.0                # how long the active task waited in the queue
        self._segments: queue.Queue = queue.Queue()
        self._goal_handle = None
        self._unsent: KeptTask | None = None   # the active task, not sent yet
        self._goal_uuid = ''                    # hex UUID of the active task's goal
        self._sent_s = 0.0                      # when its goal was sent (node clock)
        self._runs: dict[int, convert.SegmentRun] = {}   # its executed segments, by index
        self._segment_msgs: list = []           # its received segments, in order (the plan
                                                # so far: their texts)
        self._lost_goals: list[KeptTask] = []   # a previous process's goals, to report
        self._journal_lock = threading.Lock()
        state_dir = param('state_dir').value or default_state_dir()
        self.journal = TaskJournal(journal_path(state_dir, self.get_fully_qualified_name()))
        self._leaving = threading.Lock()
        self._active_goal_id = ''                # the planner's id of the streaming goal
        self._aborted_goal = ''
        self._received: set[tuple[str, int, bool]] = set()   # segments of the current goal
        self._received_lock = threading.Lock()
        self.create_timer(PLANNER_WATCH_S, self.watch_planner, callback_group=group)
        self._worker = threading.Thread(target=self._execute_segments, daemon=True)
        self._worker.start()
        self.get_logger().info(f'{self.robot_id}: {self.profile.name} on the '
                               f'{param("backend").value} backend, one plan at a time, '
                               f'up to {self.tasks.max_waiting} tasks queued')
        self._take_up_journal()

    @staticmethod
    def _label(kept: KeptTask | None) -> str:
        if kept is None:
            return '-'
        request = kept.request
        text = request.task if len(request.task) <= 40 else request.task[:37] + '...'
        return f'{request.task_id} ({text!r})' if request.task_id else repr(text)

    def _rank(self, kept: KeptTask) -> int:
        """Queue rank of a task: urgent tasks wait ahead of the others."""
        urgency = kept.request.urgency or self.get_parameter('urgency').value
        return 0 if urgency == 'urgent' else 1

    def _save_journal(self) -> None:
        """Write the robot's tasks to the journal (after every change of the queue)."""
        with self._journal_lock:
            active, waiting = self.tasks.snapshot()
            if active is not None and self._goal_uuid:
                active = replace(active, goal_uuid=self._goal_uuid)
            try:
                self.journal.save(JournalState(active, tuple(waiting),
                                               tuple(self._lost_goals)))
            except OSError as err:
                self.get_logger().error(f'{self.robot_id}: cannot write the task journal '
                                        f'{self.journal.path}: {err}')

    def _take_up_journal(self) -> None:
        """Take up the tasks a previous process of this controller left in the journal."""
        try:
            state = self.journal.load()
        except JournalError as err:
            self.get_logger().error(f'{self.robot_id}: {err}; starting with no tasks')
            return
        if state.empty:
            return
        self._lost_goals = list(state.lost)
        first: list[KeptTask] = []
        if state.active is not None:
            (self._lost_goals if state.active.goal_uuid else first).append(state.active)
        limit_s = float(self.get_parameter('resume_within_s').value)
        taken = 0
        for kept in [*first, *state.waiting]:
            age_s = max(0.0, time.time() - kept.arrived_s)
            if age_s > limit_s:
                self._publish_result(kept.request.task_id, 'failed',
                                     f'not resumed after the controller restarted: it arrived '
                                     f'{age_s:.0f} s before, more than resume_within_s '
                                     f'({limit_s:g} s)')
                continue
            self._offer(kept, age_s)
            taken += 1
        self.get_logger().warning(
            f"{self.robot_id}: restarted: took up {taken} of the journal's tasks; "
            f'{len(self._lost_goals)} active goal(s) of the previous process go to the '
            'planner to be ended')
        self._save_journal()

    def _publish_result(self, task_id: str, outcome: str, error: str = '',  # type: ignore[no-untyped-def]
                        queued_s: float = 0.0, result=None, streamed: Sequence[str] = ()) -> None:
        self.result_pub.publish(convert.plan_result_to_msg(
            PlanResult, Time, stamp_s=self.robot_clock.now(), robot_id=self.robot_id,
            robot_kind=self.profile.name, task_id=task_id, outcome=outcome,
            queued_s=queued_s, error=error, result=result, streamed=streamed))

    def task_callback(self, msg: Task) -> None:
        """Start, queue or refuse a task (non-blocking: callbacks chain the rest)."""
        try:
            request = convert.task_from_msg(msg)
        except GoalError as err:
            task_id = msg.task_id if isinstance(msg.task_id, str) else ''
            self.get_logger().error(f'{self.robot_id}: refused an invalid task message'
                                    f'{f" (task {task_id})" if task_id else ""}: {err}')
            self._publish_result(task_id, 'refused', f'invalid task: {err}')
            return
        self._offer(KeptTask(request, time.time()))
        self._save_journal()

    def _offer(self, kept: KeptTask, waited_s: float = 0.0) -> None:
        """Start, queue or refuse a task that has waited ``waited_s`` already (one taken up
        from the journal)."""
        request = kept.request
        admission = self.tasks.offer(kept, time.monotonic() - waited_s)
        if admission.outcome == 'refused':
            reason = (f'task queue full ({admission.waiting} waiting, '
                      f'max_queued_tasks {self.tasks.max_waiting})')
            self.get_logger().warning(
                f'{self.robot_id}: busy with {self._label(self.tasks.active)}: refused task '
                f'{self._label(kept)}: {reason}')
            self._publish_result(request.task_id, 'refused', reason)
        elif admission.outcome == 'queued':
            self.get_logger().info(
                f'{self.robot_id}: busy with {self._label(self.tasks.active)}: task '
                f'{self._label(kept)} queued ({admission.position} of '
                f'{self.tasks.max_waiting})')
        else:
            self._start(kept, waited_s)

    def _start(self, kept: KeptTask | None, queued_s: float) -> None:
        """Send the plan goal of the active task. With no planner action server up the task
        waits, queue and all, and is sent when a planner is back (:meth:`watch_planner`)."""
        if kept is None:
            return
        self._queued_s = queued_s
        if not self.plan_client.server_is_ready():
            if self._unsent is not kept:
                self.get_logger().warning(f'{self.robot_id}: no planner action server: task '
                                          f'{self._label(kept)} waits for one')
            self._unsent = kept
            return
        self._unsent = None
        self._sent_s = self.robot_clock.now()
        goal = convert.goal_to_msg(self.robot_id, self.profile.name, kept.request,
                                   self.get_parameter('urgency').value, PlanTask.Goal,
                                   TimeUtility)
        goal_uuid = UUID(uuid=list(uuid.uuid4().bytes))
        future = self.plan_client.send_goal_async(goal, feedback_callback=self.feedback_callback,
                                                  goal_uuid=goal_uuid)
        self._sent = (future, self._planner_endpoints(), kept, time.monotonic(),
                      bytes(goal_uuid.uuid))
        future.add_done_callback(self.goal_response_callback)

    def watch_planner(self) -> None:
        """Send a waiting task once a planner is up; send a goal again that its planner did
        not answer (it left, or the request never reached it); end the active task when the
        planner left while serving it (killed, crashed, restarted: its goal is gone with it)."""
        ready = self.plan_client.server_is_ready()
        if self._lost_goals and ready:
            self._report_lost_goals()
        sent = self._sent
        if sent is not None:
            answer_within_s = self.get_parameter('answer_within_s').value
            if sent[1] and not (sent[1] & self._planner_endpoints()):
                # Sent to a planner that died before answering (a killed planner still looks
                # ready until its DDS lease ends): the request died with it.
                why = 'the planner left before answering'
            elif time.monotonic() - sent[3] > answer_within_s:
                # The planner is there, but the request or its answer was lost on the way
                # (rmw_cyclonedds drops a response its service has not matched a reader for
                # within 100 ms; a client's requests sent before the planner matched it can
                # go, README): waiting on would leave the robot idle for good.
                why = f'the planner did not answer within {answer_within_s:g} s'
            else:
                why = ''
            if why and self._give_up_answer(sent):
                self.get_logger().warning(f'{self.robot_id}: {why} for task '
                                          f'{self._label(sent[2])}: sending it again')
                self._start(sent[2], self._queued_s)
                return
        if self._unsent is not None and ready:
            self.get_logger().info(f'{self.robot_id}: a planner is up: sending task '
                                   f'{self._label(self._unsent)}')
            self._start(self._unsent, self._queued_s)
        elif self._goal_handle is not None and (not ready or self._serving_planner_gone()):
            self._planner_left(self._goal_handle)

    def _planner_endpoints(self) -> set[tuple[int, ...]]:
        """GIDs of the action's feedback publishers: one per planner process."""
        return {tuple(info.endpoint_gid)
                for info in self.get_publishers_info_by_topic(self._feedback_topic)}

    def _serving_planner_gone(self) -> bool:
        """Whether the planner process that accepted the active goal left the graph, even if
        another one serves the action now (a planner restarted within a DDS lease looks
        ready throughout, and the goal it held would wait for a result forever)."""
        return bool(self._serving) and not (self._serving & self._planner_endpoints())

    def _report_lost_goals(self) -> None:
        """Tell the planner which of its goals a previous process of this controller held
        (named by goal UUID): it ends them and publishes their results in its place. Waits
        for the planner's own ``segment_done`` subscription (a report to no one is lost)."""
        subscribers = self.get_subscriptions_info_by_topic(self._segment_done_topic)
        if not any(info.node_name == 'planner' for info in subscribers):
            return
        now = self.robot_clock.now()
        for kept in self._lost_goals:
            reason = (f'the controller of {self.robot_id} restarted while the task was '
                      'active: its process, and the plan it was executing, are gone')
            self.get_logger().warning(f'{self.robot_id}: task {self._label(kept)}: {reason}')
            self.done_pub.publish(convert.segment_done_to_msg(
                self.robot_id, LOST_GOAL_PREFIX + kept.goal_uuid, 0, now, now, False, reason,
                SegmentDone, Time))
        self._lost_goals = []
        self._save_journal()

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
        kept = self.tasks.active
        reason = 'the planner left while the task was active (its action server is gone)'
        self.get_logger().error(f'{self.robot_id}: task {self._label(kept)}: {reason}')
        with self._received_lock:
            segments = list(self._segment_msgs)
            runs = dict(self._runs)
        streamed = [segment.text for segment in segments]
        if kept is not None:    # the planner's record of the task went with it
            self.records_pub.publish(convert.robot_task_record_to_msg(
                self.robot_id, self.profile.name, kept.request,
                self.get_parameter('urgency').value, self._sent_s, segments, runs, reason,
                self.robot_clock.now(), TaskRecord, TimeUtility, Time))
        self._publish_result(kept.request.task_id if kept is not None else '', 'failed',
                             reason, self._queued_s, streamed=streamed)
        self._next()

    def _next(self) -> None:
        """The active task ended: start the next waiting one, if any."""
        self._goal_handle = None
        self._goal_uuid = ''
        started = self.tasks.finish(time.monotonic())
        self._save_journal()
        if started is not None:
            self.get_logger().info(
                f'{self.robot_id}: starting queued task {self._label(started.item)} after '
                f'{started.queued_s:.2f} s in the queue ({self.tasks.waiting} still waiting)')
            self._start(started.item, started.queued_s)

    def _give_up_answer(self, sent: tuple) -> bool:
        """Stop waiting for the answer to ``sent``, unless it was answered meanwhile."""
        with self._sent_lock:
            if self._sent is not sent:
                return False
            self._sent = None
            self._abandoned[sent[4]] = None
            while len(self._abandoned) > ABANDONED_KEPT:
                self._abandoned.popitem(last=False)
            return True

    def goal_response_callback(self, future) -> None:  # type: ignore[no-untyped-def]
        handle = future.result()
        with self._sent_lock:
            awaited = self._sent is not None and self._sent[0] is future
            if awaited:
                self._sent = None
        if not awaited:
            if handle.accepted:     # a request given up for lost was answered after all
                handle.cancel_goal_async()
            return
        kept = self.tasks.active
        task_id = kept.request.task_id if kept is not None else ''
        if not handle.accepted:
            reason = 'the planner rejected the goal (its reason is on plan_rejections)'
            self.get_logger().warning(f'{self.robot_id}: task {self._label(kept)}: {reason}')
            self._publish_result(task_id, 'rejected', reason, self._queued_s)
            self._next()
            return
        self._goal_handle = handle
        self._goal_uuid = bytes(handle.goal_id.uuid).hex()
        self._serving = self._planner_endpoints()
        self._aborted_goal = ''        # a new goal: its id may repeat an ended one's
        with self._received_lock:
            self._received.clear()
            self._segment_msgs.clear()
            self._runs.clear()
        self._save_journal()
        handle.get_result_async().add_done_callback(
            lambda result, handle=handle: self.result_callback(result, handle))

    def feedback_callback(self, feedback) -> None:  # type: ignore[no-untyped-def]
        if bytes(feedback.goal_id.uuid) in self._abandoned:
            return    # a goal sent again: its segments are not this robot's plan any more
        segment = feedback.feedback.segment
        key = (segment.goal_id, segment.index, convert.is_plan_end(segment))
        with self._received_lock:
            if key in self._received:
                return          # the planner sent it again (no report yet): already have it
            self._received.add(key)
            if not key[2]:
                self._segment_msgs.append(segment)
        self._active_goal_id = segment.goal_id
        self._segments.put(segment)

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
        kept = self.tasks.active
        result = response.result
        outcome = convert.outcome_of(response.status, result)
        line = (f'{self.robot_id}: task {self._label(kept)} {outcome}'
                f'{f": {result.error}" if result.error else ""} ({result.segment_count} '
                f'segments, response {result.response_time_s:.2f} s, utility '
                f'{result.utility:.2f})')
        # one call site per severity: rclpy raises "Logger severity cannot be changed between
        # calls" when one line logs at two severities (it killed a controller mid-run)
        if outcome == 'succeeded':
            self.get_logger().info(line)
        else:
            self.get_logger().warning(line)
        self._publish_result(kept.request.task_id if kept is not None else '', outcome,
                             queued_s=self._queued_s, result=result)
        self._next()

    def _execute_segments(self) -> None:
        while rclpy.ok():
            try:
                msg = self._segments.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg.goal_id == self._aborted_goal or convert.is_plan_end(msg):
                continue
            try:
                segment = convert.segment_from_msg(self.profile, msg)
            except TimelyError as err:
                now = self.robot_clock.now()
                self._abort(msg, msg.index, str(err), now, now)
                continue
            run = self.skill_executor.execute(segment)
            with self._received_lock:
                self._runs[run.index] = convert.SegmentRun(run.start_time, run.end_time,
                                                           run.success, run.error)
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
        """Backend failure: report it (the planner ends the goal as failed with this reason;
        a cancel here raced the report and turned a robot failure into "cancelled by the
        client") and drop the rest of the plan."""
        self.get_logger().error(f'{self.robot_id}: segment {index} failed: {error}')
        self._aborted_goal = msg.goal_id
        self.done_pub.publish(convert.segment_done_to_msg(
            self.robot_id, msg.goal_id, index, start, end, False, error, SegmentDone, Time))

    def destroy_node(self) -> None:
        _, waiting = self.tasks.snapshot()
        if waiting and self.context.ok():
            # stopped from inside (not Ctrl-C, which shuts the context down first): the queued
            # tasks end here, with their results
            reason = 'the controller shut down before the task started'
            self.get_logger().warning(f'{self.robot_id}: {reason}: {len(waiting)} queued '
                                      'tasks end failed')
            for kept in self.tasks.drain():
                self._publish_result(kept.request.task_id, 'failed', reason)
        elif waiting:   # nothing can be published any more: the next start takes them up
            print(f'{self.robot_id}: shutting down with {len(waiting)} queued tasks, kept in '
                  f'{self.journal.path} for the next start', flush=True)
        self._save_journal()
        self.robot.close()
        super().destroy_node()


def fleet_name(namespace: str, name: str) -> str:
    """The absolute name of a fleet-wide ``name`` for a controller in ``namespace``: in the
    namespace above the robot's (``'/fleet_a/drone_0'`` -> ``'/fleet_a/<name>'``, a robot at
    the root -> ``'/<name>'``), or in ``namespace`` itself when it ends with ``/`` (the
    ``fleet`` parameter: ``'/fleet_a/'``)."""
    parts = [p for p in namespace.split('/') if p]
    fleet = parts if namespace.endswith('/') and namespace != '/' else parts[:-1]
    return '/' + '/'.join([*fleet, name])


RESULTS_DEPTH_SPARE = 16
"""Depth of the task and result topics beyond ``max_queued_tasks``."""


def controller_parameters(robot_id: str, default_kind: str
                          ) -> tuple[tuple[str, object, ParameterDescriptor], ...]:
    """The controller's parameters, with their ranges; those that need a restart are
    read-only."""
    return (
        ('robot_id', robot_id, describe('the robot id goals carry (the planner expects the '
                                         "controller's namespace)", STR)),
        ('robot_kind', default_kind, describe('robot profile name (tello, indy7, ...)', STR)),
        ('backend', 'sim', describe(f'robot backend: {" | ".join(BACKENDS)}', STR)),
        ('address', '', describe('address of a real robot (empty: the default)', STR)),
        ('urgency', 'normal', describe(
            f'TUF class of tasks that name none: {" | ".join(TUF_CLASSES)}', STR,
            read_only=False)),
        ('profiles_dir', '', describe('folder of robot profile YAMLs (empty: the bundled '
                                      'ones)', STR)),
        ('max_queued_tasks', 8, describe('tasks a busy robot queues before refusing more',
                                         INT, integer=(0, 4096))),
        ('fleet', '', describe("namespace of the fleet's planner, e.g. /fleet_a (empty: the "
                               "namespace above the robot's)", STR)),
        ('state_dir', '', describe('folder of the task journal (empty: $ROS_HOME/timelyllm, '
                                   '~/.ros/timelyllm by default)', STR)),
        ('answer_within_s', ANSWER_WITHIN_S, describe(
            'a plan goal the planner has not answered this long after it was sent is sent '
            'again (an answer to the first that comes later cancels that goal)', FLOAT,
            floating=(0.1, 3600.0), read_only=False)),
        ('resume_within_s', 60.0, describe(
            "a restarted controller takes up the journal's tasks that arrived at most this "
            'long ago; older ones end failed', FLOAT, floating=(0.0, 86400.0))),
    )


def run(node_name: str, default_kind: str, args: list[str] | None = None) -> None:
    """Spin a controller node until shutdown (``default_kind``: the default of its
    ``robot_kind`` parameter; empty: the parameter must be set)."""
    rclpy.init(args=args)
    try:
        node = RobotControllerNode(node_name, default_kind)
    except (ParameterException, InvalidParameterValueException, TimelyError) as err:
        rclpy.logging.get_logger(node_name).fatal(f'the controller cannot start: {err}')
        rclpy.try_shutdown()
        raise SystemExit(1) from None
    spin_until_shutdown(node)


def main(args: list[str] | None = None) -> None:
    """The ``controller`` executable: a robot of any kind, named by ``robot_kind``."""
    run('controller', '', args)
