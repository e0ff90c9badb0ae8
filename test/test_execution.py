"""Execution-time estimate and simulated duration of segments, walked by the statement tree."""

from __future__ import annotations

import numpy as np
import pytest

from timelyllm_ros.language.execution import MeasuredTimes, estimate_min_s, simulate_s
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import SkillCall, Statement, segment_text

# tello models: takeoff 5 s, is_visible / log / take_picture 0.001 s, goto 2.5 s,
# move_forward 1.8144 + 0.0072 d (mf(50) = 2.1744 s), turn_cw 0.784 + 0.0165 deg (tc(90) = 2.269 s)
TO, IV, LOG, TP, GOTO, MF50, TC90 = 5.0, 0.001, 0.001, 0.001, 2.5, 2.1744, 2.269


TELLO = load_profile('tello')


def parse(profile: RobotProfile, plan: str) -> tuple[Statement, ...]:
    cuts = segment_text(profile, plan)
    assert not any(cut.rejected for cut in cuts), [cut.rejected for cut in cuts]
    return tuple(st for cut in cuts for st in cut.statements)


def simulated(plan: str, measured: MeasuredTimes | None = None) -> float:
    return simulate_s(TELLO, parse(TELLO, plan), np.random.default_rng(0), measured)


@pytest.mark.parametrize(('plan', 'minimum', 'simulation'), [
    ('to();mf(50)', TO + MF50, TO + MF50),
    # a loop counts the minimum of its body: a nested conditional its condition only
    ("4{tc(90);?iv('keys')==True{l('x')}}", 4 * (TC90 + IV), 4 * (TC90 + IV + LOG)),
    # a conditional counts its condition only; simulated, its body (a loop included) runs
    ("?iv('cat')==True{g('cat');2{mf(50)}}", IV, IV + GOTO + 2 * MF50),
    # nested loops multiply
    ('2{mf(50);3{tc(90)}}', 2 * (MF50 + 3 * TC90), 2 * (MF50 + 3 * TC90)),
    # a conditional nested in a conditional: still only the outer condition for the minimum
    ("3{?iv('a'){?iv('b')!=False{tp()};mf(50)}}", 3 * IV, 3 * (IV + IV + TP + MF50)),
    ("tp();2{?iv('a'){tc(90)}};mf(50)", TP + 2 * IV + MF50, TP + 2 * (IV + TC90) + MF50),
])
def test_minimum_estimate_and_simulation_follow_the_tree(plan, minimum, simulation):
    assert estimate_min_s(TELLO, parse(TELLO, plan)) == pytest.approx(minimum, abs=1e-9)
    assert simulated(plan) == pytest.approx(simulation, abs=1e-9)


def test_measured_durations_are_taken_in_execution_order():
    plan = "2{mf(50);?iv('x'){3{tc(90)}}}"
    measured = MeasuredTimes(TELLO, [('mf', 10.0), ('tc', 1.0), ('tc', 2.0), ('tc', 3.0),
                                     ('tc', 4.0), ('mf', 20.0), ('mf', 99.0)])
    # mf 10, iv model, tc 1 2 3; mf 20, iv model, tc 4 then the model twice (records ran out)
    expected = 10.0 + IV + 1.0 + 2.0 + 3.0 + 20.0 + IV + 4.0 + 2 * TC90
    assert simulated(plan, measured) == pytest.approx(expected, abs=1e-9)
    assert measured.take('move_forward') == 99.0 and measured.take('turn_cw') is None


def test_hand_built_statements_without_a_body_count_their_flat_calls():
    iv = SkillCall('is_visible', 'iv', {'object': 'cat'}, "iv('cat')")
    mf = SkillCall('move_forward', 'mf', {'distance': 50}, 'mf(50)')
    tc = SkillCall('turn_cw', 'tc', {'degrees': 90}, 'tc(90)')
    loop = Statement('3{mf(50);tc(90)}', (mf, tc), kind='loop', repeat=3)
    conditional = Statement("?iv('cat'){mf(50)}", (iv, mf), kind='conditional')
    skills = Statement('mf(50);tc(90)', (mf, tc))
    rng = np.random.default_rng(0)
    assert estimate_min_s(TELLO, [loop]) == pytest.approx(3 * (MF50 + TC90), abs=1e-9)
    assert simulate_s(TELLO, [loop], rng) == pytest.approx(3 * (MF50 + TC90), abs=1e-9)
    assert estimate_min_s(TELLO, [conditional]) == pytest.approx(IV, abs=1e-12)
    assert simulate_s(TELLO, [conditional], rng) == pytest.approx(IV + MF50, abs=1e-9)
    assert estimate_min_s(TELLO, [skills]) == pytest.approx(MF50 + TC90, abs=1e-9)
    assert simulate_s(TELLO, [skills], rng) == pytest.approx(MF50 + TC90, abs=1e-9)
    assert estimate_min_s(TELLO, []) == 0.0 == simulate_s(TELLO, [], rng)


def test_chatbot_text_takes_its_reading_time():
    chatbot = load_profile('chatbot')
    statements = parse(chatbot, 'One two three four. Five six. ')
    assert [st.kind for st in statements] == ['text', 'text']
    seconds = 6 * 60.0 / chatbot.words_per_minute    # 300 words per minute: 1.2 s
    assert estimate_min_s(chatbot, statements) == pytest.approx(seconds)
    assert simulate_s(chatbot, statements, np.random.default_rng(0)) == pytest.approx(seconds)
