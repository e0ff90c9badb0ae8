"""Admission (§4.4): batch cap and KV fit, and the latency-guided WCET test, by hand.

The tiny calibration (test/utils.py) has prefill 0.1 ms/token and decode steps of
20 ms (batch 1), 30 ms (batch 2), 40 ms (batch 3), independent of context length.
"""

from __future__ import annotations

import math
import random
from dataclasses import astuple, replace

import pytest
from utils import make_spec, tiny_calibration

from timelyllm_ros.core.admission import (
    AdmissionContext,
    budget_s,
    delay_cost,
    fits,
    keeps_resume_reserve,
    latency_guided,
    lost,
    queue_loss_rate,
    wcet_s,
    zero_utility_budget_s,
)
from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.policies import create_policy

COMM = 0.008
L_MAX = 10


def _engine(**overrides: object) -> SimulatedEngine:
    return SimulatedEngine(calibration=tiny_calibration(**overrides))


def _add(engine: SimulatedEngine, task_id: str, prompt_tokens: int, task_class: str = 'normal',
         arrival: float = 0.0, k: int = 0, need: float | None = None, segment_tokens: int = 0,
         run: bool = False) -> Generation:
    spec = make_spec(task_id=task_id, task_class=task_class, arrival=arrival,
                     prompt_tokens=prompt_tokens)
    engine.register(EngineRequest(request_id=task_id, prompt='p', prompt_tokens=prompt_tokens,
                                  max_tokens=64, script=spec.script))
    generation = Generation(spec=spec, seq=0, k=k, segment_tokens=segment_tokens,
                            need_time=arrival if need is None else need)
    if run:
        engine.run(task_id)
        generation.status = TaskStatus.RUNNING
    return generation


def _ctx(engine: SimulatedEngine, running: list[Generation], now: float = 0.05,
         max_batch: int = 4, recent_step_s: float | None = None) -> AdmissionContext:
    return AdmissionContext(now=now, comm_s=COMM, engine=engine, running=running,
                            max_batch=max_batch, recent_step_s=recent_step_s,
                            max_segment_tokens=lambda g: L_MAX)


# -- fits ------------------------------------------------------------------------------------
def test_fits_batch_cap() -> None:
    engine = _engine()
    a = _add(engine, 'a', 10, run=True)
    b = _add(engine, 'b', 10, run=True)
    c = _add(engine, 'c', 10)
    assert fits(c, _ctx(engine, [a, b], max_batch=3))
    assert not fits(c, _ctx(engine, [a, b], max_batch=2))


def test_fits_kv_memory() -> None:
    # 160 GPU tokens = 10 blocks of 16. 'a' (200 tokens would be 13 blocks) is too big even alone.
    engine = _engine()
    assert not fits(_add(engine, 'huge', 200), _ctx(engine, []))
    # 'a': 100 tokens -> 7 blocks used (placing checks 100 + 16 lookahead = 8 blocks); 3 free.
    a = _add(engine, 'a', 100, run=True)
    assert engine.kv.gpu_free == 3
    # 30 + 16 = 46 tokens -> 3 blocks: fits; 40 + 16 = 56 -> 4 blocks: does not
    assert fits(_add(engine, 'c30', 30), _ctx(engine, [a]))
    assert not fits(_add(engine, 'c40', 40), _ctx(engine, [a]))


def test_fits_engine_batch_limit() -> None:
    engine = _engine(max_num_seqs=1)
    a = _add(engine, 'a', 10, run=True)
    assert not fits(_add(engine, 'b', 10), _ctx(engine, [a], max_batch=4))


# -- latency-guided --------------------------------------------------------------------------
def test_latency_guided_empty_batch_admits() -> None:
    engine = _engine()
    candidate = _add(engine, 'n', 1000)
    assert latency_guided(candidate, _ctx(engine, []))


def test_budget_and_wcet_by_hand() -> None:
    engine = _engine()
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    ctx = _ctx(engine, [urgent], now=0.05)
    # budget = need (0) + ERT (0.2) - now (0.05) - comm (0.008) = 0.142
    assert budget_s(urgent, ctx) == pytest.approx(0.142)
    # WCET = run_cost + (l_max - 2) * step(2) = 0.1 + 8 * 0.030 = 0.34 (no step observed yet)
    assert wcet_s(urgent, 0.1, 2, ctx) == pytest.approx(0.34)
    # observed 25 ms at batch 1, scaled by the model from b = 1 to 2: 25 * 30 / 20 = 37.5 ms
    observed = _ctx(engine, [urgent], now=0.05, recent_step_s=0.025)
    assert wcet_s(urgent, 0.1, 2, observed) == pytest.approx(0.1 + 8 * 0.0375)
    # never fewer than one token left
    done = _add(engine, 'd', 10, task_class='urgent', segment_tokens=12, run=True)
    assert wcet_s(done, 0.0, 3, _ctx(engine, [urgent, done])) == pytest.approx(0.040)


