"""SLICE (paper 004, Zhou, Lei et al.): utility-rate task selection under a one-second decode
cycle, and a decode-mask matrix that gives each selected generation its required tokens/s.

The algorithm, as this module implements it (paper §IV-C to §IV-E):

1. **Required rate and utility** of every unfinished generation. A task's required decode rate
   is ``v_i = ⌈1 / T_TPOT,i⌉`` tokens/s. Its utility rate is ``r_i = U_i · T_TPOT,i`` (eq. 6),
   the utility earned per token of required rate.
2. **Selection** (Alg. 2): take the pending generations by descending ``r_i``; add each to the
   selected set ``b`` (kept sorted by descending rate ``v_0 ≥ v_1 ≥ …``) while the cycle estimate
   of eq. 7 stays below the budget (1 s)::

       T_period = v_b·l(b+1) + Σ_{j<b} (v_j − v_{j+1})·l(j+1)

   with ``l(n)`` the decode-step time at batch ``n``; stop at the first misfit (no attempt to
   fit smaller tasks afterwards).
3. **Rate allocation** (Alg. 3): the decode-mask matrix ``M`` of size ``|b| × v_0`` whose row
   ``k`` holds ``v_k`` ones then zeros, scanned column by column: each scheduler iteration
   decodes exactly the generations with a 1 in the current column (:meth:`decode_mask`), then
   the column pointer advances, wrapping to column 0 after ``v_0 − 1``.
4. **Online wrapper** (Alg. 4): arrivals, departures and segment cuts mark the plan dirty; the
   next tick re-runs selection from scratch (after the :meth:`SlicePolicy.utility_adaptor`
   hook), rebuilds the matrix and restarts at column 0. Running generations that are not
   re-selected are preempted with their KV kept resident (``'keep'``); only selected
   generations are admitted.

Errata honoured (rivals digest §4 and §6):

* eq. 6 is printed as ``X_i · T_TPOT,i``; it is ``U_i · T_TPOT,i`` (its own derivation).
* Alg. 3's loop ``for m = 0..v_k`` would write ``v_k + 1`` ones; row k holds ``v_k`` ones.
* The matrix is ``|b| × v_0`` (the fastest rate), not ``|b| × v_1``.
* eq. 2's TTFT inequality is printed ``≥``; it is ``≤`` (used only in the metrics; see below).

Mapping onto this package, and the constants chosen (all constructor parameters):

* **Not segmented, streaming** (like ``vllm-stream``): SLICE provides continuous rate control
  instead of suspend/resume, and each executable action is streamed to its robot as it appears.
* **Real-time (RT) tasks** are the task classes in ``rt_classes`` (default: ``urgent``). Their
  utility is ``U = β·rt_utility_factor`` (β of the TUF; factor 10, the low end of the paper's
  "10–100× the NRT utility"; the authors' code uses 100 for its RT class). Their deadline is the
  TUF's zero-utility time ``ERT − β/α`` after arrival (a response later than that is worthless),
  and their required rate is ``v = ⌈N̂ / (deadline − TTFT)⌉`` (the digest's conversion; the paper
  gives none), with ``N̂`` the whole plan's predicted output tokens from the shared length
  predictor (:mod:`timelyllm_ros.core.predictors`, fitted on the bundled traces) and ``TTFT`` =
  time already waited + the engine's prefill estimate when the task is first planned. The rate
  is fixed then (SLICE's SLOs are static per task).
* **Non-real-time (NRT) tasks**: ``U = β`` and an explicit TPOT per task class, ``tpot_s``:
  robot tasks (``normal``, ``arm``) 50 ms = 20 tokens/s, ``chatbot`` 100 ms = 10 tokens/s
  (SLICE's text-Q&A rate); ``default_tpot_s`` (50 ms) for any other class.
* **Rate cap**: a required rate above what the engine can give a task decoding alone
  (``v·l(1) < budget``) cannot be met anyway; it is capped at ``⌈budget/l(1)⌉ − 1`` so that every
  task fits alone and selection never comes out empty (liveness). The utility rate uses the
  capped rate.
* ``l(b)``: the engine's latency model, ``engine.decode_step_s(b)`` at the current contexts
  (the paper profiles a table); ``step_table_s`` gives a profiled table instead (the authors'
  code hard-codes ``{14, 27, 38, 50, 60, 72, 83, 125, 126, 123, 124, 125, 126, 123, 124}`` ms;
  beyond its end the last entry is used).
* ``period_budget_s`` = 1 s (the code multiplies it by a slack ratio: pass e.g. 0.9).
* ``max_selected``: the authors' code caps selection at 16 (the length of its l(b) table);
  here ``None`` (only eq. 7 and the run's batch cap bound it).
* Rates are rounded up, ``⌈1/TPOT⌉``, as the paper says (the code truncates).
* Ties in ``r_i`` go to the earlier request.
* **Prefill**: neither algorithm says when a newly selected task is prefilled. Here it joins
  the batch in the tick it is selected and the engine prefills it in the next iteration (the
  start of the rebuilt cycle); that iteration does not advance the column pointer. Prefill
  time is not in eq. 7 (as in the paper), and there is no TTFT admission test: every task of a
  robot fleet must get its plan, so none is refused.
* **UtilityAdaptor**: the hook exists (:meth:`SlicePolicy.utility_adaptor`) and, as in the
  public code (``UpdateTaskUtility`` is empty), changes nothing by default.
* ``replan_on_cut``: the brief's "segment events" re-plan too (default on). Selection does not
  change at a cut (utilities and rates are static), but the cycle restarts at column 0, where
  every selected task decodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import AdmissionContext, fits
from timelyllm_ros.core.predictors import LengthPredictor, bundled_length_predictor
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation
from timelyllm_ros.engines.base import StepResult
from timelyllm_ros.policies.base import Eviction, Policy

SLICE_CODE_STEP_TABLE_MS = (14, 27, 38, 50, 60, 72, 83, 125, 126, 123, 124, 125, 126, 123, 124)
"""l(b) for b = 1…15 in ms, hard-coded in the authors' FastLLM integration (ChatGLM2-6B-INT4 on an
RTX 4060 Ti)."""

DEFAULT_TPOT_S: Mapping[str, float] = {'normal': 0.05, 'arm': 0.05, 'chatbot': 0.1}
"""TPOT SLO per NRT task class (s/token)."""


# -- the algorithm, as pure functions ---------------------------------------------------------
def rate_for_tpot(tpot_s: float) -> int:
    """Required rate ``⌈1 / T_TPOT⌉`` tokens/s (rounded to 1e-9 first, so 50 ms gives 20)."""
    if not tpot_s > 0:
        raise ValueError(f'TPOT must be > 0 s, got {tpot_s}')
    return max(math.ceil(round(1.0 / tpot_s, 9)), 1)


def period_s(rates: Sequence[int], step_s: Callable[[int], float]) -> float:
    """Cycle length of eq. 7 for rates sorted in descending order (``step_s(n)`` = l(n))."""
    if not rates:
        return 0.0
    b = len(rates) - 1
    total = rates[b] * step_s(b + 1)
    for j in range(b):
        total += (rates[j] - rates[j + 1]) * step_s(j + 1)
    return total


def decode_mask_matrix(rates: Sequence[int]) -> NDArray[np.int8]:
    """The ``|b| × v_0`` decode-mask matrix (Alg. 3, errata fixed): row k = ``v_k`` ones, then
    zeros. ``rates`` must be sorted in descending order."""
    rates = list(rates)
    if any(a < b for a, b in zip(rates, rates[1:], strict=False)):
        raise ValueError('rates must be sorted in descending order')
    if not rates:
        return np.zeros((0, 0), dtype=np.int8)
    columns = np.arange(rates[0])
    return (columns[None, :] < np.array(rates)[:, None]).astype(np.int8)


def column_batches(rates: Sequence[int]) -> list[int]:
    """Batch size of each column of the decode-mask matrix (one decode step each)."""
    return [int(c) for c in decode_mask_matrix(rates).sum(axis=0)]


@dataclass(frozen=True, slots=True)
class SliceTask:
    """One generation as SLICE's selection sees it."""

    task_id: str
    utility: float           # U_i
    rate: int                # v_i, required tokens/s
    seq: int = 0             # submission order (tie-break)

    @property
    def tpot_s(self) -> float:
        return 1.0 / self.rate

    @property
    def utility_rate(self) -> float:
        """r_i = U_i · T_TPOT,i (eq. 6, erratum fixed)."""
        return self.utility * self.tpot_s


