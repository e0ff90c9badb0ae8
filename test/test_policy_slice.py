"""SLICE (paper 004): eq. 7, greedy selection, the decode-mask matrix (golden values from the
paper's Table II and Fig. 4 with the authors' l(b) table), and the policy in the scheduler loop."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from utils import make_spec

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.predictors import OracleLengthPredictor
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import Scheduler
from timelyllm_ros.core.tuf import NORMAL
from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.metrics import aggregate, task_metrics
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import resolve_workload
from timelyllm_ros.policies import POLICIES, create_policy
from timelyllm_ros.policies.slice import (
    SLICE_CODE_STEP_TABLE_MS,
    SlicePolicy,
    SliceTask,
    column_batches,
    decode_mask_matrix,
    period_s,
    rate_for_tpot,
    select_tasks,
)

TABLE_S = tuple(ms / 1000 for ms in SLICE_CODE_STEP_TABLE_MS)


def l_code(batch: int) -> float:
    """The authors' l(b) (s); beyond b = 15 the last entry."""
    return TABLE_S[min(batch, len(TABLE_S)) - 1]


def table2_tasks() -> list[SliceTask]:
    """Table II: A ×3 (TPOT 100 ms), B ×4 (120 ms), C ×2 (250 ms), equal utility."""
    tpots = [0.1] * 3 + [0.12] * 4 + [0.25] * 2
    return [SliceTask(f'{"AAABBBBCC"[i]}{i}', 1.0, rate_for_tpot(t), seq=i)
            for i, t in enumerate(tpots)]


# -- golden values -----------------------------------------------------------------------------
def test_table2_rates_everything_batched_step_and_slice_period() -> None:
    assert [rate_for_tpot(t) for t in (0.1, 0.12, 0.25, 0.05)] == [10, 9, 4, 20]
    assert l_code(9) == pytest.approx(0.126)            # Orca / FastServe: all 9 every step
    tasks = table2_tasks()
    selected = select_tasks(tasks, l_code, budget_s=1.0)
    assert [t.rate for t in selected] == [10, 10, 10, 9, 9, 9, 9, 4, 4]
    period = period_s([t.rate for t in selected], l_code)
    assert period == pytest.approx(0.957)                # ≤ 1 s: all nine fit
    # Achieved rates if cycles run back to back (digest: A 10.45, B 9.40, C 4.18 tokens/s).
    assert [round(v / period, 2) for v in (10, 9, 4)] == [10.45, 9.40, 4.18]
    # One more A task no longer fits: 4·l(10) + 1·l(4) + 5·l(8) = 1.167 s.
    more = [*tasks, SliceTask('A9', 1.0, 10, seq=9)]
    assert period_s([10, 10, 10, 10, 9, 9, 9, 9, 4, 4], l_code) == pytest.approx(1.167)
    assert len(select_tasks(more, l_code)) == 9


def test_fig4_decode_mask_matrix() -> None:
    matrix = decode_mask_matrix([6, 4, 2, 1])
    assert matrix.shape == (4, 6)                        # |b| × v_0 (erratum: not v_1)
    assert matrix.sum(axis=1).tolist() == [6, 4, 2, 1]   # row k has v_k ones (not v_k + 1)
    assert matrix.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0],
                               [1, 0, 0, 0, 0, 0]]
    assert column_batches([6, 4, 2, 1]) == [4, 3, 2, 2, 1, 1]
    assert column_batches([10, 10, 10, 9, 9, 9, 9, 4, 4]) == [9] * 4 + [7] * 5 + [3]
    # Eq. 7 is the sum of the columns' step times.
    for rates in ([6, 4, 2, 1], [10, 10, 10, 9, 9, 9, 9, 4, 4], [3], [5, 5]):
        by_columns = sum(l_code(b) for b in column_batches(rates))
        assert period_s(rates, l_code) == pytest.approx(by_columns)
    with pytest.raises(ValueError, match='descending'):
        decode_mask_matrix([1, 2])