def test_latency_guided_denies_prefill_against_small_budget() -> None:
    engine = _engine()
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    candidate = _add(engine, 'n', 1000)           # needs a 1000-token prefill: 0.1 s
    assert engine.run_cost_s('n') == pytest.approx(0.1)
    ctx = _ctx(engine, [urgent], now=0.05)
    # candidate budget 1 - 0.058 = 0.942 > 0.142: not as urgent; WCET 0.34 > budget 0.142
    assert not latency_guided(candidate, ctx)
    assert not create_policy('timelyllm').admit(candidate, ctx)
    # the baselines only check the fit
    assert create_policy('seg-edf').admit(candidate, _ctx(engine, [urgent], max_batch=4)) is (
        engine.can_run('n'))


def test_latency_guided_admits_with_large_budget() -> None:
    engine = _engine()
    # urgent generation on its 2nd segment (ERT 0), needed at 0.6 s:
    # budget = 0.6 - 0.05 - 0.008 = 0.542 >= WCET 0.34
    urgent = _add(engine, 'u', 10, task_class='urgent', k=1, need=0.6, segment_tokens=2,
                  run=True)
    candidate = _add(engine, 'n', 1000)
    ctx = _ctx(engine, [urgent], now=0.05)
    assert budget_s(urgent, ctx) == pytest.approx(0.542)
    assert latency_guided(candidate, ctx)
    # with need 0.3 the budget is 0.242 < 0.34: denied
    urgent.need_time = 0.3
    assert not latency_guided(candidate, ctx)


def test_latency_guided_uses_most_urgent_running() -> None:
    engine = _engine()
    relaxed = _add(engine, 'r', 10, task_class='normal', segment_tokens=0, run=True)
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    candidate = _add(engine, 'n', 1000)
    # most urgent is 'u' (budget 0.142 vs 'r' 0.942); WCET at batch 3: 0.1 + 8 * 0.040 = 0.42
    assert not latency_guided(candidate, _ctx(engine, [relaxed, urgent], now=0.05))
    # a small candidate (10 tokens: 1 ms prefill) still breaks the budget at batch 3:
    # 0.001 + 8 * 0.04 = 0.321 > 0.142
    small = _add(engine, 's', 10)
    assert not latency_guided(small, _ctx(engine, [relaxed, urgent], now=0.05))
    # without the urgent one, 'r' has budget 0.942 >= 0.1 + 10 * 0.030 = 0.4
    assert latency_guided(candidate, _ctx(engine, [relaxed], now=0.05))


def test_latency_guided_admits_at_least_as_urgent_candidate() -> None:
    engine = _engine()
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    # same class and arrival: same budget 0.142 -> admitted despite its 0.1 s prefill
    peer = _add(engine, 'u2', 1000, task_class='urgent')
    ctx = _ctx(engine, [urgent], now=0.05)
    assert budget_s(peer, ctx) == pytest.approx(budget_s(urgent, ctx))
    assert latency_guided(peer, ctx)
    # a later urgent arrival has even more budget than 'u' -> falls back to WCET: denied
    later = _add(engine, 'u3', 1000, task_class='urgent', arrival=0.01)
    assert not latency_guided(later, ctx)
    # an older urgent arrival has less budget -> admitted
    older = _add(engine, 'u4', 1000, task_class='urgent', arrival=-0.01)
    assert latency_guided(older, ctx)


def test_a_tied_candidate_whose_join_costs_more_than_the_tie_takes_the_test() -> None:
    """``tie_run_cost`` c: a candidate whose budget is within the urgency tie (0.05 s here) of
    the most urgent running generation's, on either side, joins at once only while its run
    cost is at most c ties; a dearer one takes the less urgent test (WCET 0.1 + 8 × 0.04 =
    0.42 s against the most urgent one's budget of 0.142 s: refused). A candidate more urgent
    by more than the tie, and a cheap tied one, join at once as before."""
    engine = _engine(gpu_kv_tokens=1 << 16)
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    ctx = replace(_ctx(engine, [urgent], now=0.05), urgency_tie_s=lambda g: 0.05)
    for arrival in (0.0, 0.01, -0.01):              # the same budget; within the tie
        peer = _add(engine, f'p{arrival}', 1000, task_class='urgent', arrival=arrival)
        assert engine.run_cost_s(peer.task_id) == pytest.approx(0.1)
        assert latency_guided(peer, ctx)                            # None: at once
        assert not latency_guided(peer, ctx, tie_run_cost=1.0)      # 0.1 > 0.05
        assert latency_guided(peer, ctx, tie_run_cost=2.0)          # 0.1 <= 0.1
    cheap = _add(engine, 'u5', 10, task_class='urgent')             # 1 ms of prefill
    assert latency_guided(cheap, ctx, tie_run_cost=1.0)
    older = _add(engine, 'u4', 1000, task_class='urgent', arrival=-0.06)    # by 0.06 > 0.05
    assert latency_guided(older, ctx, tie_run_cost=0.0)
    later = _add(engine, 'u3', 1000, task_class='urgent', arrival=0.01)
    # the policies: the fleet's default weighs costly tied joins, the paper's test does not
    assert create_policy('timelyllm-share').tie_run_cost == 0.5
    assert create_policy('timelyllm').tie_run_cost is None
    assert not create_policy('timelyllm-share').admit(later, ctx)
    assert create_policy('timelyllm').admit(later, ctx)


