"""Few-shot examples chosen per task (issue 27): the pool's closest examples, closest last."""

from __future__ import annotations

import pytest

from timelyllm_ros.language.examples import ExamplePool, task_features
from timelyllm_ros.language.grounding import scene_objects, task_objects, words
from timelyllm_ros.language.profiles import PromptParts, load_profile
from timelyllm_ros.language.traces import load_trace_set, trace_set_path

POOL = [
    {'task': 'Scene: [] Task: [A] Fly forward 2 m.', 'plan': 'mf(200)'},
    {'task': 'Scene: [] Task: [E] A ball is coming. Fly backward 1 m.', 'plan': 'mb(100)'},
    {'task': 'Scene: [kite x:0.5 y:0.5 width:0.1 height:0.1] Task: [A] Find the kite and '
             'fly to it.', 'plan': "s('kite');g('kite')"},
    {'task': 'Scene: [] Task: [Q] Is the light on?', 'plan': "p('Is the light on?')"},
]


def test_a_task_is_compared_by_its_words_and_tag_not_its_scene() -> None:
    features = task_features('Scene: [lamp_1 x:0.1] Task: [E] The lamp fell. Fly back 1 m.')
    assert features == {'[e]', 'lamp', 'fell', 'fly', 'back', 'm'}
    assert 'x' not in features and 'the' not in features


def test_the_closest_examples_come_last_and_ties_keep_the_pool_order() -> None:
    pool = ExamplePool.build(POOL)
    chosen = pool.closest('Scene: [dog x:0.5] Task: [E] A dog runs at you. Fly backward 50 cm.', 2)
    assert chosen[-1] is POOL[1]                 # [E], fly, backward
    assert chosen[0] is POOL[0]                  # fly (and not a question)
    assert [e['plan'] for e in pool.closest('Scene: [] Task: [A] Find the cup and fly to it.',
                                            1)] == ["s('kite');g('kite')"]
    # nothing in common: the pool's order decides (the first ones, the first last)
    assert pool.closest('Scene: [] Task: zzz', 2) == [POOL[1], POOL[0]]
    assert pool.closest('Scene: [] Task: [A] anything', 0) == []
    assert len(pool.closest('Scene: [] Task: [A] fly', 9)) == len(POOL)
    scores = pool.scores('Scene: [] Task: [A] Fly forward 2 m.')
    assert scores[0] == pytest.approx(1.0) and max(scores[1:]) < 1.0


def test_prompt_parts_check_their_examples() -> None:
    with pytest.raises(ValueError, match='pool_examples is 3'):
        PromptParts(system='s', example_pool=POOL[:2], pool_examples=3)
    with pytest.raises(ValueError, match='keys task and plan'):
        PromptParts(system='s', examples=[{'task': 't'}])


@pytest.mark.parametrize('robot', ['tello', 'indy7'])
def test_a_task_is_shown_the_closest_pool_examples_after_a_shared_prefix(robot) -> None:
    profile = load_profile(robot)
    parts = profile.prompt
    assert parts.pool_examples > 0 and len(parts.example_pool) >= 10
    task = next(t.task for t in load_trace_set().traces if t.robot == robot)
    chosen = parts.pool.closest(task, parts.pool_examples)
    prompt = profile.build_prompt(task)
    assert prompt.startswith(profile.prompt_prefix)
    assert prompt.endswith(f"Task: {chosen[-1]['task']}\nPlan: {chosen[-1]['plan']}\n\n"
                           f'Task: {task}\nPlan:')
    turns = profile.build_messages(task)
    assert turns[0] == ('system', profile.instructions)
    shown = [content for role, content in turns[1:-1] if role == 'user']
    assert shown == [e['task'] for e in parts.examples_for(task)]
    assert turns[-1] == ('user', task)


@pytest.mark.parametrize('robot', ['tello', 'indy7'])
def test_the_examples_name_no_object_of_a_bundled_or_held_back_task(robot) -> None:
    """An example that named a task's objects would hand a small model that task's answer
    (issue 27: names from the examples leaked into unrelated tasks)."""
    tasks = [t.task for name in ('derived', 'heldback', 'heldback2')
             for t in load_trace_set(trace_set_path(name)).traces if t.robot == robot]
    task_words = set().union(*(words(' '.join(task_objects(t))) for t in tasks))
    for example in load_profile(robot).prompt.all_examples:
        named = set().union(set(), *(words(n) for n in scene_objects(example['task'])))
        named |= set().union(set(), *(words(a) for a in _quoted(example['plan'])))
        assert not named & task_words, (example['task'], named & task_words)


def _quoted(plan: str) -> list[str]:
    parts = plan.split("'")
    return [parts[i] for i in range(1, len(parts), 2)]
