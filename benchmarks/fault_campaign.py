"""Fault campaign of the ROS-free core: bad input, garbage LLM output, failing engines and
robots, overload and corrupted bags. Prints counts of what must never happen (all 0).

    python3 benchmarks/fault_campaign.py --json            # the full campaign (a few minutes)
    python3 benchmarks/fault_campaign.py --scale 0.1       # a smaller one

Each section is seeded, so a count that is not 0 reproduces with the same ``--seed``.

Counted (every one must be 0):
- ``unexpected_exceptions``: exceptions of a type the API does not promise (by type), from
  goal validation, submission, the segmenter and the statement parser;
- ``loop_crashes``: exceptions out of a scheduler tick or a live service iteration;
- ``goals_never_ended``: goals not in a terminal state once the fleet has gone quiet;
- ``plans_altered``: goals whose dispatched statements differ from what their own
  generation produced (the offline segmentation of their own output);
- ``malformed_dispatched``: dispatched statements that are not executable, do not re-parse
  to the same calls, or carry a non-finite or out-of-limit argument;
- ``invariant_violations``: ticks after which the scheduler's queue/batch bookkeeping
  disagreed with the goals' status;
- ``bag_crashes`` and ``bag_silent_corruptions``: from ``bag_faults.run_bag_campaign``;
- ``overload_below_target``: the fleet policy's throughput with 1,000 robots in overload below
  0.8× the ``vllm`` policy's (``overload.run_overload``);
- from ``service_faults``: ``native_crashes_unreported`` (a native engine dying in a child
  process, reported without its cause, or the CPU engine failing its check here),
  ``kv_goals_failed`` (goals on the real CPU engine failed for memory although they fit
  alone or were under way), ``skewed_reports_accepted`` and ``skewed_deadlines_lost`` (robot
  report times on another clock), ``stop_goals_never_ended``, ``stop_goals_accepted_after``
  and ``stop_still_serving`` (a service stopped from its own listeners or another thread);
- ``hostile_file_crashes`` and ``hostile_file_hangs`` (``hostile_files``: alias bombs, deep
  nesting, huge or non-finite numbers, non-UTF-8 and endless files into every loader and
  command line);
- ``tello_frozen_state``, ``tello_spoofed_success`` and ``tello_crashes``
  (``hostile_datagrams``: datagrams at the Tello backend during its motions);
- ``degenerate_models_written`` (``degenerate_fits``: timing sets that fit falling or
  zero-second models).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Generation, TaskSpec, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.core.tuf import Tuf, tuf_for_class
from timelyllm_ros.engines import Engine, create_engine
from timelyllm_ros.engines.faults import FaultInjectingEngine
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import EngineError, GoalError
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import Statement, segment_pieces
from timelyllm_ros.live.goals import PlanGoal
from timelyllm_ros.live.service import PlannerService
from timelyllm_ros.nodes.convert import statements_from_text, task_from_msg
from timelyllm_ros.policies import FLEET_POLICY, create_policy

PROFILES = ('tello', 'indy7', 'chatbot')
VALID_PLANS = {
    'tello': ['mf(50);tc(90);mf(20)', "s('cat');?iv('cat')==True{g('cat')}", 'u(30);3{tc(120)}',
              "?iv('person')==True{tp()};d(20)", 'mr(40);ml(40);mb(60)'],
    'indy7': ["pick('red_box');place('bin')", 'mj(0,0,90,0,90,0);grip()',
              "?detect('cup')==True{pick('cup')}", 'move_to(300,100,200);release()'],
    'chatbot': ['Sure. I can help with that! Here is the plan.', 'Yes.\n\nNo, not now.'],
}
ALPHABET = list("(){};?0123456789abcdefgimnoprstuvxyz'\"=<>.,\n -_:+eE") + [
    'nan', 'inf', 'Task:', 'Plan:', '```', 'True', 'False', 'mf(', 'tc(', '1{', '?iv(']


# -- generators ---------------------------------------------------------------------------
def random_text(rng: np.random.Generator, max_len: int = 80) -> str:
    n = int(rng.integers(0, max_len))
    return ''.join(ALPHABET[int(i)] for i in rng.integers(0, len(ALPHABET), n))


def garbage_output(rng: np.random.Generator, kind: str) -> str:
    """One LLM output a model might produce on a bad day (or an attacker on purpose)."""
    plan = VALID_PLANS[kind][int(rng.integers(len(VALID_PLANS[kind])))]
    choice = int(rng.integers(10))
    if choice == 0:
        return random_text(rng, 200)
    if choice == 1:                                   # a valid plan, mutated
        chars = list(plan)
        for _ in range(int(rng.integers(1, 6))):
            i = int(rng.integers(0, len(chars) + 1))
            op = int(rng.integers(3))
            if op == 0 and chars:
                del chars[min(i, len(chars) - 1)]
            elif op == 1:
                chars.insert(i, ALPHABET[int(rng.integers(len(ALPHABET)))])
            elif chars:
                chars[min(i, len(chars) - 1)] = ALPHABET[int(rng.integers(len(ALPHABET)))]
        return ''.join(chars)
    if choice == 2:                                   # deep nesting
        depth = int(rng.integers(5, 600))
        return '1{' * depth + 'tp()' + '}' * int(rng.integers(0, depth + 1))
    if choice == 3:                                   # huge and non-finite numbers
        number = ['9' * int(rng.integers(20, 6000)), 'nan', 'inf', '-inf', '1e999', '1e308',
                  '-0', '0x10', '1_000'][int(rng.integers(9))]
        return [f'mf({number})', f'{number}{{tp()}}', f'mj({number},0,0,0,0,0)',
                f'd({number})', f'tc({number});mf(50)'][int(rng.integers(5))]
    if choice == 4:                                   # prompt echo around a plan
        return f'Task: do it\nPlan: {plan}\nTask: again\nPlan:'
    if choice == 5:                                   # motion as a condition, unknown skills
        return ['?mf(50){tp()}', 'fly(10)', 'rm -rf /()', "?exec('x')==1{tp()}",
                '99999999999{tp()}', 'mf(50,60)', 'mf()', "mf('50')"][int(rng.integers(8))]
    if choice == 6:                                   # unbalanced brackets and quotes
        return plan[: int(rng.integers(1, len(plan) + 1))] + "({['\""[int(rng.integers(5))]
    if choice == 7:                                   # unicode, control characters, NUL
        return plan + ''.join(chr(int(c)) for c in rng.integers(0, 0x3000, 20)) + '\x00;'
    if choice == 8:
        return ';'.join(plan for _ in range(int(rng.integers(1, 40))))
    return plan


def pieces_of(rng: np.random.Generator, text: str) -> list[str]:
    """The text cut at random points, as a detokenizer would stream it."""
    if not text:
        return ['']
    cuts = sorted({int(c) for c in rng.integers(1, len(text) + 1, max(1, len(text) // 3))})
    bounds = [0, *cuts]
    if bounds[-1] != len(text):
        bounds.append(len(text))
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def random_goal(rng: np.random.Generator) -> PlanGoal:
    """A goal whose fields are each valid (3 in 4) or drawn from the hostile values seen in
    the wild, so that both the gate and the scheduler behind it are exercised."""
    def pick(valid: list[object], hostile: list[object]) -> object:
        values = valid if rng.random() < 0.75 else hostile
        return values[int(rng.integers(len(values)))]

    robot_id = pick(['drone_0', 'arm_3', 'ns/drone_1', 'robot-7.a'],
                    ['', '  ', 'x' * 300, 'a\x00b', '\ud800', 'dröne', random_text(rng, 20),
                     42, None, b'drone'])
    kind = pick(['tello', 'indy7', 'chatbot'],
                ['submarine', '/tmp/x.yaml', '../../etc/passwd', 'tello\x00', 'k' * 300,
                 '\udc80', '', 'TELLO', 'tello.yaml', '~/tello', None, 7])
    task = pick(['fly forward 50 cm', 'find the cat and go to it', 'pick the red box',
                 'こんにちは, 🚁 fly', random_text(rng, 200) + 'x'],
                ['', '   ', 'x' * 5000, 'go\x00now', 'go \ud800 now', 3.5, None])
    urgency = pick(['normal', 'urgent', 'chatbot'], ['someday', '', None])
    tuf: object = None
    if rng.random() < 0.3:
        values = [abs(float(v)) + 0.1 for v in rng.normal(0, 5, 3)]
        values[2] = -values[2]
        if rng.random() < 0.5:
            values[int(rng.integers(3))] = float(pick(
                [0.5], [math.nan, math.inf, -math.inf, 1e300, -1.0, 0.0]))  # type: ignore[arg-type]
        try:
            tuf = Tuf(*values)
        except GoalError:
            tuf = pick([None], ['not a tuf', (1.0, 1.0, -1.0)])
    return PlanGoal(robot_id, kind, task, urgency, tuf, bool(rng.random() < 0.8))  # type: ignore[arg-type]


# -- checks ---------------------------------------------------------------------------------
def call_problem(profile: RobotProfile, call: object) -> str | None:
    """Why a dispatched call is malformed (independent of the segmenter), or None."""
    skill = profile.skill_index.get(call.skill)  # type: ignore[attr-defined]
    if skill is None:
        return f'unknown skill {call.skill}'  # type: ignore[attr-defined]
    for arg in skill.args:
        value = call.args.get(arg.name)  # type: ignore[attr-defined]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                return f'non-finite {arg.name}'
            if arg.min is not None and value < arg.min or arg.max is not None and value > arg.max:
                return f'{arg.name}={value} out of [{arg.min}, {arg.max}]'
    return None


def statement_problem(profile: RobotProfile, statement: Statement) -> str | None:
    if not statement.executable:
        return 'not executable'
    if statement.kind == 'loop' and statement.repeat > profile.max_loop_count:
        return f'loop count {statement.repeat}'
    for call in statement.calls:
        problem = call_problem(profile, call)
        if problem:
            return problem
    if statement.kind == 'text':
        return None
    try:
        again = statements_from_text(profile, statement.text)
    except GoalError as err:                   # the controller would refuse the segment
        return f'refused by the controller-side parser: {err}'
    if len(again) != 1 or not again[0].executable or again[0].calls != statement.calls:
        return 're-parses differently'
    return None


class Tally:
    """Counts of the campaign, with one example per kind to reproduce it."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def bad(self, what: str, example: str) -> None:
        self.counts[what] += 1
        self.examples.setdefault(what, example[:300])

    def exception(self, where: str, err: BaseException, example: str) -> None:
        key = f'{where}:{type(err).__name__}'
        self.unexpected[key] += 1
        self.examples.setdefault(key, f'{example[:200]!r} -> {err!s:.200}')