@pytest.mark.parametrize('value', [-0.5, math.nan, math.inf])
def test_tie_run_cost_must_be_finite_and_not_negative(value: float) -> None:
    from timelyllm_ros.errors import PolicyError
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    with pytest.raises(PolicyError, match='tie_run_cost must be finite'):
        TimelyLlmPolicy(tie_run_cost=value)


def test_a_rounds_joins_share_one_stall_budget() -> None:
    """``round_stall`` k: once a round has admitted a join, a less urgent candidate joins only
    while the round's run costs stay within k × the most urgent one's remaining segment time."""
    from timelyllm_ros.core.admission import BatchColumns

    engine = _engine(gpu_kv_tokens=1 << 16, max_num_seqs=8)
    # most urgent: 8 tokens left of its segment, budget 0.6 - 0.05 - 0.008 = 0.542 s
    urgent = _add(engine, 'u', 10, task_class='urgent', k=1, need=0.6, segment_tokens=2,
                  run=True)
    running = {'u': urgent}

    def round_ctx() -> AdmissionContext:
        return replace(_ctx(engine, running.values(), now=0.05, max_batch=8),  # type: ignore[arg-type]
                       batch_columns=BatchColumns())

    def join(ctx: AdmissionContext, task_id: str) -> Generation:
        candidate = _add(engine, task_id, 1500)       # 0.15 s of prefill, budget 0.942 s
        assert latency_guided(candidate, ctx, round_stall=1.0)
        engine.run(task_id)
        running[task_id] = candidate
        return candidate

    ctx = round_ctx()
    join(ctx, 'a')          # the round's first join: the test alone, 0.15 + 8 × 0.03 <= 0.542
    b = _add(engine, 'b', 1500)
    # alone it passes (0.15 + 8 × 0.04 = 0.47 <= 0.542), but the round would stall the batch
    # 0.15 + 0.15 = 0.30 s, more than the most urgent's 8 × 0.03 = 0.24 s still to generate
    assert latency_guided(b, ctx)
    assert not latency_guided(b, ctx, round_stall=1.0)
    assert latency_guided(b, ctx, round_stall=1.25)         # 0.30 <= 1.25 × 0.24
    # a candidate at least as urgent joins whatever the round's stall, and its cost counts
    peer = _add(engine, 'p', 100, task_class='urgent', k=1, need=0.6)
    assert latency_guided(peer, ctx, round_stall=1.0)
    engine.run('p')
    running['p'] = peer
    small = _add(engine, 's', 100)        # 0.01 s: 0.15 + 0.01 + 0.01 <= 8 × 0.04 = 0.32
    assert latency_guided(small, ctx, round_stall=1.0)
    # a generation admitted but never started (its engine failed) stalls nothing
    for task_id in ('a', 'p'):
        del running[task_id]
    ctx = round_ctx()
    ghost = _add(engine, 'g', 1500)
    assert latency_guided(ghost, ctx, round_stall=1.0)      # the round's first: priced
    late = _add(engine, 'l', 1500)
    assert latency_guided(late, ctx, round_stall=1.0)       # 'g' never joined: no stall yet
    # the policies: the fleet's default has the budget, the paper's test has none
    assert create_policy('timelyllm-share').round_stall == 1.0
    assert create_policy('timelyllm').round_stall is None


@pytest.mark.parametrize('value', [0.0, -1.0, math.nan])
def test_round_stall_must_be_positive(value: float) -> None:
    from timelyllm_ros.errors import PolicyError
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    with pytest.raises(PolicyError, match='round_stall must be > 0'):
        TimelyLlmPolicy(round_stall=value)


# -- goals already late (issue 13, item 7) ----------------------------------------------------
def _late_ctx(engine: SimulatedEngine, running: list[Generation], queued: list[Generation],
              max_batch: int, now: float = 0.05) -> AdmissionContext:
    return AdmissionContext(now=now, comm_s=COMM, engine=engine, running=running,
                            max_batch=max_batch, recent_step_s=None,
                            max_segment_tokens=lambda g: L_MAX, queued=queued)


