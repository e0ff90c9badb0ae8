"""Every message ⇄ core translation of the ROS layer, with stand-in message classes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from utils import make_scheduler, make_spec

from timelyllm_ros.core.tuf import URGENT
from timelyllm_ros.errors import GoalError, TufError
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.live.goals import validate_goal
from timelyllm_ros.nodes import convert
from timelyllm_ros.robots.backend import SkillRecord


class Msg(SimpleNamespace):
    """A stand-in for a generated message class: keyword fields in, attributes out."""


def goal(**fields):
    base = dict(robot_id='drone_0', robot_kind='tello', task='find the cat', urgency='urgent',
                has_tuf=False, tuf=Msg(ert_s=0.0, alpha=0.0, beta=0.0))
    base.update(fields)
    return Msg(**base)


def test_stamp_round_trip_to_the_nanosecond():
    msg = convert.stamp(1700000000.123456789, Msg)
    assert msg.sec == 1700000000 and abs(msg.nanosec - 123456789) < 500  # float64 precision
    assert convert.seconds(msg) == pytest.approx(1700000000.123456789, abs=1e-6)
    assert (convert.stamp(2.5, Msg).sec, convert.stamp(2.5, Msg).nanosec) == (2, 500_000_000)
    nan = convert.stamp(math.nan, Msg)
    assert (nan.sec, nan.nanosec) == (0, 0)


def test_goal_from_msg_uses_the_class_tuf_unless_explicit():
    plain = convert.goal_from_msg(goal())
    assert (plain.robot_id, plain.robot_kind, plain.urgency, plain.tuf) == (
        'drone_0', 'tello', 'urgent', None)
    explicit = convert.goal_from_msg(goal(has_tuf=True,
                                           tuf=Msg(ert_s=0.3, alpha=-4.0, beta=2.0)))
    assert (explicit.tuf.ert_s, explicit.tuf.alpha, explicit.tuf.beta) == (0.3, -4.0, 2.0)
    assert convert.goal_from_msg(goal(urgency='  ')).urgency == 'normal'


def test_goal_from_msg_rejects_invalid_tuf_and_the_gate_a_missing_kind():
    with pytest.raises(TufError, match='alpha'):
        convert.goal_from_msg(goal(has_tuf=True, tuf=Msg(ert_s=0.2, alpha=3.0, beta=1.0)))
    with pytest.raises(TufError, match='beta'):
        convert.goal_from_msg(goal(has_tuf=True, tuf=Msg(ert_s=0.2, alpha=-1.0, beta=0.0)))
    unchecked = convert.goal_from_msg(goal(robot_kind=' '))   # read, not yet checked
    with pytest.raises(GoalError, match='no robot kind'):
        validate_goal(unchecked)


def test_tuf_to_msg():
    msg = convert.tuf_to_msg(URGENT, Msg)
    assert (msg.ert_s, msg.alpha, msg.beta) == (0.2, URGENT.alpha, 2.0)


def run_one(plan: str):
    scheduler, clock, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec(plan=plan))
    dispatched = []
    while scheduler.has_work:
        dispatched += scheduler.tick().dispatches
    return scheduler, generation, dispatched


def test_segment_to_msg_and_back():
    _, generation, dispatched = run_one('mf(50);tc(90)')
    segment = dispatched[0].segment
    msg = convert.segment_to_msg(generation, segment, 1000.0, Msg, Msg)
    assert (msg.robot_id, msg.goal_id, msg.index, msg.text) == (
        generation.spec.robot_id, generation.task_id, 0, 'mf(50)')
    assert msg.skills == ['move_forward']
    assert convert.seconds(msg.generated_stamp) == pytest.approx(1000.0 + segment.cut_time)
    assert msg.estimated_execution_s == pytest.approx(segment.estimated_exec_s)
    back = convert.segment_from_msg(load_profile('tello'), msg)
    assert back.index == 0 and [c.skill for c in back.calls] == ['move_forward']
    assert back.calls[0].args == {'distance': 50}


def test_segment_from_msg_rejects_malformed_or_empty_text():
    profile = load_profile('tello')
    bad = Msg(index=1, text='mf(5000)', generated_stamp=Msg(sec=0, nanosec=0),
              estimated_execution_s=0.0, is_last=False)
    with pytest.raises(GoalError, match='mf\\(5000\\)'):
        convert.segment_from_msg(profile, bad)
    with pytest.raises(GoalError, match='no executable statement'):
        convert.statements_from_text(profile, ';  ')


def test_segment_done_both_ways_on_the_planner_clock():
    msg = convert.segment_done_to_msg('drone_0', 'g#1', 2, 1010.5, 1012.0, False, 'motor',
                                       Msg, Msg)
    assert (msg.robot_id, msg.goal_id, msg.index, msg.success, msg.error) == (
        'drone_0', 'g#1', 2, False, 'motor')
    goal_id, index, start, end, success, error = convert.segment_done_from_msg(msg, 1000.0)
    assert (goal_id, index, success, error) == ('g#1', 2, False, 'motor')
    assert start == pytest.approx(10.5) and end == pytest.approx(12.0)


def test_skill_record_both_ways():
    record = SkillRecord(skill='move_forward', call='mf(50)', args={'distance': 50},
                         start_time=5.25, end_time=7.5, success=True)
    msg = convert.skill_record_to_msg('drone_0', 'g#1', 0, record, Msg, Msg)
    assert (msg.skill, msg.call, msg.segment_index) == ('move_forward', 'mf(50)', 0)
    back = convert.skill_record_from_msg(msg)
    assert (back.skill, back.call, back.start_time, back.end_time, back.success) == (
        'move_forward', 'mf(50)', 5.25, 7.5, True)


def test_result_fields_of_a_finished_and_a_failed_goal():
    scheduler, generation, dispatched = run_one('mf(50);tc(90)')
    for dispatch in dispatched:
        start = dispatch.segment.cut_time + 0.01
        scheduler.report_segment(generation.task_id, dispatch.segment.index, start, start + 2.0)
    fields = convert.result_fields(generation)
    assert fields['success'] is True and fields['error'] == ''
    assert fields['plan'] == 'mf(50);tc(90)' and fields['segment_count'] == 2
    assert fields['response_time_s'] == pytest.approx(dispatched[0].segment.cut_time + 0.01)
    assert fields['utility'] == 1.0
    _, failed, _ = run_one('fly(3)')
    fields = convert.result_fields(failed)
    assert fields['success'] is False and 'no executable skill' in fields['error']
    assert fields['response_time_s'] == -1.0 and fields['utility'] == 0.0


def test_task_record_of_a_live_goal_marks_unexecuted_segments_unset():
    scheduler, generation, dispatched = run_one('mf(50);tc(90)')
    first = dispatched[0].segment
    scheduler.report_segment(generation.task_id, first.index, first.cut_time + 0.01,
                             first.cut_time + 2.0)
    record = convert.task_record_to_msg(generation, 'task-0007', Msg, Msg, Msg)
    assert (record.task_id, record.robot_id, record.profile) == (
        'task-0007', generation.spec.robot_id, 'tello')
    assert record.segment_texts == ['mf(50)', ';tc(90)'] and record.cut_tokens[-1] > 0
    assert record.end_stamps[0].sec >= 0
    assert (record.end_stamps[1].sec, record.end_stamps[1].nanosec) == (-(2**31), 0)
    assert (record.tuf.ert_s, record.tuf.beta) == (generation.spec.tuf.ert_s,
                                                   generation.spec.tuf.beta)
    assert convert.task_record_to_msg(generation, '', Msg, Msg, Msg).task_id == \
        generation.task_id



def test_the_gate_names_every_invalid_field_of_a_goal_at_once():
    bad = convert.goal_from_msg(goal(robot_id='', task='', urgency='panic'))
    with pytest.raises(GoalError) as info:
        validate_goal(bad)
    message = str(info.value)
    assert 'no robot id' in message and 'task text is empty' in message
    assert "unknown urgency 'panic'" in message
    assert type(info.value) is GoalError          # not only the TUF: a plain goal error
    with pytest.raises(TufError):                 # only the urgency: a TUF error, as before
        validate_goal(convert.goal_from_msg(goal(urgency='panic')))
