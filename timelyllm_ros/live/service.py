"""A live planner: the scheduler loop on a wall clock, in its own thread, fed by goals.

This is what the ROS planner node wraps (and what a non-ROS server could wrap): goals are
validated at once in the caller's thread (:meth:`PlannerService.submit` raises
:class:`~timelyllm_ros.errors.GoalError` with the reason), then handed to the loop thread
through an inbox, so callers never wait for an engine iteration; what a goal's registration
can compute ahead (a real engine's plan grammar) the caller's thread computes before that
(:meth:`~timelyllm_ros.core.scheduler.Scheduler.prepare`), so that a burst of goals does not
stall the loop. The loop thread owns the scheduler: it drains the inbox (new goals, cancels,
robot reports), ticks, and calls each goal's listener with every segment the moment it is cut
and once when the goal ends: both come from the scheduler's one event stream
(:mod:`timelyllm_ros.core.events`), drained after every iteration, whatever ended the goal.

With an engine that replays recorded plans (the simulator: ``scripted_plans``), the engine
chooses each goal's plan (:meth:`~timelyllm_ros.engines.base.Engine.scripted_plan`) when the
goal is made a task; other engines generate it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from timelyllm_ros.core.clock import Clock, WallClock
from timelyllm_ros.core.events import Closed, Dispatch, Ended, Generated, SchedulerEvent
from timelyllm_ros.core.request import Generation, Segment, TaskSpec, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines import Engine, create_engine, engine_class
from timelyllm_ros.engines.base import PlanScript, ReplicaState
from timelyllm_ros.errors import (
    GoalError,
    ProfileError,
    RobotError,
    TimelyError,
    describe_error,
)
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.live import startup_heap
from timelyllm_ros.live.goals import PlanGoal, validate_goal
from timelyllm_ros.policies import FLEET_POLICY, create_policy
from timelyllm_ros.robots.kind import kind_of

logger = logging.getLogger(__name__)

SegmentListener = Callable[[Generation, Segment], None]
EndListener = Callable[[Generation], None]


__all__ = ['PlanGoal', 'PlannerService', 'ServiceState', 'closing_segment']


def closing_segment(generation: Generation, now: float) -> Segment:
    """The marker that closes a plan whose last segment was sent before its generation
    ended at ``now``: no text, no statements, the next index, ``is_last``. Robots execute
    nothing for it and report nothing; it is not one of the generation's segments."""
    return Segment(index=len(generation.segments), text='', statements=(), cut_time=now,
                   dispatch_time=now, estimated_exec_s=0.0, tokens=0, is_last=True)

ServiceStatus = Literal['idle', 'serving', 'failed', 'stopped']


@dataclass(slots=True)
class LoopLoad:
    """Whether the planner loop keeps up with its engine: over the iterations that ran the
    engine, their wall time and the engine's own part of it (its step: the model, or the
    simulator's sleep). What is left, the loop's own work (deciding, taking the tokens,
    publishing), is time the engine waits for the scheduler."""

    iterations: int = 0
    wall_s: float = 0.0
    engine_s: float = 0.0
    max_overhead_s: float = 0.0     # the longest an engine waited for one iteration

    def record(self, wall_s: float, engine_s: float) -> None:
        self.iterations += 1
        self.wall_s += wall_s
        self.engine_s += engine_s
        self.max_overhead_s = max(self.max_overhead_s, wall_s - engine_s)

    @property
    def engine_share(self) -> float:
        """The engine's share of the loop's wall time (1.0: it never waited; 0 before any
        iteration)."""
        return self.engine_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ServiceState:
    """A snapshot of the scheduler for observability (times in s on the service clock)."""

    time: float = 0.0
    queued: int = 0
    running: int = 0
    last_batch_size: int = 0
    priorities: dict[str, float] = field(default_factory=dict)  # queued goal -> priority
    executing: int = 0              # goals fully generated, waiting on their robots
    status: ServiceStatus = 'idle'  # 'failed': the loop gave up (see error); goals refused
    error: str = ''                 # why the service failed, or the last loop error
    engine_preemptions: int = 0     # generations the engine preempted on its own (vLLM)
    loop: LoopLoad = field(default_factory=LoopLoad)   # so far (a copy)
    replicas: tuple[ReplicaState, ...] = ()   # each replica of a pool engine (up, load)


