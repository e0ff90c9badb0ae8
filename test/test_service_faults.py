"""A small run of the campaign sections for issue 31's items 1, 3 and 4 (the full run:
``python3 benchmarks/service_faults.py``; item 2's KV pressure on the real CPU engine is
tested in test_engine_llamacpp.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmarks'))
from service_faults import clock_skew_cases, native_crash_cases, stop_cases  # noqa: E402


def test_every_way_a_native_child_dies_is_reported_with_its_cause() -> None:
    result = native_crash_cases(seed=0, cases=8, real_engine=False)
    assert result == {'cases': 8, 'native_crashes_unreported': 0}


def test_reports_from_robots_on_another_clock_are_refused_and_deadlines_hold() -> None:
    result = clock_skew_cases(seed=0, cases=60)
    assert result == {'cases': 60, 'skewed_reports_accepted': 0, 'skewed_deadlines_lost': 0}


def test_a_service_stopped_from_anywhere_ends_every_goal_and_refuses_new_ones() -> None:
    result = stop_cases(seed=0, cases=6)
    assert result == {'cases': 6, 'stop_goals_never_ended': 0, 'stop_goals_accepted_after': 0,
                      'stop_still_serving': 0}
