"""Input hardening (issue 13): the segmenter, the statement parser, profiles, robot backends
and task messages turn any input into a rejection with a reason, never an exception."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Segment
from timelyllm_ros.errors import GoalError, ProfileError, RobotError
from timelyllm_ros.language import parser as parser_module
from timelyllm_ros.language.profiles import (
    PROFILES_DIR,
    available_profiles,
    load_profile,
    load_profile_file,
    load_profile_name_or_file,
)
from timelyllm_ros.language.segmenter import (
    Segmenter,
    SkillCall,
    Statement,
    segment_pieces,
    segment_text,
)
from timelyllm_ros.language.validation import statement_problem
from timelyllm_ros.live.goals import validate_goal
from timelyllm_ros.nodes import convert
from timelyllm_ros.robots.backend import wait_on
from timelyllm_ros.robots.executor import SkillExecutor
from timelyllm_ros.robots.indy7 import Indy7Backend
from timelyllm_ros.robots.sim_backend import SimulatedBackend
from timelyllm_ros.robots.tello import TelloBackend

PROFILES = {name: load_profile(name) for name in available_profiles()}
TELLO = PROFILES['tello']
INDY7 = PROFILES['indy7']
_SETTINGS = settings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _rejected(profile, text: str) -> list[Statement]:
    cuts = segment_text(profile, text)
    assert not [s for cut in cuts for s in cut.statements], text[:80]
    return [s for cut in cuts for s in cut.rejected]


def _error(profile, text: str) -> str:
    (statement,) = _rejected(profile, text)
    assert statement.error and not statement.executable
    return statement.error


# --- the segmenter and the parser never raise --------------------------------------------------

def test_deep_nesting_is_rejected_before_recursing():
    assert _error(TELLO, '1{' * 400 + 'tp()' + '}' * 400) == 'nesting deeper than 4'
    assert _error(TELLO, "?iv('a'){" * 5 + 'tp()' + '}' * 5) == 'nesting deeper than 4'
    assert segment_text(TELLO, '1{' * 4 + 'tp()' + '}' * 4)[0].statements
    unclosed = _error(TELLO, '1{' * 400)
    assert 'missing 400 closing brackets' in unclosed and len(unclosed) < 200


def test_depth_limit_is_a_profile_field(tmp_path):
    data = yaml.safe_load((PROFILES_DIR / 'tello.yaml').read_text(encoding='utf-8'))
    data['max_nesting_depth'] = 1
    (tmp_path / 'flat.yaml').write_text(yaml.safe_dump(data), encoding='utf-8')
    flat = load_profile('flat', tmp_path)
    assert segment_text(flat, '2{tp()}')[0].statements
    assert _error(flat, '2{2{tp()}}') == 'nesting deeper than 1'


def test_overlong_numbers_are_malformed_not_exceptions():
    assert 'at most 20, got a 5000-character number' in _error(TELLO, '9' * 5000 + '{tp()}')
    assert 'longer than 32 characters' in _error(TELLO, 'mf(' + '9' * 5000 + ')')
    assert 'longer than 32 characters' in _error(TELLO, "?iv('a')==" + '9' * 5000 + '{tp()}')
    assert 'longer than 32 characters' in _error(TELLO, 'd(0.' + '0' * 400 + '1)')


@pytest.mark.parametrize('text', ['d(nan)', 'd(inf)', 'd(-inf)', 'd(1e999)', 'd(NaN)',
                                  'd(1_0)', 'mf(50.5)', 'mf(1e2)', 'd(٣)'])
def test_non_finite_or_odd_numbers_are_rejected(text):
    _error(TELLO, text)


@pytest.mark.parametrize('text', ['mj(nan,0,0,0,0,0)', 'mj(0,0,0,0,0,1e999)',
                                  'mt(nan,0,300,0,0,0)', 'mt(0,0,300,inf,0,0)'])
def test_non_finite_arm_arguments_are_rejected(text):
    _error(INDY7, text)


def test_loop_counts_are_bounded_by_the_profile():
    assert _error(TELLO, '99999999999{tp()}') == 'a loop count must be at most 20, got 99999999999'
    assert _error(TELLO, '21{tp()}') == 'a loop count must be at most 20, got 21'
    assert segment_text(TELLO, '20{tp()}')[0].statements[0].repeat == 20
    assert 'nested loops repeat their body 25 times' in _error(TELLO, '5{5{tp()}}')
    assert segment_text(TELLO, '4{5{tp()}}')[0].statements


def test_conditions_must_be_query_skills():
    assert _error(TELLO, '?mf(50){tp()}') == "condition must be a query skill, not 'mf'"
    assert _error(INDY7, "?pick('cup'){grip()}") == "condition must be a query skill, not 'pick'"
    for plan in ("?iv('cat')==True{g('cat')}", "?s('cat'){g('cat')}", "?od('cat')<100{mf(50)}"):
        assert segment_text(TELLO, plan)[0].statements, plan
    assert segment_text(INDY7, "?check('cup')==True{pick('cup')}")[0].statements


def test_query_flags_of_the_bundled_profiles():
    assert {s.name for s in TELLO.skills if s.query} == {
        'scan', 'scan_abstract', 'is_visible', 'object_x', 'object_y', 'object_width',
        'object_height', 'object_distance', 'probe'}
    assert {s.name for s in INDY7.skills if s.query} == {'detect', 'check'}
    for profile in PROFILES.values():
        assert profile.max_nesting_depth >= 1 and profile.max_loop_count >= 1


def test_an_unexpected_failure_rejects_only_that_statement(monkeypatch):
    original = parser_module.StatementParser._call

    def flaky(self):
        if self.s[self.i:].startswith('tc'):
            raise KeyError('boom')
        return original(self)

    monkeypatch.setattr(parser_module.StatementParser, '_call', flaky)
    cuts = segment_text(TELLO, 'mf(50);tc(90);ld()')
    assert [s.text for c in cuts for s in c.statements] == ['mf(50)', 'ld()']
    (bad,) = [s for c in cuts for s in c.rejected]
    assert bad.text == 'tc(90)' and bad.error == 'statement could not be validated: KeyError'


def test_statements_from_text_raises_only_goal_errors():
    for text in ['1{' * 400 + 'tp()' + '}' * 400, '9' * 5000 + '{tp()}', 'd(nan)',
                 '?mf(50){tp()}', 'x' * 10_000, '\udc80', '\x00']:
        with pytest.raises(GoalError) as info:
            convert.statements_from_text(TELLO, text)
        assert len(str(info.value)) < 400
    msg = SimpleNamespace(index=0, text='d(nan)', generated_stamp=SimpleNamespace(sec=0,
                          nanosec=0), estimated_execution_s=0.0, is_last=True)
    with pytest.raises(GoalError):
        convert.segment_from_msg(TELLO, msg)
    msg.text, msg.estimated_execution_s = 'tp()', math.nan
    with pytest.raises(GoalError, match='estimated execution time'):
        convert.segment_from_msg(TELLO, msg)
    msg.estimated_execution_s, msg.index = 0.0, 'x'
    with pytest.raises(GoalError, match='unreadable segment message: ValueError'):
        convert.segment_from_msg(TELLO, msg)


# --- property: arbitrary text in arbitrary pieces, every bundled profile ------------------------

_LANGUAGE = "(){};?0123456789abcdefghijklmnopqrstuvwxyz'\"=<>.,\n- "
_TOKENS = ['mf(', 'tc(', 'd(', 'iv(', "'cat'", ')', '(', '{', '}', '?', ';', '\n', '99', '0',
           '1{', "?iv('a')", '==True', 'nan', 'inf', '1e999', '9' * 40, 'tp()', "pick('x')",
           'mj(0,0,0,0,0,0)', 'check(', '.', '"', "'", '<', '>=', '-', ',', ' ', '20{']
_ADVERSARIAL = (st.text(alphabet=_LANGUAGE, max_size=120)
                | st.lists(st.sampled_from(_TOKENS), max_size=40).map(''.join)
                | st.text(max_size=60))


def _split(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _revalidates(profile, statement: Statement) -> None:
    assert statement.executable and statement.error is None
    assert statement_problem(profile, statement) is None, statement.text
    if statement.kind == 'text':
        return
    again = [s for cut in segment_text(profile, statement.text) for s in cut.statements]
    assert len(again) == 1 and again[0].calls == statement.calls, statement.text


@_SETTINGS
@given(text=_ADVERSARIAL, data=st.data(), name=st.sampled_from(sorted(PROFILES)))
def test_any_text_in_any_pieces_never_raises(text, data, name):
    profile = PROFILES[name]
    segmenter = Segmenter(profile)
    fed = ''
    cuts = []
    for piece in _split(data, text):
        fed += piece
        cut = segmenter.feed(piece)
        if cut is not None:
            cuts.append(cut)
            assert fed.startswith(''.join(c.text for c in cuts))
    cuts.append(segmenter.finish(data.draw(st.sampled_from(['eos', 'length']))))
    assert ''.join(c.text for c in cuts) == text
    for cut in cuts:
        for statement in cut.statements:
            _revalidates(profile, statement)
        assert all(not s.executable for s in cut.rejected)


@settings(max_examples=50, deadline=None)
@given(text=_ADVERSARIAL)
def test_segment_pieces_never_raises(text):
    for profile in PROFILES.values():
        pieces = segment_pieces(profile, list(text))
        assert ''.join(cut.text for _, cut in pieces) == text


# --- robot backends: finite, in-range arguments; failures never raise ----------------------------

def _mj(value: float) -> SkillCall:
    args = {f'j{i}': 0.0 for i in range(1, 7)}
    args['j1'] = value
    return SkillCall('move_joint', 'mj', args, f'mj({value},0,0,0,0,0)')


NAN_DELAY = SkillCall('delay', 'd', {'seconds': math.nan}, 'd(nan)')


@pytest.mark.parametrize('value', [math.nan, math.inf, -math.inf, 1e999])
def test_every_backend_check_refuses_non_finite_arguments(value):
    delay = SkillCall('delay', 'd', {'seconds': value}, f'd({value})')
    with pytest.raises(RobotError, match='not a finite number'):
        SimulatedBackend(TELLO, SimClock()).check(delay)
    with pytest.raises(RobotError, match='not a finite number'):
        TelloBackend(TELLO).check(delay)
    with pytest.raises(RobotError, match='not a finite number'):
        Indy7Backend(INDY7).check(_mj(value))


def test_backend_check_refuses_wrong_argument_sets_and_types():
    backend = SimulatedBackend(TELLO, SimClock())
    for call in [SkillCall('move_forward', 'mf', {}, 'mf()'),
                 SkillCall('move_forward', 'mf', {'distance': 50, 'x': 1}, 'mf(50,1)'),
                 SkillCall('move_forward', 'mf', {'distance': '50'}, "mf('50')"),
                 SkillCall('move_forward', 'mf', {'distance': True}, 'mf(True)'),
                 SkillCall('move_forward', 'mf', {'distance': 50.5}, 'mf(50.5)'),
                 SkillCall('scan', 's', {'object': 3}, 's(3)')]:
        with pytest.raises(RobotError):
            backend.check(call)


def test_tello_perform_checks_before_sending():
    drone = TelloBackend(TELLO)
    drone._tello = object()  # a "connected" client that must never be used
    with pytest.raises(RobotError, match='not a finite number'):
        drone.perform(NAN_DELAY)
    bad = SkillCall('move_forward', 'mf', {'distance': math.inf}, 'mf(inf)')
    with pytest.raises(RobotError, match='not a finite number'):
        drone.perform(bad)


def test_wait_on_refuses_non_finite_seconds():
    with pytest.raises(RobotError, match='not a finite number'):
        wait_on(SimClock(), math.nan)


def _segment(*statements: Statement) -> Segment:
    return Segment(0, ';'.join(s.text for s in statements), statements, 0.0, 0.0, 0.0, 0)


def test_executor_refuses_a_nan_segment_on_the_tello_backend():
    drone = TelloBackend(TELLO)
    result = SkillExecutor(drone, SimClock()).execute(
        _segment(Statement('d(nan)', (NAN_DELAY,))))
    assert not result.success and result.skills == []
    assert 'd(nan): seconds=nan is not a finite number' in result.error
    assert not drone.connected


class _Raising(SimulatedBackend):
    """A backend whose vendor client raises anything (not a RobotError)."""

    def __init__(self, *args, fail_in: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_in = fail_in

    def check(self, call: SkillCall) -> None:
        if self.fail_in == 'check' and call.short == 'tc':
            raise KeyError('vendor table')

    def connect(self) -> None:
        if self.fail_in == 'connect':
            raise OSError('no route to host')
        super().connect()

    def perform(self, call: SkillCall) -> object:
        if self.fail_in == 'perform' and call.short == 'tc':
            raise ValueError('sleep length must be non-negative')
        return super().perform(call)


@pytest.mark.parametrize('fail_in, expected', [
    ('check', 'refused before sending anything: tc(90): KeyError'),
    ('connect', 'cannot connect: OSError: no route to host'),
    ('perform', 'tc(90) failed: ValueError: sleep length must be non-negative'),
])
def test_executor_never_raises_whatever_the_backend_raises(fail_in, expected):
    clock = SimClock()
    backend = _Raising(TELLO, clock, rng=np.random.default_rng(0), fail_in=fail_in)
    cuts = segment_text(TELLO, 'mf(50);tc(90);ld()')
    statements = tuple(s for c in cuts for s in c.statements)
    result = SkillExecutor(backend, clock).execute(_segment(*statements))
    assert not result.success and expected in result.error
    if fail_in == 'perform':
        assert [r.success for r in result.skills] == [True, False]
        assert result.skills[-1].error == 'ValueError: sleep length must be non-negative'


def test_executor_rechecks_hand_built_statements():
    tp = SkillCall('take_picture', 'tp', {}, 'tp()')
    mf = SkillCall('move_forward', 'mf', {'distance': 50}, 'mf(50)')
    executor = SkillExecutor(SimulatedBackend(TELLO, SimClock()), SimClock())
    for statement, reason in [
        (Statement('99999999999{tp()}', (tp,), kind='loop', repeat=99_999_999_999),
         'loop count must be within 1..20'),
        (Statement('?mf(50){tp()}', (mf, tp), kind='conditional'),
         "condition must be a query skill, not 'mf'"),
    ]:
        result = executor.execute(_segment(statement))
        assert not result.success and reason in result.error


# --- profiles: a robot kind is a name, never a path ---------------------------------------------

@pytest.mark.parametrize('kind', ['/tmp/x.yaml', '../../etc/passwd', '../tello', 'tello.yaml',
                                  'a\x00b', 'a' * 300, '\udc80', '', ' tello', 'tello\n',
                                  'x/../tello', '.hidden', '-x', 'C:\\evil'])
def test_load_profile_accepts_only_names(kind):
    with pytest.raises(ProfileError) as info:
        load_profile(kind)
    message = str(info.value)
    assert repr(kind)[:40] in message or 'unknown robot profile' in message
    assert len(message) < 300


def test_load_profile_refuses_paths_and_never_quotes_file_content(tmp_path):
    secret = tmp_path / 'evil.yaml'
    secret.write_text('SECRET-TOKEN: [1, 2\n', encoding='utf-8')
    for kind in [str(secret), str(tmp_path / 'evil'), f'../../../..{tmp_path}/evil']:
        with pytest.raises(ProfileError) as info:
            load_profile(kind)
        assert 'SECRET' not in str(info.value)
    with pytest.raises(ProfileError, match='must be a profile name, got PosixPath'):
        load_profile(secret)  # type: ignore[arg-type]


def test_profile_file_errors_name_the_field_not_the_content(tmp_path):
    bad_yaml = tmp_path / 'bad.yaml'
    bad_yaml.write_text('name: tello\nkind: [SECRET-TOKEN\n', encoding='utf-8')
    with pytest.raises(ProfileError, match='not valid YAML') as info:
        load_profile_file(bad_yaml)
    assert 'SECRET' not in str(info.value)
    data = yaml.safe_load((PROFILES_DIR / 'tello.yaml').read_text(encoding='utf-8'))
    data['kind'] = 'SECRET-TOKEN'
    data['max_loop_count'] = 'SECRET-TOKEN-2'
    invalid = tmp_path / 'invalid.yaml'
    invalid.write_text(yaml.safe_dump(data), encoding='utf-8')
    with pytest.raises(ProfileError, match='kind: .*max_loop_count: ') as info:
        load_profile_file(invalid)
    assert 'SECRET' not in str(info.value)
    binary = tmp_path / 'binary.yaml'
    binary.write_bytes(b'name: \xff\xfe')
    with pytest.raises(ProfileError, match='not UTF-8'):
        load_profile_file(binary)


def test_paths_given_on_purpose_still_load(tmp_path):
    path = PROFILES_DIR / 'tello.yaml'
    assert load_profile_file(path).name == 'tello'
    assert load_profile_name_or_file(path).name == 'tello'
    assert load_profile_name_or_file(str(path)).name == 'tello'
    assert load_profile_name_or_file('indy7').name == 'indy7'


def test_bundled_traces_still_segment():
    from timelyllm_ros.language.traces import DERIVED_TRACES, load_trace_set

    traces = load_trace_set(DERIVED_TRACES)
    assert traces.traces
    for profile in PROFILES.values():
        for example in profile.prompt.all_examples:
            cuts = segment_text(profile, example['plan'])
            assert not [s for c in cuts for s in c.rejected], example['plan']


# --- task messages -------------------------------------------------------------------------------

def _task_msg(task: object = 'x', task_id: object = '', urgency: object = '',
              tuf: tuple[object, object, object] | None = None) -> SimpleNamespace:
    """A Task message as rclpy would deliver it (fields of any value a sender can set)."""
    ert_s, alpha, beta = tuf if tuf is not None else (0.0, 0.0, 0.0)
    return SimpleNamespace(task=task, task_id=task_id, urgency=urgency, has_tuf=tuf is not None,
                           tuf=SimpleNamespace(ert_s=ert_s, alpha=alpha, beta=beta))


@pytest.mark.parametrize('message, reason', [
    (_task_msg(tuf=(math.inf, 0.0, 1.0)), 'finite'),
    (_task_msg(tuf=(math.nan, 0.0, 1.0)), 'finite'),
    (_task_msg(tuf=(1.0, 0.5, 1.0)), 'alpha'),
    (_task_msg(tuf=(1.0, 0.0, 0.0)), 'beta'),
    (_task_msg(urgency='panic'), "unknown urgency 'panic'"),
    (_task_msg(task_id=['a']), 'task id must be text'),
    (_task_msg(task_id='i' * 500), 'task id is longer than'),
    (_task_msg(task=''), 'task text is empty'),
    (_task_msg(task='   '), 'task text is empty'),
    (_task_msg(task='a\u0000b'), 'control character'),
    (_task_msg(task='a\udc80b'), 'lone surrogate'),
    (_task_msg(task='x' * 5000), 'longer than 4096 characters'),
    (_task_msg(task=None), 'task text must be text'),
])
def test_task_from_msg_turns_every_bad_message_into_a_goal_error(message, reason):
    with pytest.raises(GoalError, match=reason.replace('(', r'\(')) as info:
        convert.task_from_msg(message)
    assert len(str(info.value)) < 300


def test_task_from_msg_last_resort():
    with pytest.raises(GoalError, match='unreadable task message: AttributeError'):
        convert.task_from_msg(SimpleNamespace(task='x'))


@_SETTINGS
@given(task=st.text(max_size=200) | st.none() | st.integers(),
       task_id=st.text(max_size=80) | st.integers(),
       urgency=st.sampled_from(['', 'normal', 'urgent', 'chatbot', 'panic']) | st.text(max_size=8),
       tuf=st.none() | st.tuples(st.floats(), st.floats(), st.floats()))
def test_task_from_msg_raises_only_goal_errors(task, task_id, urgency, tuf):
    try:
        request = convert.task_from_msg(_task_msg(task, task_id, urgency, tuf))
    except GoalError:
        return
    assert request.task.strip() and len(request.task) <= convert.MAX_TASK_CHARS
    assert request.urgency in ('', 'normal', 'urgent', 'chatbot')
    if request.tuf is not None:
        assert all(math.isfinite(v) for v in (request.tuf.beta, request.tuf.ert_s,
                                                request.tuf.alpha))


def test_goals_read_from_messages_are_refused_at_the_gate_for_paths_and_bad_text():
    def goal(**fields):
        base = dict(robot_id='drone_0', robot_kind='tello', task='find the cat',
                    urgency='urgent', has_tuf=False, tuf=None)
        base.update(fields)
        return SimpleNamespace(**base)

    assert validate_goal(convert.goal_from_msg(goal())).robot_kind == 'tello'
    for fields, reason in [({'robot_kind': '/tmp/x.yaml'}, 'invalid robot kind'),
                           ({'robot_kind': '../../evil'}, 'invalid robot kind'),
                           ({'robot_kind': 'a' * 300}, 'invalid robot kind'),
                           ({'robot_kind': 'te\x00llo'}, 'invalid robot kind'),
                           ({'task': 'a\udc80'}, 'lone surrogate'),
                           ({'urgency': 'panic'}, 'unknown urgency'),
                           ({'robot_id': None}, 'robot id must be text')]:
        with pytest.raises(GoalError, match=reason):
            validate_goal(convert.goal_from_msg(goal(**fields)))
    with pytest.raises(GoalError, match='unreadable goal: AttributeError'):
        convert.goal_from_msg(SimpleNamespace(robot_id='x'))


def test_a_goal_wrong_in_every_field_gets_one_short_reason() -> None:
    """The case hypothesis found (4 fields of 5 000 characters): the joined reasons ran to 405
    characters; they are cut at whole reasons, with a count of the rest."""
    from timelyllm_ros.live.goals import MAX_REASON_CHARS, PlanGoal, joined_reasons

    long = 'x' * 5000
    with pytest.raises(GoalError) as refused:
        validate_goal(PlanGoal(':', long, '', long))
    reason = str(refused.value)
    assert len(reason) <= MAX_REASON_CHARS and '\n' not in reason
    assert reason.startswith("invalid robot id ':'")
    assert re.search(r'; and \d more problems?$', reason)
    assert 'invalid robot kind' in reason
    # whole reasons while they fit, then the count; one reason alone is cut
    assert joined_reasons(['a' * 10, 'b' * 10], limit=30) == f"{'a' * 10}; {'b' * 10}"
    assert joined_reasons(['a' * 10, 'b' * 10, 'c' * 10], limit=32) == (
        f"{'a' * 10}; and 2 more problems")
    assert joined_reasons(['a' * 50, 'b'], limit=20) == 'a' * 17 + '...'