class PlannerService:
    """One scheduler + engine serving goals from many robots, live.

    Every accepted goal ends, and its end listener is called exactly once: when its plan ran
    (or was generated, for goals that do not wait for execution), failed, was cancelled, its
    robot stopped reporting, or the service stopped. A listener that raises is logged and
    affects no other goal. After ``max_loop_failures`` consecutive loop failures the service
    fails every goal with the reason, refuses new ones and stops spinning (``state().status
    == 'failed'``).
    """

    def __init__(self, scheduler: Scheduler, idle_wait_s: float = 0.05,
                 max_loop_failures: int = 5) -> None:
        self.scheduler = scheduler
        self._idle_wait_s = idle_wait_s
        self.max_loop_failures = max_loop_failures
        self._inbox: queue.Queue[tuple[str, tuple[object, ...]]] = queue.Queue()
        self._listeners: dict[str, tuple[SegmentListener, EndListener]] = {}
        self._untracked: set[str] = set()   # goals that end once generated (Generated)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._accepting = threading.RLock()  # orders submits against the service's end
        self._preparing = threading.Lock()   # goals' threads prepare in turn (all at once
                                             # measured worse: README, goal_intake.py)
        self._thread: threading.Thread | None = None
        self._holds_heap = False       # holds the start-up heap frozen (startup_heap)
        self._state = ServiceState()   # the last snapshot taken
        self._last_batch_size = 0
        self._status: ServiceStatus = 'idle'
        self.loop_error: str = ''
        self.loop_failures = 0          # loop iterations that raised, in all
        self.loop_load = LoopLoad()

    @classmethod
    def create(cls, policy: str = FLEET_POLICY, engine: str = 'sim', model: str | None = None,
               engine_options: Mapping[str, object] | None = None,
               calibration: str | None = None, max_batch: int | None = None,
               comm_s: float = 0.008, profiles_dir: str | None = None,
               config: SchedulerConfig | None = None, grammar: bool = True,
               clock: Clock | None = None) -> PlannerService:
        """Build a service over a new engine, e.g. ``create(engine='cpu', model='smollm2')``,
        with the engine's wall-clock defaults (``Engine.live_options``: the simulator runs in
        real time).

        ``engine_options`` are the engine's own options (text values are converted); the
        simulator also takes ``calibration``. ``grammar`` constrains robot plans to their
        profile's grammar on a real engine (off: free generation, for comparison). ``config``
        overrides ``comm_s``, ``max_batch`` and ``grammar`` with every scheduler parameter
        (report deadlines included). ``clock`` is the service's time (default: monotonic wall
        time; the ROS planner passes its node's clock, so that its stamps follow ROS time).

        Raises:
            EngineError: an unknown engine, an option it does not take, or one it failed with.
            PolicyError: an unknown policy.
        """
        options = {**engine_class(engine).live_options, **(engine_options or {})}
        if calibration is not None:
            options['calibration'] = calibration
        built: Engine = create_engine(engine, model=model, **options)
        try:
            def profiles(name: str) -> RobotProfile:
                return load_profile(name, profiles_dir)

            config = config or SchedulerConfig(comm_s=comm_s, max_batch=max_batch,
                                               grammar=grammar)
            scheduler = Scheduler(create_policy(policy), built, clock or WallClock(), config,
                                  profiles)
        except Exception:
            built.close()
            raise
        return cls(scheduler)

    # -- callers' side (any thread) ----------------------------------------------------------
    def make_spec(self, goal: PlanGoal) -> TaskSpec:
        """Validate a goal and turn it into a task; raises GoalError with the reason (also
        when the service failed or stopped)."""
        self._check_serving()
        try:
            return self._make_spec(validate_goal(goal))
        except TimelyError:
            raise
        except Exception as err:  # noqa: BLE001 - a goal we cannot read is refused, not a crash
            raise GoalError(f'malformed goal: {describe_error(err, 120)}') from None

    def _make_spec(self, goal: PlanGoal) -> TaskSpec:
        try:
            profile = self.scheduler.profile(goal.robot_kind)
        except ProfileError as err:
            raise GoalError(f'unknown robot kind: {err}') from None
        try:
            task_class = kind_of(profile).task_class(goal.urgency)
        except RobotError as err:
            raise GoalError(f'robot kind {profile.name}: {err}') from None
        script: PlanScript | None = self.scheduler.engine.scripted_plan(
            goal.robot_kind, goal.task, task_class)
        task_id = f'{goal.robot_id}#{next(self._ids)}'
        if script is None:
            # A real engine tokenizes the prompt itself; the scheduler's estimates need its
            # size (about four characters a token), and the part after the kind's fixed
            # prefix (the examples chosen for the task, the task) is the goal's own.
            prompt = profile.build_prompt(goal.task)
            prompt_tokens = max(2, len(prompt) // 4)
            own = len(prompt) - len(profile.prompt_prefix)
            task_tokens = min(prompt_tokens - 1, max(1, own // 4))
        else:
            prompt_tokens, task_tokens = script.prompt_tokens, script.task_tokens
        return TaskSpec(
            task_id=task_id, robot_id=goal.robot_id, profile=profile.name,
            task_class=task_class, task_type=script.task_type if script else task_class,
            tuf=goal.resolved_tuf, arrival_time=self.scheduler.now(), task=goal.task,
            prompt_tokens=prompt_tokens, task_tokens=task_tokens,
            script=script.pieces if script else None)

    def submit(self, goal: PlanGoal, on_segment: SegmentListener, on_end: EndListener) -> str:
        """Queue a goal; returns its task id. Raises GoalError at once (invalid goal, or a
        service that failed or stopped). A real engine's plan grammar for the goal is
        compiled here, in the caller's thread (milliseconds; callers take turns), not on the
        loop."""
        spec = self.make_spec(goal)
        with self._preparing:
            self.scheduler.prepare(spec)       # here, in the goal's thread: not on the loop
        with self._accepting:
            self._check_serving()
            self._inbox.put(('submit', (spec, on_segment, on_end, goal.wait_for_execution)))
        return spec.task_id

    def _check_serving(self) -> None:
        if self._status in ('failed', 'stopped') or self._stop.is_set():
            status = self._status if self._status in ('failed', 'stopped') else 'stopping'
            raise GoalError(f'the planner is not serving ({status}): '
                            f'{self.loop_error or "stopped"}')

    def cancel(self, task_id: str) -> None:
        """Drop a goal's generation and free its memory (its end listener is called)."""
        self._inbox.put(('cancel', (task_id,)))

    def fail(self, task_id: str, reason: str) -> None:
        """End a goal as failed with the reason (its robot is gone); no-op once ended."""
        self._inbox.put(('fail', (task_id, reason)))

    def report_segment(self, task_id: str, index: int, start_time: float, end_time: float,
                       success: bool = True, error: str = '') -> None:
        """A robot's SegmentDone, in the service clock's seconds."""
        self._inbox.put(('report', (task_id, index, start_time, end_time, success, error)))

    def state(self, timeout_s: float = 1.0) -> ServiceState:
        """A snapshot of the scheduler, taken when asked (by the loop thread while it runs, so
        that it never reads the queue mid-change); the last one if the loop does not answer
        within ``timeout_s``."""
        thread = self._thread
        if thread is None or not thread.is_alive() or threading.current_thread() is thread:
            self._state = self._snapshot()
            return self._state
        reply: queue.Queue[ServiceState] = queue.Queue(maxsize=1)
        self._inbox.put(('state', (reply,)))
        try:
            return reply.get(timeout=timeout_s)
        except queue.Empty:
            return self._state

    def now(self) -> float:
        return self.scheduler.now()

    # -- the loop thread ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread (the engine and everything alive now are kept out of the
        garbage collector's scans while it serves: :mod:`~timelyllm_ros.live.startup_heap`)."""
        if self._thread is None and self._status != 'failed':
            self._status = 'serving'
            self._stop.clear()
            if not self._holds_heap:
                startup_heap.hold()
                self._holds_heap = True
            self._thread = threading.Thread(target=self._run, name='planner-loop', daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop; goals that have not ended end as FAILED ("the planner stopped") and
        new goals are refused from now on. Safe from any thread, a goal listener included:
        called on the loop thread, it returns at once and the loop closes the service when
        the current iteration is done."""
        self._stop.set()
        self._inbox.put(('wake', ()))
        thread = self._thread
        if thread is threading.current_thread():
            return                      # the loop closes the service on its way out
        self._thread = None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error('the planner loop did not stop within %.1f s', timeout_s)
                return
        self._close('stopped', 'the planner service stopped')

    def __enter__(self) -> PlannerService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run_once(self, block: bool = False) -> None:
        """One loop iteration: drain the inbox, tick if there is work (else expire overdue
        reports), then tell the listeners what the scheduler's events say."""
        scheduler = self.scheduler
        waits = block and not scheduler.has_work
        started = time.perf_counter()
        self._drain(waits)
        if waits:      # waiting for work is not the engine waiting for the loop
            started = time.perf_counter()
        if scheduler.has_work:
            out = scheduler.tick()
            self._last_batch_size = out.batch_size
            if out.batch_size:
                self.loop_load.record(time.perf_counter() - started, out.duration_s)
            events = out.events
        else:
            scheduler.expire_overdue()
            events = scheduler.drain_events()
        self._publish(events)

    def _publish(self, events: list[SchedulerEvent]) -> None:
        """Call each goal's listeners for the scheduler's events, in order."""
        scheduler = self.scheduler
        for event in events:
            if isinstance(event, Dispatch):
                generation = scheduler.generations.get(event.task_id)
                if generation is not None:
                    self._notify_segment(generation, event.segment)
            elif isinstance(event, Closed):
                self._notify_segment(event.generation,
                                     closing_segment(event.generation, scheduler.now()))
            elif isinstance(event, Ended) or (
                    isinstance(event, Generated) and event.generation.task_id in self._untracked):
                self._notify_end(event.generation)

    def _run(self) -> None:
        consecutive = 0
        while not self._stop.is_set():
            try:
                self.run_once(block=True)
                consecutive = 0
            except Exception as err:  # noqa: BLE001 - the loop must outlive one bad iteration
                consecutive += 1
                self.loop_failures += 1
                self.loop_error = describe_error(err)
                logger.exception('planner loop iteration failed (%d in a row)', consecutive)
                if consecutive >= self.max_loop_failures:
                    self._close('failed', f'the planner loop failed {consecutive} times in a '
                                          f'row: {self.loop_error}')
                    return
                self._stop.wait(min(self._idle_wait_s * 2 ** consecutive, 1.0))  # back off
        self._close('stopped', 'the planner service stopped')
        if self._thread is threading.current_thread():
            self._thread = None         # stopped from a listener: start() may start anew

    def _close(self, status: ServiceStatus, reason: str) -> None:
        """End every goal (in flight or still in the inbox) with ``reason``; refuse new ones.
        Only the first close counts (the loop and :meth:`stop` may both get here, and a
        listener called from here may stop the service again)."""
        with self._accepting:
            if self._status in ('failed', 'stopped'):
                return
            self._status = status
            if status == 'failed':
                self.loop_error = reason
                logger.error('%s; failing every goal', reason)
            if self._holds_heap:
                startup_heap.release()
                self._holds_heap = False
            self.scheduler.fail_all(reason)
            self._publish(self.scheduler.drain_events())
            while True:
                try:
                    kind, args = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == 'submit':
                    self._refuse(args[0], args[2], reason)  # type: ignore[arg-type]
                elif kind == 'state':
                    self._handle(kind, args)
        self._last_batch_size = 0
        self._state = self._snapshot()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else (
                self._inbox.get_nowait())
        except queue.Empty:
            return
        while True:
            self._handle_isolated(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_isolated(self, kind: str, args: tuple[object, ...]) -> None:
        """Handle one inbox item; whatever it raises concerns that item's goal only."""
        try:
            self._handle(kind, args)
        except Exception as err:  # noqa: BLE001 - one bad message must not stop the loop
            logger.exception('planner could not handle a %s message', kind)
            if kind == 'submit':
                spec = args[0]
                assert isinstance(spec, TaskSpec)
                generation = self.scheduler.generations.get(spec.task_id)
                reason = f'internal error while queueing the goal: {describe_error(err)}'
                if generation is not None:
                    self.scheduler.fail(spec.task_id, reason)   # an Ended event, if it runs
                else:
                    self._refuse(spec, args[2], reason)  # type: ignore[arg-type]

    def _handle(self, kind: str, args: tuple[object, ...]) -> None:
        scheduler = self.scheduler
        if kind == 'submit':
            spec, on_segment, on_end, wait_for_execution = args
            assert isinstance(spec, TaskSpec)
            self._listeners[spec.task_id] = (on_segment, on_end)  # type: ignore[assignment]
            if not wait_for_execution:
                self._untracked.add(spec.task_id)
            try:
                scheduler.submit(spec)
            except TimelyError as err:
                self._refuse(spec, on_end, str(err))  # type: ignore[arg-type]
        elif kind == 'cancel':
            (task_id,) = args
            if task_id in scheduler.generations:
                scheduler.cancel(str(task_id))
        elif kind == 'fail':
            task_id, reason = args
            if task_id in scheduler.generations:
                scheduler.fail(str(task_id), str(reason))
        elif kind == 'state':
            (reply,) = args
            assert isinstance(reply, queue.Queue)
            self._state = self._snapshot()
            reply.put_nowait(self._state)
        elif kind == 'report':
            task_id, index, start, end, success, error = args
            if task_id not in scheduler.generations:
                logger.warning('SegmentDone for unknown goal %s', task_id)
                return
            try:
                scheduler.report_segment(
                    str(task_id), int(index), float(start), float(end),  # type: ignore[call-overload, arg-type]
                    bool(success), str(error))
            except (GoalError, ValueError, TypeError, OverflowError) as err:
                logger.warning('ignored SegmentDone for %s: %s', task_id, err)

    def _refuse(self, spec: TaskSpec, on_end: EndListener, reason: str) -> None:
        """End a goal that never reached the scheduler."""
        generation = Generation(spec=spec, seq=-1)
        generation.error = reason
        generation.status = TaskStatus.FAILED
        generation.done_time = self.scheduler.now()
        self._listeners.pop(spec.task_id, None)
        self._untracked.discard(spec.task_id)
        self._call_listener(on_end, generation)

    def _notify_segment(self, generation: Generation, segment: Segment) -> None:
        listeners = self._listeners.get(generation.task_id)
        if listeners is not None:
            self._call_listener(listeners[0], generation, segment)

    def _notify_end(self, generation: Generation) -> None:
        listeners = self._listeners.pop(generation.task_id, None)
        self._untracked.discard(generation.task_id)
        if generation.task_id in self.scheduler.generations:
            self.scheduler.forget(generation.task_id)
        if listeners is not None:
            self._call_listener(listeners[1], generation)

    @staticmethod
    def _call_listener(listener: Callable[..., None], *args: object) -> None:
        try:
            listener(*args)
        except Exception:  # noqa: BLE001 - a caller's listener must not stop the planner
            logger.exception('a goal listener raised')

    def _snapshot(self) -> ServiceState:
        held = self.scheduler.snapshot()
        return ServiceState(time=held.time, queued=held.queued, running=held.running,
                            last_batch_size=self._last_batch_size,
                            priorities=held.priorities, executing=held.executing,
                            status=self._status, error=self.loop_error,
                            engine_preemptions=held.engine_preemptions,
                            loop=replace(self.loop_load),
                            replicas=self.scheduler.engine.replica_states())