# -- sections -------------------------------------------------------------------------------
def goals_section(tally: Tally, seed: int, n: int) -> dict[str, int]:
    """Random goals through the one validation gate, then into a scheduler."""
    rng = np.random.default_rng(seed)
    service = PlannerService.create()
    scheduler = Scheduler(create_policy('timelyllm'), SimulatedEngine(), SimClock())
    accepted = refused = 0
    for _ in range(n):
        goal = random_goal(rng)
        try:
            spec = service.make_spec(goal)
        except GoalError as err:
            refused += 1
            reason = str(err)
            if len(reason) > 400 or 'skills:' in reason or '\n' in reason:
                tally.bad('reasons_quoting_input', reason)
            continue
        except Exception as err:  # noqa: BLE001 - what the campaign counts
            tally.exception('make_spec', err, repr(goal))
            continue
        accepted += 1
        try:
            scheduler.submit(spec)
        except (GoalError, EngineError):
            pass
        except Exception as err:  # noqa: BLE001
            tally.exception('submit', err, repr(goal))
    tasks = [task_message_case(rng) for _ in range(n // 4)]
    for message in tasks:
        try:
            task_from_msg(message)
        except GoalError:
            pass
        except Exception as err:  # noqa: BLE001
            tally.exception('task_from_msg', err, repr(message))
    return {'goals': n, 'accepted': accepted, 'refused': refused, 'task_messages': len(tasks)}


def task_message_case(rng: np.random.Generator) -> SimpleNamespace:
    """A Task message with fields a careless or hostile sender may set."""
    numbers = (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308, 2.0)

    def number() -> float:
        return float(numbers[int(rng.integers(len(numbers)))])

    choice = int(rng.integers(5))
    task: object = random_text(rng, 300)
    if choice == 0:
        task = 'x' * int(rng.integers(4000, 70_000))
    elif choice == 1:
        task = '\ud800 go'
    elif choice == 2:
        task = None
    return SimpleNamespace(
        task=task, task_id=random_text(rng, 10) if choice != 3 else ['id'],
        urgency=('urgent', 'panic', '', 5)[int(rng.integers(4))], has_tuf=bool(rng.integers(2)),
        tuf=SimpleNamespace(ert_s=number(), alpha=number(), beta=number()))


def outputs_section(tally: Tally, seed: int, n: int) -> dict[str, int]:
    """Garbage LLM outputs through the streaming segmenter, in random pieces."""
    rng = np.random.default_rng(seed + 1)
    profiles = {name: load_profile(name) for name in PROFILES}
    dispatched = 0
    for _ in range(n):
        kind = PROFILES[int(rng.integers(len(PROFILES)))]
        profile = profiles[kind]
        text = garbage_output(rng, kind)
        pieces = pieces_of(rng, text)
        try:
            cuts = [cut for _, cut in segment_pieces(profile, pieces,
                                                     'eos' if rng.random() < 0.7 else 'length')]
        except Exception as err:  # noqa: BLE001
            tally.exception('segmenter', err, text)
            continue
        if not text.startswith(''.join(cut.text for cut in cuts)):
            tally.bad('cut_text_not_a_prefix', text)
        for cut in cuts:
            for statement in cut.statements:
                dispatched += 1
                try:
                    problem = statement_problem(profile, statement)
                except Exception as err:  # noqa: BLE001
                    tally.exception('statement_parser', err, statement.text)
                    continue
                if problem:
                    tally.bad('malformed_dispatched', f'{kind}: {statement.text!r}: {problem}')
        try:
            statements_from_text(profile, text)
        except GoalError:
            pass                                 # the documented refusal of a bad segment
        except Exception as err:  # noqa: BLE001
            tally.exception('statements_from_text', err, text)
    return {'outputs': n, 'statements_checked': dispatched}


@dataclass(frozen=True)
class FleetGoal:
    """One goal of a chaos fleet and how its robot and client behave."""

    spec: TaskSpec
    robot: str = 'ok'                       # ok | fail | freeze | silent
    slowdown: float = 1.0                   # real execution time / minimum estimate
    cancel_after_s: float | None = None     # the client cancels this long after arrival


def random_fleet(rng: np.random.Generator, n: int) -> list[FleetGoal]:
    fleet = []
    for i in range(n):
        kind = PROFILES[int(rng.integers(len(PROFILES)))]
        text = garbage_output(rng, kind) if rng.random() < 0.5 else VALID_PLANS[kind][
            int(rng.integers(len(VALID_PLANS[kind])))]
        spec = TaskSpec(
            task_id=f'g{i}', robot_id=f'robot_{i}', profile=kind, task_class='normal',
            task_type='chaos', tuf=tuf_for_class('urgent' if rng.random() < 0.3 else 'normal'),
            arrival_time=float(rng.uniform(0, n * 0.05)), task='chaos task',
            prompt_tokens=int(rng.integers(50, 600)), script=tuple(pieces_of(rng, text)))
        fate = int(rng.integers(10))
        fleet.append(FleetGoal(spec, ('fail', 'freeze', 'silent')[fate] if fate < 3 else 'ok',
                               float(rng.uniform(1.0, 1.3)),
                               float(rng.exponential(1.0)) if rng.random() < 0.1 else None))
    return fleet


def fleet_section(tally: Tally, seed: int, n: int, policy: str,
                  rates: dict[str, float]) -> dict[str, object]:
    """A random chaos fleet (garbage plans, failing robots, cancels) through drive_fleet."""
    return drive_fleet(tally, random_fleet(np.random.default_rng(seed + 2), n), policy, rates,
                       seed)


def drive_fleet(tally: Tally, fleet: list[FleetGoal], policy: str, rates: dict[str, float],
                seed: int = 0, inner: Engine | None = None) -> dict[str, object]:
    """Run a fleet on a virtual clock over a (possibly failing) engine until it goes quiet:
    the simulator, or ``inner`` (a real engine, whose measured iteration times advance the
    clock). Every goal must end, and every dispatched plan must be its own generation's."""
    clock = SimClock()
    engine = FaultInjectingEngine(inner or SimulatedEngine(), rates, seed=seed, record=True)
    config = SchedulerConfig(report_timeout_factor=1.5, report_timeout_margin_s=2.0)
    scheduler = Scheduler(create_policy(policy), engine, clock, config)
    profiles = {name: load_profile(name) for name in PROFILES}
    events: list[tuple[float, int, str, tuple[object, ...]]] = []
    seq = 0

    def at(when: float, kind: str, *args: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (when, seq, kind, args))

    by_id = {goal.spec.task_id: goal for goal in fleet}
    for goal in fleet:
        at(goal.spec.arrival_time, 'arrive', goal.spec)
        if goal.cancel_after_s is not None:
            at(goal.spec.arrival_time + goal.cancel_after_s, 'cancel', goal.spec.task_id)
    submitted: dict[str, Generation] = {}
    crashes = 0
    while True:
        now = clock.now()
        while events and events[0][0] <= now:
            _, _, kind, args = heapq.heappop(events)
            try:
                deliver(scheduler, submitted, kind, args)
            except Exception as err:  # noqa: BLE001
                tally.exception(f'fleet_{kind}', err, repr(args)[:200])
        if not scheduler.has_work:
            upcoming = [e for e in (events[0][0] if events else None, scheduler.next_deadline)
                        if e is not None]
            if not upcoming:
                break
            clock.advance_to(max(now, min(upcoming)))
            scheduler.expire_overdue()
            continue
        try:
            out = scheduler.tick()
        except Exception as err:  # noqa: BLE001
            crashes += 1
            tally.exception('tick', err, policy)
            clock.elapse(0.01)
            continue
        problems = scheduler.invariant_violations()
        if problems:
            tally.bad('invariant_violations', problems[0])
        if out.duration_s == 0.0:
            clock.elapse(0.001)
        for dispatch in out.dispatches:
            goal = by_id[dispatch.task_id]
            segment = dispatch.segment
            start = clock.now() + config.comm_s
            end = start + segment.estimated_exec_s * goal.slowdown
            if goal.robot == 'silent':
                continue
            delay = 1e4 if goal.robot == 'freeze' else 0.0
            at(end + config.comm_s + delay, 'report', dispatch.task_id, segment.index, start,
               end, goal.robot != 'fail', 'motor stalled' if goal.robot == 'fail' else '')
    tally.counts['loop_crashes'] += crashes
    ended = 0
    for task_id, generation in submitted.items():
        if not generation.status.terminal:
            tally.bad('goals_never_ended', f'{task_id} {generation.status.name}')
            continue
        ended += 1
        produced = (engine.transcript or {}).get(task_id, [])
        check_own_plan(tally, profiles[generation.spec.profile], generation, produced)
    statuses = Counter(g.status.name for g in submitted.values())
    return {'goals': len(fleet), 'submitted': len(submitted), 'ended': ended, **statuses,
            **{f'injected_{k}': v for k, v in engine.injected.items() if v}}


def deliver(scheduler: Scheduler, submitted: dict[str, Generation], kind: str,
            args: tuple[object, ...]) -> None:
    if kind == 'arrive':
        spec = args[0]
        assert isinstance(spec, TaskSpec)
        try:
            submitted[spec.task_id] = scheduler.submit(spec)
        except (GoalError, EngineError):
            pass
    elif kind == 'cancel':
        task_id = str(args[0])
        if task_id in scheduler.generations:
            scheduler.cancel(task_id)
    else:
        task_id, index, start, end, success, error = args
        if task_id in scheduler.generations:
            scheduler.report_segment(str(task_id), int(index), float(start),  # type: ignore[call-overload, arg-type]
                                     float(end), bool(success), str(error))  # type: ignore[arg-type]


def check_own_plan(tally: Tally, profile: RobotProfile, generation: Generation,
                   produced: list[str]) -> None:
    """Dispatched statements = a prefix of the offline segmentation of the pieces its own
    generation produced (as the engine emitted them)."""
    dispatched = [s for segment in generation.segments for s in segment.statements]
    for statement in dispatched:
        problem = statement_problem(profile, statement)
        if problem:
            tally.bad('malformed_dispatched', f'{generation.task_id}: {statement.text!r}: '
                                              f'{problem}')
    reason = 'length' if generation.finish_reason == 'length' else 'eos'
    own = [s for _, cut in segment_pieces(profile, produced or [''], reason)
           for s in cut.statements]
    texts, own_texts = [s.text for s in dispatched], [s.text for s in own]
    complete = generation.status in (TaskStatus.FINISHED,) or (
        generation.status == TaskStatus.FAILED and 'robot' in generation.error)
    if texts != own_texts[:len(texts)] or (complete and generation.finish_reason
                                             and texts != own_texts):
        tally.bad('plans_altered', f'{generation.task_id}: {texts} vs {own_texts}')


def real_engine_section(tally: Tally, seed: int, n: int, engine: str) -> dict[str, object]:
    """Chaos fleets on a real engine (output forced to the fleet's plans, garbage included;
    measured iteration times), without and with injected engine faults."""
    fleet = random_fleet(np.random.default_rng(seed + 5), n)
    runs: dict[str, object] = {}
    for policy in ('timelyllm', 'vllm-stream'):
        for label, rates in (('clean', {}), ('faults', {'step': 0.01, 'run': 0.05,
                                                       'pause': 0.05, 'release': 0.05})):
            inner = create_engine(engine, force_script=True)
            runs[f'{policy}/{label}'] = drive_fleet(tally, fleet, policy, rates, seed, inner)
    return {'engine': engine, **runs}


def service_section(tally: Tally, seed: int, n: int) -> dict[str, object]:
    """The live service (wall clock, real-time simulator) with a failing engine, silent
    robots and cancels: every goal's end listener is called exactly once."""
    rng = np.random.default_rng(seed + 3)
    config = SchedulerConfig(report_timeout_factor=1.0, report_timeout_margin_s=0.3)
    service = PlannerService.create(config=config)
    service.scheduler.engine = FaultInjectingEngine(
        service.scheduler.engine, {'step': 0.01, 'run': 0.02, 'pause': 0.02}, seed=seed)
    ends: Counter[str] = Counter()
    lock = threading.Lock()
    goal_ids: list[str] = []

    def on_segment(generation: Generation, segment: object) -> None:
        if rng.random() < 0.2:
            return                                   # this robot never reports
        index = segment.index  # type: ignore[attr-defined]
        now = service.now()
        service.report_segment(generation.task_id, index, now, now + 0.01)

    def on_end(generation: Generation) -> None:
        with lock:
            ends[generation.task_id] += 1

    service.start()
    kinds = ('tello', 'indy7', 'chatbot')
    for i in range(n):
        kind = kinds[i % 3]
        task = {'tello': 'find the cat and go to it', 'indy7': 'pick the red box',
                'chatbot': 'tell me a joke'}[kind]
        goal_ids.append(service.submit(PlanGoal(f'robot_{i}', kind, task,
                                                'urgent' if i % 4 == 0 else 'normal'),
                                       on_segment, on_end))
        if rng.random() < 0.1:
            service.cancel(goal_ids[-1])
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        with lock:
            if len(ends) == len(goal_ids):
                break
        time.sleep(0.05)
    service.stop()
    never = [g for g in goal_ids if ends[g] == 0]
    twice = [g for g in goal_ids if ends[g] > 1]
    for goal_id in never:
        tally.bad('goals_never_ended', f'service {goal_id}')
    for goal_id in twice:
        tally.bad('goals_ended_twice', f'service {goal_id}')
    tally.counts['loop_crashes'] += service.loop_failures
    return {'goals': n, 'ended': len(goal_ids) - len(never), 'status': service.state().status}


OVERLOAD_TARGET = 0.8      # the fleet policy's throughput under overload, relative to vllm's


def overload_section(tally: Tally, seed: int, robots: int) -> dict[str, object]:
    from overload import run_overload  # type: ignore[import-not-found]  # benchmarks/ sibling

    result = run_overload(robots=robots, seed=seed, policies=('vllm', FLEET_POLICY))
    ratio = result['ratios_to_vllm'][FLEET_POLICY]['goals_per_s']
    if not isinstance(ratio, float) or ratio < OVERLOAD_TARGET:
        tally.bad('overload_below_target', f'{robots} robots: throughput ratio {ratio}')
    return result


def bags_section(tally: Tally, seed: int, cases: int) -> dict[str, object]:
    from bag_faults import run_bag_campaign  # type: ignore[import-not-found]

    with tempfile.TemporaryDirectory() as workdir:
        result = run_bag_campaign(seed=seed, cases=cases, workdir=Path(workdir))
    tally.counts['bag_crashes'] += int(result.get('crashes', 0))
    tally.counts['bag_silent_corruptions'] += int(result.get('silent_corruptions', 0))
    return result


def counted_section(tally: Tally, result: dict[str, int]) -> dict[str, int]:
    """Add a section's must-be-zero counts to the tally; its other figures (``cases``, what
    was refused on purpose) stay in the section's result, which is returned."""
    for key, value in result.items():
        if key in REQUIRED_ZERO:
            tally.counts[key] += int(value)
    return result


def native_section(tally: Tally, seed: int, cases: int) -> dict[str, int]:
    from service_faults import native_crash_cases  # type: ignore[import-not-found]

    return counted_section(tally, native_crash_cases(seed, cases))


def kv_section(tally: Tally, seed: int, runs: int) -> dict[str, int]:
    from service_faults import kv_pressure_runs  # type: ignore[import-not-found]

    return counted_section(tally, kv_pressure_runs(seed, runs))


def skew_section(tally: Tally, seed: int, cases: int) -> dict[str, int]:
    from service_faults import clock_skew_cases  # type: ignore[import-not-found]

    return counted_section(tally, clock_skew_cases(seed, cases))


def stop_section(tally: Tally, seed: int, cases: int) -> dict[str, int]:
    from service_faults import stop_cases  # type: ignore[import-not-found]

    return counted_section(tally, stop_cases(seed, cases))


def files_section(tally: Tally, seed: int, cases: int) -> dict[str, int]:
    from hostile_files import run_hostile_files_campaign  # type: ignore[import-not-found]

    return counted_section(tally, run_hostile_files_campaign(seed, cases))


def datagrams_section(tally: Tally, seed: int, cases: int) -> dict[str, int]:
    from hostile_datagrams import (  # type: ignore[import-not-found]
        run_hostile_datagrams_campaign,
    )

    return counted_section(tally, run_hostile_datagrams_campaign(seed, cases))


def fits_section(tally: Tally, seed: int, cases: int) -> dict[str, int]:
    from degenerate_fits import run_degenerate_fit_campaign  # type: ignore[import-not-found]

    return counted_section(tally, run_degenerate_fit_campaign(seed, cases))


# -- the command ---------------------------------------------------------------------------
REQUIRED_ZERO = ('unexpected_exceptions', 'loop_crashes', 'goals_never_ended',
                 'goals_ended_twice', 'plans_altered', 'malformed_dispatched',
                 'invariant_violations', 'bag_crashes', 'bag_silent_corruptions',
                 'cut_text_not_a_prefix', 'reasons_quoting_input', 'overload_below_target',
                 'native_crashes_unreported', 'kv_goals_failed', 'skewed_reports_accepted',
                 'skewed_deadlines_lost', 'stop_goals_never_ended', 'stop_goals_accepted_after',
                 'stop_still_serving', 'hostile_file_crashes', 'hostile_file_hangs',
                 'tello_frozen_state', 'tello_spoofed_success', 'tello_crashes',
                 'degenerate_models_written', 'unloadable_profiles_written', 'fit_crashes')
SECTIONS = ('goals', 'outputs', 'fleet', 'engine', 'service', 'bags', 'overload', 'native',
            'kv', 'skew', 'stop', 'files', 'datagrams', 'fits')


def run_campaign(seed: int = 0, scale: float = 1.0, sections: tuple[str, ...] = (),
                 progress: Callable[[str], None] | None = None,
                 engine: str | None = None) -> dict[str, object]:
    """Run the campaign; returns ``{"cases": …, "counts": …, "ok": bool, …}``. With
    ``engine`` (e.g. ``cpu``) a section of chaos fleets on that real engine is added."""
    tally = Tally()
    cases: dict[str, object] = {}
    wanted = sections or (*SECTIONS, *(('real',) if engine else ()))

    def size(n: int) -> int:
        return max(1, int(n * scale))

    plan: Iterator[tuple[str, Callable[[], object]]] = iter([
        ('goals', lambda: goals_section(tally, seed, size(10_000))),
        ('outputs', lambda: outputs_section(tally, seed, size(12_000))),
        ('fleet', lambda: {p: fleet_section(tally, seed, size(400), p, {})
                           for p in ('timelyllm', 'vllm', 'semantic', 'timebill', 'slice')}),
        ('engine', lambda: {p: fleet_section(tally, seed + 7, size(400), p, {
            'step': 0.01, 'run': 0.05, 'pause': 0.05, 'release': 0.05, 'register': 0.03,
            'can_run': 0.02, 'evict': 0.2}) for p in ('timelyllm', 'vllm-stream', 'semantic')}),
        ('service', lambda: service_section(tally, seed, size(150))),
        ('bags', lambda: bags_section(tally, seed, size(300))),
        ('overload', lambda: overload_section(tally, seed, 1000 if scale >= 1 else size(1000))),
        ('real', lambda: real_engine_section(tally, seed, size(40), engine or 'cpu')),
        ('native', lambda: native_section(tally, seed, size(16))),
        ('kv', lambda: kv_section(tally, seed, size(4))),
        ('skew', lambda: skew_section(tally, seed, size(500))),
        ('stop', lambda: stop_section(tally, seed, size(30))),
        ('files', lambda: files_section(tally, seed, size(200))),
        ('datagrams', lambda: datagrams_section(tally, seed, size(40))),
        ('fits', lambda: fits_section(tally, seed, size(100))),
    ])
    for name, section in plan:
        if name not in wanted:
            continue
        if progress is not None:
            progress(name)
        cases[name] = section()
    counts = {key: int(tally.counts.get(key, 0)) for key in REQUIRED_ZERO}
    counts['unexpected_exceptions'] = sum(tally.unexpected.values())
    extra = {k: v for k, v in tally.counts.items() if k not in counts}
    return {'seed': seed, 'cases': cases, 'counts': {**counts, **extra},
            'unexpected_exception_types': dict(tally.unexpected),
            'examples': tally.examples,
            'ok': all(v == 0 for v in counts.values()) and not extra}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--scale', type=float, default=1.0, help='fraction of the case counts')
    parser.add_argument('--sections', default='',
                        help=f'comma-separated subset of {", ".join((*SECTIONS, "real"))}')
    parser.add_argument('--json', action='store_true', help='print JSON only')
    parser.add_argument('--engine', default=None,
                        help='also run chaos fleets on this real engine (cpu: llama.cpp)')
    args = parser.parse_args(argv)
    sections = tuple(s for s in args.sections.split(',') if s)

    def progress(name: str) -> None:
        if not args.json:
            print(f'… {name}', file=sys.stderr, flush=True)

    started = time.perf_counter()
    result = run_campaign(args.seed, args.scale, sections, progress, args.engine)
    result['wall_s'] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=None if args.json else 2, default=str))
    return 0 if result['ok'] else 1


if __name__ == '__main__':
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
