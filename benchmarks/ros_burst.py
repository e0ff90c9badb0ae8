"""A burst of PlanTask goals from a plain rclpy ActionClient with its default QoS.

Run in a ROS 2 workspace where this package is built, beside a planner::

    ros2 run timelyllm_ros planner --ros-args -p autostart:=true &
    python3 benchmarks/ros_burst.py --goals 200 --timeout 600

The client sends every goal at once (``--new-scenes``: each in a scene of its own, so that a
real engine compiles a plan grammar per goal), then plays every robot: each segment that arrives as
feedback is reported done at once (a default-QoS publisher). It prints how many goals were
answered and how soon, which ones never were (in the order sent: the first ones are requests
sent before the planner's middleware matched the new client, scattered ones are answers the
client's reader dropped), how many ended and how, and the time to the last result: what a
user's client with rclpy's defaults (10 requests, 10 responses and 10 feedback messages kept)
sees under a burst, and how the planner loop kept up with its engine (``scheduler_state``: the
engine's share of the loop's wall time and the longest it waited for one iteration; a pool
engine's replicas, up or down).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import rclpy
from builtin_interfaces.msg import Time
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import qos_profile_sensor_data
from timelyllm_ros.action import PlanTask
from timelyllm_ros.msg import SchedulerState, SegmentDone

from timelyllm_ros.nodes import convert

TASK = 'Scene: [] Task: [A] Could you find the cat? If so, go to it.'


def scene_task(i: int) -> str:
    """The burst's task in a scene of its own: objects no other goal of the burst names."""
    return (f'Scene: [cat{i} x:0.2 y:0.5 width:0.1 height:0.1], [ball{i} x:0.6 y:0.4 '
            f'width:0.1 height:0.1] Task: [A] Could you find the cat{i}? If so, go to it.')


def spans(indices: list[int]) -> str:
    """Sorted indices as ranges, e.g. ``0-12, 40``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ', '.join(f'{a}-{b}' if b > a else f'{a}' for a, b in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--goals', type=int, default=200)
    parser.add_argument('--timeout', type=float, default=600.0, help='s to wait for results')
    parser.add_argument('--action', default='/plan')
    parser.add_argument('--reports', default='/segment_done')
    parser.add_argument('--state', default='/scheduler_state')
    parser.add_argument('--new-scenes', action='store_true',
                        help='every goal in a scene of its own (a grounded plan grammar each, '
                             'compiled by a real engine for that goal alone)')
    args = parser.parse_args()
    rclpy.init()
    node = rclpy.create_node('burst_client')
    client = ActionClient(node, PlanTask, args.action)
    reports = node.create_publisher(SegmentDone, args.reports, 10)
    latest_state: list[SchedulerState] = []

    def keep_state(message: SchedulerState) -> None:
        latest_state[:] = [message]

    node.create_subscription(SchedulerState, args.state, keep_state, qos_profile_sensor_data)
    if not client.wait_for_server(timeout_sec=30.0):
        raise SystemExit(f'no planner serves {args.action}')
    answered: dict[int, object] = {}
    answer_s: dict[int, float] = {}        # send -> answer, per goal
    sent_at: dict[int, float] = {}
    results: dict[int, object] = {}
    feedback_goals: set[int] = set()

    def on_feedback(i: int, robot: str):  # type: ignore[no-untyped-def]
        def report(message) -> None:  # type: ignore[no-untyped-def]
            segment = message.feedback.segment
            if convert.is_plan_end(segment):
                return
            feedback_goals.add(i)
            now = time.time()
            reports.publish(convert.segment_done_to_msg(
                robot, segment.goal_id, segment.index, now, now + 0.01, True, '', SegmentDone,
                Time))
        return report

    def on_answer(i: int):  # type: ignore[no-untyped-def]
        def keep(future) -> None:  # type: ignore[no-untyped-def]
            answer_s[i] = time.monotonic() - sent_at[i]
            answered[i] = handle = future.result()
            if handle.accepted:
                handle.get_result_async().add_done_callback(
                    lambda done: results.__setitem__(i, done.result()))
        return keep

    started = time.monotonic()
    for i in range(args.goals):
        robot = f'burst_{i}'
        goal = PlanTask.Goal(robot_id=robot, robot_kind='tello',
                             task=scene_task(i) if args.new_scenes else TASK,
                             urgency='normal', wait_for_execution=True)
        sent_at[i] = time.monotonic()
        client.send_goal_async(goal, feedback_callback=on_feedback(i, robot)
                               ).add_done_callback(on_answer(i))
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    deadline = started + args.timeout
    last_result = 0.0
    while time.monotonic() < deadline and len(results) < args.goals:
        before = len(results)
        executor.spin_once(timeout_sec=0.1)
        if len(results) > before:
            last_result = time.monotonic() - started
    outcomes = Counter('succeeded' if r.result.success else r.result.error[:70]
                       for r in results.values())
    print(f'goals {args.goals}: answered {len(answered)}, never answered '
          f'{args.goals - len(answered)}, feedback reached {len(feedback_goals)}, results '
          f'{len(results)} (last after {last_result:.1f} s), no result within '
          f'{args.timeout:.0f} s {args.goals - len(results)}')
    for outcome, count in outcomes.most_common():
        print(f'  {count:5d}  {outcome}')
    if answer_s:
        waits = sorted(answer_s.values())
        print(f'answers after {waits[len(waits) // 2]:.2f} s (median), {waits[-1]:.2f} s (last)')
    unanswered = [i for i in range(args.goals) if i not in answered]
    if unanswered:
        print(f'never answered, in the order sent (from 0): {spans(unanswered)}')
    for _ in range(10):                      # the planner's state after the last result
        executor.spin_once(timeout_sec=0.1)
    if latest_state:
        state = latest_state[0]
        print(f'planner loop: {state.loop_iterations} iterations ran the engine; the engine '
              f'had {state.engine_share:.1%} of their wall time; the longest it waited for '
              f'one iteration: {state.loop_overhead_max_s * 1e3:.1f} ms')
        for name, up, running, usage, error in zip(
                state.replica_names, state.replica_up, state.replica_running,
                state.replica_kv_usage, state.replica_errors, strict=True):
            print(f'replica {name}: {"up" if up else "DOWN"}, {running} running, KV '
                  f'{usage:.1%}' + (f', last error: {error}' if error else ''))
    node.destroy_node()
    rclpy.try_shutdown()


if __name__ == '__main__':
    main()