def select_tasks(tasks: Sequence[SliceTask], step_s: Callable[[int], float],
                 budget_s: float = 1.0, max_selected: int | None = None) -> list[SliceTask]:
    """Alg. 2: greedy by descending utility rate while eq. 7 stays below ``budget_s``; stop at
    the first misfit. Returns the selected tasks sorted by descending rate (the matrix's rows).

    If even the first task does not fit alone (``v·l(1) ≥ budget``), it is selected anyway so
    that the engine never idles with work pending; callers cap rates to avoid that case.
    """
    ranked = sorted(tasks, key=lambda t: (-t.utility_rate, t.seq))
    selected: list[SliceTask] = []
    for task in ranked:
        if max_selected is not None and len(selected) >= max_selected:
            break
        trial = sorted([*selected, task], key=lambda t: (-t.rate, t.seq))
        if period_s([t.rate for t in trial], step_s) >= budget_s and selected:
            break
        selected = trial
    return selected


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """The current selection: task ids and rates by descending rate, and eq. 7's estimate."""

    time: float
    task_ids: tuple[str, ...]
    rates: tuple[int, ...]
    period_s: float

    def column(self, j: int) -> tuple[str, ...]:
        """Task ids with a 1 in column ``j`` of the matrix (a prefix: rates are sorted)."""
        n = 0
        while n < len(self.rates) and self.rates[n] > j:
            n += 1
        return self.task_ids[:n]