def test_zero_utility_budget_and_lost_by_hand() -> None:
    engine = _engine()
    ctx = _ctx(engine, [], now=0.05)
    # urgent TUF0: utility 0 at 0.5 s -> 0 + 0.5 - 0.05 - 0.008 = 0.442
    urgent = _add(engine, 'u', 10, task_class='urgent')
    assert zero_utility_budget_s(urgent, ctx) == pytest.approx(0.442)
    # normal TUF1 (k >= 1, ERT 0): utility 0 at 0.5 s after need 1.0 -> 1.442
    later = _add(engine, 'n', 10, k=1, need=1.0)
    assert zero_utility_budget_s(later, ctx) == pytest.approx(1.442)
    assert not lost(urgent, ctx) and not lost(later, ctx)
    # an urgent goal that arrived 1 s ago: -0.558, nothing left to earn
    old = _add(engine, 'o', 10, task_class='urgent', arrival=-1.0)
    assert zero_utility_budget_s(old, ctx) == pytest.approx(-0.558) and lost(old, ctx)


def test_late_most_urgent_still_holds_back_a_costly_candidate_when_few_wait() -> None:
    engine = _engine()
    # urgent, arrived 0.3 s ago: budget -0.3 + 0.2 - 0.058 = -0.158 (late, not yet lost)
    urgent = _add(engine, 'u', 10, task_class='urgent', arrival=-0.3, segment_tokens=2,
                  run=True)
    candidate = _add(engine, 'n', 1000)            # 0.1 s prefill, budget 0.942
    ctx = _late_ctx(engine, [urgent], [candidate], max_batch=8)
    assert budget_s(urgent, ctx) == pytest.approx(-0.158) and not lost(urgent, ctx)
    # its WCET grows from 8 * 0.020 = 0.16 to 0.1 + 8 * 0.030 = 0.34: 0.18 s past its
    # deadline at -alpha = 20/3 per s = 1.2 utility, against nothing lost by waiting
    assert delay_cost(0.1, ctx) == pytest.approx(0.18 * 20 / 3)
    assert queue_loss_rate(ctx) == 0.0
    assert not latency_guided(candidate, ctx)


def test_a_queue_of_lost_goals_is_not_throttled_for_a_late_one() -> None:
    engine = _engine()
    urgent = _add(engine, 'u', 10, task_class='urgent', arrival=-0.3, segment_tokens=2,
                  run=True)
    candidate = _add(engine, 'n', 1000)
    lost_goals = [_add(engine, f'l{i}', 10, arrival=-10.0) for i in range(20)]
    ctx = _late_ctx(engine, [urgent], [candidate, *lost_goals], max_batch=8)
    assert all(lost(g, ctx) for g in lost_goals)
    # 20 lost normal goals (-alpha 2 each), 7 free slots: 14 utility/s lost while they
    # wait for the urgent one's segment (0.16 s): 2.24 > 1.2 -> the batch grows
    assert queue_loss_rate(ctx) == pytest.approx(14.0)
    assert queue_loss_rate(ctx, (40.0, 20)) == pytest.approx(14.0)
    assert latency_guided(candidate, ctx)
    # with 3 free slots only 6 utility/s: 0.96 < 1.2 -> refused
    assert not latency_guided(candidate, _late_ctx(engine, [urgent], [candidate, *lost_goals],
                                                   max_batch=4))


def test_a_lost_candidate_joins_a_batch_whose_most_urgent_is_late() -> None:
    engine = _engine()
    urgent = _add(engine, 'u', 10, task_class='urgent', arrival=-0.3, segment_tokens=2,
                  run=True)
    old = _add(engine, 'o', 10, arrival=-10.0)      # budget far below the urgent one's
    assert latency_guided(old, _late_ctx(engine, [urgent], [old], max_batch=8))


def test_a_waiting_weight_counts_a_candidates_wait_within_its_slack() -> None:
    """``waiting_weight`` ρ: once the most urgent running generation is late, the loss test
    also counts the candidate's wait within its slack, at ρ × its slope."""
    engine = _engine()
    late = _add(engine, 'u', 10, task_class='urgent', arrival=-0.3, segment_tokens=2,
                run=True)                        # budget -0.158 s: late, 8 tokens left
    fresh = _add(engine, 'f', 100, task_class='urgent')   # 0.01 s of prefill
    ctx = _late_ctx(engine, [late], [fresh], max_batch=8)
    assert budget_s(fresh, ctx) == pytest.approx(0.142)   # 0 + 0.2 - 0.05 - 0.008
    # its join: the late one's WCET 8 × 0.020 = 0.16 s -> 0.01 + 8 × 0.030 = 0.25 s, 0.09 s
    # more past its deadline at -α = 20/3 per s
    assert delay_cost(0.01, ctx) == pytest.approx(0.6)
    # waiting out the late one's 0.16 s: 0.018 s past its own deadline, 0.12 (the paper's
    # test); the 0.142 s within its slack add ρ × 0.947
    assert not latency_guided(fresh, ctx)
    assert not latency_guided(fresh, ctx, waiting_weight=0.25)     # 0.12 + 0.237 < 0.6
    assert latency_guided(fresh, ctx, waiting_weight=1.0)          # 0.12 + 0.947 >= 0.6
    # a costlier join still waits: 0.1 + 8 × 0.030 = 0.34 s, 0.18 s past: 1.2 > 1.067
    costly = _add(engine, 'c', 1000, task_class='urgent')
    assert not latency_guided(costly, ctx, waiting_weight=1.0)
    # with the most urgent one on time, the deadline test alone decides, whatever ρ
    on_time = _add(engine, 'o', 10, task_class='urgent', segment_tokens=2, run=True)
    relaxed = _add(engine, 'r', 1000)                 # normal: budget 0.942 s
    ctx = _late_ctx(engine, [on_time], [relaxed], max_batch=8)
    assert budget_s(on_time, ctx) > 0
    assert latency_guided(relaxed, ctx) == latency_guided(relaxed, ctx, waiting_weight=1.0)
    # the policies: the fleet's default weighs waits, the paper's test does not
    assert create_policy('timelyllm-share').waiting_weight == 1.0
    assert create_policy('timelyllm').waiting_weight == 0.0


