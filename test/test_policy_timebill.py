"""TimeBill (paper 003): the execution-time estimator and the corrected eq. 11 (golden: α*
makes the predicted WCET equal the budget exactly), the Kill and Skip-Next overrun strategies,
and the policy through the scheduler and the simulated fleet."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from utils import make_spec, tiny_calibration

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.predictors import (
    BucketLengthPredictor,
    OracleLengthPredictor,
    bundled_length_predictor,
)
from timelyllm_ros.core.queue import GenerationQueue
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import Scheduler
from timelyllm_ros.core.tuf import NORMAL, URGENT, Tuf
from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.metrics import aggregate, task_metrics
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import resolve_workload
from timelyllm_ros.policies import POLICIES, create_policy
from timelyllm_ros.policies.timebill import (
    TimeBillPolicy,
    TimeBillSkipNextPolicy,
    decode_time_s,
    optimal_evict_ratio,
    unclamped_evict_ratio,
    wcet_s,
)

# ETE coefficients for the closed-form tests: p = 0.1 ms per context token, q = 20 ms.
P, Q, N_X, N_W, PREFILL = 1e-4, 0.02, 2000, 64, 0.2


# -- the estimator and eq. 11 ------------------------------------------------------------------
def test_decode_sum_closed_form_matches_the_explicit_sum() -> None:
    for alpha in (0.0, 0.3, 0.95):
        explicit = sum(P * ((1 - alpha) * N_X + i - 1) + Q for i in range(1, N_W))
        assert decode_time_s(N_X, alpha, N_W, P, Q) == pytest.approx(explicit, rel=1e-12)
    assert decode_time_s(N_X, 0.5, 1, P, Q) == 0.0      # one token: all from the prefill
    assert wcet_s(PREFILL, N_X, N_W, 0.0, P, Q) == pytest.approx(
        PREFILL + 63 * (0.2 + 0.02) + P * 63 * 62 / 2)


@pytest.mark.parametrize('budget', [2.5, 5.0, 8.0, 14.0])
def test_optimal_ratio_makes_predicted_wcet_equal_the_budget(budget: float) -> None:
    alpha = optimal_evict_ratio(budget, PREFILL, N_X, N_W, P, Q, alpha_max=0.95)
    assert 0.0 < alpha < 0.95
    assert wcet_s(PREFILL, N_X, N_W, alpha, P, Q) == pytest.approx(budget, rel=1e-12)
    # With t_predict the WCET meets T − t_predict.
    alpha = optimal_evict_ratio(budget, PREFILL, N_X, N_W, P, Q, predict_s=0.1)
    assert wcet_s(PREFILL, N_X, N_W, alpha, P, Q) == pytest.approx(budget - 0.1, rel=1e-12)


def test_optimal_ratio_clamps_at_both_ends() -> None:
    wcet_max = wcet_s(PREFILL, N_X, N_W, 0.95, P, Q)    # 2.285 s: fastest allowed
    wcet_none = wcet_s(PREFILL, N_X, N_W, 0.0, P, Q)    # 14.255 s: no eviction
    assert unclamped_evict_ratio(wcet_max - 0.5, PREFILL, N_X, N_W, P, Q) > 0.95
    assert optimal_evict_ratio(wcet_max - 0.5, PREFILL, N_X, N_W, P, Q) == 0.95
    assert optimal_evict_ratio(1.0, PREFILL, N_X, N_W, P, Q, alpha_max=0.5) == 0.5
    assert unclamped_evict_ratio(wcet_none + 1.0, PREFILL, N_X, N_W, P, Q) < 0.0
    assert optimal_evict_ratio(wcet_none + 1.0, PREFILL, N_X, N_W, P, Q) == 0.0
    # Eviction cannot shorten anything: no decode step, or no context cost.
    assert optimal_evict_ratio(0.01, PREFILL, N_X, 1, P, Q) == 0.0
    assert optimal_evict_ratio(0.01, PREFILL, N_X, N_W, 0.0, Q) == 0.0
    assert unclamped_evict_ratio(0.01, PREFILL, N_X, N_W, 0.0, Q) == math.inf


def test_printed_eq11_erratum_saturates_where_the_corrected_form_fits() -> None:
    budget = 8.0
    printed = (1 - (budget - PREFILL) / (P * N_X * (N_W - 1)) + (N_W - 2) / (2 * P * N_X)
               + Q / (P * N_X))
    assert min(printed, 0.95) == 0.95                    # the printed form: always α_max
    corrected = optimal_evict_ratio(budget, PREFILL, N_X, N_W, P, Q)
    assert corrected < 0.95


# -- the policy in the scheduler loop ----------------------------------------------------------
def _run(scheduler: Scheduler, limit: int = 5000) -> None:
    for _ in range(limit):
        if not scheduler.has_work:
            return
        scheduler.tick()
    raise AssertionError('generation did not end')


LONG = ';'.join(['mf(50)'] * 12)                         # 12 skills, 48 tokens


def test_admission_hands_alpha_to_the_engine_and_meets_the_budget_exactly() -> None:
    # A latency model where the context matters: 0.01 ms per attended token per step.
    calibration = tiny_calibration(decode_ms_per_context_token=0.01, gpu_kv_tokens=16000,
                                   prefill_ms={'tokens': [0, 1000], 'ms': [0.0, 100.0]})
    engine = SimulatedEngine(calibration, prefix_caching=False)
    # Skip-Next: a job whose WCET equals T exactly must not be killed for the EOS iteration.
    policy = TimeBillPolicy(budget_s=3.0, length_predictor=OracleLengthPredictor(), k=1.0,
                            overrun='skip-next')
    scheduler = Scheduler(policy, engine, SimClock())
    generation = scheduler.submit(make_spec('a', plan=LONG, prompt_tokens=8000))
    job = policy.jobs['a']
    assert (job.n_hat, job.n_w, job.budget_s) == (48, 48, 3.0)
    prefill = engine.run_cost_s('a')
    scheduler.tick()                                     # admitted, α* chosen, prefilled
    assert 0.0 < job.alpha < policy.alpha_max
    assert engine._generations['a'].evict_ratio == job.alpha
    assert job.wcet_s == pytest.approx(3.0, rel=1e-9)    # the golden property, batch 1
    p, q = 1e-5, 0.020                                   # 0.01 ms/token; 20 ms at batch 1
    assert job.wcet_s == pytest.approx(wcet_s(prefill, 8000, 48, job.alpha, p, q), rel=1e-9)
    _run(scheduler)
    assert generation.status == TaskStatus.GENERATED
    # The real run (the same latency model, 48 tokens as predicted) takes the WCET, plus the
    # iteration that emits EOS after the last scripted token.
    eos_step = q + p * (1 - job.alpha) * 8000
    assert scheduler.clock.now() == pytest.approx(3.0 + eos_step, abs=0.002)


def test_generous_and_impossible_budgets_clamp_alpha() -> None:
    for budget, expected in ((60.0, 0.0), (0.05, 0.95)):
        policy = TimeBillPolicy(budget_s=budget)
        scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
        scheduler.submit(make_spec('a'))
        job = policy.jobs['a']
        scheduler.tick()
        assert job.alpha == expected
        assert (job.alpha_raw < 0) if expected == 0 else (job.alpha_raw > 0.95)


def test_length_prediction_uses_the_shared_predictor_and_pessimistic_factor() -> None:
    predictor = bundled_length_predictor()
    assert isinstance(predictor, BucketLengthPredictor)
    assert predictor is bundled_length_predictor()        # fitted once
    policy = TimeBillPolicy()
    spec = make_spec('a')
    Scheduler(policy, SimulatedEngine(), SimClock()).submit(spec)
    job = policy.jobs['a']
    assert job.n_hat == predictor.predict(spec)
    assert job.n_w == min(5 * job.n_hat, 64)             # tello: N_max = 64 tokens
    assert job.budget_s == pytest.approx(NORMAL.zero_s) == pytest.approx(1.5)
    policy = TimeBillPolicy(k=2, n_max=1000)
    Scheduler(policy, SimulatedEngine(), SimClock()).submit(make_spec('u', task_class='urgent'))
    assert policy.jobs['u'].n_w == 2 * policy.jobs['u'].n_hat
    assert policy.jobs['u'].budget_s == pytest.approx(URGENT.zero_s) == pytest.approx(0.5)


def test_fcfs_and_edf_orders() -> None:
    queue = GenerationQueue()
    late_normal = make_spec('n', arrival=0.0)            # deadline 1.5
    early_urgent = make_spec('u', task_class='urgent', arrival=0.1)   # deadline 0.6
    scheduler = Scheduler(TimeBillPolicy(), SimulatedEngine(), SimClock())
    for spec in (late_normal, early_urgent):
        queue.push(scheduler.submit(spec), 0.09)
    view = queue.view(0.008)
    assert np.argmax(TimeBillPolicy().priorities(view, 0.2)) == 0
    assert np.argmax(TimeBillPolicy(order='edf').priorities(view, 0.2)) == 1
    edf = TimeBillPolicy(order='edf').priorities(view, 0.2)
    assert edf.tolist() == pytest.approx([-1.5, -0.6])
    with pytest.raises(ValueError):
        TimeBillPolicy(order='sjf')                      # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TimeBillPolicy(overrun='abort')                  # type: ignore[arg-type]


def _tuf(zero_s: float) -> Tuf:
    return Tuf.from_zero_time(beta=1.0, ert_s=zero_s / 2, zero_s=zero_s)


def test_kill_ends_running_and_queued_jobs_past_their_budget() -> None:
    policy = TimeBillPolicy()
    engine = SimulatedEngine(max_num_seqs=1)
    scheduler = Scheduler(policy, engine, SimClock())
    a = scheduler.submit(make_spec('a', plan=LONG, tuf=_tuf(10.0)))       # ~1.2 s: fits
    b = scheduler.submit(make_spec('b', plan=LONG, tuf=_tuf(0.3)))        # waits, dies queued
    c = scheduler.submit(make_spec('c', plan=LONG, tuf=_tuf(0.5), arrival=0.0))
    _run(scheduler)
    assert a.status == TaskStatus.GENERATED
    assert b.status == c.status == TaskStatus.KILLED
    assert b.tokens == c.tokens == 0                    # never admitted: batch of one
    assert 'Kill' in b.error and '0.300 s' in b.error
    assert b.done_time == pytest.approx(0.3, abs=0.05)  # within one iteration of T
    assert engine.running == () and engine.kv.gpu_free == engine.kv.gpu_blocks
    assert policy.counts['killed'] == 2 and policy.jobs == {}

    # A running job is killed mid-generation once its elapsed time passes T.
    policy = TimeBillPolicy()
    scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
    d = scheduler.submit(make_spec('d', plan=LONG, tuf=_tuf(0.5)))
    _run(scheduler)
    assert d.status == TaskStatus.KILLED and 0 < d.tokens < 48
    assert 0.5 < d.done_time < 0.5 + 0.03


def _skip_workload() -> list:
    """Robot r: job 1 overruns its 0.3 s budget (48 tokens ≈ 1.2 s); job 2 is released during
    the overrun, job 3 after job 1 ended; robot s: job 4 during r's overrun."""
    return [
        make_spec('r1', plan=LONG, tuf=_tuf(0.3), robot_id='r', arrival=0.0),
        make_spec('r2', plan='mf(50)', robot_id='r', arrival=0.6),
        make_spec('s4', plan='mf(50)', robot_id='s', arrival=0.6),
        make_spec('r3', plan='mf(50)', robot_id='r', arrival=3.0),
    ]


