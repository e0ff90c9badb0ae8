"""LiveReplay, the ROS-free half of the lrtrace_replayer node: who gets which task when, and
the summary of the robots' reports."""

from __future__ import annotations

import pytest

from lrtrace.replay import LiveReplay
from timelyllm_ros.errors import WorkloadError
from timelyllm_ros.evaluation.workloads import WorkloadSpec, generate_tasks

SMALL = WorkloadSpec(name='small', eps=0.5, max_tpe=2, trace_ids=[1, 6, 9], agents=3,
                     duration_s=10)


def tasks():
    return generate_tasks(SMALL, seed=0)


def test_tasks_go_to_a_robot_of_their_kind_in_arrival_order():
    replay = LiveReplay.from_lists(tasks(), ['drone_0', 'drone_1', 'arm_0'],
                                   ['tello', 'tello', 'indy7'])
    assert replay.due(0.0) == [] and not replay.all_sent
    sent = replay.due(100.0)
    assert len(sent) == len(replay.tasks) and replay.all_sent and not replay.skipped
    assert [d.task.arrival_time for d in sent] == sorted(d.task.arrival_time for d in sent)
    for dispatch in sent:
        kind = replay.robots[dispatch.robot]
        assert kind == dispatch.task.profile
        assert dispatch.urgency == ('normal' if dispatch.task.task_class == 'arm'
                                    else dispatch.task.task_class)
    assert replay.due(200.0) == []        # each task once


def test_tasks_without_a_robot_of_their_kind_are_skipped():
    replay = LiveReplay.from_lists(tasks(), ['drone_0'], ['tello'])
    sent = replay.due(100.0)
    assert {d.robot for d in sent} == {'drone_0'}
    assert {t.profile for t in replay.skipped} == {'indy7'}
    assert len(sent) + len(replay.skipped) == len(replay.tasks)


def test_complete_once_every_sent_task_reported_and_the_summary_counts_outcomes():
    replay = LiveReplay.from_lists(tasks(), ['drone_0', 'arm_0'], ['tello', 'indy7'])
    sent = replay.due(100.0)
    assert replay.missing == len(sent) and not replay.complete
    for i, dispatch in enumerate(sent):
        task_id = dispatch.task.task_id
        if i == 0:
            report = {'robot_id': dispatch.robot, 'success': False, 'task_id': task_id,
                      'error': 'refused: task queue full'}
        elif i == 1:
            report = {'robot_id': dispatch.robot, 'success': False, 'task_id': task_id,
                      'error': 'rejected'}
        else:
            report = {'robot_id': dispatch.robot, 'success': True, 'task_id': task_id,
                      'error': '', 'utility': 1.0, 'response_time_s': 0.5,
                      'waiting_time_s': -1.0 if i == 2 else 1.0, 'queued_s': 2.0}
        replay.record(report)
    assert replay.complete and replay.missing == 0
    summary = replay.summary()
    overall = summary['overall']
    assert (summary['sent'], overall['reported']) == (len(sent), len(sent))
    assert (overall['refused'], overall['rejected'], overall['failed']) == (1, 1, 0)
    assert overall['succeeded'] == len(sent) - 2
    assert overall['utility_mean'] == 1.0 and overall['response_time_s_mean'] == 0.5
    assert overall['waiting_time_s_mean'] == 1.0        # -1 (not measured) left out
    assert overall['queued_s_mean'] == 2.0
    by_class = summary['by_class']
    assert sum(c['sent'] for c in by_class.values()) == len(sent)
    assert sum(c['reported'] for c in by_class.values()) == len(sent)
    lines = replay.summary_lines()
    assert lines[0].startswith(f'replayed {len(sent)} of {len(replay.tasks)} tasks')
    assert 'refused' in lines[1] and len(lines) == 2 + len(by_class)


def test_bad_robot_lists_are_rejected():
    with pytest.raises(WorkloadError, match='one kind per robot'):
        LiveReplay.from_lists(tasks(), ['drone_0', 'drone_1'], ['tello'])
    with pytest.raises(WorkloadError, match='twice'):
        LiveReplay.from_lists(tasks(), ['drone_0', 'drone_0'], ['tello', 'tello'])
    with pytest.raises(WorkloadError, match='no robot'):
        LiveReplay(tasks(), {})
