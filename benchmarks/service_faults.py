"""Faults at the planner's edges (issue 31, items 1-4): a native engine that dies, KV memory
under pressure on the real CPU engine, robots on another clock, and a service stopped from
inside its own listeners.

    python3 benchmarks/service_faults.py [--cases 20] [--seed 0] [--kv-runs 3] [--json]

Counted (each must be 0):

* ``native_crashes_unreported``: a child process that died (signal, exit code, hang, no
  verdict) and that :func:`~timelyllm_ros.engines.native_check.run_check` called ok, or whose
  reason does not name the signal; plus the real CPU engine's check failing here;
* ``kv_goals_failed``: goals on the real CPU engine with a small KV budget that failed for
  memory although they fit alone, or after their robot had a segment;
* ``skewed_reports_accepted``: robot reports with times beyond the clock tolerance that the
  scheduler accepted; ``skewed_deadlines_lost``: goals whose robot then went silent and that
  did not end at their report deadline;
* ``stop_goals_never_ended`` / ``stop_goals_accepted_after`` / ``stop_still_serving``: a
  service stopped at a random moment from a segment listener, an end listener or another
  thread that left a goal without its end, accepted a goal after the stop, or kept saying
  it serves.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from collections import Counter

import numpy as np

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Generation, TaskSpec, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.core.tuf import tuf_for_class
from timelyllm_ros.engines.native_check import check_engine, run_check
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import GoalError
from timelyllm_ros.language.traces import approx_tokenize
from timelyllm_ros.live.service import PlanGoal, PlannerService
from timelyllm_ros.policies import create_policy

TASKS = ('take off, fly forward 1 m and land', 'find the cat and go to it',
         'turn around twice, then land', 'fly up 50 cm, look for the keys, land')
MEMORY_ERRORS = ('does not fit', 'KV memory')


# -- native crashes ---------------------------------------------------------------------------
def _dying_child(how: str) -> list[str]:
    """A child process that dies the way a native library can."""
    code = {
        'segv': 'import ctypes; ctypes.string_at(0)',
        'abort': 'import os; os.abort()',
        'ill': 'import os, signal; os.kill(os.getpid(), signal.SIGILL)',
        'kill': 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)',
        'exit': 'import os; os._exit(3)',
        'silent': 'print("loading")',
        'garbage': 'print("{not json"); print("[1, 2]")',
        'hang': 'import time; time.sleep(30)',
    }[how]
    return [sys.executable, '-c', code]


SIGNALS = {'segv': signal.SIGSEGV, 'abort': signal.SIGABRT, 'ill': signal.SIGILL,
           'kill': signal.SIGKILL}


def native_crash_cases(seed: int, cases: int, real_engine: bool = True) -> dict[str, int]:
    """Children that die in every way a native fault shows; with ``real_engine``, the CPU
    engine's own check too (it must pass on this machine)."""
    rng = np.random.default_rng(seed)
    kinds = ('segv', 'abort', 'ill', 'kill', 'exit', 'silent', 'garbage', 'hang')
    unreported = 0
    for i in range(cases):
        how = kinds[int(rng.integers(len(kinds)))] if i >= len(kinds) else kinds[i]
        check = run_check('cpu', _dying_child(how), timeout_s=2.0 if how == 'hang' else 60.0)
        named = (SIGNALS[how].name in check.reason if how in SIGNALS
                 else 'hung' in check.reason if how == 'hang' else bool(check.reason))
        if check.ok or not named:
            unreported += 1
    if real_engine:
        real = check_engine('cpu', 'smollm2', {'kv_tokens': 2048, 'max_num_seqs': 2})
        unreported += 0 if real.ok else 1
    return {'cases': cases + int(real_engine), 'native_crashes_unreported': unreported}


