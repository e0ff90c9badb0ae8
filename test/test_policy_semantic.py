"""Semantic Scheduling (paper 001): urgency order, stage-aware batches, preemption, the
keep-or-recompute rule, priority-based eviction, capacity and a whole WID1 run."""

from __future__ import annotations

import itertools
import math

import pytest
from utils import make_spec, tiny_calibration

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.predictors import OracleLengthPredictor, TufClassUrgency
from timelyllm_ros.core.request import TaskSpec, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import resolve_workload
from timelyllm_ros.policies import POLICIES, create_policy
from timelyllm_ros.policies.semantic import (
    PAPER_PROFILES,
    EngineCostModel,
    PaperCostModel,
    SemanticPolicy,
)


class Recorded(SemanticPolicy):
    """Records when each generation ended."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ended: dict[str, float] = {}

    def on_end(self, generation, now):
        self.ended[generation.task_id] = now
        super().on_end(generation, now)


def run(policy: SemanticPolicy, specs: list[TaskSpec], engine: SimulatedEngine | None = None,
        limit: int = 20000) -> Scheduler:
    """Submit each spec at its arrival and tick until all are generated (no robots: a cut
    segment re-enters the queue at once)."""
    clock = SimClock()
    scheduler = Scheduler(policy, engine or SimulatedEngine(), clock)
    pending = sorted(specs, key=lambda s: s.arrival_time)
    for _ in range(limit):
        while pending and pending[0].arrival_time <= clock.now():
            scheduler.submit(pending.pop(0))
        if not scheduler.has_work:
            if not pending:
                return scheduler
            clock.advance_to(pending[0].arrival_time)
            continue
        scheduler.tick()
    raise AssertionError('did not finish')


# -- urgency order (the paper's constraint) ------------------------------------------------
MIXED = [
    make_spec('n_long', plan='mf(50);tc(90);mf(20);tu(45);md(30)'),
    make_spec('n_short', plan='tp()'),
    make_spec('u_long', task_class='urgent', plan='mr(50);mf(100);ml(20);mu(30);md(30);tc(90)'),
    make_spec('n_mid', plan='mf(50);tc(90)', arrival=0.2),
    make_spec('u_short', task_class='urgent', plan='mr(50)', arrival=0.15),
    make_spec('n_late', plan='mf(30)', arrival=0.9),
]


def test_perfect_predictors_and_b1_complete_in_urgency_order() -> None:
    policy = Recorded(batch_size=1, length_predictor=OracleLengthPredictor())
    scheduler = run(policy, MIXED)
    specs = {s.task_id: s for s in MIXED}
    rank = {t: TufClassUrgency().classify(s) for t, s in specs.items()}
    assert set(policy.ended) == set(specs)
    assert all(g.status == TaskStatus.GENERATED for g in scheduler.generations.values())
    # f_i < f_j  ⇒  f_i < a_j  ∨  r(i) ≤ r(j)  (paper §3 objective's constraint)
    for i, j in itertools.permutations(specs, 2):
        if policy.ended[i] < policy.ended[j]:
            assert policy.ended[i] < specs[j].arrival_time or rank[i] <= rank[j], (i, j)
    # Inside a class: shortest remaining first (SRPT).
    assert policy.ended['u_short'] < policy.ended['u_long']
    assert policy.ended['n_short'] < policy.ended['n_mid'] < policy.ended['n_long']
    # The late urgent request preempted the running urgent one, which kept its KV.
    assert scheduler.generations['u_long'].preemptions >= 1


def test_registered_and_checks_its_parameters() -> None:
    assert 'semantic' in POLICIES and isinstance(create_policy('semantic'), SemanticPolicy)
    with pytest.raises(ValueError):
        SemanticPolicy(batch_size=0)


def test_preempted_generation_keeps_its_kv_resident() -> None:
    policy = SemanticPolicy(batch_size=1, length_predictor=OracleLengthPredictor())
    engine = SimulatedEngine()
    scheduler = Scheduler(policy, engine, SimClock())
    normal = scheduler.submit(make_spec('n', plan='mf(50);tc(90);mf(20);tu(45)'))
    for _ in range(3):
        scheduler.tick()
    assert normal.status == TaskStatus.RUNNING
    urgent = scheduler.submit(make_spec('u', task_class='urgent', plan='mr(50)'))
    scheduler.tick()
    assert urgent.status == TaskStatus.RUNNING and normal.status == TaskStatus.WAITING
    assert normal.preemptions == 1 and engine.kv.location('n') == 'gpu'
    assert policy.stats['preempted'] == 1


# -- Alg. 2: stage-aware batch formation --------------------------------------------------
@pytest.mark.parametrize('stage_aware', [True, False])
def test_a_new_prefill_does_not_stall_a_more_urgent_decode(stage_aware: bool) -> None:
    policy = Recorded(length_predictor=OracleLengthPredictor(), stage_aware=stage_aware)
    engine = SimulatedEngine()
    scheduler = Scheduler(policy, engine, SimClock())
    urgent = scheduler.submit(make_spec('u', task_class='urgent',
                                        plan='mr(50);mf(100);ml(20);mu(30)'))
    scheduler.tick()                                           # prefill
    scheduler.tick()                                           # first decode
    normal = scheduler.submit(make_spec('n', plan='mf(50)'))
    scheduler.tick()
    if stage_aware:
        assert normal.status == TaskStatus.WAITING and policy.stats['held_prefills'] > 0
        while urgent.status < TaskStatus.GENERATED:
            scheduler.tick()
            assert normal.tokens == 0                          # held until u is done
    else:
        assert normal.status == TaskStatus.RUNNING             # its prefill stalled u
    while scheduler.has_work:
        scheduler.tick()
    assert normal.status == TaskStatus.GENERATED


def test_an_urgent_prefill_joins_at_once() -> None:
    policy = SemanticPolicy(length_predictor=OracleLengthPredictor())
    scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
    normal = scheduler.submit(make_spec('n', plan='mf(50);tc(90);mf(20);tu(45)'))
    scheduler.tick()
    scheduler.tick()
    urgent = scheduler.submit(make_spec('u', task_class='urgent', plan='mr(50)'))
    scheduler.tick()
    assert urgent.status == TaskStatus.RUNNING
    assert normal.status in (TaskStatus.RUNNING, TaskStatus.SUSPENDED)   # b = 16: both run


# -- the keep-or-recompute rule (digest §1.2 coefficient cases) ----------------------------
@pytest.mark.parametrize('name', ['a100-qwen1.5-4b', 'a100-qwen1.5-7b'])
def test_a100_profiles_always_offload_the_prompt(name: str) -> None:
    model = PAPER_PROFILES[name]
    for n in (1, 100, 1331, 10_000, 100_000):
        assert model.offload_prompt(n)
        assert model.evict_to(n, 0) == 'host'


def test_a5000_7b_recomputes_the_prompt_below_about_44k_tokens() -> None:
    model = PAPER_PROFILES['a5000-qwen1.5-7b']
    crossover = (model.beta - model.alpha2) / model.alpha1       # β n = α1 n² + α2 n
    assert 40_000 < crossover < 48_000
    for n in (1, 1331, 40_000):
        assert not model.offload_prompt(n) and model.evict_to(n, 0) == 'none'
    for n in (48_000, 100_000):
        assert model.offload_prompt(n) and model.evict_to(n, 0) == 'host'
    # Decoded tokens cost γ2 ≫ β each to recompute: a few of them tip the choice to offload.
    assert model.evict_to(1331, 50) == 'host'


@pytest.mark.parametrize('name', sorted(PAPER_PROFILES))
def test_decoded_kv_is_always_kept_since_beta_is_far_below_gamma2(name: str) -> None:
    model = PAPER_PROFILES[name]
    assert model.beta < model.gamma2 / 10
    for n, m in ((0, 1), (100, 50), (1331, 500)):
        assert model.recompute_decoded(n, m) == 0 and model.saved_decoded(n, m) == m
        # The printed eq. 6 reads "save 0 tokens" -- the opposite (erratum).
        assert model.paper_eq6(n) == 0.0
        assert model.resume_s(n, m, saved=m) < model.resume_s(n, m, saved=0)


def test_marginal_rule_is_the_minimiser_of_eq5() -> None:
    # A profile where recomputing early decoded tokens is cheaper than moving them.
    model = PaperCostModel(alpha1=0.0, alpha2=1e-4, gamma1=1e-3, gamma2=0.01, beta=0.0505)
    n, m = 10, 60
    r = model.recompute_decoded(n, m)
    costs = {saved: model.resume_s(n, m, saved) for saved in range(m + 1)}
    best_saved = min(costs, key=costs.__getitem__)
    assert m - best_saved == r == 30
    r_star = (model.beta - model.gamma1 * n - (model.gamma1 + 2 * model.gamma2) / 2) / model.gamma1
    assert abs(r - r_star) <= 1                             # corrected eq. 6 (denominator γ1)
    assert model.paper_eq6(n) == pytest.approx(r_star / 2)   # printed form: off by 2×
    assert model.recompute_decoded(n, 5) == 5 and model.recompute_decoded(n, 0) == 0


def test_engine_cost_model_offloads_on_the_bundled_calibration() -> None:
    model = EngineCostModel(load_calibration())
    assert model.evict_to(1331, 20) == 'host'
    assert model.offload_s(1331, 0) < model.recompute_s(1331, 0)


# -- Alg. 4: priority-based eviction --------------------------------------------------------
def _memory_bound(priority_eviction: bool):
    """Two normal generations suspended with their KV on a 10-block GPU, then an urgent one
    that needs more than the free blocks. ``a`` is nearly done; ``b`` has a long way to go,
    and was paused after ``a`` (so LRU would evict ``a``)."""
    engine = SimulatedEngine(calibration=tiny_calibration())
    policy = SemanticPolicy(batch_size=2, length_predictor=OracleLengthPredictor(),
                            priority_eviction=priority_eviction)
    policy_batch = 1
    scheduler = Scheduler(policy, engine, SimClock())
    a = scheduler.submit(make_spec('a', plan="l('a');tp()", prompt_tokens=40))
    b = scheduler.submit(make_spec('b', plan="l('a');" + 'mf(50);' * 8, prompt_tokens=40))
    for _ in range(50):
        scheduler.tick()
        if a.status == b.status == TaskStatus.SUSPENDED:
            break
    assert engine.kv.location('a') == engine.kv.location('b') == 'gpu'
    urgent = scheduler.submit(make_spec('u', task_class='urgent', plan='mr(50)',
                                        prompt_tokens=60))
    assert engine.kv.blocks(60 + engine.lookahead_tokens) > engine.kv.gpu_free
    policy.batch_size = policy_batch            # only u joins: the eviction is for u alone
    scheduler.tick()
    assert urgent.status == TaskStatus.RUNNING
    return engine, policy


def test_the_least_urgent_longest_resident_is_evicted_to_host() -> None:
    engine, policy = _memory_bound(priority_eviction=True)
    assert engine.kv.location('b') == 'host'           # root of G: longest remaining
    assert engine.kv.location('a') == 'gpu'
    assert policy.stats['evicted_host'] == 1


def test_without_priority_eviction_the_engine_evicts_lru() -> None:
    engine, policy = _memory_bound(priority_eviction=False)
    assert engine.kv.location('a') == 'host' and engine.kv.location('b') == 'gpu'
    assert policy.stats['evicted_host'] == 0


def test_a_more_urgent_generation_is_never_evicted_for_a_less_urgent_one() -> None:
    engine = SimulatedEngine(calibration=tiny_calibration())
    policy = SemanticPolicy(length_predictor=OracleLengthPredictor(), stage_aware=False)
    scheduler = Scheduler(policy, engine, SimClock())
    urgent = scheduler.submit(make_spec('u', task_class='urgent', prompt_tokens=100,
                                        plan='mr(50);mf(100);ml(20);mu(30)'))
    scheduler.tick()
    normal = scheduler.submit(make_spec('n', prompt_tokens=40, plan='mf(50)'))
    while urgent.status < TaskStatus.GENERATED:
        scheduler.tick()
        assert normal.tokens == 0
    assert urgent.preemptions == 0 and policy.stats['eviction_refused'] > 0
    while scheduler.has_work:
        scheduler.tick()
    assert normal.status == TaskStatus.GENERATED


# -- whole runs -------------------------------------------------------------------------------
def test_completes_every_task_of_wid1() -> None:
    tasks = resolve_workload('wid1', seed=0)[1]
    result = simulate(tasks, policy='semantic', seed=0)
    assert not result.rejected and len(result.generations) == len(tasks)
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)


class CheckedEngine(SimulatedEngine):
    """Asserts the capacity invariants at every iteration."""

    def __init__(self, max_batch: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_batch = max_batch

    def step(self, only=None):
        assert len(self.running) <= min(self.max_batch, self.max_num_seqs)
        result = super().step(only)
        assert 0 <= self.kv.gpu_free <= self.kv.gpu_blocks
        assert 0 <= self.kv._host_used <= self.kv.host_blocks
        return result


@pytest.mark.parametrize('max_batch', [6, 32])
def test_capacity_is_never_exceeded_under_memory_pressure(max_batch: int) -> None:
    tasks = resolve_workload('wid2', seed=3)[1][:200]
    calibration = load_calibration().model_copy(update={'gpu_kv_tokens': 8192,
                                                        'host_kv_tokens': 8192})
    engine = CheckedEngine(max_batch, calibration=calibration, prefix_caching=False)
    config = SchedulerConfig(max_batch=max_batch)
    result = simulate(tasks, policy='semantic', engine=engine, config=config)
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)
    assert max(result.batch_sizes) <= min(max_batch, 16)        # b = 16
    assert math.isfinite(result.sim_time_s)


# -- bounded state (issue 13, item 8) ---------------------------------------------------------
def _run_waves(policy: SemanticPolicy, waves: int, per_wave: int) -> dict[str, int]:
    """Submit ``waves`` waves of ``per_wave`` goals through a real scheduler over the simulated
    engine, each wave run until every goal ended; the largest size of each internal
    structure seen after any tick."""
    clock = SimClock()
    scheduler = Scheduler(policy, SimulatedEngine(), clock,
                          SchedulerConfig(report_deadlines=False))
    sizes: dict[str, int] = {}
    for wave in range(waves):
        for i in range(per_wave):
            urgent = (wave + i) % 3 == 0
            scheduler.submit(make_spec(f'w{wave}-{i}', task_class='urgent' if urgent
                                       else 'normal', arrival=clock.now()))
        while scheduler.has_work:
            scheduler.tick()
            for name in ('_heap', '_evict_heap', '_gens', '_key', '_fe', '_length'):
                sizes[name] = max(sizes.get(name, 0), len(getattr(policy, name)))
    assert all(g.status == TaskStatus.GENERATED for g in scheduler.generations.values())
    return sizes


def test_heaps_stay_bounded_by_the_live_generations() -> None:
    from timelyllm_ros.policies.semantic import stale_limit

    per_wave, waves = 10, 40
    policy = SemanticPolicy()
    sizes = _run_waves(policy, waves, per_wave)
    # 400 goals, each admitted once per segment; at most 10 live at a time
    assert sizes['_evict_heap'] <= stale_limit(per_wave) < waves * per_wave
    assert sizes['_heap'] <= stale_limit(per_wave)
    for name in ('_gens', '_key', '_fe', '_length'):
        assert sizes[name] <= per_wave, name
    # nothing live is left behind once every goal ended
    assert not policy._gens and not policy._key
    assert len(policy._evict_heap) <= stale_limit(0) and len(policy._heap) <= stale_limit(0)
