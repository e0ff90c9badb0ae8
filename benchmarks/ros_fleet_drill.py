"""A fault drill on a launched fleet: every task must end with one PlanResult and a TaskRecord.

Run in a ROS 2 workspace where this package is built (``install/setup.bash`` sourced)::

    python3 benchmarks/ros_fleet_drill.py --out drill                 # CPU engine, emulators
    python3 benchmarks/ros_fleet_drill.py --out drill-sim --use-sim-time --no-kills

It launches ``fleet.launch.py`` (2 drones, 1 arm; ``engine:=cpu model:=smollm2`` and
``backend:=emulator`` by default, ``record:=true``) the way the README does, and a plain rclpy
node that plays the user: it publishes normal and urgent tasks on the robots' ``task`` topics
and listens to their ``plan_results``. Then, unless ``--no-kills``:

1. a drone controller is killed (SIGKILL) while its robot executes a plan, with two more tasks
   queued, and restarted at once with the README's one command;
2. the planner is killed (SIGKILL) while plans execute, and restarted with the README's
   command (``ros2 run timelyllm_ros planner --ros-args -p autostart:=true`` and the engine's
   parameters).

``--use-sim-time`` runs every node on ``/clock``, which this script publishes (1x). At the end
it stops the launch with SIGINT (as Ctrl-C does) and times its exit, reads the recorded bag,
and prints one line per task (outcome, reason, segments, response time, whether its
TaskRecord is in the bag). Exit status 0 only when every task has exactly one PlanResult and a
TaskRecord. ``ROS_HOME`` is set to ``--out``/ros_home so that the controllers' task journals
and the logs stay with the drill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import rclpy
from lifecycle_msgs.srv import GetState
from rclpy.executors import MultiThreadedExecutor
from rosgraph_msgs.msg import Clock
from timelyllm_ros.msg import PlanResult, Segment, Task

from lrtrace.reader import read_bag
from timelyllm_ros.language.traces import load_trace_set
from timelyllm_ros.nodes import convert

DRONES = ['drone_0', 'drone_1']
ARMS = ['arm_0']


@dataclass
class Sent:
    """A task the drill sent, and what came back."""

    task_id: str
    robot: str
    urgency: str
    task: str
    sent_s: float
    results: list = field(default_factory=list)


class User:
    """The drill's rclpy node: sends tasks, collects results and segments, publishes /clock."""

    def __init__(self, sim_time: bool) -> None:
        self.node = rclpy.create_node('fleet_drill')
        self.lock = threading.Lock()
        self.sent: dict[str, Sent] = {}
        self.segments: list = []
        self.publishers = {}
        for robot in DRONES + ARMS:
            self.publishers[robot] = self.node.create_publisher(Task, f'/{robot}/task', 10)
            self.node.create_subscription(PlanResult, f'/{robot}/plan_results',
                                          self._on_result, 10)
        self.node.create_subscription(Segment, '/segments', self._on_segment, 10)
        self.get_state = self.node.create_client(GetState, '/planner/get_state')
        if sim_time:
            self.clock_pub = self.node.create_publisher(Clock, '/clock', 10)
            self.clock_origin = time.monotonic() - 1000.0     # sim time starts at 1000 s
            self.node.create_timer(0.01, self._tick)
        self.executor = MultiThreadedExecutor(num_threads=4)
        self.executor.add_node(self.node)
        threading.Thread(target=self.executor.spin, daemon=True).start()

    def planner_active(self) -> bool:
        """Whether ``/planner`` reports the lifecycle state ``active``."""
        if not self.get_state.wait_for_service(timeout_sec=1.0):
            return False
        future = self.get_state.call_async(GetState.Request())
        deadline = time.monotonic() + 5.0
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        return future.done() and future.result().current_state.label == 'active'

    def _tick(self) -> None:
        now = time.monotonic() - self.clock_origin
        msg = Clock()
        msg.clock.sec = int(now)
        msg.clock.nanosec = int((now % 1) * 1e9)
        self.clock_pub.publish(msg)

    def _on_result(self, msg: PlanResult) -> None:
        with self.lock:
            sent = self.sent.get(msg.task_id)
            if sent is not None:
                sent.results.append(msg)

    def _on_segment(self, msg: Segment) -> None:
        with self.lock:
            self.segments.append((time.monotonic(), msg.robot_id))

    def send(self, robot: str, task: str, task_id: str, urgency: str) -> None:
        with self.lock:
            self.sent[task_id] = Sent(task_id, robot, urgency, task, time.monotonic())
        request = convert.TaskRequest(task, task_id, urgency)
        self.publishers[robot].publish(convert.task_to_msg(request, Task, None))

    def segment_since(self, robot: str, since: float) -> bool:
        with self.lock:
            return any(t >= since and r == robot for t, r in self.segments)

    def pending(self) -> list[str]:
        with self.lock:
            return [s.task_id for s in self.sent.values() if not s.results]