@pytest.mark.parametrize('value', [-0.5, math.nan, math.inf])
def test_waiting_weight_must_be_finite_and_not_negative(value: float) -> None:
    from timelyllm_ros.errors import PolicyError
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    with pytest.raises(PolicyError, match='waiting_weight must be finite and >= 0'):
        TimelyLlmPolicy(waiting_weight=value)


def test_a_seen_bound_judges_a_generation_lost_at_l_max_by_its_longest_seen_segment() -> None:
    """``seen_bound`` s: a most urgent generation on time that misses its budget at l_max even
    alone is judged at the longest segment seen for its kind (+1 token), while the batch
    with the candidate holds at most s of its cap; otherwise the paper's test stands."""
    engine = _engine()
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    candidate = _add(engine, 'n', 10)                  # normal, 0.001 s of prefill

    def ctx(seen: int | None, max_batch: int = 8) -> AdmissionContext:
        return replace(_ctx(engine, [urgent], now=0.05, max_batch=max_batch),
                       seen_segment_tokens=lambda g: seen)

    # budget 0.142 s; alone, l_max's 8 tokens left take 8 × 0.020 = 0.16 s: lost at l_max,
    # and the paper's test refuses: 0.001 + 8 × 0.030 = 0.241 s
    assert budget_s(urgent, ctx(4)) == pytest.approx(0.142)
    assert not latency_guided(candidate, ctx(4))
    # seen 4 tokens: (4 + 1) − 2 = 3 left, 0.001 + 3 × 0.030 = 0.091 s within the budget
    assert latency_guided(candidate, ctx(4), seen_bound=0.25)
    # a longer segment seen: 6 left, 0.181 s; nothing seen yet: l_max, the paper's test
    assert not latency_guided(candidate, ctx(7), seen_bound=0.25)
    assert not latency_guided(candidate, ctx(None), seen_bound=0.25)
    # a batch of 2 over a quarter of a cap of 4: the paper's test
    assert not latency_guided(candidate, ctx(4, max_batch=4), seen_bound=0.25)
    assert latency_guided(candidate, ctx(4, max_batch=4), seen_bound=0.5)
    # one not lost at l_max alone (6 tokens left: 0.12 s) keeps the paper's test, which
    # refuses the join (0.001 + 6 × 0.030 = 0.181 s), whatever was seen
    closer = _add(engine, 'c', 10, task_class='urgent', segment_tokens=4, run=True)
    near = replace(_ctx(engine, [closer], now=0.05, max_batch=8),
                   seen_segment_tokens=lambda g: 4)
    assert not latency_guided(candidate, near, seen_bound=0.25)
    # the policies: the fleet's default uses a quarter of the cap, the paper's none
    assert create_policy('timelyllm-share').seen_bound == 0.25
    assert create_policy('timelyllm').seen_bound is None


