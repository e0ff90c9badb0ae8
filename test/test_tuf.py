"""Time-utility functions (paper 000 Eq. 1, TUF₀/TUF₁): hand-computed values and validation."""

from __future__ import annotations

import math

import pytest

from timelyllm_ros.core.tuf import CHATBOT, NORMAL, URGENT, Tuf, tuf_for_class
from timelyllm_ros.errors import GoalError, TufError


@pytest.mark.parametrize(('t', 'expected'), [
    (0.0, 1.0),      # before ERT: beta
    (0.5, 1.0),
    (1.0, 1.0),      # at ERT (1 s)
    (1.25, 0.5),     # -2 * 0.25 + 1
    (1.5, 0.0),      # zero-utility time ERT - beta/alpha = 1 + 0.5
    (2.0, -1.0),     # beyond: negative, -2 * 1 + 1
])
def test_normal_eq1(t: float, expected: float) -> None:
    assert NORMAL.utility(t) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(('t', 'expected'), [
    (0.0, 2.0),
    (0.2, 2.0),                  # ERT
    (0.35, 1.0),                 # alpha = -2 / 0.3; -2/0.3 * 0.15 + 2 = 1
    (0.5, 0.0),                  # zero time
    (0.8, -2.0),                 # -2/0.3 * 0.6 + 2 = -2
])
def test_urgent_eq1(t: float, expected: float) -> None:
    assert URGENT.utility(t) == pytest.approx(expected, abs=1e-12)


def test_class_parameters() -> None:
    assert (NORMAL.beta, NORMAL.ert_s, NORMAL.alpha) == (1.0, 1.0, -2.0)
    assert NORMAL.zero_s == 1.5
    assert URGENT.beta == 2.0 and URGENT.ert_s == 0.2
    assert URGENT.alpha == pytest.approx(-2.0 / 0.3)
    assert URGENT.zero_s == pytest.approx(0.5)
    assert CHATBOT == NORMAL
    assert Tuf(1.0, 1.0, 0.0).zero_s == math.inf


@pytest.mark.parametrize(('tuf', 't', 'expected'), [
    (NORMAL, -1.0, 1.0),   # negative time counts as 0 -> beta
    (NORMAL, 0.0, 1.0),
    (NORMAL, 0.25, 0.5),   # ERT 0: -2 * 0.25 + 1
    (NORMAL, 0.5, 0.0),
    (NORMAL, 1.0, -1.0),
    (URGENT, 0.15, 1.0),   # -2/0.3 * 0.15 + 2
    (URGENT, 0.3, 0.0),
])
def test_utility_suspended(tuf: Tuf, t: float, expected: float) -> None:
    assert tuf.utility_suspended(t) == pytest.approx(expected, abs=1e-12)
    # TUF₁ = the same TUF with ERT 0 (for t >= 0).
    if t >= 0:
        assert tuf.suspended().utility(t) == pytest.approx(expected, abs=1e-12)


def test_suspended_keeps_alpha_beta() -> None:
    tuf1 = URGENT.suspended()
    assert (tuf1.beta, tuf1.ert_s, tuf1.alpha) == (URGENT.beta, 0.0, URGENT.alpha)
    assert tuf1.zero_s == pytest.approx(0.3)


def test_from_zero_time() -> None:
    tuf = Tuf.from_zero_time(beta=3.0, ert_s=1.0, zero_s=4.0)
    assert tuf == Tuf(beta=3.0, ert_s=1.0, alpha=-1.0)
    assert tuf.utility(4.0) == 0.0
    assert tuf.utility(2.5) == 1.5


@pytest.mark.parametrize(('beta', 'ert', 'alpha', 'field'), [
    (0.0, 1.0, -1.0, 'beta'),
    (-1.0, 1.0, -1.0, 'beta'),
    (1.0, -0.1, -1.0, 'ERT'),
    (1.0, 1.0, 0.5, 'alpha'),
    (math.nan, 1.0, -1.0, 'beta'),
    (1.0, math.nan, -1.0, 'ert_s'),
    (1.0, 1.0, math.nan, 'alpha'),
    (1.0, math.inf, -1.0, 'ert_s'),
])
def test_invalid_params(beta: float, ert: float, alpha: float, field: str) -> None:
    with pytest.raises(TufError, match=field):
        Tuf(beta=beta, ert_s=ert, alpha=alpha)


@pytest.mark.parametrize('zero', [1.0, 0.5])
def test_from_zero_time_rejects_zero_not_after_ert(zero: float) -> None:
    with pytest.raises(TufError, match='must be after ERT'):
        Tuf.from_zero_time(beta=1.0, ert_s=1.0, zero_s=zero)


def test_tuf_error_is_goal_error() -> None:
    assert issubclass(TufError, GoalError)


@pytest.mark.parametrize('name', ['normal', 'urgent', 'chatbot'])
def test_tuf_for_class_known(name: str) -> None:
    assert tuf_for_class(name) == {'normal': NORMAL, 'urgent': URGENT, 'chatbot': NORMAL}[name]


def test_tuf_for_class_unknown() -> None:
    with pytest.raises(TufError, match=r"unknown TUF class 'arm'; known: normal, urgent, chatbot"):
        tuf_for_class('arm')