def test_selection_by_utility_rate_stops_at_first_misfit() -> None:
    # r = U·TPOT (erratum: U, not X): the RT task (U 100, 50 ms) beats NRT ones (U 1).
    rt = SliceTask('rt', 100.0, 20, seq=5)
    assert rt.utility_rate == pytest.approx(5.0)
    big = SliceTask('big', 1.0, 4, seq=1)               # r = 0.25, best NRT
    slow = [SliceTask(f's{i}', 1.0, 40, seq=10 + i) for i in range(2)]   # r = 0.025
    tiny = SliceTask('tiny', 0.5, 1, seq=20)            # r = 0.5: second overall
    late = SliceTask('late', 0.01, 1, seq=0)            # r = 0.01: last, would fit

    def step(batch: int) -> float:
        return 0.03 + 0.001 * batch

    chosen = select_tasks([late, *slow, big, tiny, rt], step, budget_s=1.0)
    # Order by r: rt, tiny, big, s0, s1, late. rt + tiny + big fit (0.625 s); + s0 (rate 40)
    # does not (1.265 s): stop there; late is never tried although it would fit.
    assert [t.task_id for t in chosen] == ['rt', 'big', 'tiny']   # sorted by rate
    assert period_s([t.rate for t in chosen], step) == pytest.approx(0.625)
    assert period_s([40, 20, 4, 1], step) == pytest.approx(1.265)
    assert period_s([20, 4, 1, 1], step) < 1.0
    # A first task that cannot meet its rate alone is still selected (liveness).
    assert [t.task_id for t in select_tasks([SliceTask('x', 1, 100)], step)] == ['x']
    assert select_tasks([], step) == []


# -- the policy in the scheduler loop ----------------------------------------------------------
def _run(scheduler: Scheduler, limit: int = 5000) -> None:
    for _ in range(limit):
        if not scheduler.has_work:
            return
        scheduler.tick()
    raise AssertionError('generation did not end')


LONG = ';'.join(['mf(50)'] * 12)                         # 12 skills, ~50 tokens


def test_decode_mask_gives_each_task_its_rate_per_cycle() -> None:
    policy = SlicePolicy(tpot_s={'A': 0.1, 'B': 0.12, 'C': 0.25}, replan_on_cut=False,
                         step_table_s=TABLE_S)
    scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
    classes = 'AAABBBBCC'
    generations = [scheduler.submit(make_spec(f'{c}{i}', task_class=c, plan=LONG, tuf=NORMAL))
                   for i, c in enumerate(classes)]
    out = scheduler.tick()                               # selection + one prefill iteration
    assert policy.plan is not None and policy.plan.period_s == pytest.approx(0.957)
    assert out.batch_size == 9 and all(g.tokens == 1 for g in generations)
    batches = [scheduler.tick().batch_size for _ in range(20)]  # two whole cycles
    assert batches == ([9] * 4 + [7] * 5 + [3]) * 2
    tokens = Counter(g.spec.task_class for g in generations for _ in range(g.tokens - 1))
    assert tokens == {'A': 3 * 20, 'B': 4 * 18, 'C': 2 * 8}


@pytest.mark.parametrize('plan', ['mf(30)', LONG])
def test_rt_rate_from_tuf_deadline_and_predicted_length(plan: str) -> None:
    policy = SlicePolicy(length_predictor=OracleLengthPredictor())
    engine = SimulatedEngine()
    scheduler = Scheduler(policy, engine, SimClock())
    spec = make_spec('u', task_class='urgent', plan=plan)
    scheduler.submit(spec)
    prefill = engine.run_cost_s('u')
    cap = math.ceil(1.0 / engine.decode_step_s(1)) - 1   # what one task alone can get
    scheduler.tick()
    expected = math.ceil(len(spec.script) / (spec.tuf.zero_s - prefill))  # ⌈N̂/(D − TTFT)⌉
    assert policy.plan.rates == (min(expected, cap),)
    assert (expected < cap) == (plan != LONG)


def test_nrt_rates_from_class_tpot() -> None:
    policy = SlicePolicy(tpot_s={'normal': 0.05, 'chatbot': 0.1}, default_tpot_s=0.25)
    scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
    scheduler.submit(make_spec('n', plan=LONG))
    scheduler.submit(make_spec('c', profile='chatbot', task_class='chatbot',
                               plan='Hello there. How are you?'))
    scheduler.submit(make_spec('x', task_class='inspection', plan=LONG, tuf=NORMAL))
    scheduler.tick()
    by_id = dict(zip(policy.plan.task_ids, policy.plan.rates, strict=True))
    assert by_id == {'n': 20, 'c': 10, 'x': 4}
    # r = U·TPOT: the lenient tasks rank first (equal U = β = 1).
    assert sorted(policy._selected, key=policy._selected.get) == ['x', 'c', 'n']


