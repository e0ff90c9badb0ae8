"""Priority math (Eq. 4 and the artifact's variant), the queue, decisions and the policy registry.

Hand computations use G = 0.09 s (drone segment generation time) and comm = 0.008 s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from utils import make_scheduler, make_spec

from timelyllm_ros.core.priority import artifact_priority, pud_priority, waiting_time
from timelyllm_ros.core.queue import GenerationQueue, QueueView
from timelyllm_ros.core.request import Generation, TaskStatus
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.core.tuf import NORMAL, URGENT
from timelyllm_ros.errors import PolicyError
from timelyllm_ros.policies import (
    PAPER_POLICIES,
    POLICIES,
    Policy,
    create_policy,
    resolve_policy_names,
)

G = 0.09
COMM = 0.008


def _arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=float)


def _pud(now: float, ref: float, tuf, suspended: bool = False,
         lost_order: str = 'least-loss') -> float:
    ert = 0.0 if suspended else tuf.ert_s
    return float(pud_priority(now, _arr(ref), _arr(ert), _arr(tuf.beta), _arr(tuf.alpha),
                              _arr(G), COMM, lost_order)[0])  # type: ignore[arg-type]


def _art(now: float, ref: float, tuf, suspended: bool = False) -> float:
    ert = 0.0 if suspended else tuf.ert_s
    return float(artifact_priority(now, _arr(ref), _arr(ert), _arr(tuf.beta), _arr(tuf.alpha),
                                   _arr(G), COMM)[0])


# -- PUD (Eq. 4) ----------------------------------------------------------------------------
def test_waiting_time() -> None:
    # W = max(0, t + G + comm - ref)
    assert waiting_time(1.0, _arr(0.5, 2.0), _arr(G, G), COMM).tolist() == pytest.approx(
        [0.598, 0.0])


def test_pud_urgent_initial_at_arrival() -> None:
    # W = G + comm = 0.098, U = 2 (before ERT 0.2), L = max(0.2 - 0.098, 0) + 0.09 = 0.192
    # Pri = 2 / (0.09 * 0.192) = 115.7407...
    assert _pud(0.0, 0.0, URGENT) == pytest.approx(2 / (0.09 * 0.192), rel=1e-12)
    assert _pud(0.0, 0.0, URGENT) == pytest.approx(115.74074074074073, rel=1e-12)


def test_pud_normal_initial_at_arrival() -> None:
    # W = 0.098, U = 1, L = (1 - 0.098) + 0.09 = 0.992, Pri = 1 / (0.09 * 0.992) = 11.2007...
    assert _pud(0.0, 0.0, NORMAL) == pytest.approx(1 / (0.09 * 0.992), rel=1e-12)


def test_pud_normal_initial_past_ert() -> None:
    # t = 1.0, arrival 0: W = 1.098, U = -2 * 0.098 + 1 = 0.804, L = max(1 - 1.098, 0) + 0.09
    # Pri = 0.804 / (0.09 * 0.09) = 99.259...
    assert _pud(1.0, 0.0, NORMAL) == pytest.approx(0.804 / 0.0081, rel=1e-9)


@pytest.mark.parametrize(('now', 'need', 'expected'), [
    # suspended (ERT 0) normal segment: W = max(0, t + 0.098 - need) = 0 -> U = 1
    (0.0, 2.0, 1 / (0.09 * (2.0 - 0.098 + 0.09))),     # L = 1.992 -> 5.5779
    (0.0, 0.5, 1 / (0.09 * (0.5 - 0.098 + 0.09))),     # L = 0.492 -> 22.584
    (1.0, 2.0, 1 / (0.09 * (1.0 - 0.098 + 0.09))),     # L = 0.992 -> 11.2007
    (1.902, 2.0, 1 / (0.09 * 0.09)),                   # L = G -> 123.457
])
def test_pud_suspended(now: float, need: float, expected: float) -> None:
    assert _pud(now, need, NORMAL, suspended=True) == pytest.approx(expected, rel=1e-9)


def test_pud_orderings() -> None:
    # urgent initial > normal initial at the same time
    assert _pud(0.0, 0.0, URGENT) > _pud(0.0, 0.0, NORMAL)
    # a suspended segment needed soon > one needed later
    assert _pud(0.0, 0.5, NORMAL, True) > _pud(0.0, 2.0, NORMAL, True)
    # priority rises as t approaches the need time
    values = [_pud(t, 2.0, NORMAL, True) for t in (0.0, 0.5, 1.0, 1.5, 1.9)]
    assert values == sorted(values) and len(set(values)) == len(values)


def test_pud_no_utility_left_ranks_last() -> None:
    # arrival 0, t = 1.5: W = 1.598, U = -2 * 0.598 + 1 = -0.196 -> ranked by U itself
    late = _pud(1.5, 0.0, NORMAL)
    assert late == pytest.approx(-0.196, rel=1e-9)
    # t = 1.402: W = 1.5 exactly the zero time -> U = 0 -> priority 0 (not U / (G L))
    assert _pud(1.402, 0.0, NORMAL) == pytest.approx(0.0, abs=1e-12)
    # even the least promising positive-utility generation ranks above
    positives = [_pud(0.0, 100.0, NORMAL, True), _pud(1.39, 0.0, NORMAL)]
    assert all(p > 0 > late for p in positives)
    # among late ones, 'least-loss': least loss first (urgent t = 0.5: W = 0.598,
    # U = -20/3*0.398 + 2 = -0.6533)
    urgent_late = _pud(0.5, 0.0, URGENT)
    assert urgent_late == pytest.approx(-2 / 0.3 * 0.398 + 2, rel=1e-9)
    assert late > urgent_late


def test_pud_lost_ones_by_loss_rate() -> None:
    """'loss-rate' (the default): lost generations by -alpha/G, steepest loss first (Smith's
    rule), then least loss first; below every generation that can earn utility, whose
    priorities do not change. A lost one's priority is -(its place), equal keys one place."""
    def queue(*rows):          # (now, ref, tuf, suspended) at one time
        now = rows[0][0]
        return pud_priority(now, _arr(*(r[1] for r in rows)),
                            _arr(*(0.0 if r[3] else r[2].ert_s for r in rows)),
                            _arr(*(r[2].beta for r in rows)), _arr(*(r[2].alpha for r in rows)),
                            _arr(*(G for _ in rows)), COMM).tolist()

    t = 1.5
    normal_late = (t, 0.0, NORMAL, False)          # U = -0.196, loses 2 / s
    normal_later = (t, -1.0, NORMAL, False)        # U = -2.196, loses 2 / s
    urgent_late = (t, 1.0, URGENT, False)          # U = -0.653, loses 20/3 / s
    earning = (t, 100.0, NORMAL, True)
    out = queue(normal_late, normal_later, urgent_late, earning, normal_late)
    # the urgent one first though it lost more, then the normal ones by their loss so far:
    # -(rank of the rate + loss / (1 + loss)); the two equal ones share a place (the earlier
    # queued goes first, by seq)
    place = [1 + (2 - 1) + 0.196 / 1.196, 2 + 2.196 / 3.196, 1 + 0.6533 / 1.6533]
    assert out[:3] == pytest.approx([-p for p in place], rel=1e-3)
    assert out[4] == out[0]
    assert out[2] > out[0] > out[1]
    assert out[3] == pytest.approx(_pud(*earning)) and out[3] > 0
    # 'least-loss' orders them by U alone
    least = pud_priority(t, _arr(0.0, -1.0, 1.0), _arr(1.0, 1.0, 0.2), _arr(1.0, 1.0, 2.0),
                         _arr(NORMAL.alpha, NORMAL.alpha, URGENT.alpha), _arr(G, G, G), COMM,
                         'least-loss')
    assert least.tolist() == pytest.approx([-0.196, -2.196, -2 / 0.3 * 0.398 + 2])
    # one class only: the same order as 'least-loss'
    same = queue(normal_late, normal_later, (t, -0.5, NORMAL, False))
    assert sorted(range(3), key=lambda i: -same[i]) == [0, 2, 1]


