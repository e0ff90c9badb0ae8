"""rclpy test of a controller whose plan goal the planner does not answer in time.

A request can reach the planner and never be answered (rmw_cyclonedds drops a response its
service has not matched a reader for within 100 ms: "Failed to send goal response"), or never
reach it; either way the controller must not wait for that answer forever. Here the planner
answers the robot's first goal request late (8 s, past the controller's ``answer_within_s`` of
2 s) and every later one at once: the controller sends the goal again, takes the answer of the
last one it sent, cancels every other goal once its answer comes, and its task ends with one
``PlanResult``, succeeded. The planner takes 2 s to act on a cancel, so the goal given up
streams segments in the meantime: the robot executes none of them (it reports segments of the
kept goal only).

The controller runs as its own process (``ros2 run timelyllm_ros drone_controller``), the
planner and a probe in this one. Needs a ROS 2 workspace where this package was built and
installed with ``colcon build`` and its ``install/setup.bash`` sourced; skipped otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run inside a ROS 2 workspace')
pytest.importorskip('timelyllm_ros.msg',
                    reason='interfaces not generated: colcon build this package first')

from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from ros_helpers import activated, kill_group, until  # noqa: E402
from timelyllm_ros.action import PlanTask  # noqa: E402
from timelyllm_ros.msg import PlanResult, SegmentDone, Task  # noqa: E402

from timelyllm_ros.language.traces import load_trace_set  # noqa: E402
from timelyllm_ros.nodes import convert  # noqa: E402
from timelyllm_ros.nodes.planner import EXECUTOR_THREADS, PlannerNode  # noqa: E402

pytestmark = pytest.mark.ros
FLEET = '/canswer'
ROBOT = 'ca_drone'
ANSWER_WITHIN_S = 2.0
FIRST_ANSWER_S = 8.0
CANCEL_AFTER_S = 2.0
STRAY_REPORT_S = 15.0


class FirstAnswerLatePlanner(PlannerNode):
    """The planner, answering the first goal request only after :data:`FIRST_ANSWER_S`."""

    def __init__(self, **node_options: object) -> None:
        self.requests: list[float] = []       # when each goal request came (monotonic s)
        self.cancels = 0
        self._count = threading.Lock()
        super().__init__(**node_options)

    def goal_callback(self, goal_request):  # type: ignore[no-untyped-def]
        with self._count:
            self.requests.append(time.monotonic())
            first = len(self.requests) == 1
        if first:
            time.sleep(FIRST_ANSWER_S)
        return super().goal_callback(goal_request)

    def cancel_callback(self, goal_handle):  # type: ignore[no-untyped-def]
        with self._count:
            self.cancels += 1
        time.sleep(CANCEL_AFTER_S)       # the goal streams on meanwhile
        return super().cancel_callback(goal_handle)


@pytest.fixture
def fleet():
    if shutil.which('ros2') is None:
        pytest.skip('ros2 is not on PATH: source the workspace (install/setup.bash)')
    initialized = not rclpy.ok()
    if initialized:
        rclpy.init()
    planner = activated(FirstAnswerLatePlanner(namespace=FLEET))
    probe = rclpy.create_node('controller_answer_probe')
    results: list = []
    probe.create_subscription(PlanResult, f'{FLEET}/{ROBOT}/plan_results', results.append, 10)
    streamed: list = []              # the planner's feedback: every goal's segments
    probe.create_subscription(PlanTask.Impl.FeedbackMessage, f'{FLEET}/plan/_action/feedback',
                              lambda msg: streamed.append(msg.feedback.segment.goal_id), 100)
    reported: list = []              # the robot's reports: the segments it executed
    probe.create_subscription(SegmentDone, f'{FLEET}/segment_done',
                              lambda msg: reported.append(msg.goal_id), 100)
    publisher = probe.create_publisher(Task, f'{FLEET}/{ROBOT}/task', 10)
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    for node in (planner, probe):
        executor.add_node(node)
    threading.Thread(target=executor.spin, daemon=True).start()
    with tempfile.TemporaryDirectory() as state_dir:
        log = Path(state_dir) / 'controller.log'
        with log.open('w') as out:
            controller = subprocess.Popen(
                ['ros2', 'run', 'timelyllm_ros', 'drone_controller', '--ros-args',
                 '-r', f'__ns:={FLEET}/{ROBOT}', '-p', f'answer_within_s:={ANSWER_WITHIN_S}',
                 '-p', f'state_dir:={state_dir}'],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield planner, publisher, results, log, streamed, reported
        finally:
            kill_group(controller)
            executor.shutdown()
            for node in (planner, probe):
                node.destroy_node()
            if initialized:
                rclpy.try_shutdown()


def test_a_goal_not_answered_in_time_is_sent_again_and_the_late_one_cancelled(fleet):
    planner, publisher, results, log, streamed, reported = fleet
    until(lambda: publisher.get_subscription_count() > 0, 60.0, 'the controller')
    task = load_trace_set().get(1).task
    publisher.publish(convert.task_to_msg(convert.TaskRequest(task, 'late-answer'), Task, None))
    until(lambda: results, 60.0, 'the task result')
    # every goal but the one the controller kept is cancelled once answered (the first
    # after FIRST_ANSWER_S; a machine too busy to answer the second within ANSWER_WITHIN_S
    # makes the controller send a third, and so on)
    until(lambda: len(planner.requests) >= 2 and planner.cancels == len(planner.requests) - 1,
          FIRST_ANSWER_S + 10.0, ('every goal but one cancelled', planner.requests))
    # A segment of the goal given up would run once the kept plan ended and be reported when
    # done (this task's first segment takes the simulated drone 10.7 s): wait that long.
    kept = set(reported)
    give_up = time.monotonic() + STRAY_REPORT_S
    while time.monotonic() < give_up and set(reported) == kept:
        time.sleep(0.1)
    assert [(r.task_id, r.outcome) for r in results] == [('late-answer', 'succeeded')], results
    assert len(kept) == 1 and set(reported) == kept, reported   # one goal's segments ran
    assert set(streamed) - kept, streamed    # while a goal given up streamed its own
    first, second = planner.requests[:2]
    assert second - first >= ANSWER_WITHIN_S, planner.requests   # not sent again before
    text = log.read_text()
    assert f'the planner did not answer within {ANSWER_WITHIN_S:g} s' in text, text
    assert 'sending it again' in text, text
