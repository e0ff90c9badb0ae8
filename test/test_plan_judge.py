"""The plan judge (issue 27): useful / partly / useless against the task and its reference,
in a world that is not cooperative. The plans quoted are ones the shipped models wrote."""

from __future__ import annotations

import pytest

from timelyllm_ros.evaluation.plan_judge import (
    arm_problem,
    flight_problem,
    grounded,
    judge_plan,
    plan_calls,
)
from timelyllm_ros.evaluation.plan_quality import PlanOutcome, judge_usefulness, summarize
from timelyllm_ros.language.grounding import scene_objects
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.language.traces import load_trace_set

TRACES = load_trace_set()
TELLO, INDY7 = load_profile('tello'), load_profile('indy7')


def _judge(profile, trace_id: int, plan: str):  # type: ignore[no-untyped-def]
    trace = TRACES.get(trace_id)
    statements = [s for cut in segment_text(profile, plan, 'eos') for s in cut.statements]
    return judge_plan(profile, trace.task, trace.plan, statements)


@pytest.mark.parametrize('trace', [t for t in TRACES.traces if t.robot in ('tello', 'indy7')],
                         ids=lambda t: str(t.id))
def test_every_reference_plan_is_useful_for_its_own_task(trace) -> None:
    profile = load_profile(trace.robot)
    assert _judge(profile, trace.id, trace.plan).verdict == 'useful'


@pytest.mark.parametrize(('profile', 'trace', 'plan', 'verdict', 'why'), [
    # the stock opening of the prompt's last example, for "find the cat, go to it"
    (TELLO, 1, 'to();mf(100);tc(90);ld()', 'useless', 'nothing of the reference'),
    (TELLO, 1, "s('cat');g('cat')", 'useful', ''),
    (TELLO, 1, "s('dog');g('dog')", 'useless', "'dog'"),             # another task's object
    # "a person is walking toward you": forward is toward it
    (TELLO, 6, 'to();mf(100);tc(256);ld()', 'useless', 'first movement move_forward'),
    (TELLO, 6, 'mr(60);mf(100)', 'useful', ''),
    (TELLO, 3, "mu(40);?iv('book')==True{l('found')}", 'partly', 'take_picture'),
    (TELLO, 3, "mu(40);s('book');tp()", 'useful', ''),               # looks another way
    (TELLO, 8, 'mf(100)', 'partly', 'delay'),                        # did not wait first
    (INDY7, 10, "pick('eraser');pick('sink');pick('toppenbook')", 'useless', "'sink'"),
    (INDY7, 10, "move_to('tray, width:0.1, height:0.4,-90,0,-90,0-')", 'useless', 'tray'),
    (INDY7, 10, "pick('pencil')", 'useless', 'not at'),
    (INDY7, 10, "move_to('pencil');pick('pencil');move_to('pen_holder');"
                "place('pencil','pen_holder')", 'partly', 'objects'),
    (INDY7, 9, "move_to('red_box');pick('red_box');move_to('green_box');pick('green_box')",
     'useless', 'already holding'),
])
def test_plans_the_models_wrote_are_judged_with_a_reason(profile, trace, plan, verdict,
                                                         why) -> None:
    judgement = _judge(profile, trace, plan)
    assert judgement.verdict == verdict, judgement
    assert why in judgement.reason


def test_scene_objects_and_grounding_read_the_task_line() -> None:
    assert scene_objects(TRACES.get(3).task) == ['cabinet_1']
    assert scene_objects(TRACES.get(11).task) == ['apple']        # "[apple:0.48 y:..."
    assert scene_objects('Scene: [] Task: [A] Find the cat.') == []
    assert scene_objects('Land now.') == []
    known = {'pen', 'holder', 'pencil', 'cat'}
    assert grounded('pen_holder', known) and grounded('near_pencil', known)
    assert grounded('cats', known)                                  # a plural of a known one
    assert not grounded('sink', known) and not grounded('near', known)


def test_the_arm_holds_one_thing_and_picks_where_it_went() -> None:
    def calls(plan: str):  # type: ignore[no-untyped-def]
        return plan_calls(INDY7, plan)
    assert arm_problem(calls("move_to('a');pick('a');move_to('b');place('a','b')")) == ''
    assert 'holds nothing' in arm_problem(calls("move_to('b');place('a','b')"))
    assert "while holding 'a'" in arm_problem(
        calls("move_to('a');pick('a');place('c','b')"))
    assert arm_problem(calls("move_to('a');pick('a');release();move_to('c');pick('c')")) == ''
    assert 'not at' in arm_problem(calls("move_to('a');pick('a');place('a','tray')"))
    assert arm_problem(calls("move_to('a');pick('a');move_to('b');place('a','near_b')")) == ''


def test_the_drone_flies_only_after_a_takeoff() -> None:
    def problem(plan: str) -> str:
        assert TELLO.flight is not None
        statements = [s for cut in segment_text(TELLO, plan, 'eos') for s in cut.statements]
        return flight_problem(statements, TELLO.flight)
    assert problem("mf(50);ld();l('down');d(1.0)") == ''
    assert problem('ld();to();2{mf(50)};ld()') == ''
    assert problem('ld();2{mf(50)}') == 'mf(50): the drone landed at ld() and has not taken off'
    assert problem("s('cat');?iv('cat')==True{ld()}") == (
        "?iv('cat')==True{ld()}: lands inside a loop or condition")
    judgement = _judge(TELLO, 1, "s('cat');g('cat');ld();mf(50)")
    assert judgement.verdict == 'useless' and 'has not taken off' in judgement.reason