def test_timelyllm_policy_lost_order_is_a_checked_parameter() -> None:
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    assert create_policy('timelyllm').lost_order == 'loss-rate'  # type: ignore[attr-defined]
    assert TimelyLlmPolicy('least-loss').lost_order == 'least-loss'
    with pytest.raises(PolicyError, match='lost_order'):
        TimelyLlmPolicy('most-loss')  # type: ignore[arg-type]


def _stranded_example() -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                 np.ndarray, np.ndarray]:
    """The worked example below: (t, ref, ert, beta, alpha, g, first) of four segments."""
    return (1.5, _arr(0.0, 1.0, 1.4, 0.5), _arr(NORMAL.ert_s, URGENT.ert_s, NORMAL.ert_s, 0.0),
            _arr(NORMAL.beta, URGENT.beta, NORMAL.beta, NORMAL.beta),
            _arr(NORMAL.alpha, URGENT.alpha, NORMAL.alpha, NORMAL.alpha), _arr(G, G, G, G),
            _arr(1.0, 1.0, 1.0, 0.0))


def test_a_stranded_goal_goes_first_the_one_that_lost_most_first() -> None:
    """With ``stranded='first'`` a goal still waiting for its first segment with no utility
    left (its robot has no plan at all) goes before every other generation, earning ones
    included; among such goals the one that has lost most goes first. A lost resume segment
    stays below the earning ones, as do stranded goals with ``stranded='eq4'`` (the default).

    Worked example at t = 1.5 (G = 0.09, comm = 0.008): a normal goal that arrived at 0 has
    W = 1.598 and U = −2·(1.598 − 1) + 1 = −0.196; an urgent one that arrived at 1.0 has W =
    0.598, U = −(20/3)·(0.598 − 0.2) + 2 = −0.6533; an earning normal goal that arrived at 1.4
    (U = 1); and a normal resume segment needed at 0.5 (ERT 0: W = 1.098, U = −1.196)."""
    from timelyllm_ros.core.priority import STRANDED

    t, ref, ert, beta, alpha, g, first = _stranded_example()
    out = pud_priority(t, ref, ert, beta, alpha, g, COMM, 'loss-rate', first, 'first')
    assert out[:2].tolist() == pytest.approx(
        [STRANDED * (2 - 1 / 1.196), STRANDED * (2 - 1 / 1.6533)], rel=1e-4)
    assert out[1] > out[0] > out[2] > 0 > out[3]          # the urgent one has lost more
    eq4 = pud_priority(t, ref, ert, beta, alpha, g, COMM, 'loss-rate', first, 'eq4')
    assert eq4[2] > 0 > max(eq4[0], eq4[1], eq4[3])
    assert eq4.tolist() == pytest.approx(
        pud_priority(t, ref, ert, beta, alpha, g, COMM, 'loss-rate').tolist())
    assert out[2:].tolist() == pytest.approx(eq4[2:].tolist())
    from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

    with pytest.raises(PolicyError, match='stranded'):
        TimelyLlmPolicy(stranded='last')  # type: ignore[arg-type]
    assert create_policy('timelyllm').stranded == 'eq4'  # type: ignore[attr-defined]
    assert TimelyLlmPolicy(stranded='first').stranded == 'first'


