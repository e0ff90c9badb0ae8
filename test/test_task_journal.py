"""A controller's task journal: what a killed controller's next process takes up."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from lrtrace.format import TASK_RECORD, check_message
from timelyllm_ros.core.tuf import TUF_CLASSES, Tuf
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes._tasks import TaskQueue
from timelyllm_ros.nodes.task_journal import (
    JournalError,
    JournalState,
    KeptTask,
    TaskJournal,
    default_state_dir,
    journal_path,
)


def kept(task: str, arrived_s: float = 100.0, **fields: object) -> KeptTask:
    goal_uuid = str(fields.pop('goal_uuid', ''))
    return KeptTask(convert.TaskRequest(task=task, **fields), arrived_s,  # type: ignore[arg-type]
                    goal_uuid)


def test_the_journal_keeps_the_active_the_waiting_and_the_lost_tasks_in_order(tmp_path):
    journal = TaskJournal(tmp_path / 'tasks' / 'drone_0' / 'controller.json')
    state = JournalState(
        active=kept('go up', 1.0, task_id='t1', goal_uuid='ab' * 16),
        waiting=(kept('urgent one', 3.0, urgency='urgent'),
                 kept('with a tuf', 2.0, task_id='t3',
                      tuf=Tuf(beta=2.0, ert_s=4.0, alpha=-0.5))),
        lost=(kept('lost', 0.5, goal_uuid='cd' * 16),))
    journal.save(state)
    assert journal.load() == state
    assert not list(journal.path.parent.glob('*.partial'))


def test_an_empty_state_removes_the_journal(tmp_path):
    journal = TaskJournal(tmp_path / 'controller.json')
    journal.save(JournalState(waiting=(kept('a'),)))
    assert journal.path.exists()
    journal.save(JournalState())
    assert not journal.path.exists()
    assert journal.load().empty


@pytest.mark.parametrize('content, reason', [
    ('{not json', 'Expecting property name'),
    ('{"format": 99, "active": null, "waiting": []}', 'not a format-1 task journal'),
    ('{"format": 1, "active": null, "waiting": [{"task": "", "arrived_s": 1}]}', 'task text'),
    ('{"format": 1, "active": null, "waiting": [{"task": "x", "urgency": "soon", '
     '"arrived_s": 1}]}', 'urgency'),
    ('{"format": 1, "active": null, "waiting": [{"task": "x", "tuf": [1, -1, -3], '
     '"arrived_s": 1}]}', 'beta'),
    ('{"format": 1, "active": null, "waiting": [{"task": "x"}]}', 'arrived_s'),
])
def test_an_unreadable_journal_is_set_aside_with_the_reason(tmp_path, content, reason):
    path = tmp_path / 'controller.json'
    path.write_text(content)
    with pytest.raises(JournalError, match=reason) as caught:
        TaskJournal(path).load()
    assert 'controller.json.unreadable' in str(caught.value)
    assert not path.exists() and (tmp_path / 'controller.json.unreadable').read_text() == content
    assert TaskJournal(path).load().empty       # the next start begins empty


def test_a_write_interrupted_before_the_rename_leaves_the_previous_journal_whole(tmp_path):
    journal = TaskJournal(tmp_path / 'controller.json')
    journal.save(JournalState(waiting=(kept('first'),)))
    (tmp_path / 'controller.json.partial').write_text('{"format": 1, "act')   # killed here
    assert journal.load().waiting[0].request.task == 'first'


def test_one_journal_per_controller_under_the_state_dir(tmp_path, monkeypatch):
    assert journal_path(tmp_path, '/fleet_a/drone_0/controller') == (
        tmp_path / 'tasks' / 'fleet_a' / 'drone_0' / 'controller.json')
    assert journal_path(tmp_path, '/controller') == tmp_path / 'tasks' / 'controller.json'
    with pytest.raises(ValueError):
        journal_path(tmp_path, '/')
    monkeypatch.setenv('ROS_HOME', str(tmp_path / 'ros_home'))
    assert default_state_dir() == tmp_path / 'ros_home' / 'timelyllm'
    monkeypatch.delenv('ROS_HOME')
    assert default_state_dir().parts[-2:] == ('.ros', 'timelyllm')


def test_the_queue_snapshot_lists_the_active_and_the_waiting_in_queue_order():
    tasks: TaskQueue[str] = TaskQueue(4, rank=lambda item: 0 if item.startswith('u') else 1)
    for t, item in enumerate(['a', 'b', 'u1', 'c']):
        tasks.offer(item, float(t))
    assert tasks.snapshot() == ('a', ['u1', 'b', 'c'])
    json.dumps(tasks.snapshot())    # plain values


def _time(sec: int = 0, nanosec: int = 0) -> SimpleNamespace:
    return SimpleNamespace(sec=sec, nanosec=nanosec)


def test_a_controller_records_what_its_robot_ran_when_the_planner_left():
    segments = [SimpleNamespace(index=i, text=text, generated_stamp=_time(10 + i),
                                estimated_execution_s=1.5)
                for i, text in enumerate(['to();', 'mf(50);'])]
    record = convert.robot_task_record_to_msg(
        'drone_0', 'tello', convert.TaskRequest('go', task_id='t7', urgency='urgent'),
        'normal', 9.0, segments, {0: convert.SegmentRun(11.0, 12.5, True)},
        'the planner left', 13.0, SimpleNamespace, SimpleNamespace, _time)
    assert (record.robot_id, record.task_id, record.task_class, record.status,
            record.error) == ('drone_0', 't7', 'urgent', 'FAILED', 'the planner left')
    urgent = TUF_CLASSES['urgent']
    assert (record.tuf.ert_s, record.tuf.alpha, record.tuf.beta) == (
        urgent.ert_s, urgent.alpha, urgent.beta)
    assert record.text == 'to();mf(50);' and record.segment_texts == ['to();', 'mf(50);']
    assert record.segment_success == [True, False]
    assert record.start_stamps[0].sec == 11 and record.end_stamps[0].nanosec == 500_000_000
    unset = convert.UNSET_STAMP_SEC
    assert record.start_stamps[1].sec == unset and record.dispatch_stamps[0].sec == unset
    assert [s.sec for s in record.cut_stamps] == [10, 11]
    assert (record.arrival_stamp.sec, record.done_stamp.sec) == (9, 13)
    assert math.isclose(record.estimated_execution_s[1], 1.5)
    assert record.cut_tokens == [0, 0]
    check_message(record, TASK_RECORD)        # what the bag reader checks
