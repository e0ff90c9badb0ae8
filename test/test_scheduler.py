"""The scheduler loop end to end on the simulated engine and a virtual clock."""

from __future__ import annotations

import numpy as np
import pytest
from utils import make_scheduler, make_spec, tiny_calibration

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.events import Dispatch
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import NO_SKILL_ERROR, Scheduler, SchedulerConfig
from timelyllm_ros.core.tuf import Tuf
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import EngineError, GoalError, TufError
from timelyllm_ros.policies.timelyllm import TimelyLlmPolicy

CAL = load_calibration()
COMM = 0.008
MF50 = 1.8144 + 0.0072 * 50        # 2.1744 s
TC90 = 0.784 + 0.0165 * 90         # 2.269 s


def _decode(context: int) -> float:
    return CAL.decode_s(1, context)


def _run(scheduler: Scheduler, max_ticks: int = 200) -> list[tuple[int, Dispatch]]:
    """Tick until nothing is queued or generating; return (tick, dispatch) pairs."""
    dispatches = []
    for i in range(max_ticks):
        if not scheduler.has_work:
            return dispatches
        dispatches.extend((i, d) for d in scheduler.tick().dispatches)
    raise AssertionError('scheduler did not drain')


def test_timelyllm_single_task_segments() -> None:
    """The paper's mechanism (``suspend_on_next_statement`` off): suspended at each cut, and
    resumed once more after the last segment to find the plan's end."""
    scheduler, clock, engine = make_scheduler(
        'timelyllm', SchedulerConfig(suspend_on_next_statement=False))
    generation = scheduler.submit(make_spec(plan='mf(50);tc(90)'))
    assert generation.status == TaskStatus.WAITING and 't0' in scheduler.queue
    # pieces: 'mf' '(' '50' ');' 'tc' '(' '90' ')'; prefill emits 'mf', the 4th piece cuts
    outs = [scheduler.tick() for _ in range(4)]
    assert [len(o.dispatches) for o in outs] == [0, 0, 0, 1]
    cut0 = CAL.prefill_s(1331) + _decode(1332) + _decode(1333) + _decode(1334)
    assert clock.now() == pytest.approx(cut0)
    first = outs[3].dispatches[0]
    assert (first.task_id, first.robot_id) == ('t0', 'tello-t0')
    seg0 = first.segment
    assert (seg0.index, seg0.text, seg0.tokens, seg0.is_last) == (0, 'mf(50)', 4, False)
    assert [c.skill for c in seg0.calls] == ['move_forward']
    assert seg0.calls[0].args == {'distance': 50}
    assert seg0.cut_time == seg0.dispatch_time == pytest.approx(cut0)
    assert seg0.estimated_exec_s == pytest.approx(MF50)
    # suspended after the cut: queued, KV kept on the GPU, need time = cut + comm + estimate
    assert generation.status == TaskStatus.SUSPENDED and generation.suspensions == 1
    assert 't0' in scheduler.queue and engine.running == ()
    assert engine.kv.location('t0') == 'gpu'
    assert generation.k == 1
    assert generation.need_time == pytest.approx(cut0 + COMM + MF50)
    # resumed without a prefill
    resumed = scheduler.tick()
    assert generation.status == TaskStatus.RUNNING and 't0' not in scheduler.queue
    assert resumed.duration_s == _decode(1335)
    rest = _run(scheduler)
    assert len(rest) == 1
    seg1 = rest[0][1].segment
    assert (seg1.index, seg1.text) == (1, ';tc(90)')
    assert [c.skill for c in seg1.calls] == ['turn_cw'] and seg1.calls[0].args == {'degrees': 90}
    assert seg1.estimated_exec_s == pytest.approx(TC90)
    # the robot is still busy with segment 0: segment 1 is needed after it
    assert generation.need_time == pytest.approx(cut0 + COMM + MF50 + TC90)
    assert generation.status == TaskStatus.GENERATED and generation.finish_reason == 'eos'
    assert generation.suspensions == 2 and [s.is_last for s in generation.segments] == [
        False, True]
    with pytest.raises(EngineError):              # generation ended: engine memory released
        engine.pause('t0')
    # robot reports (each once it happened): FINISHED at the last segment's end
    clock.advance_to(3.0)
    scheduler.report_segment('t0', 0, 1.0, 3.0)
    assert generation.status == TaskStatus.GENERATED
    clock.advance_to(5.5)
    scheduler.report_segment('t0', 1, 3.0, 5.5)
    assert generation.status == TaskStatus.FINISHED and generation.done_time == 5.5