def test_pud_vectorised_matches_scalar() -> None:
    ref, ert = _arr(0.0, 0.0, 2.0), _arr(0.2, 1.0, 0.0)
    beta, alpha = _arr(2.0, 1.0, 1.0), _arr(URGENT.alpha, -2.0, -2.0)
    out = pud_priority(0.0, ref, ert, beta, alpha, _arr(G, G, G), COMM)
    assert out.tolist() == pytest.approx([_pud(0.0, 0.0, URGENT), _pud(0.0, 0.0, NORMAL),
                                          _pud(0.0, 2.0, NORMAL, True)])
    # inputs untouched
    assert ref.tolist() == [0.0, 0.0, 2.0] and ert.tolist() == [0.2, 1.0, 0.0]


# -- the artifact's priority ----------------------------------------------------------------
@pytest.mark.parametrize(('now', 'ref', 'tuf', 'suspended', 'expected'), [
    # urgent initial at arrival: delta = 0.098 - 0.2 = -0.102 -> 2 * exp(-0.102)
    (0.0, 0.0, URGENT, False, 2 * math.exp(-0.102)),
    # normal initial at arrival: delta = 0.098 - 1 = -0.902 -> exp(-0.902)
    (0.0, 0.0, NORMAL, False, math.exp(-0.902)),
    # late normal: t = 1.5, delta = 0.598 -> -2 * 0.598 + 1 = -0.196
    (1.5, 0.0, NORMAL, False, -0.196),
    # suspended needed at 2: delta = 0.098 - 2 = -1.902 -> exp(-1.902)
    (0.0, 2.0, NORMAL, True, math.exp(-1.902)),
    # exactly on time: delta = 0 -> beta
    (0.902, 1.0, NORMAL, True, 1.0),
])
def test_artifact_priority(now: float, ref: float, tuf, suspended: bool,
                           expected: float) -> None:
    assert _art(now, ref, tuf, suspended) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_artifact_orderings() -> None:
    assert _art(0.0, 0.0, URGENT) > _art(0.0, 0.0, NORMAL)
    assert _art(0.0, 0.5, NORMAL, True) > _art(0.0, 2.0, NORMAL, True)


