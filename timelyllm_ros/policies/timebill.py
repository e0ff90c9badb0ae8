"""TimeBill (paper 003, Fan, Zou, Ma): time-budgeted inference. Per generation: predict the
response length, estimate the worst-case execution time (WCET), choose the smallest KV-eviction
ratio α that fits the time budget, and apply an overrun strategy (Kill or Skip-Next).

The algorithm, as this module implements it (paper §3–§5, rivals digest §3):

* **Response-length predictor (RLP)**: ``N̂`` = the shared bucketed predictor of
  :mod:`timelyllm_ros.core.predictors` (TimeBill's eq. 2: bucket label ``⌈N/B⌉``, reported as the
  bucket's upper edge, B = 16), fitted on the bundled LRTrace traces (the paper distils a
  0.5B model from the target LLM; no model can be trained or downloaded here). The pessimistic
  length is ``N̂_W = min(⌈k·N̂⌉, N_max)`` with ``k = 5`` (the paper's default) and ``N_max`` the
  robot profile's generation limit (``max_tokens``).
* **Execution-time estimator (ETE)**: the engine's own latency model (the paper fits
  ``t_prefill = aN_x² + bN_x + c`` and ``t_step = p·N_kv + q`` by least squares; here the model
  the engine is charged by is used directly, as the digest recommends for a fair comparison):
  ``t̂_prefill`` = the engine's ``run_cost_s`` for the generation (plus the prefills admitted
  with it in the same tick, which run in the same iteration), ``p`` = the latency model's cost
  per attended context token, and ``q = l(b) − p·N_x`` with ``l(b)`` the engine's decode-step
  time at the **current batch size** b (running generations + this one). This is the digest's
  batch-aware extension: the paper models one request at a time (batch 1), where p and q are
  constants. ``t̂_WCET = t̂_prefill + Σ_{i=1}^{N̂_W−1} [p·((1−α)·N_x + i − 1) + q]`` (eqs. 5–9).
* **Optimal eviction ratio** (eq. 11, **corrected**)::

      α* = clamp_[0, α_max]( 1 − (T − t̂_prefill − t_predict) / (p·N_x·(N̂_W − 1))
                             + (N̂_W − 2) / (2·N_x) + q / (p·N_x) )

  Erratum: the paper prints the middle term as ``(N̂_W − 2)/(2·p·N_x)``, which is
  dimensionally wrong; the form above makes ``t̂_WCET(α*) = T − t_predict`` exactly. The paper
  clamps only from above (``α_max`` = 0.95); α* is also clamped at 0 from below (a negative
  ratio means the job fits without eviction). α* is handed to the engine through
  :meth:`TimeBillPolicy.kv_evict_ratio` once, when the generation is admitted (the paper evicts
  once, after prefill, with SnapKV); the simulated engine then reads ``(1 − α)·N_x`` fewer prompt
  tokens in every decode step. **On an engine without KV compression** the scheduler never asks
  for α: TimeBill then only orders (FCFS/EDF) and applies its overrun strategy.
  ``t_predict`` = 0 by default: the predictor runs beside the prefill (paper §4, step 3) and
  costs microseconds here.
* **Budget T** (batch-aware): the TUF's zero-utility time ``ERT − β/α`` after the request's
  arrival, i.e. the time after which the response is worthless (normal tasks 1.5 s, urgent
  0.5 s). At admission, α* is solved for the budget **left** (``arrival + T − now``): the paper's
  jobs start on release, ours may have queued.
* **Not segmented, streaming** (like ``vllm-stream``): TimeBill generates a whole response per
  job, so one generation is one job, its budget covers the whole plan (there is no separate
  budget for later segments), and each executable action is streamed to the robot as it
  appears.
* **Base order**: FCFS (the paper's single stream) or EDF on ``arrival + T`` (``order``).
  Admission: continuous batching up to the batch cap and KV memory (the paper runs batch 1).
* **Overrun strategies** (paper §6.1): **Kill** ends a generation (status KILLED, counted as
  incomplete) once the time since its arrival passes T, whether it runs or still waits; it is
  checked before every engine iteration, so a job can overrun by at most one iteration.
  **Skip-Next** lets the overrunning generation finish and kills (reason ``skipped: …``) every
  later request of the **same robot** released while it overruns, i.e. after its deadline and
  before it ends (the digest's release model: each robot is one job stream).

Constants chosen (all constructor parameters): ``k`` = 5, ``alpha_max`` = 0.95,
``bucket B`` = 16 (the shared predictor's default), ``N_max`` = the profile's ``max_tokens``
(``n_max_default`` = 8192, TimeBill's N_model, for a profile that cannot be loaded),
``t_predict`` = 0, ``order`` = FCFS, overrun = Kill (``timebill``) or Skip-Next
(``timebill-skip``). Response *quality* as a function of α (the paper's score) is not modelled:
the simulator measures time only.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import AdmissionContext, fits
from timelyllm_ros.core.predictors import LengthPredictor, bundled_length_predictor
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation, TaskSpec
from timelyllm_ros.engines.base import EngineView
from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.policies.base import Policy

Overrun = Literal['kill', 'skip-next']
Order = Literal['fcfs', 'edf']


# -- the execution-time estimator and eq. 11, as pure functions -----------------------------
def decode_time_s(n_x: int, alpha: float, n: int, p: float, q: float) -> float:
    """``Σ_{i=1}^{n−1} [p·((1−α)·n_x + i − 1) + q]`` (eqs. 5–7: the first token comes from the
    prefill), in closed form."""
    if n <= 1:
        return 0.0
    return (n - 1) * (p * (1.0 - alpha) * n_x + q) + p * (n - 1) * (n - 2) / 2.0


def wcet_s(prefill_s: float, n_x: int, n_w: int, alpha: float, p: float, q: float) -> float:
    """Eq. 9: ``t̂_prefill + t̂_decode(x, α, N̂_W)``."""
    return prefill_s + decode_time_s(n_x, alpha, n_w, p, q)


def unclamped_evict_ratio(budget_s: float, prefill_s: float, n_x: int, n_w: int, p: float,
                          q: float, predict_s: float = 0.0) -> float:
    """Eq. 11 with the erratum fixed (middle term ``(N̂_W − 2)/(2·N_x)``), before clamping.

    ``−inf`` when eviction cannot change the estimate (no decode step, no prompt or ``p = 0``)
    and the job fits; ``+inf`` in that case when it does not.
    """
    if n_w <= 1 or n_x <= 0 or p <= 0:
        fits_budget = wcet_s(prefill_s, n_x, n_w, 0.0, p, q) + predict_s <= budget_s
        return -math.inf if fits_budget else math.inf
    return (1.0 - (budget_s - prefill_s - predict_s) / (p * n_x * (n_w - 1))
            + (n_w - 2) / (2.0 * n_x) + q / (p * n_x))


def optimal_evict_ratio(budget_s: float, prefill_s: float, n_x: int, n_w: int, p: float,
                        q: float, alpha_max: float = 0.95, predict_s: float = 0.0) -> float:
    """α* = the smallest eviction ratio whose WCET fits the budget, clamped to
    ``[0, alpha_max]`` (eq. 11, corrected; the lower clamp is ours). Where eviction cannot
    shorten anything (``p = 0``) the ratio is 0: evicting would cost quality for no time."""
    raw = unclamped_evict_ratio(budget_s, prefill_s, n_x, n_w, p, q, predict_s)
    if n_w <= 1 or n_x <= 0 or p <= 0:
        return 0.0
    return min(max(raw, 0.0), alpha_max)


@dataclass(slots=True)
class TimeBillJob:
    """Per-generation state (paper §3.3): budget, predictions, α* and the WCET it gives."""

    task_id: str
    robot_id: str
    arrival: float
    budget_s: float               # T (relative to arrival)
    n_hat: int                    # N̂ (RLP)
    n_w: int                      # N̂_W = min(⌈k·N̂⌉, N_max)
    alpha: float = 0.0            # α* handed to the engine (clamped)
    alpha_raw: float = math.nan   # eq. 11 before clamping (nan: never asked)
    wcet_s: float = math.nan      # t̂_WCET(α*) as predicted at admission (nan: never asked)
    skipped: bool = False         # dropped by Skip-Next

    @property
    def deadline(self) -> float:
        return self.arrival + self.budget_s


class TimeBillPolicy(Policy):
    """TimeBill (Fan, Zou, Ma, "TimeBill: Time-Budgeted Inference for Large Language Models",
    paper 003) with the Kill overrun strategy by default: see the module docstring for the
    algorithm, the erratum fixed and every constant chosen."""

    name = 'timebill'
    description = 'length prediction + WCET, KV eviction ratio fitted to the TUF budget; Kill'
    segmented = False
    streaming = True
    default_overrun: ClassVar[Overrun] = 'kill'

    def __init__(
        self,
        *,
        k: float = 5.0,
        alpha_max: float = 0.95,
        overrun: Overrun | None = None,
        order: Order = 'fcfs',
        budget_s: float | None = None,
        budget_scale: float = 1.0,
        n_max: int | None = None,
        n_max_default: int = 8192,
        predict_s: float = 0.0,
        context_cost_s_per_token: float | None = None,
        length_predictor: LengthPredictor | None = None,
    ) -> None:
        """Args:
            k: pessimistic factor on the predicted length (≥ 1).
            alpha_max: largest KV-eviction ratio, in [0, 1).
            overrun: ``'kill'`` or ``'skip-next'`` (default: the class's).
            order: base order, ``'fcfs'`` (arrival) or ``'edf'`` (arrival + T).
            budget_s: one time budget T for every request (None: the TUF's zero-utility time).
            budget_scale: factor applied to every budget.
            n_max: generation limit N_max for every request (None: the robot profile's).
            n_max_default: N_max when the profile cannot be loaded (TimeBill's N_model).
            predict_s: t_predict of eq. 11 (s).
            context_cost_s_per_token: the ETE's p (s per attended token per decode step);
                None: from the engine's latency model (0 where it has none).
            length_predictor: the RLP; the shared bucket predictor fitted on the bundled
                traces by default.
        """
        overrun = overrun or self.default_overrun
        if overrun not in ('kill', 'skip-next'):
            raise ValueError(f"overrun must be 'kill' or 'skip-next', got {overrun!r}")
        if order not in ('fcfs', 'edf'):
            raise ValueError(f"order must be 'fcfs' or 'edf', got {order!r}")
        if not k >= 1:
            raise ValueError(f'pessimistic factor k must be >= 1, got {k}')
        if not 0.0 <= alpha_max < 1.0:
            raise ValueError(f'alpha_max must be in [0, 1), got {alpha_max}')
        if budget_s is not None and not budget_s > 0 or not budget_scale > 0:
            raise ValueError('budgets must be > 0')
        self.k = k
        self.alpha_max = alpha_max
        self.overrun = overrun
        self.order = order
        self.budget_s = budget_s
        self.budget_scale = budget_scale
        self.n_max = n_max
        self.n_max_default = n_max_default
        self.predict_s = predict_s
        self.context_cost_s_per_token = context_cost_s_per_token
        self._predictor = length_predictor
        self.jobs: dict[str, TimeBillJob] = {}          # generations not ended yet
        # jobs seen; killed (Kill) or skipped (Skip-Next); overran: ended after the deadline
        # (killed ones included); evicted: α* > 0; alpha_max: α* clamped at α_max.
        self.counts: dict[str, int] = {'jobs': 0, 'killed': 0, 'skipped': 0, 'overran': 0,
                                       'evicted': 0, 'alpha_max': 0}
        self._deadlines: list[tuple[float, int, str]] = []      # Kill: (deadline, seq, id)
        self._pending: dict[str, str] = {}                      # ends due at the next tick
        self._by_robot: dict[str, dict[str, TimeBillJob]] = {}  # active jobs per robot
        self._overran: dict[str, list[tuple[float, float, str]]] = {}  # robot: ended overruns
        self._prefill: dict[str, float] = {}                    # admitted: prefill estimate
        self._tick = (math.nan, 0.0)                            # (now, prefill admitted)
        self._n_max_of: dict[str, int] = {}

    # -- inputs -------------------------------------------------------------------------------
    @property
    def length_predictor(self) -> LengthPredictor:
        if self._predictor is None:
            self._predictor = bundled_length_predictor()
        return self._predictor

    def budget_of(self, spec: TaskSpec) -> float:
        """T of a request (s after its arrival)."""
        base = self.budget_s if self.budget_s is not None else spec.tuf.zero_s
        return base * self.budget_scale

    def n_max_of(self, spec: TaskSpec) -> int:
        if self.n_max is not None:
            return self.n_max
        value = self._n_max_of.get(spec.profile)
        if value is None:
            try:
                value = load_profile(spec.profile).max_tokens
            except ProfileError:
                value = self.n_max_default
            self._n_max_of[spec.profile] = value
        return value

    def context_cost(self, engine: EngineView) -> float:
        """The ETE's p: seconds per attended context token per decode step (0 for an engine
        without a latency model)."""
        if self.context_cost_s_per_token is not None:
            return self.context_cost_s_per_token
        if engine.costs is None:
            return 0.0
        return float(engine.costs.decode_ms_per_context_token) / 1000.0

    # -- Policy hooks ---------------------------------------------------------------------------
    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        if self.order == 'fcfs':
            return -queue.arrival
        if self.budget_s is not None:
            budget = np.full(len(queue), self.budget_s)
        else:
            with np.errstate(divide='ignore'):
                budget = np.where(queue.alpha < 0, queue.ert0 - queue.beta / queue.alpha,
                                  np.inf)
        return -(queue.arrival + budget * self.budget_scale)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if not fits(candidate, ctx):
            return False
        if candidate.tokens == 0:
            # Generations admitted in one tick are prefilled together, in one iteration.
            now, admitted = self._tick
            if now != ctx.now:
                admitted = 0.0
            admitted += ctx.engine.run_cost_s(candidate.task_id)
            self._tick = (ctx.now, admitted)
            self._prefill[candidate.task_id] = admitted
        return True

    def kv_evict_ratio(self, generation: Generation, ctx: AdmissionContext) -> float | None:
        job = self.jobs.get(generation.task_id)
        if job is None:
            return None
        n_x = generation.spec.prompt_tokens
        p = self.context_cost(ctx.engine)
        q = max(ctx.engine.decode_step_s(len(ctx.running) + 1) - p * n_x, 0.0)
        prefill = self._prefill.pop(generation.task_id, 0.0)
        left = job.deadline - ctx.now
        job.alpha_raw = unclamped_evict_ratio(left, prefill, n_x, job.n_w, p, q,
                                              self.predict_s)
        job.alpha = optimal_evict_ratio(left, prefill, n_x, job.n_w, p, q, self.alpha_max,
                                        self.predict_s)
        job.wcet_s = wcet_s(prefill, n_x, job.n_w, job.alpha, p, q)
        if job.alpha > 0:
            self.counts['evicted'] += 1
        if job.alpha_raw > self.alpha_max:
            self.counts['alpha_max'] += 1
        return job.alpha or None

    def overruns(self, ctx: AdmissionContext) -> Mapping[str, str]:
        ends, self._pending = self._pending, {}
        if self.overrun == 'kill':
            while self._deadlines and self._deadlines[0][0] < ctx.now:
                _, _, task_id = heapq.heappop(self._deadlines)
                job = self.jobs.get(task_id)
                if job is not None and task_id not in ends:
                    ends[task_id] = (f'killed: overran its {job.budget_s:.3f} s time budget '
                                     f'(TimeBill Kill)')
                    self.counts['killed'] += 1
        return ends

    # -- observers ------------------------------------------------------------------------------
    def on_submit(self, generation: Generation, now: float) -> None:
        spec = generation.spec
        n_hat = max(int(self.length_predictor.predict(spec)), 1)
        n_w = max(min(math.ceil(self.k * n_hat), self.n_max_of(spec)), 1)
        job = TimeBillJob(task_id=spec.task_id, robot_id=spec.robot_id,
                          arrival=spec.arrival_time, budget_s=self.budget_of(spec), n_hat=n_hat,
                          n_w=n_w)
        self.jobs[spec.task_id] = job
        self.counts['jobs'] += 1
        if self.overrun == 'kill':
            if math.isfinite(job.deadline):
                heapq.heappush(self._deadlines, (job.deadline, generation.seq, spec.task_id))
        else:
            culprit = self._overrunning(job)
            if culprit is not None:
                job.skipped = True
                self.counts['skipped'] += 1
                self._pending[spec.task_id] = (
                    f'skipped: released while {culprit} of the same robot overran its time '
                    f'budget (TimeBill Skip-Next)')
                return
        self._by_robot.setdefault(spec.robot_id, {})[spec.task_id] = job

    def _overrunning(self, job: TimeBillJob) -> str | None:
        """The earlier job of the same robot that overruns at ``job``'s release, if any."""
        release = job.arrival
        for other in self._by_robot.get(job.robot_id, {}).values():
            if other.deadline < release:
                return other.task_id
        ended = self._overran.get(job.robot_id)
        if ended is not None:
            ended[:] = [o for o in ended if o[1] >= release]   # older overruns are over
            for deadline, _, task_id in ended:
                if deadline < release:
                    return task_id
            if not ended:
                del self._overran[job.robot_id]
        return None

    def on_end(self, generation: Generation, now: float) -> None:
        task_id = generation.task_id
        self._prefill.pop(task_id, None)
        job = self.jobs.pop(task_id, None)
        if job is None:
            return
        active = self._by_robot.get(job.robot_id)
        if active is not None:
            active.pop(task_id, None)
            if not active:
                del self._by_robot[job.robot_id]
        if not job.skipped and now > job.deadline:
            self.counts['overran'] += 1
            if self.overrun == 'skip-next':
                self._overran.setdefault(job.robot_id, []).append((job.deadline, now, task_id))


class TimeBillSkipNextPolicy(TimeBillPolicy):
    """TimeBill with the Skip-Next overrun strategy (paper 003 §6.1)."""

    name = 'timebill-skip'
    description = 'TimeBill with Skip-Next: overrunning plans finish, later ones are skipped'
    default_overrun: ClassVar[Overrun] = 'skip-next'