# -- KV pressure on the real CPU engine --------------------------------------------------------
def kv_pressure_runs(seed: int, runs: int, goals: int = 12) -> dict[str, int]:
    """Fleets of ``goals`` on a CPU engine whose context holds one to three prompts."""
    rng = np.random.default_rng(seed + 11)
    failed = 0
    total = 0
    for _ in range(runs):
        kv_tokens = int(rng.choice([900, 1024, 1536, 2048]))
        max_num_seqs = int(rng.integers(1, 5))
        service = PlannerService.create(
            engine='cpu', model='smollm2', config=SchedulerConfig(report_deadlines=False),
            engine_options={'kv_tokens': kv_tokens, 'max_num_seqs': max_num_seqs,
                            'threads': 1})
        dispatched: Counter[str] = Counter()
        ended: dict[str, Generation] = {}
        lock = threading.Lock()
        done = threading.Event()

        def on_segment(generation: Generation, segment: object,
                       service: PlannerService = service,
                       dispatched: Counter[str] = dispatched) -> None:
            if getattr(segment, 'statements', ()):
                dispatched[generation.task_id] += 1
                now = service.now()
                service.report_segment(generation.task_id, segment.index,  # type: ignore[attr-defined]
                                       now, now + 0.01)

        def on_end(generation: Generation, ended: dict[str, Generation] = ended,
                   lock: threading.Lock = lock, done: threading.Event = done) -> None:
            with lock:
                ended[generation.task_id] = generation
                if len(ended) == goals:
                    done.set()

        with service:
            for i in range(goals):
                service.submit(PlanGoal(f'drone_{i}', 'tello', TASKS[i % len(TASKS)]),
                               on_segment, on_end)
            done.wait(600.0)
        engine_context = kv_tokens
        for task_id, generation in ended.items():
            total += 1
            memory = any(text in generation.error for text in MEMORY_ERRORS)
            if generation.status == TaskStatus.FAILED and memory and (
                    dispatched[task_id] or generation.spec.prompt_tokens < engine_context):
                failed += 1
        failed += goals - len(ended)          # a goal left without its end is lost too
    return {'cases': total, 'kv_goals_failed': failed}


# -- robots on another clock -------------------------------------------------------------------
def clock_skew_cases(seed: int, cases: int) -> dict[str, int]:
    """Reports shifted by a random clock offset (0.1 s to 10^6 s, either way): beyond the
    tolerance they must be refused, and the goal must still end at its deadline once its
    robot goes silent."""
    rng = np.random.default_rng(seed + 13)
    accepted = lost = 0
    for i in range(cases):
        config = SchedulerConfig(report_timeout_factor=1.5, report_timeout_margin_s=1.0)
        clock = SimClock()
        scheduler = Scheduler(create_policy('timelyllm'), SimulatedEngine(), clock, config)
        generation = scheduler.submit(_spec(f't{i}', 'mf(50);tc(90);mf(20)'))
        for _ in range(500):
            if generation.segments or not scheduler.has_work:
                break
            scheduler.tick()
        segment = generation.segments[0]
        start = segment.dispatch_time + config.comm_s
        clock.advance_to(max(clock.now(), start + segment.estimated_exec_s))
        offset = float(rng.choice([-1.0, 1.0]) * 10 ** rng.uniform(-1, 6))
        skewed_start, skewed_end = start + offset, start + offset + segment.estimated_exec_s
        tolerance = config.report_clock_tolerance_s
        beyond = (skewed_start < segment.dispatch_time - tolerance
                  or skewed_end > clock.now() + tolerance)
        try:
            scheduler.report_segment(generation.task_id, 0, skewed_start, skewed_end)
            accepted += beyond
        except GoalError:
            pass
        for _ in range(3):                  # the robot is silent from now on
            _drain(scheduler)
            clock.advance_to(clock.now() + 1e4)
            scheduler.expire_overdue()
        lost += not generation.status.terminal
    return {'cases': cases, 'skewed_reports_accepted': accepted, 'skewed_deadlines_lost': lost}


def _spec(task_id: str, plan: str) -> TaskSpec:
    return TaskSpec(task_id=task_id, robot_id=f'tello-{task_id}', profile='tello',
                    task_class='normal', task_type='T0', tuf=tuf_for_class('normal'),
                    arrival_time=0.0, task='fly', prompt_tokens=1331,
                    script=approx_tokenize(plan))


def _drain(scheduler: Scheduler, max_ticks: int = 500) -> None:
    for _ in range(max_ticks):
        if not scheduler.has_work:
            return
        scheduler.tick()