# -- the policy -------------------------------------------------------------------------------
class SlicePolicy(Policy):
    """SLICE (Zhou, Lei et al., "SLICE: SLO-Driven Scheduling for LLM Inference on Edge
    Devices", paper 004): see the module docstring for the algorithm, the errata fixed and every
    constant chosen."""

    name = 'slice'
    description = 'utility-rate selection under a 1 s decode cycle, decode-mask rate control'
    segmented = False
    streaming = True

    def __init__(
        self,
        *,
        rt_classes: Collection[str] = ('urgent',),
        rt_utility_factor: float = 10.0,
        tpot_s: Mapping[str, float] | None = None,
        default_tpot_s: float = 0.05,
        period_budget_s: float = 1.0,
        step_table_s: Sequence[float] | None = None,
        max_selected: int | None = None,
        replan_on_cut: bool = True,
        length_predictor: LengthPredictor | None = None,
    ) -> None:
        """Args:
            rt_classes: task classes treated as real-time (rate from the TUF's deadline).
            rt_utility_factor: RT utility = TUF β × this factor (NRT utility = β).
            tpot_s: TPOT SLO (s/token) per NRT task class.
            default_tpot_s: TPOT SLO of a class missing from ``tpot_s``.
            period_budget_s: the cycle budget of eq. 7 (1 s in the paper).
            step_table_s: a profiled l(b) table (s, b = 1, 2, …) instead of the engine's model.
            max_selected: cap on the selected set (None: eq. 7 and the batch cap only).
            replan_on_cut: re-plan (restart the cycle) at every streamed segment cut too.
            length_predictor: N̂ for RT rates; the shared bucket predictor fitted on the bundled
                traces by default.
        """
        if not rt_utility_factor > 0 or not period_budget_s > 0 or not default_tpot_s > 0:
            raise ValueError('rt_utility_factor, period_budget_s and default_tpot_s must be > 0')
        self.rt_classes = frozenset(rt_classes)
        self.rt_utility_factor = rt_utility_factor
        self.tpot_s = dict(DEFAULT_TPOT_S if tpot_s is None else tpot_s)
        for value in self.tpot_s.values():
            rate_for_tpot(value)   # validates
        self.default_tpot_s = default_tpot_s
        self.period_budget_s = period_budget_s
        self.step_table_s = tuple(step_table_s) if step_table_s is not None else None
        self.max_selected = max_selected
        self.replan_on_cut = replan_on_cut
        self._predictor = length_predictor
        self.plan: SlicePlan | None = None
        self.replans = 0
        self._dirty = False
        self._selected: dict[str, int] = {}        # task id -> rank in the selection order
        self._rt_rate: dict[str, float] = {}       # task id -> required RT rate (uncapped)
        self._column = 0
        self._mask: frozenset[str] | None = None   # the column handed to the last iteration

    # -- inputs -------------------------------------------------------------------------------
    @property
    def length_predictor(self) -> LengthPredictor:
        if self._predictor is None:

            self._predictor = bundled_length_predictor()
        return self._predictor

    def is_rt(self, generation: Generation) -> bool:
        return generation.spec.task_class in self.rt_classes

    def utility_adaptor(self, generation: Generation, utility: float) -> float:
        """SLICE's UtilityAdaptor (Alg. 4): change a task's utility before each re-plan, e.g.
        lower it for tasks that generated many tokens. Identity, as in the public code."""
        return utility

    def step_s(self, batch: int, ctx: AdmissionContext) -> float:
        """l(batch): the profiled table if given, else the engine's latency model."""
        if self.step_table_s is not None:
            return self.step_table_s[min(batch, len(self.step_table_s)) - 1]
        return ctx.engine.decode_step_s(batch)

    def _required_rate(self, generation: Generation, ctx: AdmissionContext) -> float:
        spec = generation.spec
        if not self.is_rt(generation):
            return rate_for_tpot(self.tpot_s.get(spec.task_class, self.default_tpot_s))
        rate = self._rt_rate.get(spec.task_id)
        if rate is None:
            tokens = max(self.length_predictor.predict(spec), 1)
            ttft = (ctx.now - spec.arrival_time) + ctx.engine.run_cost_s(spec.task_id)
            slack = spec.tuf.zero_s - ttft
            rate = math.ceil(tokens / slack) if slack > 0 else math.inf
            self._rt_rate[spec.task_id] = rate
        return rate

    def _utility(self, generation: Generation) -> float:
        beta = generation.spec.tuf.beta
        return beta * self.rt_utility_factor if self.is_rt(generation) else beta

    # -- re-planning ---------------------------------------------------------------------------
    def _replan(self, ctx: AdmissionContext) -> SlicePlan:
        memo: dict[int, float] = {}

        def step(batch: int) -> float:
            if batch not in memo:
                memo[batch] = self.step_s(batch, ctx)
            return memo[batch]

        alone = step(1)
        max_rate = max(math.ceil(self.period_budget_s / alone) - 1, 1) if alone > 0 else 10**6
        tasks = []
        for generation in (*ctx.running, *ctx.queued):
            rate = int(min(self._required_rate(generation, ctx), max_rate))
            utility = self.utility_adaptor(generation, self._utility(generation))
            tasks.append(SliceTask(generation.task_id, utility, rate, generation.seq))
        cap = ctx.max_batch if self.max_selected is None else min(self.max_selected,
                                                                  ctx.max_batch)
        selected = select_tasks(tasks, step, self.period_budget_s, cap)
        plan = SlicePlan(time=ctx.now, task_ids=tuple(t.task_id for t in selected),
                         rates=tuple(t.rate for t in selected),
                         period_s=period_s([t.rate for t in selected], step))
        ranked = sorted(selected, key=lambda t: (-t.utility_rate, t.seq))
        self._selected = {t.task_id: i for i, t in enumerate(ranked)}
        self._column = 0
        self._dirty = False
        self.replans += 1
        self.plan = plan
        return plan

    # -- Policy hooks ---------------------------------------------------------------------------
    def preempt(self, ctx: AdmissionContext) -> Mapping[str, Eviction]:
        if not self._dirty:
            return {}
        self._replan(ctx)
        return {g.task_id: 'keep' for g in ctx.running if g.task_id not in self._selected}

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        if not self._selected:
            return np.full(len(queue), -np.inf)
        # Selected generations by descending utility rate; unselected ones last (not admitted).
        rank = self._selected
        return np.array([-rank.get(task_id, np.inf) for task_id in queue.task_ids], dtype=float)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        return candidate.task_id in self._selected and fits(candidate, ctx)

    def decode_mask(self, ctx: AdmissionContext) -> Collection[str] | None:
        self._mask = None
        plan = self.plan
        if plan is None or not plan.rates or not ctx.running:
            return None
        running = {g.task_id for g in ctx.running}
        width = plan.rates[0]
        for offset in range(width):
            j = (self._column + offset) % width
            column = running.intersection(plan.column(j))
            if column:
                self._column = j
                self._mask = frozenset(column)
                return self._mask
        return None   # no running generation is selected (cannot happen after a re-plan)

    def on_step(self, result: StepResult, stepped: Sequence[Generation],
                ctx: AdmissionContext) -> None:
        mask, self._mask = self._mask, None
        if mask is None or self.plan is None or result.prefill_tokens:
            return   # a prefill iteration ignores the mask: the column is still due
        if all(g.task_id in mask for g in stepped):
            self._column = (self._column + 1) % self.plan.rates[0]

    def on_submit(self, generation: Generation, now: float) -> None:
        self._dirty = True

    def on_cut(self, generation: Generation, now: float) -> None:
        if self.replan_on_cut:
            self._dirty = True

    def on_end(self, generation: Generation, now: float) -> None:
        self._dirty = True
        self._rt_rate.pop(generation.task_id, None)
