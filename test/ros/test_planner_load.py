"""rclpy load tests of the planner action server: bursts and many concurrent active goals.

Each active goal's execute callback sleeps on its own executor thread between events (the
planner sizes its executor for MAX_ACTIVE_GOALS), so a burst is answered in full. The client
runs on an executor of its own, as a separate process would. Prints the accept and
first-feedback latencies (run with ``-s`` to see them).

Needs a ROS 2 workspace where this package was built with ``colcon build``; skipped otherwise.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run inside a ROS 2 workspace')
pytest.importorskip('timelyllm_ros.msg',
                    reason='interfaces not generated: colcon build this package first')

from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from test_planner_node import CAT, Robots, active_planner  # noqa: E402

from timelyllm_ros.nodes.planner import EXECUTOR_THREADS  # noqa: E402

pytestmark = pytest.mark.ros
STATUS_SUCCEEDED, STATUS_CANCELED = 4, 5


@pytest.fixture
def load(request):
    initialized = not rclpy.ok()
    if initialized:
        rclpy.init()
    name = 'load_' + request.node.name.split('[')[0].removeprefix('test_')[:20]
    planner = active_planner(namespace=name)
    robots = Robots(f'{name}_robots', action=f'/{name}/plan', done_topic=f'/{name}/segment_done')
    executors = []
    for node, threads in ((planner, EXECUTOR_THREADS), (robots, 4)):
        executor = MultiThreadedExecutor(num_threads=threads)
        executor.add_node(node)
        threading.Thread(target=executor.spin, daemon=True).start()
        executors.append(executor)
    assert robots.client.wait_for_server(timeout_sec=10.0)
    yield planner, robots
    for executor in executors:
        executor.shutdown()
    planner.destroy_node()
    robots.destroy_node()
    if initialized:
        rclpy.try_shutdown()


def wait_all(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.02)


def _percentiles(values: list[float]) -> str:
    p50, p95 = np.percentile(np.asarray(values) * 1000.0, [50, 95])
    return f'p50 {p50:.1f} ms, p95 {p95:.1f} ms'


def _send_burst(robots: Robots, count: int, report: bool):
    sent_at = time.monotonic()
    goals = [robots.send(f'drone_{i}', CAT, report=report, wait_for_execution=True)
             for i in range(count)]
    return sent_at, goals


def _accept_latencies(goals, sent_at: float) -> list[float]:
    accepted_at: dict[int, float] = {}
    for i, (future, _) in enumerate(goals):
        future.add_done_callback(lambda _f, i=i: accepted_at.setdefault(i, time.monotonic()))
    wait_all(lambda: all(f.done() for f, _ in goals), 180.0, 'every goal to be answered')
    assert all(f.result().accepted for f, _ in goals)
    return [accepted_at.get(i, time.monotonic()) - sent_at for i in range(len(goals))]


def test_a_burst_of_200_goals_is_answered_in_full(load):
    _, robots = load
    sent_at, goals = _send_burst(robots, 200, report=True)
    accepts = _accept_latencies(goals, sent_at)
    results = [f.result().get_result_async() for f, _ in goals]
    wait_all(lambda: all(r.done() for r in results), 240.0, 'every result')
    failed = [r.result().result.error for r in results
              if r.result().status != STATUS_SUCCEEDED or not r.result().result.success]
    assert not failed, (len(failed), sorted(set(failed))[:5])
    first = [events[0][1] - sent_at for _, events in goals]
    print(f'\n200 goals at once: accept {_percentiles(accepts)}; '
          f'first feedback {_percentiles(first)}')
    one_sent, one = _send_burst(robots, 1, report=True)
    one_accept = _accept_latencies(one, one_sent)
    wait_all(lambda: bool(one[0][1]), 30.0, 'the first segment of a lone goal')
    print(f'1 goal: accept {one_accept[0] * 1000:.1f} ms; first feedback '
          f'{(one[0][1][0][1] - one_sent) * 1000:.1f} ms')


def test_500_concurrent_active_goals_are_served_and_canceled(load):
    """The robots never report: every goal stays active after its plan is generated, far more
    goals than the planner has threads; each gets its segments, then every cancel lands."""
    planner, robots = load
    sent_at, goals = _send_burst(robots, 500, report=False)
    accepts = _accept_latencies(goals, sent_at)
    wait_all(lambda: all(events for _, events in goals), 240.0, 'a segment for every goal')
    active = sum(1 for g in planner.service.scheduler.generations.values()
                 if not g.status.terminal)
    assert active == 500
    print(f'\n500 concurrent goals: accept {_percentiles(accepts)}; all active with segments '
          f'after {time.monotonic() - sent_at:.1f} s')
    handles = [f.result() for f, _ in goals]
    cancels = [h.cancel_goal_async() for h in handles]
    wait_all(lambda: all(c.done() for c in cancels), 60.0, 'every cancel answer')
    results = [h.get_result_async() for h in handles]
    wait_all(lambda: all(r.done() for r in results), 60.0, 'every canceled result')
    assert {r.result().status for r in results} == {STATUS_CANCELED}
    wait_all(lambda: all(g.status.terminal
                         for g in planner.service.scheduler.generations.values()),
             10.0, 'the service to drop every goal')



def test_a_burst_from_a_plain_client_with_default_qos_loses_nothing(load):
    """200 goals at once from rclpy's ActionClient with its default QoS (10 responses and 10
    feedback messages kept), the client playing every robot with a default-QoS publisher:
    every goal is answered and succeeds (paced answers; segments sent again until reported)."""
    from builtin_interfaces.msg import Time
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor
    from timelyllm_ros.action import PlanTask
    from timelyllm_ros.msg import SegmentDone

    from timelyllm_ros.nodes import convert

    planner, _ = load
    name = planner.get_namespace()
    client_node = rclpy.create_node('plain_client')
    client = ActionClient(client_node, PlanTask, f'{name}/plan')
    reports = client_node.create_publisher(SegmentDone, f'{name}/segment_done', 10)
    executor = SingleThreadedExecutor()
    executor.add_node(client_node)
    threading.Thread(target=executor.spin, daemon=True).start()
    handles, results = {}, {}
    try:
        assert client.wait_for_server(timeout_sec=10.0)

        def feedback(robot: str):
            def report(message) -> None:
                segment = message.feedback.segment
                if not convert.is_plan_end(segment):
                    now = time.time()
                    reports.publish(convert.segment_done_to_msg(
                        robot, segment.goal_id, segment.index, now, now + 0.01, True, '',
                        SegmentDone, Time))
            return report

        def answered(i: int):
            def keep(future) -> None:
                handles[i] = handle = future.result()
                handle.get_result_async().add_done_callback(
                    lambda done: results.__setitem__(i, done.result()))
            return keep

        for i in range(200):
            goal = PlanTask.Goal(robot_id=f'plain_{i}', robot_kind='tello', task=CAT,
                                 urgency='normal', wait_for_execution=True)
            client.send_goal_async(goal, feedback_callback=feedback(f'plain_{i}')
                                   ).add_done_callback(answered(i))
        wait_all(lambda: len(handles) == 200, 60.0, f'answers ({len(handles)} of 200)')
        wait_all(lambda: len(results) == 200, 600.0, f'results ({len(results)} of 200)')
        failed = [r.result.error for r in results.values() if not r.result.success]
        assert failed == [], failed[:5]
    finally:
        executor.shutdown()
        client_node.destroy_node()
