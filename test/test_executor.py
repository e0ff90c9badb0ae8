"""The skill executor on a simulated backend and a virtual clock: order, timing, control flow."""

from __future__ import annotations

import time

import numpy as np
import pytest

from timelyllm_ros.core.clock import SimClock, WallClock
from timelyllm_ros.core.request import Segment
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import SkillCall, Statement, segment_text
from timelyllm_ros.robots.executor import SegmentExecution, SkillExecutor, condition_holds
from timelyllm_ros.robots.sim_backend import SimulatedBackend

# tello models: takeoff 5 s, land 3 s, mf/mb/ml/mr 1.8144 + 0.0072 d, tc/tu 0.784 + 0.0165 deg
TO, LD = 5.0, 3.0


def mf_s(distance: float) -> float:
    return 1.8144 + 0.0072 * distance


def tc_s(degrees: float) -> float:
    return 0.784 + 0.0165 * degrees


@pytest.fixture(scope='module')
def tello() -> RobotProfile:
    return load_profile('tello')


def statements(profile: RobotProfile, plan: str) -> tuple[Statement, ...]:
    cuts = segment_text(profile, plan)
    assert not any(cut.rejected for cut in cuts), [cut.rejected for cut in cuts]
    return tuple(st for cut in cuts for st in cut.statements)


def segment(profile: RobotProfile, plan: str, index: int = 0) -> Segment:
    return Segment(index=index, text=plan, statements=statements(profile, plan), cut_time=0.0,
                   dispatch_time=0.0, estimated_exec_s=0.0, tokens=0)


def run(profile: RobotProfile, plan: str, start: float = 10.0,
        **backend_kwargs: object) -> tuple[SegmentExecution, SimulatedBackend, SimClock]:
    clock = SimClock(start)
    backend = SimulatedBackend(profile, clock, **backend_kwargs)  # type: ignore[arg-type]
    result = SkillExecutor(backend, clock).execute(segment(profile, plan))
    return result, backend, clock


# --- the segmenter's condition fields ----------------------------------------------------------

@pytest.mark.parametrize(('plan', 'op', 'value'), [
    ("?iv('cat')==True{g('cat')}", '==', True),
    ("?iv('cat')!=False{g('cat')}", '!=', False),
    ("?od('cat')<100{mf(50)}", '<', 100),
    ("?ox('cat')>=0.25{mf(50)}", '>=', 0.25),
    ("?p('color?')=='red'{mf(50)}", '==', 'red'),
    ("?iv('cat'){g('cat')}", None, None),
    ("?iv('cat'){?od('cat')<3{mf(20)}}", None, None),       # the nested op is not the top's
])
def test_statement_condition_fields(tello, plan, op, value):
    (statement,) = statements(tello, plan)
    assert statement.kind == 'conditional'
    assert statement.condition_op == op
    assert statement.condition_value == value and type(statement.condition_value) is type(value)


def test_non_conditionals_have_no_condition(tello):
    for statement in statements(tello, "mf(50);3{?iv('a')==True{tc(90)}}"):
        assert statement.condition_op is None and statement.condition_value is None


# --- order and timing --------------------------------------------------------------------------

def test_skills_run_in_order_with_exact_clock_times(tello):
    result, backend, clock = run(tello, 'to();mf(50);tc(90);ld()')
    assert result.success and result.error == ''
    assert [r.call for r in result.skills] == ['to()', 'mf(50)', 'tc(90)', 'ld()']
    assert [r.skill for r in result.skills] == ['takeoff', 'move_forward', 'turn_cw', 'land']
    durations = [TO, mf_s(50), tc_s(90), LD]
    expected_start = 10.0
    for record, duration in zip(result.skills, durations, strict=True):
        assert record.success and record.error == ''
        assert record.start_time == pytest.approx(expected_start, abs=1e-12)
        assert record.end_time - record.start_time == pytest.approx(duration, abs=1e-12)
        expected_start = record.end_time
    assert result.start_time == 10.0
    assert result.end_time == clock.now() == pytest.approx(10.0 + sum(durations))
    assert result.skills[1].args == {'distance': 50}
    assert [c.text for c in backend.performed] == ['to()', 'mf(50)', 'tc(90)', 'ld()']
    execution = result.to_execution()
    assert (execution.start_time, execution.end_time, execution.success) == (
        result.start_time, result.end_time, True)


