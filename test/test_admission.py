"""Admission (§4.4): batch cap and KV fit, and the latency-guided WCET test, by hand.

The tiny calibration (test/utils.py) has prefill 0.1 ms/token and decode steps of
20 ms (batch 1), 30 ms (batch 2), 40 ms (batch 3), independent of context length.
"""

from __future__ import annotations

import pytest
from utils import make_spec, tiny_calibration

from timelyllm_ros.admission import AdmissionContext, budget_s, fits, latency_guided, wcet_s
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.policies import create_policy
from timelyllm_ros.request import Generation, TaskStatus

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