def test_a_cut_generation_leaves_the_batch_once_its_next_statement_begins() -> None:
    """By default a cut generation decodes on through the separators after its segment and is
    suspended with the first token of its next statement; after the last segment the plan's
    end comes in the same way, without a resume. The segments, and the hooks the policy
    hears (each cut at the cut, each suspension when it happens, then the end), are the
    paper mechanism's."""
    events: list[tuple[str, int, str]] = []

    class Recording(TimelyLlmPolicy):
        def on_cut(self, generation, now):  # type: ignore[no-untyped-def]
            events.append(('cut', generation.k, generation.status.name))
            super().on_cut(generation, now)

        def on_suspend(self, generation, now):  # type: ignore[no-untyped-def]
            events.append(('suspend', generation.k, generation.status.name))

        def on_end(self, generation, now):  # type: ignore[no-untyped-def]
            events.append(('end', generation.k, generation.status.name))
            super().on_end(generation, now)

    clock = SimClock()
    engine = SimulatedEngine()
    scheduler = Scheduler(Recording(), engine, clock)
    generation = scheduler.submit(make_spec(plan='mf(50);tc(90)'))
    # pieces: 'mf' '(' '50' ');' 'tc' '(' '90' ')'; the 4th cuts segment 0 after its separator
    outs = [scheduler.tick() for _ in range(4)]
    assert [len(o.dispatches) for o in outs] == [0, 0, 0, 1]
    seg0 = outs[3].dispatches[0].segment
    assert (seg0.index, seg0.text, seg0.tokens) == (0, 'mf(50)', 4)
    assert events == [('cut', 1, 'RUNNING')]
    # still in the batch, KV running: the next statement has not begun
    assert generation.status == TaskStatus.RUNNING and generation.suspensions == 0
    assert 't0' not in scheduler.queue and engine.running == ('t0',)
    scheduler.tick()                                   # 'tc': the next statement began
    assert generation.status == TaskStatus.SUSPENDED and generation.suspensions == 1
    assert 't0' in scheduler.queue and engine.running == ()
    assert engine.kv.location('t0') == 'gpu' and generation.segment_tokens == 1
    assert events[1:] == [('suspend', 1, 'SUSPENDED')]
    here_admissions, rest = 1, []
    while scheduler.has_work:
        out = scheduler.tick()
        here_admissions += len(out.decision.admitted)
        rest.extend(out.dispatches)
    seg1 = rest[0].segment
    assert (seg1.index, seg1.text, seg1.tokens) == (1, ';tc(90)', 4)
    assert [c.skill for c in seg1.calls] == ['turn_cw']
    # the plan ended right after its last segment: no second suspension, no resume for it
    assert generation.status == TaskStatus.GENERATED and generation.finish_reason == 'eos'
    assert generation.suspensions == 1
    assert [s.is_last for s in generation.segments] == [False, True]
    assert events[2:] == [('cut', 2, 'RUNNING'), ('end', 2, 'GENERATED')]
    # the same segments as the paper's mechanism, with one admission fewer (its last resume)
    at_cut, _, _ = make_scheduler('timelyllm', SchedulerConfig(suspend_on_next_statement=False))
    paper = at_cut.submit(make_spec(plan='mf(50);tc(90)'))
    admissions = 0
    while at_cut.has_work:
        admissions += len(at_cut.tick().decision.admitted)
    assert [(s.text, s.statements) for s in paper.segments] == [
        (s.text, s.statements) for s in generation.segments]
    assert paper.suspensions == 2 and admissions == 3
    assert here_admissions == 2                                 # here: a start and one resume