def test_loop_repeats_its_body(tello):
    result, _, clock = run(tello, '3{mf(20);tc(120)}', start=0.0)
    assert result.success
    assert [r.call for r in result.skills] == ['mf(20)', 'tc(120)'] * 3
    assert clock.now() == pytest.approx(3 * (mf_s(20) + tc_s(120)))


def test_several_statements_in_one_segment(tello):
    result, _, _ = run(tello, "to();2{tu(45)};l('done')")
    assert [r.call for r in result.skills] == ['to()', 'tu(45)', 'tu(45)', "l('done')"]
    assert result.skills[-1].result == 'done'


# --- conditionals ------------------------------------------------------------------------------

@pytest.mark.parametrize(('plan', 'perception', 'runs_body'), [
    ("?iv('cat')==True{g('cat')}", {}, True),                         # default: visible
    ("?iv('cat')==True{g('cat')}", {'iv': False}, False),
    ("?iv('cat')==True{g('cat')}", {"iv('cat')": False}, False),     # by call text
    ("?iv('cat')==True{g('cat')}", {'iv:dog': False}, True),         # another object
    ("?iv('cat')==False{g('cat')}", {'iv:cat': False}, True),
    ("?iv('cat')!=True{g('cat')}", {'is_visible': True}, False),
    ("?iv('cat'){g('cat')}", {'iv': True}, True),                     # bare: truthy
    ("?iv('cat'){g('cat')}", {'iv': False}, False),
    ("?od('cat')<100{g('cat')}", {'od': 50}, True),
    ("?od('cat')<100{g('cat')}", {'od': 150}, False),
    ("?od('cat')<=100{g('cat')}", {'od': 100}, True),
    ("?ox('cat')>0.6{g('cat')}", {}, False),                          # default 0.5
    ("?p('color?')=='Red'{g('cat')}", {'p': 'red'}, True),
    ("?p('color?')=='red'{g('cat')}", {'p': 'blue'}, False),
])
def test_conditional_runs_body_only_when_the_condition_holds(tello, plan, perception,
                                                             runs_body):
    result, _, _ = run(tello, plan, perception=perception)
    assert result.success, result.error
    calls = [r.call for r in result.skills]
    assert calls[0] == plan[1:plan.index(')') + 1]       # the condition is always performed
    assert calls[1:] == (["g('cat')"] if runs_body else [])


def test_nested_conditional_inside_loop(tello):
    plan = "4{tc(90);?iv('keys')==True{l('found the keys');tp()}}"
    result, _, _ = run(tello, plan, perception={'iv:keys': False})
    assert [r.call for r in result.skills] == ['tc(90)', "iv('keys')"] * 4
    result, _, _ = run(tello, plan, perception={'iv:keys': True})
    assert [r.call for r in result.skills] == [
        'tc(90)', "iv('keys')", "l('found the keys')", 'tp()'] * 4


def test_nested_loop_inside_conditional_inside_loop(tello):
    plan = "2{?iv('cat')==True{3{tc(30)};l('x')};mf(20)}"
    result, _, _ = run(tello, plan)
    assert [r.call for r in result.skills] == (
        ["iv('cat')", 'tc(30)', 'tc(30)', 'tc(30)', "l('x')", 'mf(20)'] * 2)
    result, _, _ = run(tello, plan, perception={'iv': False})
    assert [r.call for r in result.skills] == ["iv('cat')", 'mf(20)'] * 2


