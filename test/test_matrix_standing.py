"""Where a policy stands in the benchmark matrix against the best other policy (issue 28)."""

from __future__ import annotations

import pytest

from timelyllm_ros.errors import PolicyError
from timelyllm_ros.evaluation.matrix import FIGURES, matrix_table, standing, verdict


def _spread(mean: float | None, sd: float | None = 0.0) -> dict[str, object]:
    return {'mean': mean, 'sd': sd if mean is not None else None, 'values': []}


def _cell(**figures: tuple[float | None, float]) -> dict[str, dict[str, object]]:
    """A policy's figures in one cell: the named ones as given, every other one 1.0 ± 0."""
    cell = {name: _spread(1.0) for name, _, _ in FIGURES}
    for key, (mean, sd) in figures.items():
        cell[key.replace('_', ' ')] = _spread(mean, sd)
    return cell


def test_verdict_reads_the_targets_of_issue_28():
    # higher is better: ahead at the best mean, level while the spreads overlap
    assert verdict(0.50, 0.0, 0.50, 0.0, 'utility') == 'ahead'
    assert verdict(0.45, 0.03, 0.50, 0.02, 'utility') == 'level'      # 0.48 >= 0.48
    assert verdict(0.45, 0.02, 0.50, 0.02, 'utility') == 'behind'     # 0.47 <  0.48
    # a response time: level within 10 % of the best, whatever the spreads
    assert verdict(0.125, 0.0, 0.126, 0.0, 'mean response s') == 'ahead'
    assert verdict(0.138, 0.0, 0.126, 0.0, 'mean response s') == 'level'   # 9.5 % behind
    assert verdict(0.140, 0.5, 0.126, 0.5, 'mean response s') == 'behind'  # 11 % behind
    assert verdict(0.140, 0.0, 0.126, 0.0, 'p95 response s', response_margin=0.2) == 'level'


def test_standing_names_the_best_other_policy_of_each_figure():
    """A worked cell: share against vllm and slice, each figure against its own best."""
    matrix = {
        'policies': ['vllm', 'timelyllm-share', 'slice'],
        'cells': {'wid2': {'contended': {
            'vllm': _cell(urgent_utility=(-6.0, 1.0), urgent_floored=(0.0, 0.0),
                          mean_response_s=(0.90, 0.1)),
            'timelyllm-share': _cell(urgent_utility=(-4.8, 1.6), urgent_floored=(0.12, 0.03),
                                     mean_response_s=(2.17, 0.3)),
            'slice': _cell(urgent_utility=(-3.5, 1.2), urgent_floored=(0.24, 0.04),
                           mean_response_s=(2.78, 0.5)),
        }}},
    }
    judged = standing(matrix, 'timelyllm-share')
    cell = judged['cells']['wid2']['contended']
    # −4.8 + 1.6 = −3.2 reaches −3.5 − 1.2 = −4.7: level with slice, the best there
    assert cell['urgent utility'] == {'verdict': 'level', 'best': 'slice', 'best_mean': -3.5,
                                      'best_sd': 1.2}
    # 0.12 + 0.03 < 0.24 − 0.04: behind slice
    assert cell['urgent floored']['verdict'] == 'behind'
    # the best response is vllm's 0.90 s, not slice's: 2.17 s is far behind it
    assert cell['mean response s']['best'] == 'vllm'
    assert cell['mean response s']['verdict'] == 'behind'
    assert cell['completion']['verdict'] == 'ahead'          # 1.0 against 1.0
    assert judged['behind'] == ['wid2 contended urgent floored',
                                'wid2 contended mean response s']
    table = matrix_table({**matrix, 'seeds': [0], 'robot_jitter': 0.1, 'standing': judged})
    assert 'Where timelyllm-share stands' in table and 'behind in 2 of 8 figures' in table
    assert '| wid2 | contended | level · slice | **behind** · slice 0.240 |' in table