def test_skip_next_lets_the_overrun_finish_and_skips_releases_during_it() -> None:
    result = simulate(_skip_workload(), 'timebill-skip')
    status = {g.task_id: g for g in result.generations}
    assert status['r1'].status == TaskStatus.FINISHED   # overran, finished anyway
    assert status['r2'].status == TaskStatus.KILLED
    assert status['r2'].error.startswith('skipped') and 'r1' in status['r2'].error
    assert status['s4'].status == status['r3'].status == TaskStatus.FINISHED

    # The same workload under Kill: r1 dies at its budget, nobody is skipped.
    result = simulate(_skip_workload(), 'timebill')
    status = {g.task_id: g.status for g in result.generations}
    assert status == {'r1': TaskStatus.KILLED, 'r2': TaskStatus.FINISHED,
                      's4': TaskStatus.FINISHED, 'r3': TaskStatus.FINISHED}


def test_skip_next_covers_a_release_while_the_overrun_ends_in_the_same_tick() -> None:
    policy = TimeBillSkipNextPolicy()
    scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
    r1 = scheduler.submit(make_spec('r1', plan='mf(50)', tuf=_tuf(0.05), robot_id='r'))
    _run(scheduler)
    assert r1.status == TaskStatus.GENERATED
    ended = scheduler.clock.now()
    assert ended > 0.05
    # Released after r1's deadline but before it ended (the arrival is delivered late).
    r2 = scheduler.submit(make_spec('r2', plan='mf(50)', robot_id='r', arrival=ended - 0.01))
    r3 = scheduler.submit(make_spec('r3', plan='mf(50)', robot_id='r', arrival=ended + 0.01))
    _run(scheduler)
    assert r2.status == TaskStatus.KILLED and r2.error.startswith('skipped')
    assert r3.status == TaskStatus.GENERATED
    assert policy.counts['skipped'] == 1 and policy.counts['overran'] == 1