def test_where_the_seen_bound_judges_only_less_urgent_joins_use_the_stall_budget() -> None:
    """The round stall budget is k × the most urgent generation's time left at l_max; where
    that generation misses its budget at l_max anyway and the seen bound judges it, the
    prefills of joins at least as urgent (which come first whatever is refused) do not count
    in it: the default regime's normal goals waited behind urgent ones for nothing."""
    from timelyllm_ros.core.admission import BatchColumns

    engine = _engine(gpu_kv_tokens=1 << 16, max_num_seqs=8)
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=2, run=True)
    running = [urgent]

    def round_ctx(seen: int | None) -> AdmissionContext:
        return replace(_ctx(engine, running, now=0.05, max_batch=8),
                       batch_columns=BatchColumns(), seen_segment_tokens=lambda g: seen)

    for seen, joins in ((4, True), (None, False)):
        ctx = round_ctx(seen)
        # an urgent peer as urgent as 'u' joins and prices its 0.25 s prefill
        peer = _add(engine, f'p{seen}', 2500, task_class='urgent')
        assert engine.run_cost_s(peer.task_id) == pytest.approx(0.25)
        assert latency_guided(peer, ctx, round_stall=1.0, seen_bound=0.5)
        engine.run(peer.task_id)
        running.append(peer)
        # 'u' misses its 0.142 s budget at l_max (8 × 0.030 = 0.24 s at 2 running) and the
        # round stall 0.25 + 0.001 s is over 1 × 0.24 s; seen 4 tokens, the peer's prefill
        # does not count and 0.001 + 3 × 0.040 s = 0.121 s is within the budget; with
        # nothing seen the stall budget refuses
        normal = _add(engine, f'n{seen}', 10)
        assert latency_guided(normal, ctx, round_stall=1.0, seen_bound=0.5) is joins
        assert latency_guided(normal, round_ctx(seen), seen_bound=0.5) is joins
        running.remove(peer)
        engine.release(peer.task_id)
    # the less urgent joins' stall still counts there: with k = 0.05, 0.05 × 8 × 0.040 s =
    # 0.016 s at 3 running; 'n' (0.001 s) joined, so 'm' (0.016 s) would stall 0.017 s
    ctx = round_ctx(3)
    peer = _add(engine, 'p', 2500, task_class='urgent')
    assert latency_guided(peer, ctx, round_stall=0.05, seen_bound=0.5)
    engine.run('p')
    running.append(peer)
    normal = _add(engine, 'n', 10)
    assert latency_guided(normal, ctx, round_stall=0.05, seen_bound=0.5)
    engine.run('n')
    running.append(normal)
    more = _add(engine, 'm', 160)
    assert engine.run_cost_s('m') == pytest.approx(0.016)
    assert latency_guided(more, round_ctx(3), seen_bound=0.5)     # alone: 0.016 + 2 × 0.05
    assert not latency_guided(more, ctx, round_stall=0.05, seen_bound=0.5)


@pytest.mark.parametrize('value', [0.0, -0.1, 1.5, math.nan])
def test_seen_bound_must_be_a_share_of_the_cap(value: float) -> None:
    from timelyllm_ros.errors import PolicyError
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    with pytest.raises(PolicyError, match=r'seen_bound must be within \(0, 1\]'):
        TimelyLlmPolicy(seen_bound=value)


def test_a_resume_reserve_keeps_the_last_slots_from_early_resumes() -> None:
    """``resume_reserve`` r: a later segment its robot does not need yet, less urgent than the
    batch's most urgent generation, does not take one of the last r of the slots while no
    queued goal has lost its utility."""
    engine = _engine(max_num_seqs=8, gpu_kv_tokens=640)
    urgent = _add(engine, 'u', 10, task_class='urgent', segment_tokens=9,
                  run=True)                      # budget 0.142 s, one token left to l_max
    others = [_add(engine, f'o{i}', 10, run=True) for i in range(3)]
    early = _add(engine, 'r', 10, k=1, need=0.5)                     # budget 0.442 s
    batch = [urgent, *others]                                        # 4 of a cap of 8

    def ctx(running: list[Generation], queued: tuple[Generation, ...] = ()) -> AdmissionContext:
        return _late_ctx(engine, running, list(queued), max_batch=8)

    assert budget_s(early, ctx(batch)) == pytest.approx(0.442)
    # the 5th slot of 8 is one of the last half: kept
    assert not keeps_resume_reserve(early, ctx(batch), 0.5)
    # a quarter of the slots kept: the 5th is free to take; so is the 4th at a half
    assert keeps_resume_reserve(early, ctx(batch), 0.25)
    assert keeps_resume_reserve(early, ctx(batch[:3]), 0.5)
    # a goal past its zero-utility time waits in the queue: the slot is worth more to it
    lost_goal = _add(engine, 'l', 10, arrival=-10.0)
    assert keeps_resume_reserve(early, ctx(batch, (lost_goal,)), 0.5)
    # a first segment, a resume its robot needs now, one more urgent than the batch's most urgent
    fresh = _add(engine, 'f', 10)
    due = _add(engine, 'd', 10, k=1, need=0.0)                       # budget -0.058 s
    as_urgent = _add(engine, 'a', 10, k=1, need=0.1)                 # budget 0.042 s
    for candidate in (fresh, due, as_urgent):
        assert keeps_resume_reserve(candidate, ctx(batch), 0.5), candidate.task_id
    # the policies: the fleet's default keeps half, the paper's none, whose latency test lets
    # the early resume in (the most urgent one's last token stays well within its budget)
    share, paper = create_policy('timelyllm-share'), create_policy('timelyllm')
    assert share.resume_reserve == 0.5 and paper.resume_reserve is None
    assert latency_guided(early, ctx(batch)) and paper.admit(early, ctx(batch))
    assert not share.admit(early, ctx(batch))


@pytest.mark.parametrize('value', [0.0, 1.0, -0.5, math.nan])
def test_resume_reserve_must_be_a_share_of_the_slots(value: float) -> None:
    from timelyllm_ros.errors import PolicyError
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    with pytest.raises(PolicyError, match=r'resume_reserve must be within \(0, 1\)'):
        TimelyLlmPolicy(resume_reserve=value)


