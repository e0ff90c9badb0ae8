"""Plan quality of a real model: does what it writes parse, stay within limits and run?

``timelyllm plan-quality`` asks a real engine for a plan for every task of the bundled trace set
(tasks 1-11 for the Tello and the Indy7, and the chatbot prompts), one task at a time with the
prompt the live service sends (the profile's instructions and examples through the model's chat
template, the task with its scene line), with or without the profile's grammar, and counts per
robot kind:

* ``plans`` -- plans generated;
* ``parsed`` -- the plan's syntax is the plan language's: the segmenter accepts every
  statement when the robot's limits are lifted (any skill arguments, loop counts, nesting), and
  the plan ended with end of text, not cut at the token limit; for the chatbot, a non-empty
  answer;
* ``within_limits`` -- parsed with the robot's own profile: its skills, argument types and
  ranges, loop counts and nesting depth;
* ``executed_ok`` -- the whole plan runs to its end on the robot's loopback emulator through
  the real client (djitellopy for the Tello, IndyDCP3 for the Indy7) with the skill executor the
  controllers use; the chatbot's answer is executed by being read, so it counts when parsed;
* ``useful`` / ``partly`` / ``useless`` -- robot plans judged against their task and its
  reference plan in a world that is not cooperative (:mod:`~timelyllm_ros.evaluation.plan_judge`:
  objects only where the scene or task puts them, an arm that holds one thing, coverage of the
  reference's skills and objects); a plan that did not run is useless; chat answers are not
  judged;
* ``tokens_mean`` -- output tokens per plan;
* ``decode_ms_per_token`` -- decode iteration time per generated token (prefill excluded).

The table (without ``--json``) also shows the grammar's share of the decode time, measured in
the same run (:func:`grammar_share`; the engines time their grammar checks and masks).

The emulated world is cooperative, since there is no camera: every object a plan asks for is
there and in view (``iv`` is true, ``od`` is 100 cm, ``p``/``sa`` answer ``yes``), and each
drone plan starts with the Tello hovering, as in the traces' scenes (the tasks are given to a
flying drone). What can still fail is what the plan asks of the robot: a move after landing, a
place without a pick, a skill the robot refuses.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from timelyllm_ros.core.clock import WallClock
from timelyllm_ros.core.plan_requests import plan_request
from timelyllm_ros.core.request import Segment
from timelyllm_ros.engines.base import Engine
from timelyllm_ros.errors import RobotError, describe_error
from timelyllm_ros.evaluation.plan_judge import VERDICTS, judge_plan
from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import FinishReason, segment_text
from timelyllm_ros.language.traces import Trace, load_trace_set
from timelyllm_ros.language.validation import statement_problem

QUALITY_KEYS = ('plans', 'parsed', 'within_limits', 'executed_ok', *VERDICTS, 'tokens_mean',
                'decode_ms_per_token')


@dataclass(frozen=True, slots=True)
class PlanOutcome:
    """One task's plan and how it fared."""

    task: int
    robot: str
    text: str
    finish: str                 # 'eos' or 'length'
    tokens: int
    decode_s: float             # decode iterations of this plan (s)
    decode_tokens: int          # tokens those iterations produced
    grammar_s: float            # time the engine spent in the grammar for this plan (s)
    parsed: bool
    within_limits: bool
    executed_ok: bool
    problem: str                # why it did not parse, pass or run ('' when it did)
    verdict: str = ''           # useful, partly or useless ('' for a chat answer)
    verdict_reason: str = ''    # why it is not useful


def cooperative_perception(call: SkillCall) -> object:
    """Answers a Tello perception skill as if the object were in view, 1 m ahead."""
    answers: dict[str, object] = {
        'is_visible': True, 'scan': True, 'scan_abstract': 'yes', 'probe': 'yes',
        'goto': 100, 'object_distance': 100, 'object_x': 0.5, 'object_y': 0.5,
        'object_width': 0.2, 'object_height': 0.2,
    }
    if call.skill not in answers:
        raise RobotError(f'{call.text}: no answer for {call.skill!r}')
    return answers[call.skill]


def relaxed(profile: RobotProfile) -> RobotProfile:
    """The profile with its limits lifted: any argument value, loop count and nesting (what
    ``parsed`` checks: the syntax, not the robot's limits)."""
    data = profile.model_dump()
    for skill in data['skills']:
        for arg in skill['args']:
            arg['min'] = arg['max'] = None
    data.update(max_nesting_depth=16, max_loop_count=1_000_000)
    return RobotProfile.model_validate(data)


def generate(engine: Engine, profile: RobotProfile, trace: Trace, request_id: str,
             grammar: bool) -> tuple[str, str, int, float, int]:
    """One plan, alone on the engine: its text, finish reason, tokens, decode time and decode
    tokens."""
    request = plan_request(profile, request_id, trace.task, prompt_tokens=trace.prompt_tokens,
                           grammar=grammar and engine.supports('grammar'))
    engine.register(request)
    text, finish, tokens, decode_s, decode_tokens = '', 'length', 0, 0.0, 0
    try:
        engine.run(request_id)
        for _ in range(4 * request.max_tokens + 8):
            result = engine.step()
            produced = result.produced(request_id)
            text += result.text.get(request_id, '')
            tokens += produced
            if result.prefill_tokens == 0:
                decode_s += result.duration_s
                decode_tokens += produced
            if request_id in result.finished:
                finish = result.finished[request_id]
                break
    finally:
        engine.release(request_id)
    return text, finish, tokens, decode_s, decode_tokens