def test_the_executor_walks_the_tree_not_the_text(tello):
    # the text is never read again: a tree under an unrelated text runs as the tree says
    (parsed,) = statements(tello, "3{?iv('cat')<2{tp()}}")
    renamed = Statement('anything', parsed.calls, kind='loop', repeat=2, body=parsed.body)
    seg = Segment(0, 'anything', (renamed,), 0.0, 0.0, 0.0, 0)
    clock = SimClock()
    backend = SimulatedBackend(tello, clock, perception={'iv': 1})
    result = SkillExecutor(backend, clock).execute(seg)
    assert result.success
    assert [r.call for r in result.skills] == ["iv('cat')", 'tp()'] * 2


def _hand_built(tello: RobotProfile, statement: Statement,
                **backend_kwargs: object) -> list[str]:
    seg = Segment(0, statement.text, (statement,), 0.0, 0.0, 0.0, 0)
    clock = SimClock()
    backend = SimulatedBackend(tello, clock, **backend_kwargs)  # type: ignore[arg-type]
    result = SkillExecutor(backend, clock).execute(seg)
    assert result.success, result.error
    return [r.call for r in result.skills]


def test_hand_built_statements_without_a_body_run_their_flat_calls(tello):
    iv = SkillCall('is_visible', 'iv', {'object': 'cat'}, "iv('cat')")
    tp = SkillCall('take_picture', 'tp', {}, 'tp()')
    mf = SkillCall('move_forward', 'mf', {'distance': 20}, 'mf(20)')
    assert _hand_built(tello, Statement('mf(20);tp()', (mf, tp))) == ['mf(20)', 'tp()']
    loop = Statement('2{mf(20);tp()}', (mf, tp), kind='loop', repeat=2)
    assert _hand_built(tello, loop) == ['mf(20)', 'tp()'] * 2
    conditional = Statement("?iv('cat')==True{tp()}", (iv, tp), kind='conditional',
                            condition_op='==', condition_value=True)
    assert _hand_built(tello, conditional) == ["iv('cat')", 'tp()']
    assert _hand_built(tello, conditional, perception={'iv': False}) == ["iv('cat')"]
    text = Statement('Hello there.', (), kind='text')
    assert _hand_built(tello, text) == []


def test_condition_that_cannot_be_compared_fails_the_segment(tello):
    result, _, _ = run(tello, "?od('cat')<100{g('cat')};ld()", perception={'od': 'far'})
    assert not result.success
    assert "od('cat')" in result.error and 'cannot compare' in result.error
    assert [r.call for r in result.skills] == ["od('cat')"]


def test_condition_holds_semantics():
    assert condition_holds('True', '==', True) and not condition_holds('no', None, None)
    assert condition_holds('42', '>', 41.5) and condition_holds(3, '!=', 4)
    with pytest.raises(RobotError):
        condition_holds(True, '<', 3)
    with pytest.raises(RobotError):
        condition_holds('maybe', None, None)


# --- refusal and failure -----------------------------------------------------------------------

def test_out_of_range_segment_is_refused_before_anything_is_sent(tello):
    # the segmenter already rejects mf(600) for the tello profile: build the call by hand
    bad = SkillCall('move_forward', 'mf', {'distance': 600}, 'mf(600)')
    ok = SkillCall('takeoff', 'to', {}, 'to()')
    seg = Segment(0, 'to();mf(600)', (Statement('to()', (ok,)), Statement('mf(600)', (bad,))),
                  0.0, 0.0, 0.0, 0)
    clock = SimClock(5.0)
    backend = SimulatedBackend(tello, clock)
    result = SkillExecutor(backend, clock).execute(seg)
    assert not result.success
    assert result.skills == [] and backend.performed == []
    assert 'mf(600): distance=600 above the maximum 500 cm' in result.error
    assert result.start_time == result.end_time == clock.now() == 5.0


class _NoGoto(SimulatedBackend):
    def supports(self, skill: str) -> bool:
        return skill != 'goto' and super().supports(skill)