# -- the queue -------------------------------------------------------------------------------
def _generation(task_id: str, seq: int, arrival: float = 0.0, task_class: str = 'normal',
                k: int = 0, need: float | None = None) -> Generation:
    spec = make_spec(task_id=task_id, arrival=arrival, task_class=task_class)
    return Generation(spec=spec, seq=seq, k=k,
                      need_time=arrival if need is None else need,
                      status=TaskStatus.WAITING if k == 0 else TaskStatus.SUSPENDED)


def _check_consistent(queue: GenerationQueue, ids: set[str]) -> None:
    view = queue.view(COMM)
    assert len(queue) == len(view) == len(ids)
    assert {g.task_id for g in queue} == ids
    for row in range(len(queue)):
        g = queue.at(row)
        assert g.task_id in queue
        assert view.arrival[row] == g.spec.arrival_time
        assert view.seq[row] == g.seq
        assert view.ref_time[row] == g.need_time
        assert view.ert[row] == g.ert_s
        assert view.ert0[row] == g.spec.tuf.ert_s
        assert view.beta[row] == g.spec.tuf.beta
        assert view.alpha[row] == g.spec.tuf.alpha
        assert view.first[row] == (1.0 if g.k == 0 else 0.0)


def test_queue_push_remove_view() -> None:
    queue = GenerationQueue(capacity=2)     # grows while pushing
    gens = [_generation(f't{i}', i, arrival=0.1 * i, task_class='urgent' if i % 2 else 'normal',
                        k=i % 3, need=1.0 + i) for i in range(6)]
    for g in gens:
        queue.push(g, G)
    ids = {g.task_id for g in gens}
    _check_consistent(queue, ids)
    assert queue.view(COMM).g.tolist() == [G] * 6
    assert queue.view(COMM).comm_s == COMM
    for victim in ('t1', 't5', 't0'):       # middle, last, first
        assert queue.remove(victim).task_id == victim
        ids.discard(victim)
        assert victim not in queue
        _check_consistent(queue, ids)
    # [t0 t1 t2 t3 t4 t5] -remove t1-> [t0 t5 t2 t3 t4] -remove t5-> [t0 t4 t2 t3]
    # -remove t0-> [t3 t4 t2]
    assert [queue.at(r).task_id for r in range(len(queue))] == ['t3', 't4', 't2']
    queue.push(gens[1], G)
    ids.add('t1')
    _check_consistent(queue, ids)


def test_queue_errors() -> None:
    queue = GenerationQueue()
    g = _generation('a', 0)
    queue.push(g, G)
    with pytest.raises(ValueError, match='already queued'):
        queue.push(g, G)
    with pytest.raises(KeyError):
        queue.remove('nope')
    queue.remove('a')
    assert len(queue) == 0 and len(queue.view(COMM)) == 0


# -- baselines on initial and suspended rows -------------------------------------------------
def _two_row_view() -> tuple[QueueView, list[str]]:
    queue = GenerationQueue()
    # normal request from t = 0, now suspended (k = 1) and needed at 5 s
    queue.push(_generation('normal-susp', 0, arrival=0.0, k=1, need=5.0), G)
    # urgent request arriving at 0.5, initial
    queue.push(_generation('urgent-init', 1, arrival=0.5, task_class='urgent'), G)
    return queue.view(COMM), ['normal-susp', 'urgent-init']


def test_seg_fcfs_ranks_by_arrival() -> None:
    view, _ = _two_row_view()
    pri = create_policy('seg-fcfs').priorities(view, 1.0)
    assert pri.tolist() == [-0.0, -0.5]


def test_seg_edf_ranks_by_request_deadline() -> None:
    view, _ = _two_row_view()
    pri = create_policy('seg-edf').priorities(view, 1.0)
    # suspended normal keeps its request deadline 0 + 1 (not need time + 0); urgent 0.5 + 0.2
    assert pri.tolist() == pytest.approx([-1.0, -0.7])
    assert np.argmax(pri) == 1


