"""A controller's task admission (one plan at a time, bounded FIFO) and its task messages,
without ROS (the node wraps :mod:`timelyllm_ros.nodes._tasks` and ``convert``)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from timelyllm_ros.errors import GoalError, TufError
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes._tasks import TaskQueue
from timelyllm_ros.tuf import URGENT, Tuf


class Msg(SimpleNamespace):
    """A stand-in for a generated message class."""


def test_a_free_robot_starts_at_once_and_a_busy_one_queues_fifo():
    tasks: TaskQueue[str] = TaskQueue(max_waiting=2)
    assert tasks.offer('a', now=0.0).outcome == 'start'
    assert tasks.busy and tasks.active == 'a'
    b = tasks.offer('b', now=1.0)
    c = tasks.offer('c', now=2.0)
    assert (b.outcome, b.position) == ('queued', 1)
    assert (c.outcome, c.position, c.waiting) == ('queued', 2, 2)
    started = tasks.finish(now=5.0)
    assert started is not None and started.item == 'b' and started.queued_s == 4.0
    assert tasks.active == 'b' and tasks.waiting == 1
    started = tasks.finish(now=6.0)
    assert started.item == 'c' and started.queued_s == 4.0
    assert tasks.finish(now=7.0) is None
    assert not tasks.busy and tasks.active is None
    assert tasks.offer('d', now=8.0).outcome == 'start'


def test_a_full_queue_refuses_and_keeps_the_waiting_tasks():
    tasks: TaskQueue[str] = TaskQueue(max_waiting=1)
    tasks.offer('a', 0.0)
    tasks.offer('b', 0.0)
    refused = tasks.offer('c', 0.0)
    assert (refused.outcome, refused.waiting) == ('refused', 1)
    assert tasks.finish(1.0).item == 'b'
    assert tasks.offer('c', 1.0).outcome == 'queued'     # room again


def test_max_waiting_zero_never_queues_and_negative_is_an_error():
    tasks: TaskQueue[str] = TaskQueue(max_waiting=0)
    assert tasks.offer('a', 0.0).outcome == 'start'
    assert tasks.offer('b', 0.0).outcome == 'refused'
    with pytest.raises(ValueError):
        TaskQueue(max_waiting=-1)


def test_drain_drops_the_waiting_tasks_oldest_first():
    tasks: TaskQueue[str] = TaskQueue(max_waiting=3)
    for item in 'abc':
        tasks.offer(item, 0.0)
    assert tasks.drain() == ['b', 'c'] and tasks.waiting == 0


def test_concurrent_offers_start_exactly_one_task():
    tasks: TaskQueue[int] = TaskQueue(max_waiting=100)
    outcomes: list[str] = []
    barrier = threading.Barrier(16)

    def offer(i: int) -> None:
        barrier.wait()
        outcomes.append(tasks.offer(i, 0.0).outcome)

    threads = [threading.Thread(target=offer, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count('start') == 1 and outcomes.count('queued') == 15
    first = tasks.active
    order = [tasks.finish(1.0).item for _ in range(15)]
    assert tasks.finish(1.0) is None
    assert sorted([first, *order]) == list(range(16))


def test_plain_text_and_json_task_messages():
    assert convert.parse_task('find the cat') == convert.TaskRequest(task='find the cat')
    assert convert.parse_task('{not json') == convert.TaskRequest(task='{not json')
    payload = convert.task_payload('a dog is chasing me', 'task-0003', 'urgent', URGENT)
    request = convert.parse_task(payload)
    assert request == convert.TaskRequest('a dog is chasing me', 'task-0003', 'urgent', URGENT)
    assert convert.parse_task(convert.task_payload('hover')) == convert.TaskRequest('hover')
    with pytest.raises(GoalError, match='no "task"'):
        convert.parse_task('{"task_id": "x"}')
    with pytest.raises(GoalError, match='bad "tuf"'):
        convert.parse_task('{"task": "x", "tuf": {"beta": 1}}')
    with pytest.raises(TufError):
        convert.parse_task(json.dumps({'task': 'x',
                                        'tuf': {'ert_s': 0.2, 'alpha': 5.0, 'beta': 1.0}}))


def test_goal_to_msg_uses_the_default_urgency_and_an_explicit_tuf():
    plain = convert.goal_to_msg('drone_0', 'tello', convert.TaskRequest('hover'), 'normal',
                                 Msg, Msg)
    assert (plain.urgency, plain.wait_for_execution) == ('normal', True)
    assert not hasattr(plain, 'has_tuf')
    tuf = Tuf(beta=1.0, ert_s=3.0, alpha=-0.5)
    goal = convert.goal_to_msg('drone_0', 'tello',
                                convert.TaskRequest('run', 't1', 'urgent', tuf), 'normal',
                                Msg, Msg)
    assert goal.urgency == 'urgent' and goal.has_tuf
    assert (goal.tuf.ert_s, goal.tuf.alpha, goal.tuf.beta) == (3.0, -0.5, 1.0)


def test_reports_carry_the_task_id_and_queue_time_and_say_refused():
    result = Msg(success=True, error='', segment_count=2, response_time_s=0.2,
                 waiting_time_s=0.3, utility=1.0)
    report = convert.parse_report(convert.result_report('drone_0', 'tello', result,
                                                          'task-0001', 1.5))
    assert report['task_id'] == 'task-0001' and report['queued_s'] == 1.5
    refused = convert.parse_report(convert.refusal_report('drone_0', 'task-0002',
                                                            'task queue full'))
    assert refused == {'robot_id': 'drone_0', 'success': False,
                       'error': 'refused: task queue full', 'task_id': 'task-0002'}
    rejected = convert.parse_report(convert.rejection_report('drone_0', 't', 0.0, 'no server'))
    assert rejected['error'] == 'rejected: no server' and rejected['queued_s'] == 0.0