def test_a_figure_nobody_else_has_is_left_out():
    """TimeBill killing every goal has no response time: the response is judged against
    the others; a figure only the judged policy lacks is not judged."""
    matrix = {
        'policies': ['timebill', 'timelyllm-share'],
        'cells': {'authors-arm': {'contended': {
            'timebill': _cell(mean_response_s=(None, 0.0), p95_response_s=(None, 0.0)),
            'timelyllm-share': _cell(SLO=(None, 0.0)),
        }}},
    }
    cell = standing(matrix, 'timelyllm-share')['cells']['authors-arm']['contended']
    assert 'mean response s' not in cell and 'p95 response s' not in cell and 'SLO' not in cell
    assert cell['utility']['best'] == 'timebill'


def test_a_response_time_is_judged_against_policies_that_completed_as_many_goals():
    """TimeBill kills the goals it would serve late: its mean response is over the 8 % it
    kept, so share's is judged against the best of those that completed as many (slice),
    and the entry names the faster one that completed fewer."""
    matrix = {
        'policies': ['timebill', 'slice', 'timelyllm-share'],
        'cells': {'wid2': {'contended': {
            'timebill': _cell(completion=(0.08, 0.02), mean_response_s=(0.85, 0.08),
                              p95_response_s=(1.25, 0.07)),
            'slice': _cell(mean_response_s=(2.78, 0.5), p95_response_s=(3.0, 0.4)),
            'timelyllm-share': _cell(mean_response_s=(1.97, 0.19), p95_response_s=(4.16, 1.1)),
        }}},
    }
    judged = standing(matrix, 'timelyllm-share')
    cell = judged['cells']['wid2']['contended']
    assert cell['mean response s'] == {
        'verdict': 'ahead', 'best': 'slice', 'best_mean': 2.78, 'best_sd': 0.5,
        'fewer_goals': {'policy': 'timebill', 'mean': 0.85, 'completion': 0.08,
                        'verdict': 'behind'}}
    assert cell['p95 response s']['best'] == 'slice'             # 4.16 > 1.1 × 3.0
    assert cell['p95 response s']['verdict'] == 'behind'
    assert cell['completion']['verdict'] == 'ahead'
    assert cell['utility']['best'] == 'timebill'   # other figures: everyone (equal: the first)
    assert judged['behind'] == ['wid2 contended p95 response s']
    assert judged['behind_counting_fewer_goals'] == ['wid2 contended mean response s',
                                                     'wid2 contended p95 response s']
    table = matrix_table({**matrix, 'seeds': [0], 'robot_jitter': 0.1, 'standing': judged})
    assert 'behind in 1 of 8 figures' in table and '2 counting the response times' in table
    assert '| ahead (timebill 0.850 over 8% of goals) |' in table


def test_completion_within_the_spread_counts_as_as_many_goals():
    """A completion rate behind only within the seeds' spread is not fewer goals; where
    every other policy completed fewer, the judged one is ahead on response time."""
    as_many = {
        'policies': ['timebill', 'timelyllm-share'],
        'cells': {'wid1': {'paper': {
            'timebill': _cell(completion=(0.98, 0.02), mean_response_s=(0.20, 0.01)),
            'timelyllm-share': _cell(mean_response_s=(0.27, 0.01)),
        }}},
    }
    cell = standing(as_many, 'timelyllm-share')['cells']['wid1']['paper']
    assert cell['mean response s']['verdict'] == 'behind'
    assert cell['mean response s']['best'] == 'timebill' and 'fewer_goals' not in cell[
        'mean response s']
    fewer = {**as_many, 'cells': {'wid1': {'paper': {
        **as_many['cells']['wid1']['paper'],
        'timebill': _cell(completion=(0.95, 0.01), mean_response_s=(0.20, 0.01))}}}}
    judged = standing(fewer, 'timelyllm-share')
    entry = judged['cells']['wid1']['paper']['mean response s']
    assert entry['verdict'] == 'ahead' and entry['best'] is None
    assert entry['fewer_goals']['policy'] == 'timebill'
    assert judged['behind'] == [] and judged['behind_counting_fewer_goals'] == [
        'wid1 paper mean response s']


@pytest.mark.parametrize('policies', [['vllm'], ['vllm', 'slice']])
def test_standing_needs_the_policy_and_another(policies):
    matrix = {'policies': policies, 'cells': {}}
    with pytest.raises(PolicyError, match="'timelyllm' must be one of at least two"):
        standing(matrix, 'timelyllm')