def test_the_scheduler_tells_the_longest_segment_seen_per_robot_kind_and_position() -> None:
    """The context's ``seen_segment_tokens``: the most tokens of a cut segment so far, first
    segments apart from later ones, per robot profile; None before any."""
    scheduler = Scheduler(create_policy('timelyllm-share'), _engine(max_num_seqs=8),
                          SimClock(), SchedulerConfig(report_deadlines=False))
    first = scheduler.submit(make_spec('a', plan='takeoff();mf(50);tc(90)', prompt_tokens=10))
    seen = scheduler._context(0.0).seen_segment_tokens
    assert seen is not None and seen(first) is None
    while scheduler.has_work:
        scheduler.tick()
    tokens = [s.tokens for s in first.segments]
    assert len(tokens) == 3 and tokens[0] != max(tokens[1:])
    fresh = scheduler.submit(make_spec('b', prompt_tokens=10))
    assert seen(fresh) == tokens[0]                      # a first segment: k = 0
    fresh.k = 1
    assert seen(fresh) == max(tokens[1:])                # a later one
    other = scheduler.submit(make_spec('c', profile='indy7', prompt_tokens=10))
    assert seen(other) is None                           # no arm segment yet


def _queued_scheduler(goals: int, arrival_gap_s: float) -> Scheduler:
    """A timelyllm scheduler with ``goals`` queued, every third normal, the rest urgent."""
    scheduler = Scheduler(create_policy('timelyllm'), _engine(max_num_seqs=64), SimClock(),
                          SchedulerConfig(report_deadlines=False))
    for i in range(goals):
        scheduler.submit(make_spec(f't{i}', task_class='urgent' if i % 3 else 'normal',
                                   arrival=arrival_gap_s * i, prompt_tokens=10))
    return scheduler


def test_policy_counts_lost_goals_once_per_decision_like_the_scalar_test() -> None:
    from timelyllm_ros.core.admission import lost_slopes

    scheduler = _queued_scheduler(12, arrival_gap_s=0.1)
    scheduler.clock.advance_to(1.3)
    ctx = scheduler._context(1.3)
    expected = [-g.spec.tuf.alpha for g in scheduler.queue.generations if lost(g, ctx)]
    assert 0 < len(expected) < 12
    total, count = lost_slopes(scheduler.queue.view(COMM), 1.3)
    assert count == len(expected) and total == pytest.approx(sum(expected))


def test_the_lost_tally_follows_the_queue_through_an_admission_round() -> None:
    from timelyllm_ros.core.admission import LostTally, lost_slopes

    scheduler = _queued_scheduler(30, arrival_gap_s=0.05)
    now = 1.4
    view = scheduler.queue.view(COMM)
    tally = LostTally(view, now, lambda: len(scheduler.queue))
    tally.taken(scheduler.queue.at(0))            # before the first question: nothing kept
    total, count = tally.slopes()
    assert 0 < count < 30
    for task_id in [g.task_id for g in scheduler.queue.generations][::3]:
        generation = scheduler.queue.remove(task_id)
        tally.taken(generation)
        fresh = lost_slopes(view, now, len(scheduler.queue))
        assert tally.slopes()[1] == fresh[1]
        assert tally.slopes()[0] == pytest.approx(fresh[0], abs=1e-9)


# -- the delay cost's running sums (issue 32) --------------------------------------------------
def _random_batch(engine: SimulatedEngine, rng: random.Random, size: int) -> list[Generation]:
    """Running generations with budgets around 0 (late and on time) and every TUF class."""
    batch = []
    for i in range(size):
        g = _add(engine, f'r{i}', 10, task_class=rng.choice(['urgent', 'normal']),
                 arrival=rng.uniform(-0.6, 0.3), segment_tokens=rng.randrange(0, L_MAX + 2))
        g.status = TaskStatus.RUNNING
        batch.append(g)
    return batch


@pytest.mark.parametrize('seed', range(40))
def test_the_bounded_delay_test_gives_the_exact_verdict(seed: int) -> None:
    """delay_cost_within answers ``delay_cost <= gain`` exactly, whether the running sums or
    the sum over the batch settle it: gains on both sides of the cost, at it, and at 0."""
    from timelyllm_ros.core.admission import BatchColumns, delay_cost_within

    rng = random.Random(seed)
    engine = SimulatedEngine(calibration=tiny_calibration(gpu_kv_tokens=1 << 20, max_num_seqs=64))
    batch = _random_batch(engine, rng, rng.randrange(1, 40))
    recent = rng.choice([None, 0.021, 0.05])
    ctx = replace(_ctx(engine, batch, max_batch=64, recent_step_s=recent),
                  batch_columns=BatchColumns())
    for extra in (0.0, 0.004, rng.uniform(0.0, 0.2)):
        cost = delay_cost(extra, ctx, BatchColumns().of(ctx))    # apart from the tested one
        for gain in (cost, cost * (1 + 1e-12), cost * (1 - 1e-12), cost + 0.5,
                     max(cost - 0.5, 0.0), 0.0, rng.uniform(0.0, 2 * cost + 1.0)):
            assert delay_cost_within(gain, extra, ctx) == (cost <= gain), (extra, gain, cost)