@pytest.mark.parametrize('name', ['vllm', 'vllm-stream'])
def test_vllm_ranks_by_arrival(name: str) -> None:
    view, _ = _two_row_view()
    assert create_policy(name).priorities(view, 1.0).tolist() == [-0.0, -0.5]


def test_timelyllm_policy_uses_pud() -> None:
    view, _ = _two_row_view()
    now = 0.5
    pri = create_policy('timelyllm').priorities(view, now)
    # suspended normal needed at 5: L = 5 - 0.598 + 0.09 = 4.492 -> 1 / (0.09 * 4.492)
    # urgent initial at its arrival: 2 / (0.09 * 0.192)
    assert pri.tolist() == pytest.approx([1 / (0.09 * 4.492), 2 / (0.09 * 0.192)])
    art = create_policy('timelyllm-artifact').priorities(view, now)
    assert art.tolist() == pytest.approx([math.exp(0.598 - 5.0), 2 * math.exp(-0.102)])


# -- the scheduler's decision ----------------------------------------------------------------
def test_decide_admits_in_priority_order_ties_by_submission() -> None:
    scheduler, clock, _ = make_scheduler('seg-fcfs')
    clock.advance_to(1.0)
    for task_id, arrival in (('late', 0.9), ('x', 0.2), ('y', 0.2), ('early', 0.1), ('z', 0.2)):
        scheduler.submit(make_spec(task_id=task_id, arrival=arrival))
    admitted = scheduler.decide()
    assert [g.task_id for g in admitted] == ['early', 'x', 'y', 'z', 'late']
    assert all(g.status == TaskStatus.RUNNING for g in admitted)
    assert len(scheduler.queue) == 0


def test_decide_respects_batch_cap() -> None:
    scheduler, _, engine = make_scheduler('seg-fcfs', config=SchedulerConfig(max_batch=2))
    for i in range(4):
        scheduler.submit(make_spec(task_id=f't{i}', arrival=0.0))
    assert [g.task_id for g in scheduler.decide()] == ['t0', 't1']
    assert engine.running == ('t0', 't1')
    assert scheduler.decide() == []
    assert {g.task_id for g in scheduler.queue} == {'t2', 't3'}


def test_decide_timelyllm_urgent_first() -> None:
    scheduler, _, _ = make_scheduler('timelyllm')
    scheduler.submit(make_spec(task_id='n', task_class='normal'))
    scheduler.submit(make_spec(task_id='u', task_class='urgent'))
    admitted = scheduler.decide()
    assert admitted[0].task_id == 'u'


# -- the registry ----------------------------------------------------------------------------
class MyPolicy(Policy):
    """A tiny external policy: last come first served."""

    name = 'lcfs'

    def priorities(self, queue: QueueView, now: float) -> np.ndarray:
        return queue.arrival


class NotAPolicy:
    pass


@pytest.mark.parametrize('name', sorted(POLICIES))
def test_create_every_policy(name: str) -> None:
    policy = create_policy(name)
    assert isinstance(policy, POLICIES[name]) and policy.name == name


def test_policy_flags() -> None:
    flags = {n: (create_policy(n).segmented, create_policy(n).streaming) for n in POLICIES}
    expected = {'vllm': (False, False), 'vllm-stream': (False, True),
                'seg-fcfs': (True, True), 'seg-edf': (True, True),
                'timelyllm': (True, True), 'timelyllm-artifact': (True, True),
                'semantic': (True, True), 'autellix-plas': (True, True),
                'autellix-atlas': (True, True)}
    assert {n: flags[n] for n in expected} == expected   # rivals added later check their own


def test_unknown_policy_lists_names() -> None:
    with pytest.raises(PolicyError) as info:
        create_policy('fifo')
    message = str(info.value)
    assert "unknown policy 'fifo'" in message
    for name in POLICIES:
        assert name in message


def test_external_policy() -> None:
    policy = create_policy(f'{__name__}:MyPolicy')
    assert isinstance(policy, MyPolicy)
    scheduler, _, _ = make_scheduler(f'{__name__}:MyPolicy')
    scheduler.submit(make_spec(task_id='old', arrival=0.0))
    scheduler.submit(make_spec(task_id='new', arrival=0.5))
    assert [g.task_id for g in scheduler.decide()][0] == 'new'


