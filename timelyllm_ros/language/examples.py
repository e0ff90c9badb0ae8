"""Few-shot examples chosen per task: the examples of a robot kind's pool closest to the task.

Small models copy the shape of the example nearest to the task in the prompt (issue 27: 16 of
20 SmolLM2 drone plans opened like the last fixed example, whatever the task). A profile can
therefore keep a pool of examples, one or more per kind of request its robot gets, and show each
task the few that read most like it, the closest last (right before the task).

Closeness is word overlap weighted by rarity: a task and an example are compared as sets of
their task text's words (the scene line is left out: its object names are what the examples
must not share with real tasks) plus the task's tag (``[A]``, ``[Q]``, ``[E]``), each word
weighted by its inverse document frequency over the pool, so that a rare word such as
``backward`` counts for more than ``fly``. The score is the cosine of the two weighted sets; ties
keep the pool's order. It is deterministic and costs microseconds per task (the pool's words
are counted once per profile).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from timelyllm_ros.language.grounding import task_text, words

_TAG = re.compile(r'Task:\s*\[([A-Z])\]')

FUNCTION_WORDS = frozenset("""
a an the and or but if so of to at by for from with is are was were be been it its this that
these those there here you your me my i we our us please could can would will should do does
did have has had then
""".split())
"""Words that say nothing of what a task asks (the rest, verbs and directions included, do)."""


def task_features(task: str) -> frozenset[str]:
    """The words a task is compared by: its text's words less function words, and its tag."""
    features = words(task_text(task)) - FUNCTION_WORDS
    tag = _TAG.search(task)
    if tag:
        features.add(f'[{tag.group(1).lower()}]')
    return frozenset(features)


@dataclass(frozen=True, slots=True)
class ExamplePool:
    """A robot kind's pool of examples with each example's weighted words (built once)."""

    examples: tuple[Mapping[str, str], ...]
    features: tuple[frozenset[str], ...]
    weights: Mapping[str, float]        # inverse document frequency of each pool word
    norms: tuple[float, ...]

    @classmethod
    def build(cls, examples: Sequence[Mapping[str, str]]) -> ExamplePool:
        """Count the pool's words (the pool is a profile's, so this runs once per profile)."""
        features = tuple(task_features(e['task']) for e in examples)
        counts: dict[str, int] = {}
        for named in features:
            for word in named:
                counts[word] = counts.get(word, 0) + 1
        n = len(examples)
        weights = {w: math.log((n + 1) / (c + 1)) + 1.0 for w, c in counts.items()}
        norms = tuple(math.sqrt(sum(weights[w] ** 2 for w in named)) or 1.0
                      for named in features)
        return cls(tuple(examples), features, weights, norms)

    def scores(self, task: str) -> list[float]:
        """Each example's closeness to the task, in pool order (0 shares no word, 1 same words).
        A word the pool does not have weighs as much as the rarest pool word."""
        asked = task_features(task)
        rare = max(self.weights.values(), default=1.0)
        norm = math.sqrt(sum(self.weights.get(w, rare) ** 2 for w in asked)) or 1.0
        return [sum(self.weights[w] ** 2 for w in asked & features) / (norm * example_norm)
                for features, example_norm in zip(self.features, self.norms, strict=True)]

    def closest(self, task: str, k: int) -> list[Mapping[str, str]]:
        """The ``k`` examples closest to the task, ordered from the least close to the closest
        (the closest is shown last, next to the task); ties go to the earlier pool example."""
        if k <= 0 or not self.examples:
            return []
        scores = self.scores(task)
        best = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
        return [self.examples[i] for i in reversed(best)]