def test_a_plan_that_did_not_run_is_useless_and_a_chat_answer_is_not_judged() -> None:
    trace = TRACES.get(3)
    assert judge_usefulness(TELLO, trace, 'ld();mf(50)', False, 'flies after landing') == (
        'useless', 'flies after landing')
    assert judge_usefulness(load_profile('chatbot'), TRACES.get(12), 'Hello!', True, '') == (
        '', '')
    verdicts = [PlanOutcome(1, 'tello', 'x', 'eos', 1, 0.1, 1, 0.0, True, True, True, '', v)
                for v in ('useful', 'partly', 'useless', 'useless', '')]
    overall = summarize(verdicts)['overall']
    assert (overall['useful'], overall['partly'], overall['useless']) == (1, 1, 2)


@pytest.mark.parametrize('name, tello, indy7', [('heldback', 12, 8), ('heldback2', 12, 8)])
def test_the_held_back_tasks_are_new_and_their_references_useful(name, tello, indy7) -> None:
    """Issue 27's held-back sets: Tello and Indy7 tasks kept out of every prompt (the second
    written after the profiles' example pools)."""
    from timelyllm_ros.language.traces import trace_set_path

    held = load_trace_set(trace_set_path(name))
    robots = [t.robot for t in held.traces]
    assert (robots.count('tello'), robots.count('indy7')) == (tello, indy7)
    others = [load_trace_set(trace_set_path(n)) for n in ('derived', 'heldback', 'heldback2')
              if n != name]
    assert not any(set(held.by_id) & set(other.by_id) for other in others)
    prompts = ' '.join(str(load_profile(kind).model_dump()) for kind in ('tello', 'indy7'))
    for trace in held.traces:
        task_line = trace.task.split('Task:')[1].split(']', 1)[1].strip()
        assert task_line not in prompts
        profile = load_profile(trace.robot)
        statements = [s for cut in segment_text(profile, trace.plan, 'eos')
                      for s in cut.statements]
        assert judge_plan(profile, trace.task, trace.plan, statements).verdict == 'useful'
    assert trace_set_path(name).is_file()
    assert str(trace_set_path('my/set.yaml')) == 'my/set.yaml'


def test_task_objects_are_the_scene_and_the_things_the_task_names() -> None:
    from timelyllm_ros.language.grounding import task_objects

    assert task_objects(TRACES.get(10).task)[:4] == ('pencil', 'pen', 'holder', 'pen_holder')
    assert task_objects(TRACES.get(8).task) == ('boy',)       # not the history's mf(50)
    assert task_objects('Scene: [] Task: [A] Turn left 90 degrees and fly forward 1.5 m.') == ()
    # every reference plan names only objects its task's grounded grammar allows
    for trace in TRACES.traces:
        if trace.robot in ('tello', 'indy7'):
            allowed = set(task_objects(trace.task))
            named = {n.split('_', 1)[1] if n.startswith(('near_', 'on_')) else n
                     for n in (str(c.args[a]) for c in plan_calls(load_profile(trace.robot),
                                                                   trace.plan)
                               for a in ('object', 'where') if a in c.args)}
            assert named <= allowed, (trace.id, named - allowed)


def test_a_measurement_the_task_asks_for_is_required() -> None:
    """Held-back task 108 asks how far the remote is: a picture instead is not useful."""
    from timelyllm_ros.language.traces import trace_set_path

    trace = load_trace_set(trace_set_path('heldback')).get(108)
    def judge(plan: str):  # type: ignore[no-untyped-def]
        statements = [s for cut in segment_text(TELLO, plan, 'eos') for s in cut.statements]
        return judge_plan(TELLO, trace.task, trace.plan, statements)
    assert judge("tc(10);?iv('remote_control')==True{tp()}").verdict == 'partly'
    assert judge("?iv('remote_control')==True{od('remote_control')}").verdict == 'useful'


def test_an_arm_plan_must_put_each_thing_where_its_task_wants_it() -> None:
    """SmolLM2 put the blue box on the yellow ball for 'Put the yellow ball on the blue box':
    the objects and skills of the reference, the placement reversed."""
    from timelyllm_ros.language.traces import trace_set_path

    arm = load_profile('indy7')
    trace = load_trace_set(trace_set_path('heldback')).get(115)
    def judge(plan: str):  # type: ignore[no-untyped-def]
        statements = [s for cut in segment_text(arm, plan, 'eos') for s in cut.statements]
        return judge_plan(arm, trace.task, trace.plan, statements)
    reversed_ = judge("move_to('blue_box');pick('blue_box');move_to('yellow_ball');"
                      "place('blue_box','yellow_ball')")
    assert reversed_.verdict == 'partly'
    assert "place('yellow_ball','blue_box')" in reversed_.reason
    assert judge("move_to('yellow_ball');pick('yellow_ball');move_to('blue_box');"
                 "place('yellow_ball','on_blue_box')").verdict == 'useful'