def test_deselected_generations_are_preempted_with_kv_kept_and_resume() -> None:
    def plans(policy: SlicePolicy) -> tuple[Scheduler, list]:
        table = [0.02 + 0.01 * (b - 1) for b in range(1, 17)]     # l(b) = 20 + 10(b−1) ms
        policy.step_table_s = table
        scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
        a = scheduler.submit(make_spec('a', plan=LONG))
        b = scheduler.submit(make_spec('b', plan=LONG))
        for _ in range(4):
            scheduler.tick()
        return scheduler, [a, b]

    reference, (ra, rb) = plans(SlicePolicy())
    _run(reference)

    predictor = OracleLengthPredictor()
    policy = SlicePolicy(length_predictor=predictor)
    scheduler, (a, b) = plans(policy)
    assert policy.plan.task_ids == ('a', 'b')            # 20·l(2) = 0.6 s
    urgent = scheduler.submit(make_spec('u', task_class='urgent', plan='mf(30);' * 3,
                                        arrival=scheduler.clock.now()))
    scheduler.tick()
    # u: 12 tokens in 0.5 s − 0.133 s of prefill → 33 tokens/s, r = 20/33 (first); then a:
    # 20·l(2) + 13·l(1) = 0.86 s; with b too 20·l(3) + 13·l(1) = 1.06 s (ties on r → seq).
    assert policy.plan.task_ids[0] == 'u' and 'a' in policy.plan.task_ids
    assert 'b' not in policy.plan.task_ids
    assert policy.plan.rates == (33, 20)
    assert b.status in (TaskStatus.WAITING, TaskStatus.SUSPENDED) and b.preemptions == 1
    assert 'b' in scheduler.queue and 'b' not in scheduler.engine.running
    assert scheduler.engine.kv.location('b') == 'gpu'    # 'keep': KV resident
    _run(scheduler)
    assert urgent.status == a.status == b.status == TaskStatus.GENERATED
    assert [s.text for s in a.segments] == [s.text for s in ra.segments]
    assert [s.text for s in b.segments] == [s.text for s in rb.segments]


class _Checked(SlicePolicy):
    """Records every plan and asserts the decode-column invariants at every iteration."""

    name = 'slice-checked'
    plans: list = []
    columns: list = []

    def decode_mask(self, ctx):
        mask = super().decode_mask(ctx)
        running = {g.task_id for g in ctx.running}
        assert mask is not None and mask and set(mask) <= running
        assert set(mask) <= set(self.plan.task_ids)
        assert running <= set(self.plan.task_ids)       # only selected tasks run
        type(self).columns.append(len(mask))
        return mask

    def _replan(self, ctx):
        plan = super()._replan(ctx)
        type(self).plans.append(plan)
        return plan


@pytest.mark.parametrize('prefix_caching', [True, False])
def test_wid1_every_task_completes_within_capacity(monkeypatch, prefix_caching: bool) -> None:
    monkeypatch.setitem(POLICIES, 'slice-checked', _Checked)
    monkeypatch.setattr(_Checked, 'plans', [])
    monkeypatch.setattr(_Checked, 'columns', [])
    tasks = resolve_workload('wid1', seed=0)[1]
    result = simulate(tasks, 'slice-checked',
                      engine=create_engine('sim', prefix_caching=prefix_caching))
    assert result.rejected == [] and len(result.generations) == len(tasks)
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)
    assert aggregate([task_metrics(g) for g in result.generations])['completion_rate'] == 1.0
    assert _Checked.plans and all(p.period_s < 1.0 for p in _Checked.plans)
    assert all(list(p.rates) == sorted(p.rates, reverse=True) for p in _Checked.plans)
    assert min(_Checked.columns) >= 1


def test_registered_and_streaming_not_segmented() -> None:
    policy = create_policy('slice')
    assert isinstance(policy, SlicePolicy)
    assert policy.streaming and not policy.segmented
    assert np.all(policy.priorities(_empty_view(), 0.0) == np.array([]))
    with pytest.raises(ValueError):
        SlicePolicy(tpot_s={'normal': 0.0})


def _empty_view():
    from timelyllm_ros.core.queue import GenerationQueue

    return GenerationQueue().view(0.008)
