"""The scheduler's one event stream: every dispatch, close, completion and end, whatever
caused it, is an event a driver drains, exactly once and in order."""

from __future__ import annotations

import math

import numpy as np
from utils import make_scheduler, make_spec, tiny_calibration

from timelyllm_ros.core.events import Closed, Dispatch, Ended, Generated, SchedulerEvent
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig


def _report_all(scheduler: Scheduler, dispatches: list[Dispatch]) -> None:
    for dispatch in dispatches:
        segment = dispatch.segment
        start = scheduler.clock.now()
        scheduler.report_segment(dispatch.task_id, segment.index, start, start)


def test_a_cancel_between_ticks_is_an_ended_event_drained_once() -> None:
    scheduler, _, _ = make_scheduler()
    generation = scheduler.submit(make_spec(task_id='a'))
    scheduler.tick()
    scheduler.cancel('a')
    assert scheduler.drain_events() == [Ended(generation)]
    assert scheduler.drain_events() == []
    assert generation.status == TaskStatus.CANCELLED


def test_a_failed_report_ends_the_goal_through_the_stream() -> None:
    scheduler, _, _ = make_scheduler()
    generation = scheduler.submit(make_spec(task_id='a'))
    while not generation.segments:
        scheduler.tick()
    now = scheduler.clock.now()
    scheduler.report_segment('a', 0, now, now, success=False, error='motor stalled')
    out = scheduler.tick() if scheduler.has_work else None
    events = out.events if out is not None else scheduler.drain_events()
    assert Ended(generation) in events
    assert generation.status == TaskStatus.FAILED and 'motor stalled' in generation.error


def test_events_before_a_tick_come_first_in_its_result() -> None:
    scheduler, _, _ = make_scheduler()
    first = scheduler.submit(make_spec(task_id='a'))
    scheduler.submit(make_spec(task_id='b'))
    scheduler.tick()
    scheduler.cancel('a')
    out = scheduler.tick()
    assert out.events[0] == Ended(first)
    assert out.ended == [first]


def test_a_goal_refused_at_admission_is_an_event_of_that_tick() -> None:
    # 160 KV tokens: a 400-token prompt can never fit, even in an idle engine.
    scheduler, _, _ = make_scheduler(calibration=tiny_calibration())
    generation = scheduler.submit(make_spec(task_id='big', prompt_tokens=400))
    out = scheduler.tick()
    assert out.ended == [generation] and out.decision is not None
    assert out.decision.refused == ('big',)
    assert 'does not fit' in generation.error


def test_a_plan_that_ends_after_its_last_segment_is_closed_then_generated() -> None:
    # The finish comes after the last cut: nothing is left to send but the close.
    scheduler, _, _ = make_scheduler()
    generation = scheduler.submit(make_spec(task_id='a', plan='mf(50);'))
    events: list[SchedulerEvent] = []
    while scheduler.has_work:
        events.extend(scheduler.tick().events)
    kinds = [type(e) for e in events]
    assert kinds == [Dispatch, Closed, Generated]
    assert generation.segments[-1].is_last


def test_every_goal_ends_exactly_once_whatever_ends_it() -> None:
    """A fleet where robots report, fail, go silent, or are cancelled: each goal has one Ended
    event, after its Generated (if it got that far), with dispatches in index order."""
    config = SchedulerConfig(report_timeout_margin_s=1.0)
    scheduler, clock, _ = make_scheduler(config=config)
    rng = np.random.default_rng(7)
    n = 24
    fates = {f't{i}': ('report', 'fail', 'silent', 'cancel')[i % 4] for i in range(n)}
    for i in range(n):
        scheduler.submit(make_spec(task_id=f't{i}', arrival=0.0,
                                   plan='mf(50);tc(90);mf(20)'))
    events: list[SchedulerEvent] = []
    for _ in range(5000):
        if scheduler.has_work:
            batch = scheduler.tick().events
        else:                                     # as the live service does when idle
            scheduler.expire_overdue()
            batch = scheduler.drain_events()
        events.extend(batch)
        for event in batch:
            if not isinstance(event, Dispatch):
                continue
            fate = fates[event.task_id]
            now = clock.now()
            if fate == 'report' or (fate == 'cancel' and event.segment.index == 0):
                scheduler.report_segment(event.task_id, event.segment.index, now, now)
            elif fate == 'fail':
                scheduler.report_segment(event.task_id, event.segment.index, now, now,
                                         success=False, error='dropped the payload')
            if fate == 'cancel' and event.segment.index == 0:
                scheduler.cancel(event.task_id)
        generating = {g.task_id for g in scheduler.generations.values()
                      if not g.status.terminal}
        if not generating:
            break
        if not scheduler.has_work:
            deadline = scheduler.next_deadline
            clock.advance_to(max(clock.now(), deadline if deadline is not None else math.inf))
        else:
            clock.elapse(float(rng.uniform(0, 0.05)))
    events.extend(scheduler.drain_events())
    ended = [e.generation.task_id for e in events if isinstance(e, Ended)]
    assert sorted(ended) == sorted(fates)                     # each exactly once
    for task_id, fate in fates.items():
        generation = scheduler.generations[task_id]
        expected = {'report': TaskStatus.FINISHED, 'fail': TaskStatus.FAILED,
                    'silent': TaskStatus.FAILED, 'cancel': TaskStatus.CANCELLED}[fate]
        assert generation.status == expected, (task_id, generation.error)
        own = [e for e in events if getattr(e, 'task_id', None) == task_id
               or getattr(e, 'generation', None) is generation]
        assert isinstance(own[-1], Ended)
        indices = [e.segment.index for e in own if isinstance(e, Dispatch)]
        assert indices == list(range(len(indices)))
        if fate == 'silent':
            assert 'did not report' in generation.error