def test_a_cut_generation_the_policy_does_not_let_decode_is_suspended() -> None:
    """A generation between statements that the policy's decode mask leaves out is suspended
    after that iteration, not kept in the batch without decoding; one the engine did not
    decode otherwise (a prefill-only iteration) stays."""

    class Masking(TimelyLlmPolicy):
        mask: frozenset[str] | None = None

        def decode_mask(self, ctx):  # type: ignore[no-untyped-def]
            return self.mask

    policy = Masking()
    scheduler = Scheduler(policy, SimulatedEngine(), SimClock())
    # pieces: 'mf' '(' '50' ');' '\n' 'tc' '(' '90' ')': a newline between the statements
    generation = scheduler.submit(make_spec(plan='mf(50);\ntc(90)'))
    for _ in range(5):
        scheduler.tick()
    assert generation.status == TaskStatus.RUNNING and len(generation.segments) == 1
    assert generation.segment_tokens == 1                # the newline: still between statements
    policy.mask = frozenset({'another goal'})
    scheduler.tick()
    assert generation.status == TaskStatus.SUSPENDED and generation.suspensions == 1
    policy.mask = None
    _run(scheduler)
    assert generation.status == TaskStatus.GENERATED and generation.suspensions == 1
    assert [s.text for s in generation.segments] == ['mf(50)', ';\ntc(90)']


def test_vllm_one_segment_at_eos() -> None:
    scheduler, clock, _ = make_scheduler('vllm')
    generation = scheduler.submit(make_spec(plan='mf(50);tc(90)'))
    dispatches = _run(scheduler)
    # 8 pieces, then the EOS iteration (9th tick) dispatches the whole plan
    assert [i for i, _ in dispatches] == [8]
    segment = dispatches[0][1].segment
    assert segment.text == 'mf(50);tc(90)' and segment.is_last
    assert [s.text for s in segment.statements] == ['mf(50)', 'tc(90)']
    assert [c.skill for c in segment.calls] == ['move_forward', 'turn_cw']
    assert segment.estimated_exec_s == pytest.approx(MF50 + TC90)
    eos = CAL.prefill_s(1331) + sum(_decode(1332 + i) for i in range(8))
    assert segment.dispatch_time == pytest.approx(eos) == pytest.approx(clock.now())
    assert generation.suspensions == 0 and generation.status == TaskStatus.GENERATED


def test_vllm_stream_dispatches_without_suspending() -> None:
    scheduler, _, _ = make_scheduler('vllm-stream')
    generation = scheduler.submit(make_spec(plan='mf(50);tc(90)'))
    for _ in range(4):
        out = scheduler.tick()
    assert [d.segment.text for d in out.dispatches] == ['mf(50)']
    assert generation.status == TaskStatus.RUNNING and 't0' not in scheduler.queue
    rest = _run(scheduler)
    assert [(i, d.segment.text) for i, d in rest] == [(3, ';tc(90)')]
    assert generation.suspensions == 0 and len(generation.segments) == 2


def test_report_segment_updates_need_time() -> None:
    scheduler, clock, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec())
    for _ in range(5):           # 'mf' '(' '50' ');' cut segment 0, 'tc' began the next
        scheduler.tick()
    assert generation.status == TaskStatus.SUSPENDED
    clock.advance_to(7.25)
    scheduler.report_segment('t0', 0, start_time=0.3, end_time=7.25)
    assert generation.need_time == 7.25
    row = [scheduler.queue.at(r).task_id for r in range(len(scheduler.queue))].index('t0')
    assert scheduler.queue.view(COMM).ref_time[row] == 7.25
    assert generation.segments[0].exec_s == pytest.approx(6.95)
    with pytest.raises(GoalError, match='has no dispatched segment 1'):
        scheduler.report_segment('t0', 1, 0.0, 1.0)
    with pytest.raises(GoalError, match="unknown task 'nope'"):
        scheduler.report_segment('nope', 0, 0.0, 1.0)


@pytest.mark.parametrize(('kwargs', 'match'), [
    ({'task': '   '}, 'the task text is empty'),
    ({'profile': 'roomba'}, 'unknown robot kind'),
    ({'prompt_tokens': 0}, 'prompt_tokens > 0'),
    ({'prompt_tokens': -5}, 'prompt_tokens > 0'),
    ({'prompt_tokens': 10, 'task_tokens': 11}, 'task_tokens <= prompt_tokens'),
    ({'task_tokens': -1}, 'task_tokens'),
])
def test_bad_goals(kwargs: dict, match: str) -> None:
    scheduler, _, _ = make_scheduler()
    scheduler.prepare(make_spec(**kwargs))      # left for submit to refuse, with the reason
    with pytest.raises(GoalError, match=match):
        scheduler.submit(make_spec(**kwargs))
    assert scheduler.generations == {} and len(scheduler.queue) == 0