def test_engine_without_kv_compression_falls_back_to_order_and_overruns() -> None:
    class NoCompression(SimulatedEngine):
        capabilities = SimulatedEngine.capabilities - {'compress_kv'}

    policy = TimeBillPolicy(budget_s=0.05)
    scheduler = Scheduler(policy, NoCompression(), SimClock())
    generation = scheduler.submit(make_spec('a', plan=LONG))
    job = policy.jobs['a']
    _run(scheduler)
    assert math.isnan(job.alpha_raw) and job.alpha == 0.0   # never asked
    assert generation.status == TaskStatus.KILLED


# -- the fleet ---------------------------------------------------------------------------------
def test_registered_streaming_not_segmented() -> None:
    for name, overrun in (('timebill', 'kill'), ('timebill-skip', 'skip-next')):
        policy = create_policy(name)
        assert isinstance(policy, TimeBillPolicy) and policy.overrun == overrun
        assert policy.streaming and not policy.segmented


@pytest.mark.parametrize('policy', ['timebill', 'timebill-skip'])
def test_wid1_every_task_ends_and_completion_rate(policy: str) -> None:
    tasks = resolve_workload('wid1', seed=0)[1]
    result = simulate(tasks, policy)
    rows = [task_metrics(g) for g in result.generations]
    assert result.rejected == [] and len(result.generations) == len(tasks) == 276
    # With prefix caching every plan fits its TUF budget: none is killed.
    assert aggregate(rows)['completion_rate'] == 1.0
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)