@pytest.mark.parametrize(('spec', 'match'), [
    (f'{__name__}:NotAPolicy', 'is not a Policy subclass'),
    (f'{__name__}:Missing', 'cannot load policy'),
    ('no_such_module_xyz:Thing', 'cannot load policy'),
    (f'{__name__}:Policy', None),   # abstract: not instantiable, handled below
])
def test_external_policy_errors(spec: str, match: str | None) -> None:
    if match is None:
        with pytest.raises(TypeError):
            create_policy(spec)
        return
    with pytest.raises(PolicyError, match=match):
        create_policy(spec)


def test_resolve_policy_names() -> None:
    assert resolve_policy_names('all') == list(POLICIES)
    assert {'semantic', 'autellix-plas', 'autellix-atlas'} < set(POLICIES)
    assert len(POLICIES) >= 9
    assert resolve_policy_names('paper') == list(PAPER_POLICIES) == [
        'vllm', 'vllm-stream', 'seg-fcfs', 'seg-edf', 'timelyllm']
    assert resolve_policy_names(' vllm , timelyllm ') == ['vllm', 'timelyllm']
    assert resolve_policy_names(f'seg-edf,{__name__}:MyPolicy') == [
        'seg-edf', f'{__name__}:MyPolicy']


@pytest.mark.parametrize(('spec', 'match'), [
    ('', 'no policy given'),
    (' , ', 'no policy given'),
    ('vllm,bogus', "unknown policy 'bogus'"),
])
def test_resolve_policy_names_errors(spec: str, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        resolve_policy_names(spec)


def test_stranded_goals_are_the_lost_first_segments_most_loss_first() -> None:
    """The same example: the stranded goals (``timelyllm-share`` promotes them) are rows 1
    then 0, the urgent one having lost more; the lost resume (row 3) is not stranded. Equal
    losses: the earlier queued first."""
    from timelyllm_ros.core.priority import stranded_by_loss, utility_if_started

    t, ref, ert, beta, alpha, g, first = _stranded_example()
    utility = utility_if_started(t, ref, ert, beta, alpha, g, COMM)
    rows = stranded_by_loss(utility, first, _arr(0, 1, 2, 3))
    assert rows.tolist() == [1, 0]
    same = stranded_by_loss(utility_if_started(t, ref[:1].repeat(2), ert[:1].repeat(2),
                                               beta[:1].repeat(2), alpha[:1].repeat(2), g[:2],
                                               COMM), first[:2], _arr(7, 3))
    assert same.tolist() == [1, 0]


def test_stranded_goals_by_loss_rate_go_steepest_first_then_most_lost() -> None:
    """With each row's α/G, the stranded goals go by the steepest loss rate first, and among
    equal rates the one that has lost most first. Worked example (utility if started now):
    normal goals that lost 1.2 and 0.1 (rate 2/G), urgent goals that lost 0.2 and 0.5 (rate
    (20/3)/G), a lost resume (not stranded) and an earning goal: urgent 0.5, urgent 0.2,
    normal 1.2, normal 0.1, where the loss alone gives normal 1.2, urgent 0.5, urgent 0.2,
    normal 0.1. A loss too large to tell from the next keeps its rate's rank."""
    from timelyllm_ros.core.priority import stranded_by_loss

    utility = _arr(-1.2, -0.2, -0.1, -0.5, -3.0, 0.4)
    alpha = _arr(NORMAL.alpha, URGENT.alpha, NORMAL.alpha, URGENT.alpha, NORMAL.alpha,
                 NORMAL.alpha)
    first = _arr(1.0, 1.0, 1.0, 1.0, 0.0, 1.0)
    seq = _arr(0, 1, 2, 3, 4, 5)
    rates = alpha / G
    assert stranded_by_loss(utility, first, seq, alpha_per_g=rates).tolist() == [3, 1, 0, 2]
    assert stranded_by_loss(utility, first, seq).tolist() == [0, 3, 1, 2]
    assert stranded_by_loss(utility, first, seq, limit=2,
                            alpha_per_g=rates).tolist() == [3, 1]
    huge = stranded_by_loss(_arr(-1e300, -1e-3), _arr(1.0, 1.0), _arr(0, 1),
                            alpha_per_g=_arr(NORMAL.alpha, URGENT.alpha) / G)
    assert huge.tolist() == [1, 0]


def test_rate_ranks_are_the_ranks_among_the_distinct_rates() -> None:
    """A rank is one plus the count of distinct rates below it, whether found by a pass a
    rate (a few distinct rates, as a fleet's TUF classes give) or by the sort (many, or a
    NaN): the same as ranking against ``np.unique``."""
    from timelyllm_ros.core.priority import _FEW_RATES, _rate_ranks

    def reference(rates: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.unique(rates), rates).astype(float) + 1.0

    rng = np.random.default_rng(3)
    for distinct in (1, 2, 3, _FEW_RATES, _FEW_RATES + 1, 40):
        values = -rng.uniform(0.1, 5.0, distinct)
        rates = rng.choice(values, size=500)
        assert np.array_equal(_rate_ranks(rates), reference(rates))
    assert _rate_ranks(np.empty(0)).tolist() == []
    with_nan = np.array([-2.0, np.nan, -1.0, -2.0])
    assert np.array_equal(_rate_ranks(with_nan), reference(with_nan))


def test_stranded_by_loss_with_a_limit_is_the_head_of_the_full_order() -> None:
    """``limit`` gives the first ``limit`` rows of the full order (and any tied with the
    last), by loss or by rate then loss, so the policy, which reads at most a batch cap of
    them, sees the same rows in the same order; equal keys still go to the earlier queued."""
    from timelyllm_ros.core.priority import stranded_by_loss

    rng = np.random.default_rng(5)
    n = 400
    utility = np.round(rng.uniform(-3.0, 1.0, n), 1)     # rounded: many equal losses
    first = (rng.uniform(size=n) < 0.7).astype(float)
    seq = rng.permutation(n).astype(float)
    rates = rng.choice([-2.0, -20.0 / 3.0], size=n) / 0.09
    for alpha_per_g in (None, rates):
        full = stranded_by_loss(utility, first, seq, alpha_per_g=alpha_per_g)
        for limit in (1, 7, 64, len(full) - 1, len(full), len(full) + 5):
            head = stranded_by_loss(utility, first, seq, limit=limit, alpha_per_g=alpha_per_g)
            assert len(head) >= min(limit, len(full))
            assert head.tolist() == full[:len(head)].tolist()
    # by rate: the full order is the sort by (steepest rate, most lost, earlier queued)
    stranded = np.flatnonzero((first > 0.0) & (utility <= 0.0))
    expected = stranded[np.lexsort((seq[stranded], utility[stranded], rates[stranded]))]
    assert full.tolist() == expected.tolist()


def test_interleave_follows_its_rule_on_large_queues() -> None:
    """The rule of :func:`interleave`, by brute force: the others sorted by priority then seq,
    the i-th promoted row at place i/share and the j-th other at j/(1 − share), a promoted
    row first at equal places; the rows from the last promoted one on keep their priorities,
    below the interleaved head. Many equal priorities, so the seq tie-break is at work."""
    from timelyllm_ros.core.priority import interleave

    rng = np.random.default_rng(11)
    for n, m, share in ((10, 3, 0.5), (300, 40, 0.5), (300, 40, 0.25), (300, 250, 0.75),
                        (50, 49, 0.5), (2000, 256, 0.5)):
        priority = np.round(rng.normal(size=n), 1)
        seq = rng.permutation(n).astype(float)
        promoted = rng.choice(n, size=m, replace=False)
        chosen = set(promoted.tolist())
        others = sorted((r for r in range(n) if r not in chosen),
                        key=lambda r: (-priority[r], seq[r]))
        places = sorted([(i / share, 0, int(r)) for i, r in enumerate(promoted, 1)]
                        + [(j / (1.0 - share), 1, r) for j, r in enumerate(others, 1)])
        last = m / share
        head = [r for place, promoted_first, r in places if place <= last]
        if places[len(head) - 1][1] == 1 and places[len(head) - 1][0] == last:
            head.pop()                  # an other at the last promoted place comes after it
        ranked = interleave(priority, seq, promoted, share)
        tail = np.setdiff1d(np.arange(n), head)
        assert np.all(np.diff(ranked[head]) < 0)                      # the head, in order
        assert np.array_equal(ranked[tail], priority[tail])           # the rest as they were
        assert ranked[head].min() > priority.max()