def test_duplicate_goal() -> None:
    scheduler, _, _ = make_scheduler()
    scheduler.submit(make_spec(task_id='a'))
    with pytest.raises(GoalError, match="task 'a' was already submitted"):
        scheduler.submit(make_spec(task_id='a'))
    assert len(scheduler.queue) == 1


def test_invalid_tuf_at_construction() -> None:
    with pytest.raises(TufError):
        make_spec(tuf=Tuf(beta=1.0, ert_s=1.0, alpha=2.0))
    with pytest.raises(GoalError):       # a TufError is a GoalError
        Tuf(beta=0.0, ert_s=1.0, alpha=-1.0)


def test_cancel_running_frees_engine_and_queue() -> None:
    scheduler, _, engine = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec(task_id='a'))
    scheduler.submit(make_spec(task_id='b'))
    scheduler.tick()
    assert engine.running == ('a', 'b')
    free_before = engine.kv.gpu_free
    assert scheduler.cancel('a') is generation
    assert generation.status == TaskStatus.CANCELLED
    assert generation.error == 'cancelled by the client'
    assert engine.running == ('b',) and 'a' not in scheduler.queue
    assert engine.kv.gpu_free > free_before
    with pytest.raises(EngineError, match="unknown request 'a'"):
        engine.run('a')
    # cancelling again is a no-op; unknown ids are refused
    scheduler.cancel('a', 'again')
    assert generation.error == 'cancelled by the client'
    with pytest.raises(GoalError):
        scheduler.cancel('zzz')


def test_cancel_queued_and_suspended() -> None:
    scheduler, _, engine = make_scheduler('timelyllm')
    queued = scheduler.submit(make_spec(task_id='q'))
    scheduler.cancel('q', 'operator')
    assert queued.status == TaskStatus.CANCELLED and queued.error == 'operator'
    assert len(scheduler.queue) == 0 and not scheduler.has_work
    suspended = scheduler.submit(make_spec(task_id='s'))
    for _ in range(5):           # 'mf' '(' '50' ');' cut segment 0, 'tc' began the next
        scheduler.tick()
    assert suspended.status == TaskStatus.SUSPENDED
    scheduler.cancel('s')
    assert suspended.status == TaskStatus.CANCELLED and 's' not in scheduler.queue
    assert not scheduler.has_work
    with pytest.raises(EngineError):
        engine.pause('s')
    assert engine.kv.gpu_free == engine.kv.gpu_blocks


def test_a_goal_cancelled_or_failed_between_statements_leaves_nothing_behind() -> None:
    """Cancelled after its cut, while it decodes on to its next statement, or its robot
    failing the segment then: the goal ends there, its KV freed, and it is never suspended."""
    for end in ('cancel', 'robot failure'):
        scheduler, _, engine = make_scheduler('timelyllm')
        generation = scheduler.submit(make_spec())
        for _ in range(4):
            scheduler.tick()
        assert generation.status == TaskStatus.RUNNING and len(generation.segments) == 1
        if end == 'cancel':
            scheduler.cancel('t0')
            assert generation.status == TaskStatus.CANCELLED
        else:
            scheduler.report_segment('t0', 0, 0.3, 0.9, success=False, error='motor stalled')
            assert generation.status == TaskStatus.FAILED
        assert not scheduler.invariant_violations()     # no longer between statements either
        while scheduler.has_work:
            scheduler.tick()
        assert generation.suspensions == 0 and 't0' not in scheduler.queue
        assert engine.running == () and engine.kv.gpu_free == engine.kv.gpu_blocks
        assert not scheduler.invariant_violations()


def test_no_executable_skill_fails() -> None:
    scheduler, _, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec(plan='fly(3);hello'))
    dispatches = _run(scheduler)
    assert dispatches == []
    assert generation.status == TaskStatus.FAILED
    assert generation.error.startswith(NO_SKILL_ERROR)
    assert 'no executable skill' in generation.error
    assert "unknown skill 'fly'" in generation.error
    assert generation.segments == []


