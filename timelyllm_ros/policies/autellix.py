"""Autellix (paper 002: Luo, Shi, Cai et al., "Autellix: An Efficient Serving Engine for LLM
Agents as General Programs"): program-level least attained service, PLAS and ATLAS.

Implemented from the paper's Alg. 1 and ``../shared/papers/rivals-digest.md`` §2, mapped onto
this package's scheduler loop:

* **Programs and calls.** A program is a robot by default (``program='robot'``: a robot's
  consecutive tasks form one program, so a robot that has been served a lot yields to the
  others), or a single task (``program='task'``). Each *segment generation* is one LLM call:
  a call arrives when its generation is queued (the request's arrival, or the cut of its
  previous segment, when the scheduler re-queues the suspended generation) and completes at
  its segment cut (:meth:`on_cut`) or when the generation ends (:meth:`on_end`). The robot
  executing a segment plays the role of Autellix's external interrupt.
* **Process table** (:class:`Program`, one per program id): ``service`` (PLAS: the sum of the
  model time of its completed calls, paper eq. 1; ATLAS: the longest critical path observed,
  ``pt.service = max(pt.service, c.service + c.model_time)``, Alg. 1 line 4), ``wait`` (sum of
  its completed calls' queueing time), the active calls, and the last call arrival and
  completion times. A new call inherits ``c.service = pt.service`` as its priority. In the
  bundled workloads every program is single-threaded unless one robot has several tasks in
  flight at once (WID workloads pick distinct robots per event, but a robot can be re-picked
  by a later event while still busy); only then do ``autellix-plas`` (sum) and
  ``autellix-atlas`` (max) differ.
* **Model time** of a call = the duration of every engine iteration that stepped it (prefill
  or decode); **waiting** = the duration of every iteration it spent queued (running but
  stalled behind a prefill counts as neither).
* **K queues** (:meth:`queue_bounds`): ``Q_1 … Q_K`` with geometric boundaries
  ``hi_i = q0·(2^i − 1)`` (``hi_K = ∞``) and quanta ``hi_i − lo_i = q0·2^(i−1)`` (``Q_K``:
  no demotion). A call is placed in the queue whose range holds its priority ``c.service``
  (not always ``Q_1``) with that queue's full quantum (the paper's pseudocode;
  ``partial_quantum=True`` gives ``hi_i − c.service`` instead); FCFS inside a queue.
* **Each round** (every tick, in :meth:`preempt`): arrived calls are placed; a call whose
  quantum (decremented by its model time in :meth:`on_step`) is used up is demoted one queue
  with the new queue's quantum; a *waiting* call with ``(W_p + W_c) / max(T_p + T_c, T_min) ≥
  β`` is promoted to the tail of ``Q_1`` and only its own counters ``W_c``, ``T_c`` are reset.
  Then the batch is formed by walking ``Q_1, Q_2, …`` in order and taking calls while they
  fit (batch cap and KV memory), stopping at the first misfit (no back-filling); running
  calls left out are preempted with their KV swapped to host (``'host'``), and :meth:`admit`
  accepts exactly the queued calls taken, in walk order.

Corrections and interpretations (digest §2.2):

* Division by zero in the anti-starvation ratio is guarded by flooring ``T_total`` at
  ``min_service_s`` (default ``q0/20``, about one decode step at the default q0).
* The pseudocode resets ``c.model_time`` on promotion; here only the anti-starvation counters
  ``W_c``/``T_c`` are reset, while the model time that updates the process table is kept
  whole (otherwise a promoted call's service would be forgotten and its program would gain
  priority from starving). The process table's ``wait`` adds each call's whole waiting time.
* Calls already in ``Q_1`` are not "promoted" to its tail (the pseudocode would move them
  behind newer calls, the opposite of its intent).
* ``engine.can_fit(c)`` is judged with the engine's own KV accounting (``engine.kv``, when
  it exposes it): the free GPU blocks, plus those of paused contexts the engine evicts when it
  needs room, plus those of running calls *later* in the walk, which are then left out (and
  swapped out), lowest priority first, so a higher-priority queued call displaces
  lower-priority running ones as preemption in vLLM does. Without KV accounting the fit is
  checked by :meth:`admit` once the preemptions are done.
* Multi-step scheduling (every N iterations) and the swap kernel are engine optimisations
  of the paper that are not modelled: the scheduler runs every iteration (N = 1). The load
  balancer is out of scope (one engine).

Bounded state (this package's choice; the paper keeps a program's entry until its session
ends). With ``program='task'`` an entry is dropped when its task ends (``end_session``).
A robot, though, never says that its program ended, so with ``program='robot'`` a robot's
entry is kept, with its attained service, while it has a live generation (semantics
unchanged), and once idle among the ``idle_programs`` most recently active idle robots; past
that the least recently active idle ones are forgotten, lazily, when idle entries outnumber
live ones plus ``idle_programs``. A forgotten robot's next goal starts a new program
(attained service 0), as a new Autellix session would. The promotion log keeps the last
``PROMOTION_LOG`` promotions. So the policy's state is O(live generations + idle_programs)
however many goals and robots have come and gone.

Constants chosen (none is given by the paper; digest §2.2 suggests FastServe-style values):
``num_queues`` K = 6; ``q0_s`` = 0.5 s (about 23 decode steps of the bundled 21.9 ms/token
calibration, "a few tens of decode steps"); ``starvation_ratio`` β = 4 (the middle of the
{2, 4, 8, 16} sweep the digest suggests); ``min_service_s`` = q0/20; full quantum on arrival;
``program`` = ``'robot'``; ``idle_programs`` = 256 idle robots remembered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from timelyllm_ros.core.admission import AdmissionContext
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.engines.base import StepResult
from timelyllm_ros.policies.base import Eviction
from timelyllm_ros.policies.planned import PlannedBatchPolicy
from timelyllm_ros.policies.semantic import KvBudget

ProgramId = Literal['robot', 'task']
Mode = Literal['plas', 'atlas']
QUEUE_SCALE = 1e9           # queue index weight when (queue, FCFS position) is one number
PROMOTION_LOG = 1024        # promotions kept for inspection (the most recent)


@dataclass(slots=True)
class Program:
    """One process-table entry."""

    service: float = 0.0             # s: PLAS sum / ATLAS longest critical path
    wait: float = 0.0                # s: queueing time of its completed calls
    active: set[str] = field(default_factory=set)   # task ids with a call in flight
    calls: int = 0                   # completed calls
    last_arrival_time: float = math.nan
    last_completion_time: float = math.nan


@dataclass(slots=True)
class Call:
    """One LLM call: a segment generation of one task."""

    task_id: str
    pid: str
    service: float                   # s: inherited priority p(c) = pt[pid].service at arrival
    arrival_time: float
    queue: int = -1                  # index into the queues (0 = Q_1); -1 before placement
    position: int = 0                # FCFS order inside its queue
    quantum: float = math.inf        # s of model time left before demotion
    wait: float = 0.0                # W_c (s), reset on promotion
    run: float = 0.0                 # T_c (s), reset on promotion
    model_time: float = 0.0          # s executed in total (updates the process table)
    wait_total: float = 0.0          # s queued in total


@dataclass(frozen=True, slots=True)
class Promotion:
    """An anti-starvation promotion, for inspection: the call and its ratio inputs."""

    task_id: str
    time: float
    from_queue: int
    wait_s: float                    # W_p + W_c
    service_s: float                 # T_p + T_c (unfloored)
    call_wait_s: float               # W_c: the call's own wait since arrival or last reset


def _last_activity(entry: Program) -> float:
    """When a program last had a call arrive or complete (``-inf`` if never)."""
    times = [t for t in (entry.last_arrival_time, entry.last_completion_time)
             if not math.isnan(t)]
    return max(times, default=-math.inf)


class AutellixPolicy(PlannedBatchPolicy):
    """Autellix PLAS (single-threaded programs); see the module docstring."""

    name: ClassVar[str] = 'autellix-plas'
    description: ClassVar[str] = ('program-level least attained service (robot = program), '
                                  'K-level queues, anti-starvation (Autellix PLAS)')
    segmented: ClassVar[bool] = True
    streaming: ClassVar[bool] = True
    mode: ClassVar[Mode] = 'plas'

    def __init__(self, num_queues: int = 6, q0_s: float = 0.5, starvation_ratio: float = 4.0,
                 program: ProgramId = 'robot', min_service_s: float | None = None,
                 partial_quantum: bool = False, idle_programs: int = 256) -> None:
        """Args:
            num_queues: K, the number of priority queues (≥ 1).
            q0_s: width of Q_1 and base of the geometric boundaries (s of model time).
            starvation_ratio: β; a waiting call whose program-level wait/service ratio
                reaches it is promoted to Q_1 (``math.inf`` disables anti-starvation).
            program: ``'robot'`` (a robot's tasks form one program) or ``'task'``.
            min_service_s: floor of T_total in the ratio (default q0_s / 20).
            partial_quantum: give an arriving call ``hi_i − p(c)`` instead of a full quantum.
            idle_programs: idle programs (no live generation) whose attained service is
                remembered, the most recently active (module docstring).
        """
        super().__init__()
        if num_queues < 1:
            raise ValueError(f'need at least one queue, got {num_queues}')
        if not q0_s > 0:
            raise ValueError(f'q0 must be > 0 s, got {q0_s}')
        if not starvation_ratio > 0:
            raise ValueError(f'the starvation ratio must be > 0, got {starvation_ratio}')
        if program not in ('robot', 'task'):
            raise ValueError(f"program must be 'robot' or 'task', got {program!r}")
        if idle_programs < 0:
            raise ValueError(f'idle_programs must be >= 0, got {idle_programs}')
        self.num_queues = num_queues
        self.q0_s = q0_s
        self.starvation_ratio = starvation_ratio
        self.program = program
        self.min_service_s = q0_s / 20 if min_service_s is None else min_service_s
        self.partial_quantum = partial_quantum
        self.idle_programs = idle_programs
        self.table: dict[str, Program] = {}
        self._live_programs = 0          # table entries with a live generation
        self.calls: dict[str, Call] = {}
        self.queues: list[dict[str, None]] = [{} for _ in range(num_queues)]
        self.promotions: list[Promotion] = []
        self.demotions = 0
        self._gens: dict[str, Generation] = {}
        self._arrived: list[str] = []
        self._position = 0
        self._now = 0.0

    # -- queues -------------------------------------------------------------------------------
    def queue_bounds(self, index: int) -> tuple[float, float]:
        """``[lo, hi)`` of queue ``index`` (0 = Q_1), in seconds of service."""
        lo = self.q0_s * (2 ** index - 1)
        hi = math.inf if index == self.num_queues - 1 else self.q0_s * (2 ** (index + 1) - 1)
        return lo, hi

    def quantum(self, index: int) -> float:
        lo, hi = self.queue_bounds(index)
        return hi - lo

    def queue_of(self, service: float) -> int:
        """The queue whose range holds a priority (service) value."""
        if service < self.q0_s:
            return 0
        index = int(math.floor(math.log2(service / self.q0_s + 1)))
        return min(index, self.num_queues - 1)

    def _enqueue(self, call: Call, index: int, quantum: float) -> None:
        if call.queue >= 0:
            self.queues[call.queue].pop(call.task_id, None)
        call.queue = index
        call.quantum = quantum
        self._position += 1
        call.position = self._position
        self.queues[index][call.task_id] = None

    def program_id(self, generation: Generation) -> str:
        return generation.spec.robot_id if self.program == 'robot' else generation.task_id

    # -- calls ----------------------------------------------------------------------------------
    def _arrive(self, generation: Generation, now: float) -> None:
        pid = self.program_id(generation)
        entry = self.table.setdefault(pid, Program())
        self._activate(entry, generation.task_id)
        entry.last_arrival_time = now
        self.calls[generation.task_id] = Call(generation.task_id, pid, entry.service, now)
        self._arrived.append(generation.task_id)

    def _complete(self, task_id: str, now: float) -> None:
        call = self.calls.pop(task_id, None)
        if call is None:
            return
        if call.queue >= 0:
            self.queues[call.queue].pop(task_id, None)
        entry = self.table[call.pid]
        entry.service = self.update_service(entry.service, call)
        entry.wait += call.wait_total
        entry.calls += 1
        entry.last_completion_time = now
        self._deactivate(entry, task_id)

    def _activate(self, entry: Program, task_id: str) -> None:
        if not entry.active:
            self._live_programs += 1
        entry.active.add(task_id)

    def _deactivate(self, entry: Program, task_id: str) -> None:
        if task_id in entry.active:
            entry.active.discard(task_id)
            if not entry.active:
                self._live_programs -= 1

    def _forget_idle(self) -> None:
        """Forget the least recently active idle programs beyond ``idle_programs``, once idle
        entries outnumber live ones plus ``idle_programs`` (amortised O(1) per goal)."""
        idle_count = len(self.table) - self._live_programs
        if idle_count <= self._live_programs + self.idle_programs:
            return
        idle = [(_last_activity(entry), pid) for pid, entry in self.table.items()
                if not entry.active]
        idle.sort()
        for _, pid in idle[:len(idle) - self.idle_programs]:
            del self.table[pid]

    def update_service(self, service: float, call: Call) -> float:
        """PLAS, eq. 1: the program's service is the sum of its completed calls' model time."""
        return service + call.model_time

    def _place_arrivals(self) -> None:
        arrived, self._arrived = self._arrived, []
        for task_id in arrived:
            call = self.calls.get(task_id)
            if call is None or call.queue >= 0:
                continue
            index = self.queue_of(call.service)
            quantum = self.quantum(index)
            if self.partial_quantum:
                quantum = self.queue_bounds(index)[1] - call.service
            self._enqueue(call, index, quantum)

    def _sweep(self, now: float) -> None:
        """Demotion of calls whose quantum is used up; anti-starvation promotion."""
        last = self.num_queues - 1
        for index in range(self.num_queues):
            for task_id in list(self.queues[index]):
                call = self.calls[task_id]
                if call.queue != index:
                    continue                                 # moved earlier in this sweep
                if call.quantum <= 0 and index < last:
                    self._enqueue(call, index + 1, self.quantum(index + 1))
                    self.demotions += 1
                generation = self._gens.get(task_id)
                if generation is None or generation.status == TaskStatus.RUNNING:
                    continue
                entry = self.table[call.pid]
                wait = entry.wait + call.wait
                service = entry.service + call.run
                if call.queue > 0 and wait / max(service, self.min_service_s) >= \
                        self.starvation_ratio:
                    self.promotions.append(Promotion(task_id, now, call.queue, wait, service,
                                                     call.wait))
                    if len(self.promotions) > 2 * PROMOTION_LOG:
                        del self.promotions[:-PROMOTION_LOG]
                    self._enqueue(call, 0, self.quantum(0))
                    call.wait = 0.0
                    call.run = 0.0

    def _order(self) -> list[str]:
        return [task_id for queue in self.queues for task_id in queue]

    def _make_plan(self, ctx: AdmissionContext, preempting: bool) -> dict[str, Eviction]:
        self._now = ctx.now
        self._place_arrivals()
        if preempting:
            self._sweep(ctx.now)
        engine = ctx.engine
        budget = KvBudget.of(engine)
        order = [t for t in self._order() if t in self._gens
                 and not self._gens[t].status.terminal]
        free = None
        if budget is not None:
            # Free blocks plus those of paused contexts the engine evicts when it needs room.
            free = budget.free + sum(budget.resident(g.task_id) for g in ctx.queued)
        # Running calls later in the walk can be left out to make room for an earlier call;
        # they are claimed lowest priority first.
        claimable = [t for t in reversed(order)
                     if self._gens[t].status == TaskStatus.RUNNING] if preempting else []
        rank = {task_id: i for i, task_id in enumerate(order)}
        claimed: set[str] = set()
        taken: list[str] = []
        kept: set[str] = set()
        for position, task_id in enumerate(order):
            generation = self._gens[task_id]
            if len(taken) + len(kept) >= ctx.max_batch:
                break
            if generation.status == TaskStatus.RUNNING:
                if task_id not in claimed:
                    kept.add(task_id)
                continue
            if budget is not None and free is not None:
                need = budget.need(task_id) + budget.resident(task_id)
                while need > free and claimable and rank[claimable[0]] > position:
                    victim = claimable.pop(0)
                    claimed.add(victim)
                    free += budget.resident(victim)
                if need > free:
                    break                                   # first misfit: no back-fill
                free -= need
            # (Without KV accounting, admit() checks the fit once the preemptions are done.)
            taken.append(task_id)
        decisions: dict[str, Eviction] = {}
        if preempting:
            for generation in ctx.running:
                if generation.task_id not in kept and generation.task_id in self.calls:
                    decisions[generation.task_id] = 'host'     # left out: swapped out
        self._plan = {task_id: rank for rank, task_id in enumerate(taken)}
        return decisions

    # -- observers ----------------------------------------------------------------------------
    def on_submit(self, generation: Generation, now: float) -> None:
        self._gens[generation.task_id] = generation
        self._arrive(generation, now)

    def on_cut(self, generation: Generation, now: float) -> None:
        self._complete(generation.task_id, now)
        # its program stays live: the generation runs on until it is suspended or ends
        entry = self.table.get(self.program_id(generation))
        if entry is not None:
            self._activate(entry, generation.task_id)

    def on_suspend(self, generation: Generation, now: float) -> None:
        self._arrive(generation, now)                        # the next segment's call

    def on_end(self, generation: Generation, now: float) -> None:
        task_id = generation.task_id
        pid = self.calls[task_id].pid if task_id in self.calls else self.program_id(generation)
        self._complete(task_id, now)
        self._gens.pop(task_id, None)
        self._untrack(generation)
        entry = self.table.get(pid)
        if entry is not None:
            self._deactivate(entry, task_id)
            if self.program == 'task' and not entry.active:
                del self.table[pid]                          # end_session
        self._forget_idle()

    def on_step(self, result: StepResult, stepped: Sequence[Generation],
                ctx: AdmissionContext) -> None:
        super().on_step(result, stepped, ctx)
        duration = result.iteration_time_s
        for task_id in dict.fromkeys(g.task_id for g in stepped):
            call = self.calls.get(task_id)
            if call is not None:
                call.quantum -= duration
                call.run += duration
                call.model_time += duration
        for generation in ctx.queued:
            call = self.calls.get(generation.task_id)
            if call is not None:
                call.wait += duration
                call.wait_total += duration

    # -- the plan -------------------------------------------------------------------------------
    def _unplanned_priority(self, task_id: str) -> float | None:
        call = self.calls.get(task_id)
        if call is None or call.queue < 0:
            return None
        return -(call.queue * QUEUE_SCALE + call.position)


class AutellixAtlasPolicy(AutellixPolicy):
    """Autellix ATLAS: a program's priority is its longest observed critical path."""

    name: ClassVar[str] = 'autellix-atlas'
    description: ClassVar[str] = ('program-level critical-path attained service (robot = '
                                  'program), K-level queues, anti-starvation (Autellix ATLAS)')
    mode: ClassVar[Mode] = 'atlas'

    def update_service(self, service: float, call: Call) -> float:
        """Alg. 1 line 4: ``pt.service = max(pt.service, c.service + c.model_time)``."""
        return max(service, call.service + call.model_time)