class DrillTimeout(Exception):
    """A phase of the drill did not happen in time (the report still prints)."""


def until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    deadline = started + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise DrillTimeout(f'timed out after {timeout_s:.0f} s waiting for {what}')
        time.sleep(0.1)
    log(f'{what}: after {time.monotonic() - started:.1f} s')


def log(line: str) -> None:
    print(f'[drill {time.strftime("%H:%M:%S")}] {line}', file=sys.stderr, flush=True)


def pids(pattern: str) -> list[int]:
    found = subprocess.run(['pgrep', '-f', pattern], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split() if int(p) != os.getpid()]


def kill(pattern: str) -> int:
    killed = pids(pattern)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    return len(killed)


def spawn(command: list[str], log: Path) -> subprocess.Popen:
    # SIGINT at its default in the child (a background job would ignore Ctrl-C)
    return subprocess.Popen(command, stdout=log.open('w'), stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', type=Path, required=True, help='folder for the bag and logs')
    parser.add_argument('--engine', default='cpu')
    parser.add_argument('--model', default='smollm2')
    parser.add_argument('--engine-options', default='threads=1 kv_tokens=8192')
    parser.add_argument('--backend', default='emulator')
    parser.add_argument('--use-sim-time', action='store_true')
    parser.add_argument('--no-kills', action='store_true')
    parser.add_argument('--timeout', type=float, default=600.0, help='s to wait for results')
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=False)
    os.environ['ROS_HOME'] = str(out / 'ros_home')
    sim = 'true' if args.use_sim_time else 'false'
    engine_params = [f'engine:={args.engine}', f'model:={args.model}',
                     f'engine_options:={args.engine_options}']
    launch = spawn(['ros2', 'launch', 'timelyllm_ros', 'fleet.launch.py',
                    f'drones:={len(DRONES)}', f'arms:={len(ARMS)}', *engine_params,
                    f'backend:={args.backend}', 'record:=true', f'bag:={out / "bag"}',
                    f'use_sim_time:={sim}'], out / 'launch.log')
    restarted: list[subprocess.Popen] = []
    rclpy.init()
    user = User(args.use_sim_time)
    traces = load_trace_set()
    drone_tasks = [t.task for t in traces.traces if t.robot == 'tello']
    arm_tasks = [t.task for t in traces.traces if t.robot == 'indy7']
    started = time.monotonic()
    figures: dict[str, object] = {}
    try:
        until(lambda: all(p.get_subscription_count() > 0 for p in user.publishers.values()),
              120.0, 'the controllers')
        until(user.planner_active, 180.0, 'the planner to be active')
        n = 0

        def send(robot: str, urgency: str) -> str:
            nonlocal n
            pool = arm_tasks if robot in ARMS else drone_tasks
            task_id = f't{n:02d}-{robot}-{urgency}'
            user.send(robot, pool[n % len(pool)], task_id, urgency)
            n += 1
            return task_id

        for robot in DRONES + ARMS:          # normal and urgent goals on every robot
            send(robot, 'normal')
            send(robot, 'urgent')
        if not args.no_kills:
            # 1. a controller killed mid-plan, two tasks queued behind its active one
            until(lambda: not any(s.robot == 'drone_1' for s in user.sent.values()
                                  if not s.results), args.timeout, 'drone_1 to be free')
            since = time.monotonic()
            for urgency in ('normal', 'normal', 'urgent'):
                send('drone_1', urgency)
            until(lambda: user.segment_since('drone_1', since), args.timeout,
                  'a segment for drone_1')
            figures['controllers_killed'] = kill('__ns:=/drone_1')
            log('killed the drone_1 controller; restarting it')
            restarted.append(spawn(
                ['ros2', 'run', 'timelyllm_ros', 'drone_controller', '--ros-args',
                 '-r', '__ns:=/drone_1',
                 '-p', f'backend:={args.backend}', '-p', f'use_sim_time:={sim}'],
                out / 'drone_1-restarted.log'))
            # the restarted controller's lost task is reported before the next fault
            until(lambda: not any(s.robot == 'drone_1' for s in user.sent.values()
                                  if not s.results),
                  args.timeout, "the result of every task of drone_1's killed controller")
            # 2. the planner killed while plans execute
            since = time.monotonic()
            for robot in ('drone_0', 'arm_0'):
                send(robot, 'normal')
            until(lambda: user.segment_since('drone_0', since)
                  or user.segment_since('arm_0', since), args.timeout, 'a segment')
            figures['planners_killed'] = kill('lib/timelyllm_ros/planner')
            log('killed the planner; restarting it')
            until(lambda: not pids('lib/timelyllm_ros/planner'), 10.0, 'the planner to die')
            restarted.append(spawn(
                ['ros2', 'run', 'timelyllm_ros', 'planner', '--ros-args',
                 '-p', 'autostart:=true', *[p for param in engine_params
                                            for p in ('-p', param)],
                 '-p', f'use_sim_time:={sim}'], out / 'planner-restarted.log'))
            until(user.planner_active, 180.0, 'the restarted planner to be active')
            for robot in DRONES + ARMS:      # and the fleet serves new goals
                send(robot, 'urgent')
        until(lambda: not user.pending(), args.timeout, 'every result')
        figures['all_results_s'] = round(time.monotonic() - started, 1)
    except DrillTimeout as timeout:
        figures['timed_out'] = str(timeout)
        log(f'{timeout}; missing: {user.pending()}')
    finally:
        time.sleep(2.0)
        t0 = time.monotonic()
        for process in (launch, *restarted):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)     # Ctrl-C
        for process in (launch, *restarted):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                figures.setdefault('needed_sigkill', []).append(process.args[:4])  # type: ignore[union-attr]
        figures['ctrl_c_exit_s'] = round(time.monotonic() - t0, 2)
        user.executor.shutdown()
        rclpy.try_shutdown()
    bag = read_bag(out / 'bag')
    records: dict[str, int] = {}
    for record in bag.tasks:
        records[record.task_id] = records.get(record.task_id, 0) + 1
    bad = 0
    print(f'{"task":<24} {"outcome":<10} {"segs":>4} {"resp_s":>7} {"record":>6}  error')
    for sent in user.sent.values():
        result = sent.results[0] if sent.results else None
        ok = len(sent.results) == 1 and records.get(sent.task_id, 0) >= 1
        bad += not ok
        print(f'{sent.task_id:<24} {result.outcome if result else "-":<10} '
              f'{result.segment_count if result else 0:>4} '
              f'{result.response_time_s if result else -1:>7.2f} '
              f'{records.get(sent.task_id, 0):>6}  '
              f'{(result.error if result else "no result")[:70]}'
              f'{"" if len(sent.results) <= 1 else f"  [{len(sent.results)} results]"}')
    outcomes: dict[str, int] = {}
    for sent in user.sent.values():
        for result in sent.results[:1]:
            outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
    figures.update(tasks=len(user.sent), outcomes=outcomes,
                   with_one_result=sum(len(s.results) == 1 for s in user.sent.values()),
                   with_record=sum(records.get(t, 0) >= 1 for t in user.sent),
                   bag_records=len(bag.tasks), bag_truncated=bag.truncated)
    print(json.dumps(figures))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
