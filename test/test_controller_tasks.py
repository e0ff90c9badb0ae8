"""A controller's task admission (one plan at a time, a bounded queue, urgent first) and its
messages, without ROS (the node wraps :mod:`timelyllm_ros.nodes._tasks` and ``convert``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from timelyllm_ros.core.tuf import URGENT, Tuf
from timelyllm_ros.errors import TufError
from timelyllm_ros.nodes import convert
from timelyllm_ros.nodes._tasks import TaskQueue


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


def test_urgent_tasks_wait_ahead_of_normal_ones_and_keep_arrival_order_among_equals():
    tasks: TaskQueue[str] = TaskQueue(max_waiting=5, rank=lambda t: 0 if t.startswith('u') else 1)
    tasks.offer('n0', 0.0)                                   # executing
    assert tasks.offer('n1', 1.0).position == 1
    assert tasks.offer('n2', 2.0).position == 2
    assert tasks.offer('u1', 3.0).position == 1              # ahead of the normal ones
    assert tasks.offer('u2', 4.0).position == 2              # behind the earlier urgent one
    assert tasks.offer('n3', 5.0).position == 5
    assert [tasks.finish(6.0).item for _ in range(5)] == ['u1', 'u2', 'n1', 'n2', 'n3']
    assert tasks.finish(7.0) is None


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


def test_task_messages_round_trip_with_id_urgency_and_tuf():
    request = convert.TaskRequest('a dog is chasing me', 'task-0003', 'urgent', URGENT)
    msg = convert.task_to_msg(request, Msg, Msg)
    assert msg.has_tuf and msg.task_id == 'task-0003'
    assert convert.task_from_msg(msg) == request
    plain = Msg(task='hover', task_id='', urgency='', has_tuf=False, tuf=Msg())
    assert convert.task_from_msg(plain) == convert.TaskRequest('hover')
    with pytest.raises(TufError):
        convert.task_from_msg(Msg(task='x', task_id='', urgency='', has_tuf=True,
                                  tuf=Msg(ert_s=0.2, alpha=5.0, beta=1.0)))


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


def test_goal_to_msg_carries_the_task_id():
    goal = convert.goal_to_msg('drone_0', 'tello', convert.TaskRequest('hover', 't7'), 'normal',
                               Msg, Msg)
    assert goal.task_id == 't7'


def test_plan_results_carry_outcome_task_id_and_queue_time():
    result = Msg(success=True, error='', plan='tu(90)', segment_count=2, response_time_s=0.2,
                 waiting_time_s=0.3, utility=1.0)
    msg = convert.plan_result_to_msg(Msg, Msg, stamp_s=12.5, robot_id='drone_0',
                                     robot_kind='tello', task_id='task-0001',
                                     outcome='succeeded', queued_s=1.5, result=result)
    fields = convert.plan_result_fields(msg)
    assert fields == {'robot_id': 'drone_0', 'robot_kind': 'tello', 'task_id': 'task-0001',
                      'outcome': 'succeeded', 'success': True, 'error': '', 'plan': 'tu(90)',
                      'segment_count': 2, 'response_time_s': 0.2, 'waiting_time_s': 0.3,
                      'utility': 1.0, 'queued_s': 1.5}
    assert (msg.stamp.sec, msg.stamp.nanosec) == (12, 500_000_000)
    refused = convert.plan_result_to_msg(Msg, Msg, stamp_s=1.0, robot_id='drone_0',
                                         robot_kind='tello', task_id='task-0002',
                                         outcome='refused', error='task queue full')
    assert (refused.success, refused.error, refused.response_time_s) == (
        False, 'task queue full', -1.0)
    assert (refused.plan, refused.segment_count) == ('', 0)
    left = convert.plan_result_to_msg(Msg, Msg, stamp_s=2.0, robot_id='drone_0',
                                      robot_kind='tello', task_id='task-0003',
                                      outcome='failed', error='the planner left',
                                      streamed=['mf(50)', ';tc(90)'])
    assert (left.plan, left.segment_count, left.error) == ('mf(50);tc(90)', 2,
                                                          'the planner left')


@pytest.mark.parametrize('status, success, error, outcome', [
    (4, True, '', 'succeeded'),
    (6, False, 'rejected: unknown robot kind', 'rejected'),
    (6, False, 'the robot reported a failure', 'failed'),
    (5, False, 'cancelled', 'canceled'),
])
def test_outcome_of_a_goal(status, success, error, outcome):
    assert convert.outcome_of(status, Msg(success=success, error=error)) == outcome


def test_rejections_keep_robot_and_task_apart_from_the_reason():
    msg = convert.rejection_to_msg(Msg, Msg, 3.0, 'drone_9', 't1', 'unknown robot kind')
    assert (msg.robot_id, msg.task_id, msg.reason) == ('drone_9', 't1', 'unknown robot kind')
    odd = convert.rejection_to_msg(Msg, Msg, 3.0, 7, None, 'unreadable goal')
    assert (odd.robot_id, odd.task_id) == ('', '')


def test_segment_text_is_sent_clean_and_the_plan_end_marker_is_recognised():
    assert convert.clean_segment_text('; tc(90)\n') == 'tc(90)'
    assert convert.clean_segment_text(' The cat is here. ') == 'The cat is here.'
    assert convert.is_plan_end(Msg(is_last=True, text='', skills=[]))
    assert not convert.is_plan_end(Msg(is_last=True, text='tc(90)', skills=['turn_cw']))
    assert not convert.is_plan_end(Msg(is_last=False, text='', skills=[]))
