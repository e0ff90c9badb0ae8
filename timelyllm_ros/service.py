"""A live planner: the scheduler loop on a wall clock, in its own thread, fed by goals.

This is what the ROS planner node wraps (and what a non-ROS server could wrap): goals are
validated at once in the caller's thread (:meth:`PlannerService.submit` raises
:class:`~timelyllm_ros.errors.GoalError` with the reason), then handed to the loop thread
through an inbox, so callers never wait for an engine iteration. The loop thread owns the
scheduler: it drains the inbox (new goals, cancels, robot reports), ticks, and calls each
goal's listener with every segment the moment it is cut and once when the goal ends.

With the simulated engine the text of each plan comes from the trace set: the recorded plan
of the trace whose task line matches the goal, else a trace of the same robot kind and class.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from timelyllm_ros.clock import WallClock
from timelyllm_ros.engines import Engine, create_engine
from timelyllm_ros.errors import GoalError, ProfileError, TimelyError
from timelyllm_ros.policies import create_policy
from timelyllm_ros.profiles import RobotProfile, load_profile
from timelyllm_ros.request import Generation, Segment, TaskSpec, TaskStatus
from timelyllm_ros.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.tuf import Tuf, tuf_for_class

logger = logging.getLogger(__name__)

SegmentListener = Callable[[Generation, Segment], None]
EndListener = Callable[[Generation], None]


@dataclass(frozen=True, slots=True)
class PlanGoal:
    """A plan request as a robot sends it (the PlanTask action goal)."""

    robot_id: str
    robot_kind: str                 # robot profile name
    task: str
    urgency: str = 'normal'         # TUF class: normal | urgent | chatbot
    tuf: Tuf | None = None          # explicit TUF, overriding the class's
    wait_for_execution: bool = True  # end when executed (robot reports) or when generated


@dataclass(frozen=True, slots=True)
class ServiceState:
    """A snapshot of the scheduler for observability (times in s on the service clock)."""

    time: float = 0.0
    queued: int = 0
    running: int = 0
    last_batch_size: int = 0
    priorities: dict[str, float] = field(default_factory=dict)  # queued goal -> priority


@dataclass(frozen=True, slots=True)
class PlanScript:
    """What the simulated engine will answer for a goal."""

    task_type: str
    task_class: str
    pieces: tuple[str, ...]
    prompt_tokens: int
    task_tokens: int


def script_for(goal: PlanGoal, task_class: str) -> PlanScript:
    """The recorded plan the simulated engine replays for a goal.

    Raises:
        GoalError: the trace set has no plan for this robot kind.
    """
    from lrtrace.traces import approx_tokenize, load_trace_set

    traces = load_trace_set().traces
    exact = [t for t in traces if t.robot == goal.robot_kind and t.task == goal.task]
    candidates = exact or [t for t in traces if t.robot == goal.robot_kind
                           and t.task_class == task_class] or [
        t for t in traces if t.robot == goal.robot_kind]
    if not candidates:
        raise GoalError(f'the simulated engine has no recorded plan for robot kind '
                        f'{goal.robot_kind!r} (record traces with lrtrace first)')
    trace = candidates[zlib.crc32(goal.task.encode()) % len(candidates)]
    task_tokens = min(len(approx_tokenize(goal.task)) + 4, trace.prompt_tokens)
    return PlanScript(trace.task_type, trace.task_class, trace.pieces, trace.prompt_tokens,
                      task_tokens)


class PlannerService:
    """One scheduler + engine serving goals from many robots, live."""

    def __init__(self, scheduler: Scheduler, simulated_text: bool = True,
                 idle_wait_s: float = 0.05) -> None:
        self.scheduler = scheduler
        self.simulated_text = simulated_text
        self._idle_wait_s = idle_wait_s
        self._inbox: queue.Queue[tuple[str, tuple[object, ...]]] = queue.Queue()
        self._listeners: dict[str, tuple[SegmentListener, EndListener]] = {}
        self._untracked: set[str] = set()   # goals that end once generated
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = ServiceState()
        self.loop_error: str = ''

    @classmethod
    def create(cls, policy: str = 'timelyllm', engine: str = 'sim',
               calibration: str | None = None, max_batch: int | None = None,
               comm_s: float = 0.008, profiles_dir: str | None = None) -> PlannerService:
        """Build a service over a new engine (the simulator runs in real time)."""
        options: dict[str, object] = {'calibration': calibration}
        if engine == 'sim':
            options['realtime'] = True
        built: Engine = create_engine(engine, **options)

        def profiles(name: str) -> RobotProfile:
            return load_profile(name, profiles_dir)

        scheduler = Scheduler(create_policy(policy), built, WallClock(),
                              SchedulerConfig(comm_s=comm_s, max_batch=max_batch), profiles)
        return cls(scheduler, simulated_text=engine == 'sim')

    # -- callers' side (any thread) ----------------------------------------------------------
    def make_spec(self, goal: PlanGoal) -> TaskSpec:
        """Validate a goal and turn it into a task; raises GoalError with the reason."""
        if not goal.robot_id.strip():
            raise GoalError('the goal has no robot id')
        if not goal.task.strip():
            raise GoalError(f'{goal.robot_id}: the task text is empty')
        try:
            profile = self.scheduler.profile(goal.robot_kind)
        except ProfileError as err:
            raise GoalError(f'{goal.robot_id}: unknown robot kind {goal.robot_kind!r}: '
                            f'{err}') from None
        tuf = goal.tuf if goal.tuf is not None else tuf_for_class(goal.urgency)
        task_class = goal.urgency if profile.kind != 'arm' else 'arm'
        script = script_for(goal, task_class) if self.simulated_text else None
        task_id = f'{goal.robot_id}#{next(self._ids)}'
        return TaskSpec(
            task_id=task_id, robot_id=goal.robot_id, profile=profile.name,
            task_class=task_class, task_type=script.task_type if script else task_class,
            tuf=tuf, arrival_time=self.scheduler.clock.now(), task=goal.task,
            prompt_tokens=script.prompt_tokens if script else 1,
            task_tokens=script.task_tokens if script else 0,
            script=script.pieces if script else None)

    def submit(self, goal: PlanGoal, on_segment: SegmentListener, on_end: EndListener) -> str:
        """Queue a goal; returns its task id. Raises GoalError (or TufError) at once."""
        spec = self.make_spec(goal)
        self._inbox.put(('submit', (spec, on_segment, on_end, goal.wait_for_execution)))
        return spec.task_id

    def cancel(self, task_id: str) -> None:
        """Drop a goal's generation and free its memory (its end listener is called)."""
        self._inbox.put(('cancel', (task_id,)))

    def report_segment(self, task_id: str, index: int, start_time: float, end_time: float,
                       success: bool = True, error: str = '') -> None:
        """A robot's SegmentDone, in the service clock's seconds."""
        self._inbox.put(('report', (task_id, index, start_time, end_time, success, error)))

    def state(self) -> ServiceState:
        return self._state

    def now(self) -> float:
        return self.scheduler.clock.now()

    # -- the loop thread ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name='planner-loop', daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(('wake', ()))
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> PlannerService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run_once(self, block: bool = False) -> None:
        """One loop iteration: drain the inbox, then tick if there is work."""
        self._drain(block and not self.scheduler.has_work)
        if self.scheduler.has_work:
            out = self.scheduler.tick()
            for dispatch in out.dispatches:
                generation = self.scheduler.generations[dispatch.task_id]
                self._notify_segment(generation, dispatch.segment)
            for generation in out.ended:
                self._notify_end(generation)
            for task_id in [t for t in self._untracked if t in self.scheduler.generations]:
                generation = self.scheduler.generations[task_id]
                if generation.status >= TaskStatus.GENERATED:
                    self._notify_end(generation)
            self._state = self._snapshot(out.batch_size)
        else:
            self._state = self._snapshot(0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(block=True)
            except Exception as err:  # noqa: BLE001 - the loop must outlive one bad iteration
                logger.exception('planner loop iteration failed')
                self.loop_error = str(err)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else (
                self._inbox.get_nowait())
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, args: tuple[object, ...]) -> None:
        scheduler = self.scheduler
        if kind == 'submit':
            spec, on_segment, on_end, wait_for_execution = args
            assert isinstance(spec, TaskSpec)
            self._listeners[spec.task_id] = (on_segment, on_end)  # type: ignore[assignment]
            if not wait_for_execution:
                self._untracked.add(spec.task_id)
            try:
                generation = scheduler.submit(spec)
            except TimelyError as err:
                generation = Generation(spec=spec, seq=-1)
                generation.error = str(err)
                generation.status = TaskStatus.FAILED
                self._notify_end(generation)
                return
            if generation.status.terminal:
                self._notify_end(generation)
        elif kind == 'cancel':
            (task_id,) = args
            if task_id in scheduler.generations:
                self._notify_end(scheduler.cancel(str(task_id)))
        elif kind == 'report':
            task_id, index, start, end, success, error = args
            if task_id not in scheduler.generations:
                logger.warning('SegmentDone for unknown goal %s', task_id)
                return
            try:
                generation = scheduler.report_segment(str(task_id), int(index),  # type: ignore[arg-type]
                                                      float(start), float(end),  # type: ignore[arg-type]
                                                      bool(success), str(error))
            except GoalError as err:
                logger.warning('ignored SegmentDone: %s', err)
                return
            if generation.status.terminal:
                self._notify_end(generation)

    def _notify_segment(self, generation: Generation, segment: Segment) -> None:
        listeners = self._listeners.get(generation.task_id)
        if listeners is not None:
            listeners[0](generation, segment)

    def _notify_end(self, generation: Generation) -> None:
        listeners = self._listeners.pop(generation.task_id, None)
        self._untracked.discard(generation.task_id)
        if generation.task_id in self.scheduler.generations:
            self.scheduler.forget(generation.task_id)
        if listeners is not None:
            listeners[1](generation)

    def _snapshot(self, batch_size: int) -> ServiceState:
        scheduler = self.scheduler
        priorities: dict[str, float] = {}
        if len(scheduler.queue):
            view = scheduler.queue.view(scheduler.config.comm_s)
            values = np.asarray(scheduler.policy.priorities(view, scheduler.clock.now()))
            priorities = {scheduler.queue.at(i).task_id: float(v) for i, v in enumerate(values)}
        return ServiceState(time=scheduler.clock.now(), queued=len(scheduler.queue),
                            running=len(scheduler.engine.running), last_batch_size=batch_size,
                            priorities=priorities)