def execute_plan(profile: RobotProfile, statements: Sequence[Statement]) -> str:
    """Run a plan on the robot's loopback emulator through its real client; '' when it ran to
    its end, else why not."""
    from timelyllm_ros.robots.executor import SkillExecutor
    from timelyllm_ros.robots.factory import RobotOptions, open_robot

    logging.getLogger('djitellopy').setLevel(logging.WARNING)   # a line per command
    clock = WallClock()
    options = RobotOptions(time_scale=0.0, endless_battery=True, own_loopback_host=True,
                           perception=cooperative_perception)
    robot = open_robot(profile, 'emulator', None, clock, options)
    try:
        if profile.kind == 'drone':     # the task finds the drone hovering
            robot.backend.perform(SkillCall('takeoff', 'to', {}, 'to()'))
        segment = Segment(index=0, text='', statements=tuple(statements), cut_time=0.0,
                          dispatch_time=0.0, estimated_exec_s=0.0, tokens=0, is_last=True)
        execution = SkillExecutor(robot.backend, clock).execute(segment)
        return '' if execution.success else execution.error
    except RobotError as err:
        return describe_error(err)
    finally:
        robot.close()


def judge(profile: RobotProfile, text: str, finish: str) -> tuple[bool, bool, bool, str]:
    """(parsed, within_limits, executed_ok, problem) of one generated plan."""
    if profile.segmentation != 'skills':
        ok = bool(text.strip())
        return ok, ok, ok, '' if ok else 'empty answer'
    reason: FinishReason = 'eos' if finish == 'eos' else 'length'
    syntax = segment_text(relaxed(profile), text, reason)
    rejected = [r for cut in syntax for r in cut.rejected]
    statements = [s for cut in syntax for s in cut.statements]
    if finish != 'eos':
        return False, False, False, 'cut at the token limit'
    if rejected or not statements:
        return False, False, False, (rejected[0].error or '') if rejected else 'no statement'
    cuts = segment_text(profile, text, reason)
    rejected = [r for cut in cuts for r in cut.rejected]
    statements = [s for cut in cuts for s in cut.statements]
    problems = [p for p in (statement_problem(profile, s) for s in statements) if p]
    if rejected or problems:
        return True, False, False, (rejected[0].error or '') if rejected else problems[0]
    failure = execute_plan(profile, statements)
    return True, True, not failure, failure


def judge_usefulness(profile: RobotProfile, trace: Trace, text: str, executed_ok: bool,
                     problem: str) -> tuple[str, str]:
    """(verdict, reason) of a robot plan (:func:`~timelyllm_ros.evaluation.plan_judge.judge_plan`);
    a plan that did not run is useless for that reason; ('', '') for a chat answer."""
    if profile.segmentation != 'skills':
        return '', ''
    if not executed_ok:
        return 'useless', problem
    statements = [s for cut in segment_text(profile, text, 'eos') for s in cut.statements]
    judgement = judge_plan(profile, trace.task, trace.plan, statements)
    return judgement.verdict, judgement.reason


def run_plan_quality(engine: Engine, grammar: bool = True,
                     traces: Sequence[Trace] | None = None,
                     progress: Callable[[PlanOutcome], None] | None = None
                     ) -> list[PlanOutcome]:
    """Generate and judge a plan for every task (default: the bundled trace set)."""
    outcomes = []
    for trace in traces if traces is not None else load_trace_set().traces:
        profile = load_profile(trace.robot)
        grammar_before = engine.stats().grammar_s
        text, finish, tokens, decode_s, decode_tokens = generate(
            engine, profile, trace, f'quality-{trace.id}', grammar)
        grammar_s = engine.stats().grammar_s - grammar_before
        parsed, within, executed, problem = judge(profile, text, finish)
        verdict, why = judge_usefulness(profile, trace, text, executed, problem)
        outcome = PlanOutcome(trace.id, trace.robot, text, finish, tokens, decode_s,
                              decode_tokens, grammar_s, parsed, within, executed, problem,
                              verdict, why)
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    return outcomes


def _quality(outcomes: Sequence[PlanOutcome]) -> dict[str, Any]:
    decode_tokens = sum(o.decode_tokens for o in outcomes)
    return {
        'plans': len(outcomes),
        'parsed': sum(o.parsed for o in outcomes),
        'within_limits': sum(o.within_limits for o in outcomes),
        'executed_ok': sum(o.executed_ok for o in outcomes),
        **{verdict: sum(o.verdict == verdict for o in outcomes) for verdict in VERDICTS},
        'tokens_mean': (sum(o.tokens for o in outcomes) / len(outcomes)
                        if outcomes else math.nan),
        'decode_ms_per_token': (1000.0 * sum(o.decode_s for o in outcomes) / decode_tokens
                                if decode_tokens else math.nan),
    }


def summarize(outcomes: Sequence[PlanOutcome]) -> dict[str, Any]:
    """``{"overall": Q, "by_robot": {kind: Q}}`` with Q the counts of :data:`QUALITY_KEYS`."""
    by_robot: dict[str, list[PlanOutcome]] = defaultdict(list)
    for outcome in outcomes:
        by_robot[outcome.robot].append(outcome)
    return {'overall': _quality(outcomes),
            'by_robot': {robot: _quality(group) for robot, group in sorted(by_robot.items())}}


def grammar_share(outcomes: Sequence[PlanOutcome]) -> float:
    """The engine's time in the grammar as a share of the decode time (the grammar's cost,
    measured inside one run rather than across two runs with different plans)."""
    decode_s = sum(o.decode_s for o in outcomes)
    return sum(o.grammar_s for o in outcomes) / decode_s if decode_s else math.nan


def outcome_record(outcome: PlanOutcome) -> dict[str, Any]:
    """One outcome as plain data (for ``--plans``)."""
    return asdict(outcome)