def test_the_batch_columns_follow_a_round_of_admissions_like_a_fresh_build() -> None:
    from timelyllm_ros.core.admission import BatchColumns

    rng = random.Random(7)
    engine = SimulatedEngine(calibration=tiny_calibration(gpu_kv_tokens=1 << 20, max_num_seqs=64))
    batch = _random_batch(engine, rng, 30)
    running: dict[str, Generation] = {g.task_id: g for g in batch[:5]}
    kept = BatchColumns()
    ctx = _ctx(engine, running.values(), max_batch=64, recent_step_s=0.03)  # type: ignore[arg-type]
    for g in batch[5:]:
        kept.of(ctx)
        running[g.task_id] = g
        fresh = BatchColumns().of(ctx)
        kept.of(ctx)
        assert kept.generations == fresh.generations
        assert kept.most_urgent == fresh.most_urgent
        assert kept.most_urgent_budget == fresh.most_urgent_budget
        assert (kept.most_urgent_remaining == fresh.most_urgent_remaining
                == fresh.remaining[fresh.most_urgent])
        for column in ('remaining', 'budget', 'alpha'):
            assert getattr(kept, column).tolist() == getattr(fresh, column).tolist()
        assert kept.delay_floor(0.03).tolist() == fresh.delay_floor(0.03).tolist()
        assert astuple(kept.weights) == pytest.approx(astuple(fresh.weights), rel=1e-12)
    del running[batch[9].task_id]                 # not an append: rebuilt
    assert kept.of(ctx).generations == list(running.values())


@pytest.mark.parametrize('seed', range(30))
def test_the_delay_test_stays_exact_through_a_round_of_admissions(seed: int) -> None:
    """Through a round (rows appended one by one, the observed step time fixed, the decode
    model's b → b + 1 step changing), every verdict equals the exact sum's, whether the running
    sums, the last exact cost plus its growth (the anchor), or a new exact sum settles it."""
    from timelyllm_ros.core.admission import BatchColumns, delay_cost_within

    rng = random.Random(seed)
    engine = SimulatedEngine(calibration=tiny_calibration(gpu_kv_tokens=1 << 20, max_num_seqs=64))
    generations = _random_batch(engine, rng, 40)
    running: dict[str, Generation] = {g.task_id: g for g in generations[:rng.randrange(1, 10)]}
    ctx = replace(_ctx(engine, running.values(), max_batch=64,  # type: ignore[arg-type]
                       recent_step_s=rng.choice([0.021, 0.05])), batch_columns=BatchColumns())
    anchored = 0
    for g in generations[len(running):]:
        assert ctx.batch_columns is not None
        batch = ctx.batch_columns.of(ctx)           # as the round's next test brings it up
        for extra in (rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.05)):
            cost = delay_cost(extra, ctx, BatchColumns().of(ctx))  # apart from the tested one
            for gain in (cost, cost * (1 + 1e-12), cost * (1 - 1e-12), cost + 0.05,
                         max(cost - 0.05, 0.0), rng.uniform(0.0, 2 * cost + 0.1)):
                size = len(ctx.running)
                step = ctx.recent_step_s
                assert step is not None
                anchored += batch.anchored_upper(extra, step, step * (size + 1) / size) < math.inf
                assert delay_cost_within(gain, extra, ctx, batch) == (cost <= gain), (extra, gain)
        running[g.task_id] = g                      # the next admission
    assert anchored                                 # the anchor was there to be used


@pytest.mark.parametrize('recent', [None, 0.03])
def test_the_step_scales_of_a_test_are_those_of_each_size_asked_once(recent: float | None
                                                                      ) -> None:
    """``_step_scales`` gives ``_step_scale`` at the batch's size and one more (the latency
    test's two step times), asking the decode model for each size once, the larger first."""
    from timelyllm_ros.core.admission import _step_scale, _step_scales

    engine = _engine()
    running = [_add(engine, f'r{i}', 10, run=True) for i in range(3)]
    ctx = _ctx(engine, running, recent_step_s=recent)
    for model in ({2: 0.02, 3: 0.03, 4: 0.045}, {3: 0.0, 4: 0.01}):
        asked: list[int] = []

        def decode_s(size: int, model: dict[int, float] = model,
                     asked: list[int] = asked) -> float:
            asked.append(size)
            return model[size]

        scales = _step_scales(3, ctx, decode_s)
        assert asked == [4, 3]
        assert scales == (_step_scale(4, ctx, decode_s)[0], _step_scale(3, ctx, decode_s)[1],
                          _step_scale(4, ctx, decode_s)[1])
