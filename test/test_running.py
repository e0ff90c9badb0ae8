"""The running batch's columns (core/running.py): what the scheduler keeps of each running
generation stays equal to the generations through joins, removals and timing changes, and a
decision's batch columns built from it equal those read from the generations one by one."""

from __future__ import annotations

import random
from dataclasses import astuple

import pytest
from utils import make_scheduler, make_spec

from timelyllm_ros.core.admission import AdmissionContext, BatchColumns
from timelyllm_ros.core.request import Generation
from timelyllm_ros.core.running import RunningBatch

L_MAX = {'tello': 10, 'indy7': 24}


def _generation(i: int, rng: random.Random) -> Generation:
    profile = rng.choice(sorted(L_MAX))
    spec = make_spec(task_id=f'g{i}', profile=profile,
                     task_class=rng.choice(['urgent', 'normal']), arrival=rng.uniform(0, 5))
    return Generation(spec=spec, seq=i, k=rng.choice([0, 0, 1, 2]),
                      need_time=rng.uniform(0, 8), segment_tokens=rng.randrange(0, 30))


def _expected(batch: RunningBatch) -> list[tuple[float, float, float]]:
    return [(g.need_time + g.ert_s, float(L_MAX[g.spec.profile]), g.spec.tuf.alpha)
            for g in batch.values()]


def _columns(batch: RunningBatch) -> list[tuple[float, float, float]]:
    return list(zip(*(column.tolist() for column in batch.columns()), strict=True))


def test_the_columns_follow_joins_removals_and_refreshes_in_the_batch_order() -> None:
    rng = random.Random(3)
    asked: list[str] = []

    def l_max(generation: Generation) -> int:
        asked.append(generation.spec.profile)
        return L_MAX[generation.spec.profile]

    batch = RunningBatch(l_max)
    made = [_generation(i, rng) for i in range(200)]   # past the first 64 rows: it grows
    for step, generation in enumerate(made):
        batch[generation.task_id] = generation
        if step % 3 == 2:                               # removals leave holes, then reads
            gone = rng.choice(list(batch))
            if rng.random() < 0.5:
                del batch[gone]
            else:
                assert batch.pop(gone).task_id == gone
        if step % 7 == 0:
            moved = rng.choice(list(batch.values()))
            moved.need_time += 1.5
            moved.k += 1                                # its TUF's ERT changes with k = 0
            batch.refresh(moved)
        if step % 5 == 0:
            assert _columns(batch) == _expected(batch)
            checked = len(asked)
            assert batch.column_errors() == []
            del asked[checked:]                         # the check asks l_max itself
    assert _columns(batch) == _expected(batch)
    assert sorted(asked) == sorted(L_MAX)               # l_max asked once per profile
    first = next(iter(batch.values()))
    batch[first.task_id] = first                        # set again: keeps its place
    assert next(iter(batch)) == first.task_id and _columns(batch) == _expected(batch)
    assert batch.pop('absent', None) is None
    with pytest.raises(KeyError):
        batch.pop('absent')
    gone = next(g for g in made if g.task_id not in batch)
    gone.need_time += 1.0
    batch.refresh(gone)                                 # not running: nothing to change
    assert gone.task_id not in batch and _columns(batch) == _expected(batch)


def test_the_columns_are_kept_from_their_first_read_on() -> None:
    rng = random.Random(4)
    asked: list[str] = []
    batch = RunningBatch(lambda g: asked.append(g.task_id) or L_MAX[g.spec.profile])
    made = [_generation(i, rng) for i in range(100)]
    for generation in made:
        batch[generation.task_id] = generation
    del batch['g3']
    made[5].need_time += 1.0
    batch.refresh(made[5])
    assert asked == [] and batch.column_errors() == []  # nothing kept, nothing read
    assert _columns(batch) == _expected(batch)          # the first read reads the batch
    batch['g3'] = made[3]
    del batch['g7']
    assert _columns(batch) == _expected(batch) and next(reversed(batch)) == 'g3'


def test_a_change_the_batch_was_not_told_of_is_reported() -> None:
    rng = random.Random(5)
    batch = RunningBatch(lambda g: L_MAX[g.spec.profile])
    generation = _generation(0, rng)
    batch[generation.task_id] = generation
    batch.columns()                                     # kept from here on
    generation.need_time += 2.0                         # no refresh
    problems = batch.column_errors()
    assert len(problems) == 1 and problems[0].startswith('g0: batch columns')


@pytest.mark.parametrize('method', ['clear', 'popitem', 'setdefault', 'update'])
def test_changes_other_than_by_item_are_refused(method: str) -> None:
    batch = RunningBatch(lambda g: 10)
    with pytest.raises(TypeError, match='by item only'):
        getattr(batch, method)()


@pytest.mark.parametrize('seed', range(10))
def test_batch_columns_from_the_kept_columns_equal_those_read_from_the_generations(
        seed: int) -> None:
    rng = random.Random(seed)
    scheduler, _, _ = make_scheduler()
    batch = RunningBatch(lambda g: L_MAX[g.spec.profile])
    for i in range(rng.randrange(16, 90)):
        generation = _generation(i, rng)
        batch[generation.task_id] = generation
        if rng.random() < 0.3:
            del batch[rng.choice(list(batch))]
    if len(batch) < 16:
        pytest.skip('too few rows for the array read')
    common = {'now': rng.uniform(0, 6), 'comm_s': 0.008, 'engine': scheduler.engine_view,
              'running': batch.values(), 'max_batch': 256, 'recent_step_s': 0.03,
              'max_segment_tokens': lambda g: L_MAX[g.spec.profile]}
    kept = BatchColumns().of(AdmissionContext(**common, running_columns=batch))
    read = BatchColumns().of(AdmissionContext(**common))
    assert kept.generations == read.generations
    for column in ('remaining', 'budget', 'alpha'):
        assert getattr(kept, column).tolist() == getattr(read, column).tolist()
    assert (kept.most_urgent, kept.most_urgent_budget, kept.most_urgent_remaining) == (
        read.most_urgent, read.most_urgent_budget, read.most_urgent_remaining)
    assert astuple(kept.weights) == astuple(read.weights)
