"""The TimelyLLM scheduler loop (paper 000 §3–§4): one decision, one engine step, per tick.

Each :meth:`Scheduler.tick` first decides (:meth:`Scheduler.schedule`, which returns the
tick's :class:`Decision`, as vLLM's scheduler returns a ``SchedulerOutput``), then executes:

1. ends the generations the policy kills and takes out of the batch those it preempts
   (optional policy hooks, see :mod:`timelyllm_ros.policies.base`);
2. refreshes the priority of every queued generation (initial and suspended) at the current
   time and admits the best ones while the policy's admission test allows (:meth:`decide`);
3. asks the policy for its decode mask, then runs one engine iteration over it;
4. feeds each new token piece to its generation's segmenter; when a segment is cut it is
   dispatched to the robot (streaming policies) and the generation is suspended with its
   token ids and KV kept (segmented policies), re-entering the queue with the time the robot
   will need its next segment as priority input; when a generation ends, its last segment is
   dispatched (or, for the ``vllm`` policy, the whole plan).

A cut generation is suspended once its next statement begins, not at the cut itself
(``SchedulerConfig.suspend_on_next_statement``, on by default): it decodes on through the
separators after its segment, so that a plan whose last segment was just cut ends there. At
the cut (the paper's mechanism) every plan was suspended once more only to be resumed for its
end of text: one admission and one resume per goal, a third of all admissions under overload
(``benchmarks/overload.py``, 1,000 robots).

Robots report each segment's real start/end through :meth:`Scheduler.report_segment`, which
replaces the estimate of when the next segment is needed. The scheduler is clock-agnostic:
the same loop runs on a :class:`~timelyllm_ros.core.clock.SimClock` (simulation) or a wall clock.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from timelyllm_ros.core.admission import (
    BATCH_MODES,
    AdmissionContext,
    BatchColumns,
    BatchMode,
    LostTally,
    ReplicaBatches,
    round_decode_steps,
)
from timelyllm_ros.core.clock import Clock
from timelyllm_ros.core.events import Closed, Dispatch, Ended, Generated, SchedulerEvent
from timelyllm_ros.core.plan_requests import ProfileCache, task_request
from timelyllm_ros.core.queue import GenerationQueue, best_rows
from timelyllm_ros.core.request import Generation, Segment, TaskSpec, TaskStatus
from timelyllm_ros.core.running import RunningBatch
from timelyllm_ros.engines.base import Engine, EngineRequest, EngineView, StepResult
from timelyllm_ros.errors import (
    ConfigError,
    EngineError,
    GoalError,
    ProfileError,
    describe_error,
)
from timelyllm_ros.language.execution import estimate_max_s, estimate_min_s
from timelyllm_ros.language.plan import Statement
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import Cut, Segmenter
from timelyllm_ros.policies.base import Eviction, Policy

logger = logging.getLogger(__name__)

MISSED_REPORT = 'robot did not report segment'
"""Start of the error of a goal ended because its robot missed a report deadline (the
robot, or its controller, may be gone)."""

NO_SKILL_ERROR = 'no executable skill in the LLM output'


_FIRST_CANDIDATES = 16
"""Candidates a decision reads from the queue first (:meth:`Scheduler.decide`)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Run-wide scheduling parameters."""

    comm_s: float = 0.008            # one-way network latency to the robots (s), paper §7.2
    max_batch: int | None = None     # fixed batch cap (Fig. 7); None = the engine's limit
    batch_mode: BatchMode = 'latency-guided'   # 'fixed': admission by batch cap and memory
                                               # only (the paper's §7.3.1 sweeps, the artifact)
    step_smoothing: float = 0.5      # weight of the newest decode step in the speed estimate
    report_timeout_factor: float = 3.0   # a robot may take this many times a segment's
                                         # longest execution estimate before it is overdue
    report_timeout_margin_s: float = 10.0  # ... plus this margin (s)
    report_deadlines: bool = True    # end goals whose robot stops reporting (SegmentDone)
    report_clock_tolerance_s: float = 2.0  # how far a robot's report times may lie before its
                                           # segment's dispatch or after the planner's now
    grammar: bool = True             # constrain robot plans to their profile's grammar, on
                                     # engines with the 'grammar' capability
    suspend_on_next_statement: bool = True   # a cut generation leaves the batch once its next
                                     # statement begins (the separators after a cut and the
                                     # plan's end are decoded first), not at the cut itself
    record_decisions: bool = False   # keep each decision's CPU time and admission count
                                     # (benchmarks read them); off, a planner that serves for
                                     # days keeps nothing per decision

    def __post_init__(self) -> None:
        for name in ('comm_s', 'report_timeout_margin_s', 'report_clock_tolerance_s'):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f'{name} must be a finite number >= 0, got {value}')
        if not math.isfinite(self.report_timeout_factor) or self.report_timeout_factor < 1:
            raise ConfigError(f'report_timeout_factor must be finite and >= 1, '
                             f'got {self.report_timeout_factor}')
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f'max_batch must be >= 1, got {self.max_batch}')
        if self.batch_mode not in BATCH_MODES:
            raise ConfigError(f'batch_mode must be one of {", ".join(BATCH_MODES)}, got '
                              f'{self.batch_mode!r}')
        if not 0 < self.step_smoothing <= 1:
            raise ConfigError(f'step_smoothing must be in (0, 1], got {self.step_smoothing}')


@dataclass(frozen=True, slots=True)
class Decision:
    """What one tick decided before its engine iteration (task ids)."""

    time: float                                      # s on the scheduler clock
    killed: tuple[str, ...] = ()                     # ended by the policy (TimeBill's Kill)
    preempted: Mapping[str, Eviction] = field(default_factory=dict)  # out of the batch: KV
    admitted: tuple[str, ...] = ()                   # joined the batch
    refused: tuple[str, ...] = ()                    # could not start: ended as FAILED
    decode_mask: frozenset[str] | None = None        # decode only these (None: all running)


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """What the scheduler holds at one time (s on its clock), read without changing it."""

    time: float
    queued: int                       # goals waiting for the engine (initial or suspended)
    running: int                      # generations in the engine's batch
    executing: int                    # goals fully generated, waiting on their robots
    priorities: dict[str, float]      # queued goal -> the policy's priority now
    engine_preemptions: int           # generations the engine preempted on its own (vLLM)


@dataclass(slots=True)
class TickResult:
    """What one tick did, and the events drained at its end (all since the last drain, in
    order: those of robot reports or cancels handled before the tick come first)."""

    duration_s: float = 0.0                                        # engine iteration time (s)
    batch_size: int = 0                                            # generations in it
    prefill_tokens: int = 0                                        # tokens it prefilled
    cached_tokens: int = 0                                         # prompt tokens it reused
    events: list[SchedulerEvent] = field(default_factory=list)     # see timelyllm_ros.core.events
    decision: Decision | None = None                               # what the tick decided

    @property
    def dispatches(self) -> list[Dispatch]:
        """The segments to send now."""
        return [e for e in self.events if isinstance(e, Dispatch)]

    @property
    def ended(self) -> list[Generation]:
        """The goals that reached a terminal status."""
        return [e.generation for e in self.events if isinstance(e, Ended)]

    @property
    def closed(self) -> list[Generation]:
        """The plans that ended after their last segment had been dispatched."""
        return [e.generation for e in self.events if isinstance(e, Closed)]


class Scheduler:
    """Owns the queue and the generations; the engine owns tokens and KV memory.

    Faults stay with the goal they concern: an exception while handling one generation's
    output (segmenter, dispatch, engine pause) ends that goal as FAILED with the reason and
    the tick goes on with the others; an engine call that fails leaves the scheduler's state
    as it was before the call and fails the goals it concerned. Every generated goal ends:
    a robot that does not report a dispatched segment within its deadline (see
    :class:`SchedulerConfig`) ends its goal as FAILED.

    Whatever it does that a robot or a goal's owner must hear of (a dispatch, a closed plan,
    a complete generation, an ended goal) is an event in one buffer, whichever call caused
    it; drivers drain it (:meth:`drain_events`, or a tick's ``events``).
    """

    def __init__(
        self,
        policy: Policy,
        engine: Engine,
        clock: Clock,
        config: SchedulerConfig | None = None,
        profiles: Callable[[str], RobotProfile] = load_profile,
    ) -> None:
        """``profiles`` loads a robot profile by name (each is asked once: a
        :class:`~timelyllm_ros.core.plan_requests.ProfileCache` is used as it is)."""
        self.policy = policy
        self.engine = engine
        self.engine_view = EngineView(engine)   # all that policies see of the engine
        self.clock = clock
        self.config = config or SchedulerConfig()
        self.profiles = profiles if isinstance(profiles, ProfileCache) else ProfileCache(profiles)
        self.queue = GenerationQueue()
        policy.attach(self.engine_view, self._cap)
        # a policy that does not observe steps is not handed each step's context
        self._tells_steps = getattr(policy.on_step, '__func__', None) is not Policy.on_step
        self.generations: dict[str, Generation] = {}
        self._segmenters: dict[str, Segmenter] = {}
        # l_max read from the profiles, not through a method of the scheduler: the batch is
        # the scheduler's own, and a bound method would make a reference cycle
        profiles = self.profiles
        self._running = RunningBatch(
            lambda generation: profiles(generation.spec.profile).max_segment_tokens)
        # cut, still running until their next statement begins (in the order of their cuts)
        self._between: dict[str, None] = {}
        self._deadlines: list[tuple[float, int, str, int]] = []  # (due, seq, task, segment)
        self._deadline_seq = 0
        self._events: list[SchedulerEvent] = []   # not yet drained, in order
        self._seq = 0
        self.recent_step_s: float | None = None
        # longest segment cut so far per (robot profile, first segment or later), in tokens
        self._longest_segment: dict[tuple[str, bool], int] = {}
        self.ticks = 0
        self.decision_s = 0.0        # wall time spent deciding (policy hooks and admission)
        # with config.record_decisions, the CPU time of each decision (this thread's), for its
        # distribution (a busy machine stretches wall time, not this), and what it admitted
        self.decision_cpu_s: array[float] = array('d')
        self.decision_admissions: array[int] = array('l')

    # -- requests ---------------------------------------------------------------------------
    def prepare(self, spec: TaskSpec) -> None:
        """Do ahead, in the caller's thread, what :meth:`submit` of this goal will compute
        beside the loop's work: its engine request is built and the engine prepares it
        (:meth:`~timelyllm_ros.engines.base.Engine.prepare_request`: a real engine compiles
        the plan grammar, milliseconds for each new scene), so that submitting it on the loop
        finds that done. Safe while the loop runs (it reads the profiles and the engine's
        caches only); a goal it cannot prepare is left for :meth:`submit` to refuse."""
        try:
            self.engine.prepare_request(self._request(self.profile(spec.profile), spec))
        except Exception as err:  # noqa: BLE001 - submit refuses the goal with its reason
            logger.debug('could not prepare %s ahead: %s', spec.task_id, err)

    def submit(self, spec: TaskSpec) -> Generation:
        """Queue a new plan request.

        Raises:
            GoalError: empty task, duplicate id, non-positive prompt length, unknown robot kind.
            EngineError: the engine refused the request (nothing was queued).
        """
        if not spec.task.strip():
            raise GoalError(f'task {spec.task_id!r}: the task text is empty')
        if spec.task_id in self.generations:
            raise GoalError(f'task {spec.task_id!r} was already submitted')
        if spec.prompt_tokens <= 0 or not 0 <= spec.task_tokens <= spec.prompt_tokens:
            raise GoalError(f'task {spec.task_id!r}: need prompt_tokens > 0 and '
                            f'0 <= task_tokens <= prompt_tokens')
        try:
            profile = self.profile(spec.profile)
        except ProfileError as err:
            raise GoalError(f'task {spec.task_id!r}: unknown robot kind: {err}') from None
        request = self._request(profile, spec)
        try:
            self.engine.register(request)
        except Exception as err:  # noqa: BLE001 - any engine fault refuses only this goal
            raise EngineError(f'task {spec.task_id!r}: the engine refused it: '
                              f'{describe_error(err)}') from err
        generation = Generation(spec=spec, seq=self._seq, need_time=spec.arrival_time)
        self._seq += 1
        self.generations[spec.task_id] = generation
        self._segmenters[spec.task_id] = Segmenter(profile)
        self.queue.push(generation, profile.segment_generation_s)
        self.policy.on_submit(generation, self.clock.now())
        return generation

    def _request(self, profile: RobotProfile, spec: TaskSpec) -> EngineRequest:
        """The goal's engine request, its plan grammar where the scheduler and engine use
        one."""
        return task_request(profile, spec,
                            grammar=self.config.grammar and self.engine.supports('grammar'))

    def cancel(self, task_id: str, reason: str = 'cancelled by the client') -> Generation:
        """Drop a task's generation and free its memory (goal cancel)."""
        generation = self._get(task_id)
        if not generation.status.terminal:
            self._end(generation, TaskStatus.CANCELLED, reason)
        return generation

    def fail(self, task_id: str, reason: str) -> Generation:
        """End a task as FAILED with ``reason`` and free its memory (no-op once ended)."""
        generation = self._get(task_id)
        if not generation.status.terminal:
            self._end(generation, TaskStatus.FAILED, reason)
        return generation

    def report_segment(self, task_id: str, index: int, start_time: float, end_time: float,
                       success: bool = True, error: str = '') -> Generation:
        """A robot reports a segment's real execution (SegmentDone).

        The times must be possible on the planner's clock, within
        ``report_clock_tolerance_s``: not before the segment was dispatched, not after now,
        and the end not before the start. A robot on another clock (wall time beside a
        planner on sim time) would otherwise move the goal's report deadline anywhere; such a
        report is refused and the goal keeps the deadline it had. A failure report ends the
        goal as FAILED with the robot's reason whatever its times (impossible ones are not
        kept): a robot that failed must not be left waiting for a deadline.

        Raises:
            GoalError: unknown task or segment index, or a success report whose times are not
                finite or not possible (nothing is changed).
        """
        generation = self._get(task_id)
        if not 0 <= index < len(generation.segments):
            raise GoalError(f'task {task_id!r} has no dispatched segment {index}')
        segment = generation.segments[index]
        problem = self._report_time_problem(segment, start_time, end_time)
        if problem is not None and success:
            raise GoalError(f'task {task_id!r} segment {index}: {problem}')
        if problem is None:
            segment.start_time, segment.end_time = start_time, end_time
        segment.success, segment.error = success, error
        if generation.status.terminal:
            return generation
        if not success:
            self._end(generation, TaskStatus.FAILED, f'robot failed segment {index}: {error}')
            return generation
        if index == len(generation.segments) - 1 and generation.status < TaskStatus.GENERATED:
            # The next segment is needed when this one really ended, not when we guessed.
            generation.need_time = end_time
            self._running.refresh(generation)
            if task_id in self.queue:
                self.queue.remove(task_id)
                self.queue.push(generation, self._profile(generation).segment_generation_s)
        self._arm_deadline(generation)
        self._maybe_finished(generation)
        return generation

    def _report_time_problem(self, segment: Segment, start_time: float, end_time: float
                             ) -> str | None:
        """Why a robot's reported execution times cannot be true, or None."""
        if not (math.isfinite(start_time) and math.isfinite(end_time)):
            return f'start and end times must be finite, got {start_time} and {end_time}'
        tolerance = self.config.report_clock_tolerance_s
        if end_time < start_time:
            return f'ends ({end_time:.3f} s) before it starts ({start_time:.3f} s)'
        if start_time < segment.dispatch_time - tolerance:
            return (f'starts at {start_time:.3f} s, before it was dispatched at '
                    f'{segment.dispatch_time:.3f} s (clock tolerance {tolerance} s): is the '
                    f'robot on another clock?')
        now = self.clock.now()
        if end_time > now + tolerance:
            return (f"ends at {end_time:.3f} s, after the planner's now {now:.3f} s (clock "
                    f'tolerance {tolerance} s): is the robot on another clock?')
        return None

    def forget(self, task_id: str) -> Generation:
        """Drop the record of a task that ended or is fully generated (long-running services
        call this once they reported it; later robot reports for it are then refused).

        Raises:
            GoalError: unknown task, or a task still generating.
        """
        generation = self._get(task_id)
        if generation.status < TaskStatus.GENERATED:
            raise GoalError(f'task {task_id!r} has not ended ({generation.status.name})')
        del self.generations[task_id]
        self._segmenters.pop(task_id, None)
        return generation

    def expire_overdue(self) -> list[Generation]:
        """End the goals whose robot did not report a dispatched segment in time.

        A segment's deadline runs from when its robot could start it (dispatch + network,
        or the previous segment's reported end) for ``report_timeout_factor`` times its
        longest execution estimate plus ``report_timeout_margin_s``. Returns the goals ended
        (each is also an :class:`~timelyllm_ros.core.events.Ended` event).
        """
        ended: list[Generation] = []
        now = self.clock.now()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, task_id, index = heapq.heappop(self._deadlines)
            generation = self.generations.get(task_id)
            if (generation is None or generation.status.terminal
                    or index >= len(generation.segments)
                    or not math.isnan(generation.segments[index].end_time)):
                continue                    # reported (or ended) since the deadline was set
            self._end(generation, TaskStatus.FAILED, f'{MISSED_REPORT} {index} in time')
            ended.append(generation)
        return ended

    def fail_all(self, reason: str) -> list[Generation]:
        """End every goal that has not ended (the service gives up); returns them (each is
        also an :class:`~timelyllm_ros.core.events.Ended` event)."""
        ended = [g for g in self.generations.values() if not g.status.terminal]
        for generation in ended:
            self._end(generation, TaskStatus.FAILED, reason)
        return ended

    def invariant_violations(self) -> list[str]:
        """Where the bookkeeping disagrees with itself (empty when consistent): every goal
        that is generating is in exactly one of the queue and the running batch, ended and
        generated ones in neither. Tests and fault campaigns check it after every tick."""
        problems: list[str] = []
        for task_id, generation in self.generations.items():
            queued, running = task_id in self.queue, task_id in self._running
            status = generation.status
            if status == TaskStatus.RUNNING and (queued or not running):
                problems.append(f'{task_id}: RUNNING but queued={queued} running={running}')
            elif status in (TaskStatus.WAITING, TaskStatus.SUSPENDED) and (
                    running or not queued):
                problems.append(f'{task_id}: {status.name} but queued={queued} '
                                f'running={running}')
            elif status >= TaskStatus.GENERATED and (queued or running):
                problems.append(f'{task_id}: {status.name} but queued={queued} '
                                f'running={running}')
        for task_id in self._running:
            if task_id not in self.generations:
                problems.append(f'{task_id}: running but unknown')
        for task_id in self._between:
            if task_id not in self._running:
                problems.append(f'{task_id}: between statements but not running')
        problems.extend(self._running.column_errors())
        return problems

    def now(self) -> float:
        """The scheduler's time (s on its clock)."""
        return self.clock.now()

    def snapshot(self) -> SchedulerSnapshot:
        """The queue, batch and priorities now; a policy's ranking is read, never advanced
        (:meth:`~timelyllm_ros.policies.base.Policy.priorities` changes no state)."""
        now = self.clock.now()
        priorities: dict[str, float] = {}
        if len(self.queue):
            view = self.queue.view(self.config.comm_s)
            values = np.asarray(self.policy.priorities(view, now), dtype=float)
            priorities = dict(zip(view.task_ids, values.tolist(), strict=True))
        executing = sum(1 for g in self.generations.values()
                        if g.status == TaskStatus.GENERATED)
        return SchedulerSnapshot(time=now, queued=len(self.queue),
                                 running=len(self.engine.running), executing=executing,
                                 priorities=priorities,
                                 engine_preemptions=self.engine.stats().preemptions)

    # -- the loop ---------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Whether anything is queued or generating."""
        return bool(self.queue) or bool(self._running)

    @property
    def next_deadline(self) -> float | None:
        """The earliest pending report deadline (s on the clock), or None; it may belong to a
        segment reported since, which :meth:`expire_overdue` then skips."""
        return self._deadlines[0][0] if self._deadlines else None

    def schedule(self, ctx: AdmissionContext | None = None) -> Decision:
        """Decide this tick: the policy's kills and preemptions, admission, the decode mask.

        One admission context serves the whole decision (its running generations are a live
        view of the batch). Goals that end here are events, as always.
        """
        ctx = ctx if ctx is not None else self._context(self.clock.now())
        killed, preempted = self._steer(ctx)
        refused_from = len(self._events)
        admitted = self.decide(ctx)
        refused = tuple(e.generation.task_id for e in self._events[refused_from:]
                        if isinstance(e, Ended))
        mask = self.policy.decode_mask(ctx) if self._running else None
        return Decision(time=ctx.now, killed=killed, preempted=preempted,
                        admitted=tuple(g.task_id for g in admitted), refused=refused,
                        decode_mask=frozenset(mask) if mask is not None else None)

    def decide(self, ctx: AdmissionContext | None = None) -> list[Generation]:
        """Refresh priorities, then admit the best queued generations while allowed.

        A candidate the engine fails to start (any exception) or that cannot fit even in an
        idle engine ends as FAILED (an :class:`~timelyllm_ros.core.events.Ended` event); the
        scheduler changes its state only once the engine accepted the generation.
        """
        admitted: list[Generation] = []
        n = len(self.queue)
        if n == 0:
            return admitted
        ctx = ctx if ctx is not None else self._context(self.clock.now())
        now = ctx.now
        cap = self._cap
        if len(self._running) >= cap:
            return admitted
        view = self.queue.view(self.config.comm_s)
        ranking, leading = self.policy.ranked(view, now)
        priorities = np.array(ranking, dtype=float)
        tally = LostTally(view, now, lambda: len(self.queue))
        ctx = replace(ctx, ranked=view, lost_tally=tally, batch_columns=BatchColumns(),
                      decode_steps=round_decode_steps(ctx.engine),
                      replica_batches=ReplicaBatches())
        seq = view.seq
        candidates: list[Generation] = []
        chunk = _FIRST_CANDIDATES
        while n > 0 and len(self._running) < cap:
            if not candidates:
                # The best rows for the free slots, best last (popped): a partial sort, not
                # a scan of the whole queue per admission. Most rounds end after a few
                # admissions, so the first read is short and each next one twice as long.
                take = min(cap - len(self._running), chunk)
                chunk *= 2
                if leading is not None and len(leading) >= take:   # the first read only: the
                    rows = leading[:take]           # rows move as the queue swap-removes
                else:
                    rows = best_rows(priorities[:n], seq[:n], take)
                leading = None
                candidates = [self.queue.at(int(r)) for r in rows[::-1]]
            candidate = candidates.pop()
            row = self.queue.row_of(candidate.task_id)
            try:
                admit = self.policy.admit(candidate, ctx)   # may ask the engine (can_run)
                fits_alone = admit or bool(self._running) or self.engine.fits_when_idle(
                    candidate.task_id)
                if admit:
                    self.engine.run(candidate.task_id)
            except Exception as err:  # noqa: BLE001 - the engine fault ends this goal only
                logger.error('engine failed to start %s: %s', candidate.task_id, err)
                tally.taken(candidate)
                self._end(candidate, TaskStatus.FAILED,
                          f'engine failure: could not start the generation: {describe_error(err)}')
                n -= 1
                priorities[row] = priorities[n]   # the queue moved its last row into this one
                continue
            if not admit:
                if fits_alone:
                    if self.engine.place_elsewhere(candidate.task_id):
                        candidates.append(candidate)    # asked again on another replica
                        continue
                    break                   # it waits for memory to free up
                n -= 1
                priorities[row] = priorities[n]
                tally.taken(candidate)
                if candidate.segments:
                    # Its robot already runs the plan: end the plan with what was sent, as
                    # at the context limit, rather than fail a goal that is under way.
                    logger.warning('%s no longer fits in the engine KV memory; its plan ends '
                                   'after segment %d', candidate.task_id,
                                   len(candidate.segments) - 1)
                    self.queue.remove(candidate.task_id)
                    self._on_finish(candidate, 'length', now)
                else:
                    self._end(candidate, TaskStatus.FAILED,
                              'the prompt does not fit in the engine KV memory')
                continue
            self.queue.remove(candidate.task_id)
            tally.taken(candidate)
            n -= 1
            priorities[row] = priorities[n]
            candidate.status = TaskStatus.RUNNING
            if self.engine.supports('compress_kv') and candidate.tokens == 0:
                self._compress(candidate, ctx)   # asked with the batch it joins, before it joins
            self._running[candidate.task_id] = candidate
            admitted.append(candidate)
        return admitted

    def _compress(self, candidate: Generation, ctx: AdmissionContext) -> None:
        """Hand the engine the share of the prompt's KV the policy evicts (TimeBill's α)."""
        ratio = self.policy.kv_evict_ratio(candidate, ctx)
        if ratio:
            try:
                self.engine.compress_kv(candidate.task_id, ratio)
            except Exception as err:  # noqa: BLE001 - the full KV is kept
                logger.warning('KV compression of %s failed, kept the full KV: %s',
                               candidate.task_id, err)

    def tick(self) -> TickResult:
        """One decision and one engine iteration; returns what it did with the events drained
        at its end (segments to send, goals ended)."""
        self.ticks += 1
        out = TickResult()
        self._iterate(out)
        out.events = self.drain_events()
        return out

    def drain_events(self) -> list[SchedulerEvent]:
        """The events since the last drain, in order (the buffer is emptied)."""
        events, self._events = self._events, []
        return events

    def _iterate(self, out: TickResult) -> None:
        self.expire_overdue()
        started, started_cpu = time.perf_counter(), time.thread_time()
        ctx = self._context(self.clock.now())
        decision = out.decision = self.schedule(ctx)
        cpu_s = time.thread_time() - started_cpu
        self.decision_s += time.perf_counter() - started
        if self.config.record_decisions:
            self.decision_cpu_s.append(cpu_s)
            self.decision_admissions.append(len(decision.admitted))
        if not self._running:
            return
        try:
            result = self.engine.step(decision.decode_mask)
        except Exception as err:  # noqa: BLE001 - the iteration's generations fail, not the loop
            logger.error('engine step failed: %s', err)
            for generation in list(self._running.values()):
                self._end(generation, TaskStatus.FAILED, f'engine failure: {describe_error(err)}')
            return
        self.clock.elapse(result.duration_s)
        out.duration_s, out.batch_size = result.duration_s, result.batch_size
        out.prefill_tokens, out.cached_tokens = result.prefill_tokens, result.prefix_cached_tokens
        self._note_speed(result)
        now = self.clock.now()
        if self._tells_steps:
            stepped = [self._running[r] for r in dict.fromkeys((*result.text, *result.finished))
                       if r in self._running]   # once each, even with a token and a finish
            self.policy.on_step(result, stepped, replace(ctx, now=now))
        for task_id, piece in result.text.items():
            producing = self._running.get(task_id)
            if producing is not None:
                self._isolated(producing, self._on_token, producing, piece,
                               result.produced(task_id), now)
        for task_id, reason in result.finished.items():
            finishing = self.generations.get(task_id)
            if finishing is not None and not finishing.status.terminal:
                self._isolated(finishing, self._on_finish, finishing, reason, now)
        for task_id in result.preempted:
            preempted = self._running.pop(task_id, None)
            if preempted is not None:
                self._requeue_preempted(preempted)
        for task_id, why in result.failed.items():
            failing = self.generations.get(task_id)
            if failing is not None and not failing.status.terminal:
                self._end(failing, TaskStatus.FAILED, f'engine failure: {why}')
        masked = decision.decode_mask
        for task_id in list(self._between):     # all running: every way out removes them
            if ((masked is not None and task_id not in masked)
                    or not self._segmenters[task_id].between_statements):
                # its next statement began (or the policy does not let it decode)
                between = self._running[task_id]
                self._isolated(between, self._suspend, between, now)

    def _isolated(self, generation: Generation, handler: Callable[..., None],
                  *args: object) -> None:
        """Run one generation's handler; whatever it raises ends that goal only."""
        try:
            handler(*args)
        except Exception as err:  # noqa: BLE001 - one goal's fault must not touch the others
            logger.exception('handling the output of %s failed', generation.task_id)
            if not generation.status.terminal:
                self._end(generation, TaskStatus.FAILED,
                          f'internal error while handling its output: {describe_error(err)}')

    def _on_token(self, generation: Generation, piece: str, produced: int, now: float) -> None:
        generation.tokens += produced
        generation.segment_tokens += produced
        generation.pieces.append(piece)
        cut = self._segmenters[generation.task_id].feed(piece)
        if cut is not None:
            self._on_cut(generation, cut, now)

    def _steer(self, ctx: AdmissionContext) -> tuple[tuple[str, ...], dict[str, Eviction]]:
        """Apply the policy's kills and preemptions before this tick's admission; returns the
        goals killed and the generations preempted."""
        killed: list[str] = []
        for task_id, reason in self.policy.overruns(ctx).items():
            generation = self.generations.get(task_id)
            if generation is not None and generation.status < TaskStatus.GENERATED:
                self._end(generation, TaskStatus.KILLED, reason)
                killed.append(task_id)
        preempted: dict[str, Eviction] = {}
        preempt = self.policy.preempt(ctx)
        for task_id, where in preempt.items():
            generation = self._running.get(task_id)
            if generation is None:
                if where != 'keep' and task_id in self.queue and self.engine.supports('evict'):
                    # A queued generation whose KV is still resident: evict it, keep it queued.
                    try:
                        self.engine.evict(task_id, where)
                        preempted[task_id] = where
                    except Exception as err:  # noqa: BLE001 - engines that cannot evict keep KV
                        logger.debug('evicting queued %s failed: %s', task_id, err)
                continue
            try:
                self._take_out(task_id, where)
            except Exception as err:  # noqa: BLE001 - the engine fault ends this goal only
                self._end(generation, TaskStatus.FAILED,
                          f'engine failure: could not preempt the generation: '
                          f'{describe_error(err)}')
                continue
            del self._running[task_id]
            self._requeue_preempted(generation)
            preempted[task_id] = where
        return tuple(killed), preempted

    def _take_out(self, task_id: str, where: Eviction) -> None:
        """Take a generation out of the engine's batch, evicting its KV where asked (engines
        that cannot evict keep it)."""
        if where != 'keep' and self.engine.supports('evict'):
            self.engine.evict(task_id, where)
        else:
            self.engine.pause(task_id)

    def _requeue_preempted(self, generation: Generation) -> None:
        self._between.pop(generation.task_id, None)
        generation.preemptions += 1
        generation.status = TaskStatus.WAITING if generation.k == 0 else TaskStatus.SUSPENDED
        self.queue.push(generation, self._profile(generation).segment_generation_s)

    @property
    def _cap(self) -> int:
        return min(self.config.max_batch or self.engine.max_num_seqs, self.engine.max_num_seqs)

    def _context(self, now: float) -> AdmissionContext:
        return AdmissionContext(
            now=now, comm_s=self.config.comm_s, engine=self.engine_view,
            running=self._running.values(), max_batch=self._cap,
            recent_step_s=self.recent_step_s, max_segment_tokens=self._max_segment_tokens,
            batch_mode=self.config.batch_mode,
            urgency_tie_s=self._segment_generation_s, queued=self.queue.generations,
            seen_segment_tokens=self._seen_segment_tokens, running_columns=self._running)

    # -- segments ---------------------------------------------------------------------------
    def _on_cut(self, generation: Generation, cut: Cut, now: float) -> None:
        generation.rejected.extend(s.error or '' for s in cut.rejected)
        suspend_now = self.policy.segmented and not self.config.suspend_on_next_statement
        if suspend_now:
            # Pause first: if the engine fails here the goal ends before anything is sent.
            self.engine.pause(generation.task_id)
        if self.policy.streaming:
            self._dispatch(generation, cut.statements, cut.text, now, is_last=False)
        else:
            generation.held.extend(cut.statements)
            generation.held_text += cut.text
        if suspend_now:
            self._to_queue(generation)
        elif self.policy.segmented:
            # It decodes on until its next statement begins: a plan that ends here ends
            # without a resume (else each plan is resumed once more only to end).
            self._between[generation.task_id] = None
        self.policy.on_cut(generation, now)
        if suspend_now:
            self.policy.on_suspend(generation, now)

    def _to_queue(self, generation: Generation) -> None:
        """A cut generation leaves the batch for the queue (its KV kept, paused)."""
        del self._running[generation.task_id]
        generation.status = TaskStatus.SUSPENDED
        generation.suspensions += 1
        self.queue.push(generation, self._profile(generation).segment_generation_s)

    def _suspend(self, generation: Generation, now: float) -> None:
        """Suspend a generation whose next statement began after a cut."""
        del self._between[generation.task_id]
        try:
            self.engine.pause(generation.task_id)
        except Exception as err:  # noqa: BLE001 - the engine fault ends this goal only
            logger.error('engine failed to suspend %s: %s', generation.task_id, err)
            self._end(generation, TaskStatus.FAILED,
                      f'engine failure: could not suspend the generation: {describe_error(err)}')
            return
        self._to_queue(generation)
        self.policy.on_suspend(generation, now)

    def _on_finish(self, generation: Generation, reason: str, now: float) -> None:
        cut = self._segmenters[generation.task_id].finish('length' if reason == 'length' else
                                                          'eos')
        generation.rejected.extend(s.error or '' for s in cut.rejected)
        generation.finish_reason = reason
        statements = [*generation.held, *cut.statements]
        if not statements and not generation.segments:
            detail = f" ({'; '.join(generation.rejected)})" if generation.rejected else ''
            self._end(generation, TaskStatus.FAILED, NO_SKILL_ERROR + detail)
            return
        self._release(generation)
        generation.status = TaskStatus.GENERATED
        if statements:
            self._dispatch(generation, tuple(statements), generation.held_text + cut.text, now,
                           is_last=True)
        else:
            generation.segments[-1].is_last = True
            self._events.append(Closed(generation))
        self._events.append(Generated(generation))
        self.policy.on_end(generation, now)
        self._maybe_finished(generation)

    def _dispatch(self, generation: Generation, statements: tuple[Statement, ...], text: str,
                  now: float, is_last: bool) -> None:
        profile = self._profile(generation)
        estimate = estimate_min_s(profile, statements)
        index = len(generation.segments)
        previous_end = generation.need_time if index > 0 else -math.inf
        start_estimate = max(now + self.config.comm_s, previous_end)
        segment = Segment(index=index, text=text, statements=statements, cut_time=now,
                          dispatch_time=now, estimated_exec_s=estimate,
                          tokens=generation.segment_tokens, is_last=is_last,
                          longest_exec_s=estimate_max_s(profile, statements))
        generation.segments.append(segment)
        kind = (generation.spec.profile, index == 0)
        self._longest_segment[kind] = max(self._longest_segment.get(kind, 0), segment.tokens)
        generation.need_time = start_estimate + estimate
        generation.k = index + 1
        generation.segment_tokens = 0
        self._running.refresh(generation)
        self._events.append(Dispatch(generation.task_id, generation.spec.robot_id, segment))
        if all(not math.isnan(s.end_time) for s in generation.segments[:index]):
            self._arm_deadline(generation)   # else the first unreported one's deadline runs

    def _arm_deadline(self, generation: Generation) -> None:
        """Set the report deadline of the first unreported segment once it can start."""
        if not self.config.report_deadlines or generation.status.terminal:
            return
        segments = generation.segments
        index = next((i for i, s in enumerate(segments) if math.isnan(s.end_time)), None)
        if index is None:
            return
        segment = segments[index]
        ready = segment.dispatch_time + self.config.comm_s
        if index > 0:
            ready = max(ready, segments[index - 1].end_time)
        longest = segment.longest_exec_s
        if not math.isfinite(longest):
            longest = segment.estimated_exec_s
        due = (ready + self.config.report_timeout_factor * longest
               + self.config.report_timeout_margin_s + self.config.comm_s)
        self._deadline_seq += 1
        heapq.heappush(self._deadlines, (due, self._deadline_seq, generation.task_id, index))

    # -- endings ----------------------------------------------------------------------------
    def _maybe_finished(self, generation: Generation) -> None:
        if generation.status != TaskStatus.GENERATED:
            return
        if all(not math.isnan(s.end_time) for s in generation.segments):
            generation.status = TaskStatus.FINISHED
            generation.done_time = generation.segments[-1].end_time
            self._events.append(Ended(generation))

    def _end(self, generation: Generation, status: TaskStatus, error: str) -> None:
        was_generating = generation.status < TaskStatus.GENERATED
        generation.status = status
        generation.error = error
        generation.done_time = self.clock.now()
        self._release(generation)
        if was_generating:
            try:
                self.policy.on_end(generation, generation.done_time)
            except Exception:  # noqa: BLE001 - the goal has ended whatever the policy says
                logger.exception('policy %s failed on the end of %s', self.policy.name,
                                 generation.task_id)
        self._events.append(Ended(generation))

    def _release(self, generation: Generation) -> None:
        task_id = generation.task_id
        self._between.pop(task_id, None)
        if task_id in self.queue:
            self.queue.remove(task_id)
        self._running.pop(task_id, None)
        try:
            self.engine.release(task_id)
        except Exception as err:  # noqa: BLE001 - the goal ends even if its memory leaks
            logger.error('engine failed to release %s: %s', task_id, err)

    # -- helpers ----------------------------------------------------------------------------
    def _note_speed(self, result: StepResult) -> None:
        """Smooth the time per decoded token: an iteration's duration, divided by the tokens
        each generation got from it where an engine produces several per iteration."""
        if result.prefill_tokens or not result.text:
            return
        step_s = result.iteration_time_s
        produced = sum(result.produced(r) for r in result.text)
        if produced > len(result.text):
            step_s = step_s * len(result.text) / produced
        weight = self.config.step_smoothing
        if self.recent_step_s is None:
            self.recent_step_s = step_s
        else:
            self.recent_step_s = weight * step_s + (1 - weight) * self.recent_step_s

    def profile(self, name: str) -> RobotProfile:
        """A robot profile by name, loaded once per scheduler."""
        return self.profiles(name)

    def _profile(self, generation: Generation) -> RobotProfile:
        return self.profiles(generation.spec.profile)

    def _segment_generation_s(self, generation: Generation) -> float:
        return self._profile(generation).segment_generation_s

    def _max_segment_tokens(self, generation: Generation) -> int:
        return self._profile(generation).max_segment_tokens

    def _seen_segment_tokens(self, generation: Generation) -> int | None:
        return self._longest_segment.get((generation.spec.profile, generation.k == 0))

    def _get(self, task_id: str) -> Generation:
        try:
            return self.generations[task_id]
        except KeyError:
            raise GoalError(f'unknown task {task_id!r}') from None

