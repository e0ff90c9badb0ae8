"""Semantic Scheduling (paper 001: Hua, Ding et al., "Semantic Scheduling for LLM Inference").

Strict urgency classes, then shortest predicted remaining time, over a scheduling heap and an
eviction heap; stage-aware batch formation (Alg. 2) and priority-based KV eviction with the
keep-or-recompute rule (Alg. 4). Implemented from the paper and ``../shared/papers/
rivals-digest.md`` §1, mapped onto this package's scheduler loop:

* **Keys.** Each generation gets the lexicographic key ``(f_e, f_t)``, smallest first:
  ``f_e`` from a pluggable :class:`~timelyllm_ros.core.predictors.UrgencyClassifier` (default: the
  request's TUF class, :class:`~timelyllm_ros.core.predictors.TufClassUrgency`: urgent 0,
  normal/arm 1, chatbot 2); ``f_t`` = the predicted remaining computation time of the *whole
  request*: ``engine.run_cost_s`` (its pending prefill, re-prefill or swap-in, i.e. the
  authors' code's "pending KV reload time") + ``max(N̂ − tokens so far, 1) · t_tok``, with N̂
  from a pluggable :class:`~timelyllm_ros.core.predictors.LengthPredictor` (default: the bucket
  predictor fitted on the bundled LRTrace traces) and ``t_tok`` one decode step of a lone
  request from the engine's latency model (``engine.decode_step_s(1)``, read once: the
  paper's simulator charges nothing for batch size, so the key is a per-request time).
  Ties go to the earlier submission.
* **Segmented and streaming.** Each executable segment is sent when it is cut and the
  generation re-enters the scheduling heap like a new arrival (digest §1.6), still keyed by
  the remaining time of the whole request. Cuts are where the paper's iteration-level
  preemption becomes cheap (the KV stays resident), and streaming gets actions to robots
  without waiting for the whole plan.
* **Heaps.** ``U`` (arrivals, cuts, preemptions) is drained into the min-heap ``H`` keyed
  ``(f_e, f_t)`` at each decision (Alg. 5's insertion thread, made synchronous); top-b
  extraction pops H, so a decision costs O(b log n) plus the vector the scheduler asks for.
  Entries are invalidated lazily: a popped entry whose key changed (the engine swapped or
  dropped its KV, which adds reload time) is re-pushed with its new key. ``G`` is the
  eviction min-heap keyed ``(−f_e, −f_t)`` over generations admitted to the GPU, validated
  the same way (a popped entry whose KV is no longer resident is discarded). Both heaps are
  compacted once their entries exceed twice the live generations (plus a constant): stale
  and duplicate entries and those of ended generations go, so the policy's state stays
  O(live) over any number of goals (:func:`stale_limit`).
* **Alg. 2, stage-aware batch formation** (every tick, in :meth:`preempt`): ``C`` = top-b of
  H; ``p*`` = the best of ``C ∪ O`` (O = running). A queued generation is in the *prefill*
  stage when joining costs an extra iteration (``engine.run_cost_s > 0``: a fresh prompt,
  a dropped context or a swap-in, all of which stall every decode in a vLLM-0.5 style
  iteration); running and KV-resident suspended ones are in the *decode* stage. If ``p*`` is
  decoding, the prefill-stage members of C are held out of this iteration. ``B_next`` = the
  b best of what remains plus O; running generations outside ``B_next`` are preempted with
  their KV kept resident (``'keep'``), and :meth:`admit` accepts exactly the queued members
  of ``B_next``, in key order.
* **Alg. 4, priority-based eviction.** Before a queued member r of ``B_next`` allocates KV
  beyond the free GPU blocks, the root of G (least urgent, longest remaining) is evicted until
  r fits: a running victim is preempted, a suspended one is evicted in place (the generic
  "preempt a queued generation" case of :meth:`Policy.preempt`). Where its KV goes follows
  the keep-or-recompute rule below. Edge cases the paper leaves open (digest §1.2): r is never
  its own victim, and r is **not** admitted (this tick) if the root of G outranks it, so an
  urgent generation is never evicted for a less urgent one. Needs an engine exposing its KV
  accounting (``engine.kv`` and ``engine.lookahead_tokens``, as the simulator does);
  otherwise the engine's own eviction applies and only ordering/admission are steered. The
  engine may still evict paused contexts on its own (LRU) when a *running* generation grows
  past its reserved blocks.

Errata and corrections implemented (digest §1.2):

* Keep-or-recompute, prompt tokens: the paper's sentence states the inequality the wrong
  way round; the logical rule (as in the authors' code) is used: offload iff
  ``β·n < α1·n² + α2·n`` (:meth:`PaperCostModel.offload_prompt`).
* Decoded tokens: eq. 6 has the wrong denominator (2γ1 for γ1) and returns the number to
  *recompute*, not to save. :meth:`PaperCostModel.recompute_decoded` uses the marginal rule
  (recompute the k-th decoded token iff ``γ1(n + k) + γ2 < β``, the exact integer minimiser of
  eq. 5), so with β ≪ γ2 (every published profile) all decoded KV is kept;
  :meth:`PaperCostModel.paper_eq6` keeps the printed formula for comparison.
* Engines here evict a context whole (``'host'`` or ``'none'``), so the eviction target is the
  cheaper of the two whole-context options under the cost model: ``'host'`` iff
  ``offload_s(n, m) < recompute_s(n, m)``. With no decoded tokens this is exactly the corrected
  prompt rule; decoded tokens add ``β`` per token to offloading and their recompute cost to
  recomputing, so the decoded-token erratum pushes towards keeping (offloading) the KV.
* The A100 + Qwen1.5-4B α1 printed as 1.466e-2 is 1.466e-9 in the authors' code (used here).
* Alg. 5 writes f_p for f_e (typo); ExtractTopb also sees U (drained first here).

Constants chosen (constructor parameters): ``batch_size`` b = 16 (the authors' simulator;
capped by the run's batch cap); ``cost_model`` = the engine's own latency model when it has a
calibration (:class:`EngineCostModel`: swap-in time vs one re-prefill pass over the context,
the recompute model the simulator uses for every policy), else always ``'host'`` (the
paper's A100 conclusion); or any :class:`PaperCostModel` (``PAPER_PROFILES``);
``stage_aware`` and ``priority_eviction`` on; no predictor latency (predictions are
instantaneous, "immediate processing" with 0 s).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from timelyllm_ros.core.admission import AdmissionContext
from timelyllm_ros.core.predictors import (
    LengthPredictor,
    TufClassUrgency,
    UrgencyClassifier,
    bundled_length_predictor,
)
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.engines.base import CostModel, EngineView, EvictTo, KvAccounting, StepResult
from timelyllm_ros.policies.base import Eviction
from timelyllm_ros.policies.planned import PlannedBatchPolicy

Key = tuple[int, float, int]            # (f_e, f_t s, seq): smaller runs sooner
QUEUED = (TaskStatus.WAITING, TaskStatus.SUSPENDED)
URGENCY_SCALE = 1e6                     # f_e weight when (f_e, f_t) is flattened to one number
STALE_SLACK = 64                        # heap entries tolerated beyond 2 per live generation


def stale_limit(live: int) -> int:
    """Size above which a lazily invalidated heap is compacted: ``2·live + STALE_SLACK``, so
    the heaps stay O(live) however many generations have come and gone."""
    return 2 * live + STALE_SLACK


# -- the keep-or-recompute rule ---------------------------------------------------------------
class EvictionCostModel(Protocol):
    """Prices the two ways out for an evicted context of n prompt and m decoded tokens."""

    def evict_to(self, n: int, m: int) -> EvictTo:
        """``'host'`` (offload, reload later) or ``'none'`` (drop, recompute later)."""
        ...


@dataclass(frozen=True, slots=True)
class PaperCostModel:
    """The paper's time model (§3, App. B): prefill ``α1·n² + α2·n``; the m'-th decoded token
    after an n-token prompt ``γ1·(n + m' − 1) + γ2``; moving KV ``β`` per token."""

    alpha1: float
    alpha2: float
    gamma1: float
    gamma2: float
    beta: float

    def prefill_s(self, n: int) -> float:
        return self.alpha1 * n * n + self.alpha2 * n

    def decode_s(self, n: int, m: int) -> float:
        """Paper eq. 4: decoding m tokens after an n-token prompt."""
        return self.gamma1 * (m * m / 2 + n * m + m / 2) + self.gamma2 * m

    def offload_prompt(self, n: int) -> bool:
        """Corrected rule: offload the prompt's KV iff ``β·n < α1·n² + α2·n`` (the paper's
        sentence has the inequality reversed; erratum)."""
        return self.beta * n < self.prefill_s(n)

    def recompute_decoded(self, n: int, m: int) -> int:
        """How many of the m decoded tokens to recompute (the rest are offloaded; corrects
        eq. 6): the marginal rule, recompute the k-th iff its cost ``γ1·(n + k) + γ2 < β``.

        This is the exact integer minimiser of eq. 5; its continuous optimum is
        ``r* = (β − γ1·n − (γ1 + 2γ2)/2) / γ1``. (The paper's per-token wording,
        ``γ1·(n + k − 1) + γ2``, disagrees with its own eq. 4 by one γ1 per token; eq. 4/5
        are followed here.)"""
        if m <= 0:
            return 0
        if self.gamma1 <= 0.0:
            return m if self.gamma2 < self.beta else 0
        bound = (self.beta - self.gamma2) / self.gamma1 - n      # recompute k iff k < bound
        return int(min(max(math.ceil(bound) - 1, 0), m))

    def saved_decoded(self, n: int, m: int) -> int:
        """Decoded tokens whose KV is kept (offloaded) rather than recomputed."""
        return m - self.recompute_decoded(n, m)

    def paper_eq6(self, n: int) -> float:
        """Eq. 6 as printed, ``max(0, (β − γ1·n − (γ1 + 2γ2)/2) / (2γ1))`` -- wrong (erratum);
        kept only to show the correction."""
        return max(0.0, (self.beta - self.gamma1 * n - (self.gamma1 + 2 * self.gamma2) / 2)
                   / (2 * self.gamma1))

    def resume_s(self, n: int, m: int, saved: int) -> float:
        """Eq. 5: reload ``saved`` decoded tokens, recompute the other ``r = m − saved``."""
        r = m - saved
        return self.beta * saved + self.gamma1 * (r * r / 2 + n * r + r / 2) + self.gamma2 * r

    def offload_s(self, n: int, m: int) -> float:
        return self.beta * (n + m)

    def recompute_s(self, n: int, m: int) -> float:
        return self.prefill_s(n) + self.decode_s(n, m)

    def evict_to(self, n: int, m: int) -> EvictTo:
        return 'host' if self.offload_s(n, m) < self.recompute_s(n, m) else 'none'


PAPER_PROFILES: dict[str, PaperCostModel] = {
    # paper App. B; the A100-4B α1 is the authors' code value (the paper prints 1.466e-2).
    'a100-qwen1.5-4b': PaperCostModel(alpha1=1.466e-9, alpha2=1.052e-4, gamma1=5.913e-9,
                                      gamma2=1.196e-2, beta=1e-4),
    'a100-qwen1.5-7b': PaperCostModel(alpha1=5.135e-7, alpha2=1.481e-4, gamma1=1.349e-8,
                                      gamma2=1.330e-2, beta=1e-4),
    'a5000-qwen1.5-7b': PaperCostModel(alpha1=1.859e-9, alpha2=2.175e-4, gamma1=2.117e-6,
                                       gamma2=2.727e-2, beta=3e-4),
    'a5000-qwen1.5-4b': PaperCostModel(alpha1=1.586e-9, alpha2=1.305e-4, gamma1=2.869e-6,
                                       gamma2=3.008e-2, beta=3e-4),   # authors' code only
}


class EngineCostModel:
    """Keep-or-recompute priced with the engine's own latency model (``prefill_s``,
    ``swap_in_s``): offloading costs the swap-in of the whole context, recomputing one prefill
    pass over it (how the simulated engine, like vLLM's recompute preemption, rebuilds a
    dropped context)."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    def offload_s(self, n: int, m: int) -> float:
        return float(self.costs.swap_in_s(n + m))

    def recompute_s(self, n: int, m: int) -> float:
        return float(self.costs.prefill_s(n + m))

    def evict_to(self, n: int, m: int) -> EvictTo:
        return 'host' if self.offload_s(n, m) < self.recompute_s(n, m) else 'none'


class _AlwaysOffload:
    def evict_to(self, n: int, m: int) -> EvictTo:
        return 'host'


# -- KV accounting of an admission plan -------------------------------------------------------
class KvBudget:
    """Mirrors the block arithmetic of an engine's KV accounting (``blocks``, ``tokens``,
    ``location``, ``gpu_free``) so a policy can plan admissions and evictions before the
    engine places anything. ``None`` from :meth:`of` when the engine does not expose it."""

    def __init__(self, kv: KvAccounting, lookahead_tokens: int) -> None:
        self.kv = kv
        self.lookahead = lookahead_tokens

    @classmethod
    def of(cls, engine: EngineView) -> KvBudget | None:
        if engine.kv is None:
            return None
        return cls(engine.kv, engine.lookahead_tokens)

    @property
    def free(self) -> int:
        return int(self.kv.gpu_free)

    def resident(self, task_id: str) -> int:
        """GPU blocks the context holds now (0 when swapped out, dropped or unknown)."""
        try:
            if self.kv.location(task_id) != 'gpu':
                return 0
            return int(self.kv.blocks(self.kv.tokens(task_id)))
        except KeyError:
            return 0

    def need(self, task_id: str) -> int:
        """Extra GPU blocks placing the context for running takes (lookahead included)."""
        tokens = self.kv.tokens(task_id)
        extra = self.kv.blocks(tokens + self.lookahead)
        return int(extra - self.resident(task_id))

    def context_tokens(self, task_id: str) -> int:
        return int(self.kv.tokens(task_id))


# -- the policy --------------------------------------------------------------------------------
class SemanticPolicy(PlannedBatchPolicy):
    """Semantic Scheduling (paper 001): urgency classes, then shortest predicted remaining
    time; stage-aware batches; priority-based KV eviction. See the module docstring for the
    mapping, the errata it corrects and the constants it chose."""

    name: ClassVar[str] = 'semantic'
    description: ClassVar[str] = ('urgency class, then shortest predicted remaining time; '
                                  'stage-aware batches, priority KV eviction (Hua et al.)')
    segmented: ClassVar[bool] = True
    streaming: ClassVar[bool] = True

    def __init__(self, batch_size: int = 16, length_predictor: LengthPredictor | None = None,
                 urgency: UrgencyClassifier | None = None,
                 cost_model: EvictionCostModel | None = None, stage_aware: bool = True,
                 priority_eviction: bool = True, token_s: float | None = None) -> None:
        """Args:
            batch_size: b, the fixed batch size of Alg. 2 (16, the authors' simulator);
                the run's batch cap applies too.
            length_predictor: N̂ of a whole plan (default: bucket predictor on the bundled
                traces).
            urgency: f_e classifier (default: the request's TUF class).
            cost_model: keep-or-recompute pricing (default: the engine's calibration).
            stage_aware: Alg. 2's hold-out of prefills while the best generation decodes.
            priority_eviction: Alg. 4 (needs an engine exposing its KV accounting).
            token_s: seconds per decoded token in f_t (default: ``engine.decode_step_s(1)``).
        """
        super().__init__()
        if batch_size < 1:
            raise ValueError(f'batch size must be >= 1, got {batch_size}')
        self.batch_size = batch_size
        self._predictor = length_predictor
        self.urgency = urgency or TufClassUrgency()
        self.cost_model = cost_model
        self.stage_aware = stage_aware
        self.priority_eviction = priority_eviction
        self.token_s = token_s
        self._gens: dict[str, Generation] = {}
        self._fe: dict[str, int] = {}
        self._length: dict[str, int] = {}
        self._key: dict[str, Key] = {}          # last key pushed to H or G
        self._arrived: list[str] = []           # U
        self._heap: list[tuple[int, float, int, str]] = []          # H
        self._evict_heap: list[tuple[int, float, int, str]] = []    # G: (−f_e, −f_t, −seq)
        self.stats: Counter[str] = Counter()

    # -- predictors and prices --------------------------------------------------------------
    @property
    def length_predictor(self) -> LengthPredictor:
        if self._predictor is None:
            self._predictor = bundled_length_predictor()
        return self._predictor

    def _prepare(self, engine: EngineView) -> None:
        if self.token_s is None:
            self.token_s = engine.decode_step_s(1)
        if self.cost_model is None:
            self.cost_model = (EngineCostModel(engine.costs) if engine.costs is not None
                               else _AlwaysOffload())

    def remaining_tokens(self, generation: Generation) -> int:
        """Predicted tokens still to generate (≥ 1 while generating)."""
        return max(self._length.get(generation.task_id, 1) - generation.tokens, 1)

    def key(self, generation: Generation, engine: EngineView) -> Key:
        """The current ``(f_e, f_t, seq)`` of a generation."""
        task_id = generation.task_id
        reload_s = engine.run_cost_s(task_id) if generation.status != TaskStatus.RUNNING else 0.0
        f_t = reload_s + self.remaining_tokens(generation) * (self.token_s or 0.0)
        return (self._fe[task_id], f_t, generation.seq)

    # -- observers ----------------------------------------------------------------------------
    def on_submit(self, generation: Generation, now: float) -> None:
        task_id = generation.task_id
        self._gens[task_id] = generation
        self._fe[task_id] = int(self.urgency.classify(generation.spec))
        self._length[task_id] = max(int(self.length_predictor.predict(generation.spec)), 1)
        self._arrived.append(task_id)

    def on_suspend(self, generation: Generation, now: float) -> None:
        self._arrived.append(generation.task_id)       # a resumed segment re-enters like new

    def on_step(self, result: StepResult, stepped: Any, ctx: AdmissionContext) -> None:
        super().on_step(result, stepped, ctx)
        self._arrived.extend(result.preempted)          # the engine ran out of KV for them
        if result.prefill_tokens:
            # A prefill may have cached a shared prompt prefix: fresh prompts got cheaper.
            self._arrived.extend(g.task_id for g in ctx.queued if g.tokens == 0)

    def on_end(self, generation: Generation, now: float) -> None:
        task_id = generation.task_id
        self._gens.pop(task_id, None)
        self._untrack(generation)
        self._fe.pop(task_id, None)
        self._length.pop(task_id, None)
        self._key.pop(task_id, None)
        self._compact_heap()
        self._compact_evict_heap()

    # -- the heaps ----------------------------------------------------------------------------
    def _push(self, generation: Generation, engine: EngineView) -> None:
        key = self.key(generation, engine)
        self._key[generation.task_id] = key
        heapq.heappush(self._heap, (key[0], key[1], key[2], generation.task_id))

    def _drain_arrivals(self, engine: EngineView) -> None:
        arrived, self._arrived = self._arrived, []
        for task_id in arrived:
            generation = self._gens.get(task_id)
            if generation is not None and generation.status in QUEUED:
                self._push(generation, engine)
        self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop H's stale entries once they outnumber the live generations: those whose key
        is no longer the generation's last (or whose generation ended), and duplicates."""
        if len(self._heap) <= stale_limit(len(self._gens)):
            return
        current = {e[3]: e for e in self._heap if self._key.get(e[3]) == e[:3]}
        self._heap = list(current.values())                    # one per live generation
        heapq.heapify(self._heap)

    def _top(self, b: int, engine: EngineView) -> list[tuple[Key, Generation]]:
        """Pop the b best queued generations off H (lazily re-keying stale entries), then put
        them back: they stay queued until admitted."""
        top: list[tuple[Key, Generation]] = []
        seen: set[str] = set()
        while self._heap and len(top) < b:
            entry = heapq.heappop(self._heap)
            task_id = entry[3]
            generation = self._gens.get(task_id)
            if (generation is None or generation.status not in QUEUED or task_id in seen
                    or self._key.get(task_id) != entry[:3]):
                continue                                     # stale entry
            current = self.key(generation, engine)
            if current != entry[:3]:
                self._key[task_id] = current                 # its KV moved: re-key
                heapq.heappush(self._heap, (*current, task_id))
                continue
            seen.add(task_id)
            top.append((current, generation))
        for key, generation in top:
            heapq.heappush(self._heap, (*key, generation.task_id))
        return top

    def _insert_resident(self, generation: Generation, engine: EngineView) -> None:
        """Alg. 3: a generation placed on the GPU joins the eviction heap G."""
        key = self.key(generation, engine)
        heapq.heappush(self._evict_heap, (-key[0], -key[1], -key[2], generation.task_id))
        self._compact_evict_heap()

    def _compact_evict_heap(self) -> None:
        """Drop G's stale entries once they outnumber the live generations: entries of ended
        generations, and all but the first (smallest) entry of each live one, the one
        :meth:`_pop_victim` meets first and re-keys if its KV moved. Keeps G O(live)."""
        if len(self._evict_heap) <= stale_limit(len(self._gens)):
            return
        first: dict[str, tuple[int, float, int, str]] = {}
        for entry in self._evict_heap:
            task_id = entry[3]
            if task_id in self._gens and (task_id not in first or entry < first[task_id]):
                first[task_id] = entry
        self._evict_heap = list(first.values())
        heapq.heapify(self._evict_heap)

    def _pop_victim(self, engine: EngineView, budget: KvBudget, exclude: set[str]
                    ) -> tuple[Key, Generation] | None:
        """Root of G: the least urgent resident generation with the longest remaining time."""
        aside: list[tuple[int, float, int, str]] = []
        found: tuple[Key, Generation] | None = None
        while self._evict_heap:
            entry = heapq.heappop(self._evict_heap)
            task_id = entry[3]
            generation = self._gens.get(task_id)
            if generation is None or budget.resident(task_id) == 0:
                continue                                     # gone or no longer resident
            current = self.key(generation, engine)
            if (-entry[0], -entry[1], -entry[2]) != current:
                heapq.heappush(self._evict_heap,
                               (-current[0], -current[1], -current[2], task_id))
                continue
            if task_id in exclude:
                aside.append(entry)
                continue
            found = (current, generation)
            break
        for entry in aside:
            heapq.heappush(self._evict_heap, entry)
        self._compact_evict_heap()
        return found

    # -- Alg. 2 + Alg. 4 ----------------------------------------------------------------------
    def _needs_prefill(self, generation: Generation, engine: EngineView) -> bool:
        return generation.status != TaskStatus.RUNNING and engine.run_cost_s(
            generation.task_id) > 0.0

    def _make_plan(self, ctx: AdmissionContext, preempting: bool) -> dict[str, Eviction]:
        engine = ctx.engine
        self._prepare(engine)
        self._drain_arrivals(engine)
        b = max(1, min(self.batch_size, ctx.max_batch))
        queued = self._top(b, engine)
        running = [(self.key(g, engine), g) for g in ctx.running]
        self._plan = {}
        if not queued and not running:
            return {}
        best_key, best = min(queued + running, key=lambda kg: kg[0])
        if self.stage_aware and not self._needs_prefill(best, engine):
            kept = [kg for kg in queued if not self._needs_prefill(kg[1], engine)]
            self.stats['held_prefills'] += len(queued) - len(kept)
            queued = kept
        merged = sorted(queued + running, key=lambda kg: kg[0])
        batch = merged[:b]
        in_batch = {g.task_id for _, g in batch}
        decisions: dict[str, Eviction] = {}
        if preempting:
            for _, g in running:
                if g.task_id not in in_batch:
                    decisions[g.task_id] = 'keep'
                    self._arrived.append(g.task_id)
                    self.stats['preempted'] += 1
        admissions = [kg for kg in batch if kg[1].status != TaskStatus.RUNNING]
        budget = KvBudget.of(engine) if self.priority_eviction and preempting else None
        if budget is not None:
            admissions = self._evict_for(admissions, decisions, ctx, budget)
        self._plan = {g.task_id: rank for rank, (_, g) in enumerate(admissions)}
        return decisions

    def _evict_for(self, admissions: list[tuple[Key, Generation]],
                   decisions: dict[str, Eviction], ctx: AdmissionContext, budget: KvBudget
                   ) -> list[tuple[Key, Generation]]:
        """Alg. 4 for each planned admission, in key order; returns those that will fit."""
        engine = ctx.engine
        free = budget.free
        admitted: list[tuple[Key, Generation]] = []
        exclude = {g.task_id for _, g in admissions}
        for key, candidate in admissions:
            need = budget.need(candidate.task_id)
            while need > free:
                victim = self._pop_victim(engine, budget, exclude)
                if victim is None or victim[0] < key:      # never evict a higher priority
                    if victim is not None:
                        v = victim[0]
                        heapq.heappush(self._evict_heap, (-v[0], -v[1], -v[2],
                                                          victim[1].task_id))
                    self.stats['eviction_refused'] += 1
                    return admitted
                _, generation = victim
                where = self._evict_to(generation, budget)
                decisions[generation.task_id] = where
                exclude.add(generation.task_id)
                self._arrived.append(generation.task_id)   # re-keyed: reload time added
                free += budget.resident(generation.task_id)
                self.stats[f'evicted_{where}'] += 1
            free -= need
            admitted.append((key, candidate))
        return admitted

    def _evict_to(self, generation: Generation, budget: KvBudget) -> EvictTo:
        tokens = budget.context_tokens(generation.task_id)
        decoded = min(generation.tokens, tokens)
        assert self.cost_model is not None
        return self.cost_model.evict_to(tokens - decoded, decoded)

    # -- the plan -------------------------------------------------------------------------------
    def _unplanned_priority(self, task_id: str) -> float | None:
        if task_id not in self._key:
            return None
        f_e, f_t, _ = self._key[task_id]
        return -(f_e * URGENCY_SCALE + f_t)

    def _on_admitted(self, generation: Generation, ctx: AdmissionContext) -> None:
        self._insert_resident(generation, ctx.engine)
