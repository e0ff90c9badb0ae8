"""A status snapshot reads the scheduler without changing it; queue rows carry their ids."""

from __future__ import annotations

import pytest
from utils import make_scheduler, make_spec

from timelyllm_ros.core.queue import GenerationQueue
from timelyllm_ros.policies import POLICIES


def _state(policy: object) -> str:
    return repr(sorted(vars(policy).items()))


@pytest.mark.parametrize('policy', sorted(POLICIES))
def test_a_snapshot_changes_no_policy_state(policy: str) -> None:
    scheduler, _, _ = make_scheduler(policy)
    for i in range(12):
        scheduler.submit(make_spec(task_id=f't{i}', task_class='urgent' if i % 3 else 'normal',
                                   arrival=0.01 * i, plan='mf(50);tc(90);mf(20)'))
    for _ in range(6):
        scheduler.tick()
    before = _state(scheduler.policy)
    held = scheduler.snapshot()
    assert _state(scheduler.policy) == before
    assert held.queued == len(held.priorities) == len(scheduler.queue)
    assert set(held.priorities) == {g.task_id for g in scheduler.queue.generations}


def test_queue_rows_carry_their_generation_ids_after_removals() -> None:
    scheduler, _, _ = make_scheduler()
    queue = GenerationQueue(capacity=2)
    generations = [scheduler.submit(make_spec(task_id=f't{i}')) for i in range(5)]
    for generation in generations:
        queue.push(generation, 0.1)
    queue.remove('t1')
    queue.remove('t4')
    view = queue.view(0.008)
    assert view.task_ids == tuple(g.task_id for g in queue.generations)
    assert [int(s) for s in view.seq] == [
        next(g.seq for g in generations if g.task_id == t) for t in view.task_ids]