# -- a stop from anywhere ----------------------------------------------------------------------
class _StopCase:
    """One service that a segment listener, an end listener or another thread stops once
    ``after`` segments or ends were seen, while ``goals`` goals are served."""

    def __init__(self, where: str, after: int, goals: int) -> None:
        self.where, self.after, self.goals = where, after, goals
        self.service = PlannerService.create(config=SchedulerConfig(report_deadlines=False))
        self.ends: Counter[str] = Counter()
        self.segments = 0
        self.lock = threading.Lock()
        self.all_ended = threading.Event()
        self.stopped = threading.Event()

    def stop_once(self) -> None:
        if not self.stopped.is_set():
            self.stopped.set()
            self.service.stop()

    def on_segment(self, generation: Generation, segment: object) -> None:
        self.segments += 1
        if self.where == 'segment' and self.segments >= self.after:
            self.stop_once()

    def on_end(self, generation: Generation) -> None:
        with self.lock:
            self.ends[generation.task_id] += 1
            if len(self.ends) == self.goals:
                self.all_ended.set()
        if self.where == 'end' and len(self.ends) >= self.after:
            self.stop_once()


def stop_cases(seed: int, cases: int, goals: int = 8) -> dict[str, int]:
    """Services stopped at a random moment: from a segment listener, an end listener, or
    another thread, while goals are being served."""
    rng = np.random.default_rng(seed + 17)
    never = accepted_after = serving = 0
    for _ in range(cases):
        case = _StopCase(('segment', 'end', 'thread')[int(rng.integers(3))],
                         int(rng.integers(1, goals)), goals)
        service = case.service
        ids: list[str] = []
        with service:
            for i in range(goals):
                wait = bool(rng.integers(2))
                ids.append(service.submit(
                    PlanGoal(f'drone_{i}', 'tello', TASKS[i % len(TASKS)],
                             wait_for_execution=wait), case.on_segment, case.on_end))
            if case.where == 'thread':
                time.sleep(float(rng.uniform(0.0, 0.5)))
                threading.Thread(target=case.stop_once).start()
            if not case.all_ended.wait(60.0):
                case.stop_once()         # the segment/end never came: stop from here
            case.all_ended.wait(30.0)
            deadline = time.monotonic() + 10.0
            while service.state().status == 'serving' and time.monotonic() < deadline:
                time.sleep(0.01)
            if service.state().status == 'serving':
                serving += 1
            try:
                service.submit(PlanGoal('late', 'tello', 'take off'), lambda g, s: None,
                               lambda g: None)
                accepted_after += 1
            except GoalError:
                pass
        never += sum(1 for goal_id in ids if case.ends[goal_id] == 0)
        never += sum(1 for goal_id in ids if case.ends[goal_id] > 1)   # ended twice is as bad
    return {'cases': cases, 'stop_goals_never_ended': never,
            'stop_goals_accepted_after': accepted_after, 'stop_still_serving': serving}


def run_service_faults(seed: int, cases: int, kv_runs: int = 3,
                       real_engine: bool = True) -> dict[str, dict[str, int]]:
    """Every section; ``kv_runs`` fleets on the real CPU engine (0: none, ~20 s each)."""
    return {
        'native': native_crash_cases(seed, min(cases, 16), real_engine),
        'kv_pressure': kv_pressure_runs(seed, kv_runs) if kv_runs else {
            'cases': 0, 'kv_goals_failed': 0},
        'clock_skew': clock_skew_cases(seed, cases * 10),
        'stop': stop_cases(seed, cases),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cases', type=int, default=20)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--kv-runs', type=int, default=3)
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args(argv)
    if args.cases < 1 or args.kv_runs < 0:
        parser.error('--cases must be >= 1 and --kv-runs >= 0')
    result = run_service_faults(args.seed, args.cases, args.kv_runs)
    print(json.dumps(result, indent=None if args.json else 2))
    counts = [v for section in result.values() for k, v in section.items() if k != 'cases']
    return 0 if not any(counts) and all(math.isfinite(v) for v in counts) else 1


if __name__ == '__main__':
    sys.exit(main())