def test_unsupported_skill_is_refused_before_anything_is_sent(tello):
    clock = SimClock()
    backend = _NoGoto(tello, clock)
    executor = SkillExecutor(backend, clock)
    with pytest.raises(RobotError, match='not supported'):
        executor.validate(statements(tello, "to();?iv('cat')==True{g('cat')}"))
    result = executor.execute(segment(tello, "to();?iv('cat')==True{g('cat')}"))
    assert not result.success and result.skills == [] and backend.performed == []
    assert "skill 'goto'" in result.error and 'refused before sending anything' in result.error


def test_malformed_statement_is_refused(tello):
    seg = Segment(0, 'mf(', (Statement('mf(', (), error="mf: missing ')'"),), 0, 0, 0, 0)
    clock = SimClock()
    result = SkillExecutor(SimulatedBackend(tello, clock), clock).execute(seg)
    assert not result.success and result.skills == [] and 'malformed' in result.error


def test_injected_failure_stops_the_segment(tello):
    result, backend, clock = run(tello, 'to();mf(50);tc(90);ld()', start=0.0, fail_on={'tc'})
    assert not result.success
    assert result.error.startswith('tc(90) failed:') and 'injected failure' in result.error
    assert [(r.call, r.success) for r in result.skills] == [
        ('to()', True), ('mf(50)', True), ('tc(90)', False)]
    assert result.skills[-1].error and result.skills[-1].end_time == clock.now()
    assert [c.text for c in backend.performed] == ['to()', 'mf(50)', 'tc(90)']
    assert result.end_time == pytest.approx(TO + mf_s(50) + tc_s(90))


def test_failure_inside_a_loop_stops_at_the_first_iteration(tello):
    result, _, _ = run(tello, '3{mf(20);tc(90)}', fail_on={'tc(90)'})
    assert [r.call for r in result.skills] == ['mf(20)', 'tc(90)']


def test_random_failures_and_jitter_are_seeded(tello):
    def once(seed: int) -> SegmentExecution:
        result, _, _ = run(tello, '5{mf(20)}', rng=np.random.default_rng(seed), jitter=0.2,
                           fail_probability=0.3)
        return result
    first, again = once(3), once(3)
    assert [(r.start_time, r.end_time, r.success) for r in first.skills] == [
        (r.start_time, r.end_time, r.success) for r in again.skills]
    durations = {round(r.end_time - r.start_time, 9) for r in first.skills}
    assert len(durations) == len(first.skills)     # jitter: no two draws alike
    assert all(d >= 0 for d in durations)
    failures = [once(seed) for seed in range(20)]
    assert any(not f.success for f in failures) and any(f.success for f in failures)


def test_sampled_model_draws_from_its_samples(tello):
    result, _, _ = run(tello, "s('cat')", rng=np.random.default_rng(0))
    record = result.skills[0]
    samples = tello.skill('scan').exec_time.samples
    assert min(abs(record.end_time - record.start_time - s) for s in samples) < 1e-9


def test_unconnected_backend_is_connected_by_the_executor(tello):
    clock = SimClock()
    backend = SimulatedBackend(tello, clock)
    assert not backend.connected
    assert SkillExecutor(backend, clock).execute(segment(tello, 'to()')).success
    assert backend.connected
    backend.close()
    with pytest.raises(RobotError, match='not connected'):
        backend.perform(SkillCall('takeoff', 'to', {}, 'to()'))


def test_wall_clock_backend_sleeps(tello):
    clock = WallClock()
    backend = SimulatedBackend(tello, clock)
    began = time.monotonic()
    result = SkillExecutor(backend, clock).execute(segment(tello, 'd(0.05);d(0.05)'))
    assert result.success
    assert time.monotonic() - began >= 0.1           # lower bounds: sleeps never end early
    assert result.end_time - result.start_time >= 0.1 - 1e-6


def test_bad_backend_parameters(tello):
    with pytest.raises(ValueError):
        SimulatedBackend(tello, SimClock(), jitter=-1)
    with pytest.raises(ValueError):
        SimulatedBackend(tello, SimClock(), fail_probability=2)