def test_malformed_statement_never_dispatched() -> None:
    scheduler, _, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec(plan='mf(50);mf(5);tc(90)'))
    dispatches = _run(scheduler)
    texts = [s.text for _, d in dispatches for s in d.segment.statements]
    assert texts == ['mf(50)', 'tc(90)']
    assert generation.rejected == ['mf: distance=5 below the minimum 20 cm']
    assert generation.status == TaskStatus.GENERATED


def test_engine_failure_fails_running_and_keeps_serving() -> None:
    scheduler, _, engine = make_scheduler('timelyllm', fail_at_step=3)
    a = scheduler.submit(make_spec(task_id='a'))
    b = scheduler.submit(make_spec(task_id='b'))
    scheduler.tick()
    scheduler.tick()
    out = scheduler.tick()
    assert {g.task_id for g in out.ended} == {'a', 'b'}
    for g in (a, b):
        assert g.status == TaskStatus.FAILED
        assert g.error == 'engine failure: simulated engine failure at iteration 3'
    assert engine.running == () and not scheduler.has_work
    c = scheduler.submit(make_spec(task_id='c'))
    dispatches = _run(scheduler)
    assert [d.segment.text for _, d in dispatches] == ['mf(50)', ';tc(90)']
    assert c.status == TaskStatus.GENERATED


def test_robot_failure() -> None:
    scheduler, _, engine = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec())
    for _ in range(5):           # 'mf' '(' '50' ');' cut segment 0, 'tc' began the next
        scheduler.tick()
    assert generation.status == TaskStatus.SUSPENDED
    scheduler.report_segment('t0', 0, 0.3, 0.9, success=False, error='motor stalled')
    assert generation.status == TaskStatus.FAILED
    assert generation.error == 'robot failed segment 0: motor stalled'
    assert generation.segments[0].success is False
    assert 't0' not in scheduler.queue and not scheduler.has_work
    assert engine.kv.gpu_free == engine.kv.gpu_blocks
    with pytest.raises(EngineError):
        engine.run('t0')


def test_prompt_larger_than_kv_fails_without_stall() -> None:
    # 160 KV tokens on the GPU: a 1331-token prompt can never run
    scheduler, _, _ = make_scheduler('timelyllm', calibration=tiny_calibration())
    big = scheduler.submit(make_spec(task_id='big', prompt_tokens=1331))
    small = scheduler.submit(make_spec(task_id='small', prompt_tokens=50))
    out = scheduler.tick()
    assert big.status == TaskStatus.FAILED
    assert big.error == 'the prompt does not fit in the engine KV memory'
    assert small.status == TaskStatus.RUNNING and out.batch_size == 1
    _run(scheduler)
    assert small.status == TaskStatus.GENERATED and len(small.segments) == 2


def test_prompt_larger_than_kv_in_simulation() -> None:
    from timelyllm_ros.engines.sim import SimulatedEngine
    from timelyllm_ros.evaluation.simulation import simulate

    result = simulate([make_spec(task_id='big', prompt_tokens=1331)], 'timelyllm',
                      engine=SimulatedEngine(calibration=tiny_calibration()))
    [generation] = result.generations
    assert generation.status == TaskStatus.FAILED
    assert 'does not fit in the engine KV memory' in generation.error


def test_best_rows_gives_the_order_of_repeated_argmax_with_the_earlier_queued_first():
    from timelyllm_ros.core.queue import best_rows
    rng = np.random.default_rng(3)
    for n, k in ((1, 1), (7, 3), (50, 50), (200, 17), (200, 400)):
        priorities = rng.integers(-3, 4, n).astype(float)     # many ties
        priorities[rng.integers(0, n, 2)] = -np.inf
        seq = rng.permutation(n).astype(float)
        expected, left = [], list(range(n))
        while left and len(expected) < min(k, n):
            best = max(left, key=lambda r: (priorities[r], -seq[r]))
            expected.append(best)
            left.remove(best)
        got = list(best_rows(priorities, seq, k))
        assert got[:len(expected)] == expected
        tied = priorities[expected[-1]]
        assert all(priorities[r] == tied for r in got[len(expected):])   # the k-th's ties


def test_a_nan_priority_ranks_as_minus_infinity():
    from timelyllm_ros.core.queue import best_rows
    rows = best_rows(np.array([np.nan, 1.0, -np.inf]), np.array([0.0, 1.0, 2.0]), 3)
    assert list(rows) == [1, 0, 2]      # as -inf: tied with row 2, queued earlier
