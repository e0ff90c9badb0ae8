"""Continuum (Li, He, Mang et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent
Scheduling with KV Cache Time-to-Live", arXiv 2511.02230; renamed CacheTTL in v4): KV pinned
for a time-to-live through each tool call, and program-level first-come-first-serve.

Implemented from the paper's Algorithm 1, §4.1–4.3 and §5.1–5.2 (``../shared/papers/
rivals-digest.md`` names it the fifth rival), mapped onto this package's scheduler loop:

* **Programs, turns and tool calls.** A program is a goal; each segment generation is one LLM
  request (a turn); the robot executing the segment is the tool call, the segment's first
  skill its tool ``f`` (``mf``, ``pick``, ...). The next turn's request *arrives* when the
  robot reports that the segment ended (the tool returned): a suspended generation is not
  admitted before (an agent cannot ask before its tool's output is in). A goal's first
  request arrives with the goal.
* **Tool-call durations** (§5.1): the interval from a turn's end (its segment's cut) to the
  next turn's arrival, recorded per tool in ``S[f]`` and overall in ``S`` (the last
  ``history_window`` of each).
* **TTL** (Eq. 2): at the end of a turn that is not the program's last,
  ``τ* = argmax_τ P(τ, f)·(T·η + Prefill-Reload(r)) − τ`` over τ = 0 and every recorded
  duration, with ``P`` the empirical CDF of ``S[f]`` (of ``S`` while ``|S[f]| ≤ K``);
  ``T`` the sliding-window mean queueing delay of requests whose KV had been evicted (the last
  ``queue_delay_window``, 0 at start), ``η = −Corr(k, N − k)`` over the turns of the programs
  that ended (k served of N; 1 until there are ``K`` pairs), ``Prefill-Reload(r)`` the time to
  bring the context back: a swap-in if host memory has room for it, else a prefill of the
  whole context, from the engine's latency model (``reload_s_per_token`` per context token
  for an engine without one). A τ* > 0 pins the KV until ``now + τ*``.
* **Schedule** (Algorithm 1, §5.2): each tick, pins past their TTL whose program has no
  request waiting are released (their KV is evictable again, as vLLM's freed blocks are);
  the waiting requests are ranked by (preempted first, a pinned program first, then the
  program's arrival, then submission) and taken in that order while the batch has room and
  the KV fits; a request that does not fit first takes the GPU blocks of unpinned suspended
  contexts (least recently suspended first, swapped to host or dropped as the engine can),
  then of pinned ones, the program that arrived latest first (the paper's deadlock
  prevention), and the walk stops at the first request that still does not fit (no
  back-filling). A program's pin goes when its next request is admitted or it ends.

Corrections and interpretations:

* §4.2 says "we set a threshold M" where it means K (the history size threshold).
* The cold-start TTL ``T_default`` is given no value: it is "the optimal τ* under"
  durations ``~ Exp(1)`` and η = 1. That optimum is
  ``τ = μ·ln((T + Prefill-Reload(r))/μ)`` when the benefit exceeds the mean μ = 1 s, else 0,
  computed here per request with the current T (``cold_start_mean_s`` = μ).
* "Preempted requests first": Continuum preempts nothing itself; the rank covers generations
  the engine took out of the batch (vLLM's recompute preemption).
* A pin here protects the KV from the policy's own evictions; the simulated engine, asked to
  grow a *running* context past its blocks, may still swap out a pinned one (rare: growth is
  reserved at admission).
* Without the engine's KV accounting (the vLLM engines) nothing is pinned or evicted by the
  policy; it ranks and gates arrivals only (program-level FCFS).

Constants (constructor parameters): ``history_threshold`` K = 100 and T = 0 at start (the
paper's); ``queue_delay_window`` = 200 requests (the authors' code); ``history_window`` =
1,000 records per tool (the paper keeps all; a bound keeps the state finite);
``cold_start_mean_s`` = 1 s (Exp(1)); ``reload_s_per_token`` = 0.0002 s (the authors' code's
default).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from timelyllm_ros.core.admission import AdmissionContext
from timelyllm_ros.core.request import Generation
from timelyllm_ros.engines.base import EngineView
from timelyllm_ros.errors import PolicyError
from timelyllm_ros.policies.base import Eviction
from timelyllm_ros.policies.planned import PlannedBatchPolicy
from timelyllm_ros.policies.semantic import KvBudget

RANK_SCALE = 1e9            # weight of (preempted, pinned) when the rank is one number
FIRST_TOOL = 'request'      # the "tool" before a goal's first turn (none: nothing to record)


def ttl_from_history(durations: Iterable[float], benefit_s: float) -> float:
    """Eq. 2: the τ among 0 and the recorded durations that maximises
    ``P(τ)·benefit_s − τ``, P the empirical CDF of ``durations`` (the first such τ)."""
    samples = np.sort(np.fromiter(durations, dtype=float))
    if not len(samples) or benefit_s <= 0.0:
        return 0.0
    below = np.searchsorted(samples, samples, side='right') / len(samples)   # P(τ = s_i)
    reward = below * benefit_s - samples
    best = int(np.argmax(reward))
    return float(samples[best]) if reward[best] > 0.0 else 0.0


def cold_start_ttl(benefit_s: float, mean_s: float = 1.0) -> float:
    """The optimum of Eq. 2 for durations ``~ Exp(1/mean_s)``: ``(1 − e^{−τ/μ})·B − τ`` is
    largest at ``τ = μ·ln(B/μ)`` when B > μ, else at 0."""
    return mean_s * math.log(benefit_s / mean_s) if benefit_s > mean_s else 0.0


def memoryfulness(pairs: Iterable[tuple[int, int]]) -> float | None:
    """η = −Corr(k, N − k) over (served, remaining) pairs; None where it is undefined."""
    values = np.array(list(pairs), dtype=float)
    if len(values) < 2 or values[:, 0].std() == 0.0 or values[:, 1].std() == 0.0:
        return None
    return float(-np.corrcoef(values[:, 0], values[:, 1])[0, 1])


class ContinuumPolicy(PlannedBatchPolicy):
    """Continuum / CacheTTL: pinned KV through tool calls, program-level FCFS. See the module
    docstring for the mapping, the interpretations and the constants."""

    name: ClassVar[str] = 'continuum'
    description: ClassVar[str] = ('program-level FCFS, KV pinned through each robot action '
                                  'for a TTL from its cost and duration history (Li et al.)')
    segmented: ClassVar[bool] = True
    streaming: ClassVar[bool] = True

    def __init__(self, history_threshold: int = 100, queue_delay_window: int = 200,
                 history_window: int = 1000, cold_start_mean_s: float = 1.0,
                 reload_s_per_token: float = 0.0002) -> None:
        super().__init__()
        for option, value in (('history_threshold', history_threshold),
                              ('queue_delay_window', queue_delay_window),
                              ('history_window', history_window)):
            if value < 1:
                raise PolicyError(f'{option} must be >= 1, got {value}')
        for option, number in (('cold_start_mean_s', cold_start_mean_s),
                               ('reload_s_per_token', reload_s_per_token)):
            if not number > 0.0 or not math.isfinite(number):
                raise PolicyError(f'{option} must be a positive number, got {number}')
        self.history_threshold = history_threshold
        self.history_window = history_window
        self.cold_start_mean_s = cold_start_mean_s
        self.reload_s_per_token = reload_s_per_token
        self._history: dict[str, deque[float]] = {}       # S[f]
        self._all: deque[float] = deque(maxlen=history_window)   # S
        self._delays: deque[float] = deque(maxlen=queue_delay_window)   # for T
        self._turns: deque[tuple[int, int]] = deque(maxlen=history_window)   # (k, N − k)
        # arrived requests: (generation, arrival, preempted)
        self._waiting: dict[str, tuple[Generation, float, bool]] = {}
        self._in_tool: dict[str, tuple[Generation, str, float]] = {}   # (g, tool, turn end)
        self._running: dict[str, Generation] = {}
        self._pins: dict[str, float] = {}                 # task -> TTL expiry
        self._engine: EngineView | None = None

    def attach(self, engine: EngineView, batch_cap: int) -> None:
        self._engine = engine

    # -- the cost model ----------------------------------------------------------------------
    @property
    def queue_delay_s(self) -> float:
        """T: the mean queueing delay of the recent requests whose KV had been evicted."""
        return float(np.mean(self._delays)) if self._delays else 0.0

    @property
    def eta(self) -> float:
        """η, 1 until ``history_threshold`` (k, N − k) pairs are known (or it is undefined)."""
        if len(self._turns) < self.history_threshold:
            return 1.0
        value = memoryfulness(self._turns)
        return 1.0 if value is None else value

    def reload_s(self, task_id: str) -> float:
        """Prefill-Reload(r): a swap-in if host memory holds the context, else a prefill."""
        engine = self._engine
        tokens = engine.context_tokens(task_id) if engine is not None else None
        if engine is None or tokens is None:
            return 0.0
        costs, kv = engine.costs, engine.kv
        if costs is None:
            return tokens * self.reload_s_per_token
        if kv is not None and kv.host_free >= kv.blocks(tokens):
            return costs.swap_in_s(tokens)
        return costs.prefill_s(tokens)

    def ttl_s(self, task_id: str, tool: str) -> float:
        """τ* for the KV of a turn that ended before tool ``tool`` (Eq. 2, cold start §4.2)."""
        benefit = self.queue_delay_s * self.eta + self.reload_s(task_id)
        if len(self._all) <= self.history_threshold:
            return cold_start_ttl(benefit, self.cold_start_mean_s)
        history = self._history.get(tool, ())
        return ttl_from_history(history if len(history) > self.history_threshold
                                else self._all, benefit)

    # -- observers -----------------------------------------------------------------------------
    def on_submit(self, generation: Generation, now: float) -> None:
        self._waiting[generation.task_id] = (generation, now, False)

    def on_cut(self, generation: Generation, now: float) -> None:
        task_id = generation.task_id
        self._running.pop(task_id, None)
        segment = generation.segments[-1]
        calls = segment.calls
        tool = calls[0].skill if calls else 'text'
        self._in_tool[task_id] = (generation, tool, now)
        if not segment.is_last:
            ttl = self.ttl_s(task_id, tool)
            if ttl > 0.0:
                self._pins[task_id] = now + ttl

    def on_end(self, generation: Generation, now: float) -> None:
        task_id = generation.task_id
        for table in (self._waiting, self._in_tool, self._running, self._pins):
            table.pop(task_id, None)
        self._untrack(generation)
        turns = len(generation.segments)
        self._turns.extend((k, turns - k) for k in range(1, turns + 1))

    # -- the plan ------------------------------------------------------------------------------
    def _arrivals(self, ctx: AdmissionContext) -> None:
        """Robots that reported the end of their segment: the tool returned, the next turn's
        request arrives (its duration recorded); running generations taken out of the batch
        without a cut were preempted."""
        now = ctx.now
        for task_id, (generation, tool, ended) in list(self._in_tool.items()):
            if generation.segments and not math.isnan(generation.segments[-1].end_time):
                del self._in_tool[task_id]
                self._record(tool, now - ended)
                self._waiting[task_id] = (generation, now, False)
        running = {g.task_id for g in ctx.running}
        for task_id in [t for t in self._running if t not in running]:
            generation = self._running.pop(task_id)
            self._waiting[task_id] = (generation, now, True)

    def _record(self, tool: str, duration_s: float) -> None:
        history = self._history.setdefault(tool, deque(maxlen=self.history_window))
        history.append(duration_s)
        self._all.append(duration_s)

    def _expire(self, now: float) -> None:
        for task_id, expiry in list(self._pins.items()):
            if now > expiry and task_id not in self._waiting:
                del self._pins[task_id]

    def _key(self, task_id: str) -> tuple[bool, bool, float, int]:
        generation, _, preempted = self._waiting[task_id]
        return (not preempted, task_id not in self._pins, generation.spec.arrival_time,
                generation.seq)

    def _make_plan(self, ctx: AdmissionContext, preempting: bool) -> dict[str, Eviction]:
        self._arrivals(ctx)
        self._expire(ctx.now)
        slots = ctx.max_batch - len(ctx.running)
        order = sorted(self._waiting, key=self._key)
        budget = KvBudget.of(ctx.engine) if preempting else None
        decisions: dict[str, Eviction] = {}
        plan: list[str] = []
        if budget is not None:
            free, victims = budget.free, self._victims(budget, set(order))
        for task_id in order:
            if len(plan) >= slots:
                break
            if budget is not None:
                need = budget.need(task_id)
                while need > free and victims:
                    victim = victims.pop()
                    self._pins.pop(victim, None)           # a pinned victim is unpinned
                    decisions[victim] = 'host'
                    free += budget.resident(victim)
                if need > free:
                    break                                  # Algorithm 1: no back-filling
                free -= need
            plan.append(task_id)
        self._plan = {task_id: rank for rank, task_id in enumerate(plan)}
        return decisions

    def _victims(self, budget: KvBudget, waiting: set[str]) -> list[str]:
        """Suspended contexts still on the GPU whose requests have not arrived, the last to
        take first: pinned ones, the program that arrived latest taken first, after the
        unpinned ones, the least recently suspended taken first."""
        pinned: list[tuple[float, int, str]] = []
        unpinned: list[tuple[float, int, str]] = []
        for task_id, (generation, _, ended) in self._in_tool.items():
            if task_id in waiting or not budget.resident(task_id):
                continue
            if task_id in self._pins:
                pinned.append((generation.spec.arrival_time, generation.seq, task_id))
            else:
                unpinned.append((-ended, -generation.seq, task_id))
        pinned.sort()           # popped from the end: the latest program first
        unpinned.sort()         # popped from the end: the least recently suspended first
        return [t for *_, t in pinned] + [t for *_, t in unpinned]

    def _unplanned_priority(self, task_id: str) -> float | None:
        if task_id not in self._waiting:
            return None
        not_preempted, unpinned, arrival, _ = self._key(task_id)
        return -(arrival + RANK_SCALE * (unpinned + 2 * not_preempted))

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if candidate.task_id not in self._waiting:      # its robot is still executing
            return False
        return super().admit(candidate, ctx)

    def _on_admitted(self, generation: Generation, ctx: AdmissionContext) -> None:
        task_id = generation.task_id
        _, arrived, _ = self._waiting.pop(task_id)
        self._pins.pop(task_id, None)
        self._running[task_id] = generation
        kv = ctx.engine.kv
        if kv is not None and generation.k > 0 and kv.location(task_id) != 'gpu':
            self._delays.append(ctx.now - arrived)        # it waited with its KV evicted