def test_wid1_contended_kill_ends_every_task_and_a_generous_budget_finishes_all(
        monkeypatch) -> None:
    tasks = resolve_workload('wid1', seed=0)[1]
    result = simulate(tasks, 'timebill', engine=create_engine('sim', prefix_caching=False))
    statuses = Counter(g.status for g in result.generations)
    assert len(result.generations) == len(tasks)       # none lost
    assert set(statuses) == {TaskStatus.FINISHED, TaskStatus.KILLED}
    summary = aggregate([task_metrics(g) for g in result.generations])
    assert summary['completed'] + summary['killed'] == len(tasks)
    assert summary['completion_rate'] == statuses[TaskStatus.FINISHED] / len(tasks)
    assert 0.2 < summary['completion_rate'] < 0.8      # 114 / 276 = 0.41 at the time of writing
    for g in result.generations:
        if g.status == TaskStatus.KILLED:
            assert g.done_time > g.spec.arrival_time + g.spec.tuf.zero_s

    class Generous(TimeBillPolicy):
        name = 'timebill-generous'

        def __init__(self) -> None:
            super().__init__(budget_scale=100.0)

    monkeypatch.setitem(POLICIES, Generous.name, Generous)
    result = simulate(tasks, Generous.name, engine=create_engine('sim', prefix_caching=False))
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)
