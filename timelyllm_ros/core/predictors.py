"""Output-length predictors and urgency classifiers: the pluggable predictors of the rival
policies (Semantic Scheduling, paper 001; TimeBill, paper 003).

Two seams, each a :class:`~typing.Protocol` so that any object with the one method plugs in:

* :class:`LengthPredictor` -- ``predict(spec) -> int``, the predicted number of output tokens of
  the *whole* plan of a request (all its segments). The default, :class:`BucketLengthPredictor`,
  is learnt from traces the way TimeBill's response-length predictor is trained (paper 003,
  eq. 2): the true length N of every training example is labelled with its bucket
  ``⌈N / B⌉``; a request is predicted the bucket most often seen for its task type (falling
  back to its robot profile, then to all examples), reported as the bucket's **upper edge**
  ``min(N_max, n̂·B)``. :meth:`BucketLengthPredictor.errors` measures it (MAE, RMSE, R²)
  against the true lengths, and an optional seeded relative noise emulates a worse predictor
  for sweeps (Semantic Scheduling's "length-predictor error", paper 001 §4.1).
  :class:`OracleLengthPredictor` returns the true length (perfect predictor, for tests).
* :class:`UrgencyClassifier` -- ``classify(spec) -> int``, the urgency level f_e of Semantic
  Scheduling (0 = most urgent). :class:`TufClassUrgency` (the default) reads it from the
  request's TUF class; :class:`KeywordUrgencyClassifier` assigns it from the task text with
  regular-expression rules, and :meth:`KeywordUrgencyClassifier.fit` learns such rules (a tiny
  bag-of-words model: one multinomial naive-Bayes vote per word) from labelled task lines --
  the stand-in for the paper's DistilBERT classifier, which cannot be downloaded here.

Training inputs are task specs with a ``script`` (its length = ``len(script)``), traces or
a trace set (:mod:`timelyllm_ros.language.traces`); :func:`bundled_length_predictor` is the bucket
predictor fitted once on the bundled trace set (TimeBill, SLICE and Semantic Scheduling use it
by default).
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.core.tuf import TUF_CLASSES, Tuf
from timelyllm_ros.language.traces import Trace, TraceSet, load_trace_set

__all__ = [
    'BucketLengthPredictor',
    'KeywordUrgencyClassifier',
    'LengthExample',
    'LengthPredictor',
    'OracleLengthPredictor',
    'TufClassUrgency',
    'UrgencyClassifier',
    'length_examples',
    'true_length',
]

DEFAULT_BUCKET_TOKENS = 16
"""TimeBill's bucket size B (paper 003 §3.2(a): B = 16)."""


# -- the seams ------------------------------------------------------------------------------
@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts how many output tokens a request's whole plan will have."""

    def predict(self, spec: TaskSpec) -> int:
        """Predicted output tokens of the whole plan (all segments), ≥ 1."""
        ...


@runtime_checkable
class UrgencyClassifier(Protocol):
    """Assigns Semantic Scheduling's urgency level f_e to a request (0 = most urgent)."""

    def classify(self, spec: TaskSpec) -> int:
        """Urgency level, 0 = most urgent; larger = less urgent."""
        ...


# -- training examples ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LengthExample:
    """One training example: the groups it belongs to and its true output length (tokens)."""

    task_type: str
    profile: str
    tokens: int


def true_length(spec: TaskSpec) -> int:
    """The true output length of a request whose output is known (its ``script``).

    Raises:
        ValueError: the spec carries no script.
    """
    if spec.script is None:
        raise ValueError(f'task {spec.task_id!r} has no script: its true length is unknown')
    return len(spec.script)


def length_examples(items: TraceSet | Iterable[TaskSpec | Trace]) -> list[LengthExample]:
    """Training examples from task specs, traces or a trace set (or a mix of them).

    Raises:
        ValueError: an item is none of those, or a spec has no script.
    """
    if isinstance(items, TraceSet):
        items = items.traces
    examples: list[LengthExample] = []
    for item in items:
        if isinstance(item, TaskSpec):
            examples.append(LengthExample(item.task_type, item.profile, true_length(item)))
        elif isinstance(item, Trace):
            examples.append(LengthExample(item.task_type, item.robot, len(item.pieces)))
        else:
            raise ValueError(f'cannot learn an output length from {type(item).__name__}')
    return examples


# -- length predictors ----------------------------------------------------------------------
class OracleLengthPredictor:
    """The true length (``len(spec.script)``): a perfect predictor, for tests and upper bounds.
    Requests without a script are predicted ``default`` tokens."""

    def __init__(self, default: int = 32) -> None:
        self.default = default

    def predict(self, spec: TaskSpec) -> int:
        return max(len(spec.script), 1) if spec.script is not None else self.default


@dataclass
class BucketLengthPredictor:
    """Bucketed output-length predictor learnt from traces (TimeBill's RLP, paper 003 eq. 2).

    Each group (task type; else robot profile; else everything) predicts the bucket label
    ``⌈N / B⌉`` seen most often among its training examples (ties go to the larger bucket:
    pessimistic, as a WCET should be), reported as the bucket's upper edge ``label·B`` and
    capped at ``max_tokens``. With ``noise > 0`` each request's length is first scaled by a
    relative error drawn uniformly from ``[−noise, +noise]``, from a generator seeded by
    ``seed`` and the task id (so the same request always gets the same prediction), then
    bucketed: a worse predictor for sweeps.

    Attributes:
        bucket_tokens: bucket width B in tokens (≥ 1; 16 as in TimeBill).
        by_task_type / by_profile: learnt bucket label per group.
        global_label: learnt bucket label over all examples (None before fitting).
        max_tokens: N_max cap of a prediction (None: no cap).
        noise: relative error injected into predictions (0 = none).
        seed: seed of the injected error.
        default_tokens: prediction when nothing was learnt at all.
    """

    bucket_tokens: int = DEFAULT_BUCKET_TOKENS
    by_task_type: dict[str, int] = field(default_factory=dict)
    by_profile: dict[str, int] = field(default_factory=dict)
    global_label: int | None = None
    max_tokens: int | None = None
    noise: float = 0.0
    seed: int = 0
    default_tokens: int = 32

    def __post_init__(self) -> None:
        if self.bucket_tokens < 1:
            raise ValueError(f'bucket width must be >= 1 token, got {self.bucket_tokens}')
        if not 0.0 <= self.noise < 1.0 or not math.isfinite(self.noise):
            raise ValueError(f'relative noise must be in [0, 1), got {self.noise}')
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f'max_tokens must be >= 1, got {self.max_tokens}')

    @classmethod
    def fit(cls, specs_or_traces: Any, bucket_tokens: int = DEFAULT_BUCKET_TOKENS,
            max_tokens: int | None = None, noise: float = 0.0, seed: int = 0
            ) -> BucketLengthPredictor:
        """Learn the bucket of every task type and profile.

        Args:
            specs_or_traces: task specs with scripts, lrtrace traces or a trace set.
            bucket_tokens: bucket width B (tokens).
            max_tokens: cap of a prediction (N_max).
            noise: relative error injected into predictions, in [0, 1).
            seed: seed of that error.

        Raises:
            ValueError: no usable example, or invalid parameters.
        """
        examples = length_examples(specs_or_traces)
        if not examples:
            raise ValueError('cannot fit a length predictor on no example')
        predictor = cls(bucket_tokens=bucket_tokens, max_tokens=max_tokens, noise=noise,
                        seed=seed)
        by_type: dict[str, Counter[int]] = defaultdict(Counter)
        by_profile: dict[str, Counter[int]] = defaultdict(Counter)
        overall: Counter[int] = Counter()
        for example in examples:
            label = predictor.label(example.tokens)
            by_type[example.task_type][label] += 1
            by_profile[example.profile][label] += 1
            overall[label] += 1
        predictor.by_task_type = {k: _mode(c) for k, c in by_type.items()}
        predictor.by_profile = {k: _mode(c) for k, c in by_profile.items()}
        predictor.global_label = _mode(overall)
        return predictor

    def label(self, tokens: int) -> int:
        """Bucket label ``⌈N / B⌉`` of a length (at least 1)."""
        return max(-(-int(tokens) // self.bucket_tokens), 1)

    def _learnt_label(self, spec: TaskSpec) -> int | None:
        for table, key in ((self.by_task_type, spec.task_type), (self.by_profile, spec.profile)):
            if key in table:
                return table[key]
        return self.global_label

    def predict(self, spec: TaskSpec) -> int:
        label = self._learnt_label(spec)
        tokens = self.default_tokens if label is None else label * self.bucket_tokens
        if self.noise > 0.0:
            digest = zlib.crc32(f'{self.seed}:{spec.task_id}'.encode())
            # Deterministic per (seed, task): a uniform draw in [0, 1) from the hash.
            u = (digest & 0xFFFFFFFF) / 2**32
            tokens = self.label(max(round(tokens * (1.0 + self.noise * (2.0 * u - 1.0))), 1)
                                ) * self.bucket_tokens
        if self.max_tokens is not None:
            tokens = min(tokens, self.max_tokens)
        return max(tokens, 1)

    def errors(self, specs: Iterable[TaskSpec]) -> dict[str, float]:
        """Prediction error against the true lengths (``len(spec.script)``).

        Returns:
            ``n``, ``mae`` and ``rmse`` (tokens), ``bias`` (mean predicted − true, tokens),
            ``r2`` (coefficient of determination; 1.0 for perfect predictions, nan when the
            true lengths do not vary and the predictions are not perfect).

        Raises:
            ValueError: no spec, or a spec without a script.
        """
        return length_errors(self, specs)


def length_errors(predictor: LengthPredictor, specs: Iterable[TaskSpec]) -> dict[str, float]:
    """MAE / RMSE / bias / R² of any length predictor on specs with known output (scripts).

    Raises:
        ValueError: no spec, or a spec without a script.
    """
    pairs = [(float(predictor.predict(s)), float(true_length(s))) for s in specs]
    if not pairs:
        raise ValueError('no spec to measure the predictor on')
    n = len(pairs)
    residuals = [p - t for p, t in pairs]
    mean_true = sum(t for _, t in pairs) / n
    ss_res = sum(r * r for r in residuals)
    ss_tot = sum((t - mean_true) ** 2 for _, t in pairs)
    if ss_tot > 0:
        r2 = 1.0 - ss_res / ss_tot
    else:
        r2 = 1.0 if ss_res == 0 else math.nan
    return {'n': float(n), 'mae': sum(abs(r) for r in residuals) / n,
            'rmse': math.sqrt(ss_res / n), 'bias': sum(residuals) / n, 'r2': r2}


def _mode(counts: Counter[int]) -> int:
    """Most frequent label; ties go to the larger (pessimistic) label."""
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


# -- urgency classifiers --------------------------------------------------------------------
DEFAULT_CLASS_LEVELS: Mapping[str, int] = {'urgent': 0, 'normal': 1, 'arm': 1, 'chatbot': 2}
"""Urgency level per task class (0 = most urgent): error handling first, robot tasks next,
conversation last."""


class TufClassUrgency:
    """The default classifier: the urgency level of the request's task class.

    A class missing from ``levels`` is matched by its TUF instead: a TUF equal to that of a
    known TUF class (``urgent``, ``normal``, ``chatbot``) gets that class's level (so, e.g., a
    task class ``'inspection'`` with the urgent TUF counts as urgent). Anything else gets
    ``unknown_level``, by default one below the least urgent known level.
    """

    def __init__(self, levels: Mapping[str, int] | None = None,
                 unknown_level: int | None = None) -> None:
        self.levels = dict(DEFAULT_CLASS_LEVELS if levels is None else levels)
        if any(level < 0 for level in self.levels.values()):
            raise ValueError('urgency levels must be >= 0')
        self.unknown_level = (max(self.levels.values(), default=-1) + 1
                              if unknown_level is None else unknown_level)
        self._by_tuf: dict[Tuf, int] = {}
        for name, tuf in TUF_CLASSES.items():
            if name in self.levels:
                level = self.levels[name]
                self._by_tuf[tuf] = min(level, self._by_tuf.get(tuf, level))

    @property
    def num_levels(self) -> int:
        return max(max(self.levels.values(), default=0), self.unknown_level) + 1

    def classify(self, spec: TaskSpec) -> int:
        level = self.levels.get(spec.task_class)
        if level is None:
            level = self._by_tuf.get(spec.tuf, self.unknown_level)
        return level


DEFAULT_KEYWORD_RULES: tuple[tuple[str, int], ...] = (
    # LRTrace's error-handling tasks are tagged "[E]" and report a failure or a threat.
    (r'\[E\]', 0),
    (r'\b(?:emergenc\w*|urgent\w*|danger\w*|injur\w*|collision\w*|collid\w*|chas\w*|'
     r'attack\w*|fire|help|hurt\w*|fall\w*|approaching|failure)\b', 0),
    # Questions and small talk addressed to the robot are conversation, not plans.
    (r'^(?:hi|hello|hey)\b|\b(?:tell me|what can you|why did|story)\b', 2),
)


class KeywordUrgencyClassifier:
    """Urgency from the task text: the first matching regular expression's level wins.

    The default rules send LRTrace's error-handling tasks (``[E]`` tag, words such as
    "collision", "chasing", "approaching", "failure") to level 0 and chat-like lines
    ("hi …", "tell me …", "why did …") to level 2; anything else gets ``default_level`` (1).
    :meth:`fit` learns a bag-of-words model from labelled task lines instead.
    """

    def __init__(self, rules: Sequence[tuple[str, int]] = DEFAULT_KEYWORD_RULES,
                 default_level: int = 1) -> None:
        self.rules = [(re.compile(pattern, re.IGNORECASE), level) for pattern, level in rules]
        self.default_level = default_level
        self._model: _NaiveBayes | None = None

    @classmethod
    def fit(cls, lines: Sequence[str], levels: Sequence[int], smoothing: float = 1.0
            ) -> KeywordUrgencyClassifier:
        """Learn the urgency of task lines: multinomial naive Bayes over lower-case words
        (and ``[X]`` tags), Laplace ``smoothing``, log-prior of each level's share of lines.
        Ties go to the more urgent level.

        Raises:
            ValueError: no line, or lines and levels of different lengths.
        """
        if not lines or len(lines) != len(levels):
            raise ValueError('need as many urgency levels as task lines (at least one)')
        classifier = cls(rules=(), default_level=min(levels))
        classifier._model = _NaiveBayes.fit([_words(x) for x in lines], list(levels),
                                            smoothing)
        return classifier

    @classmethod
    def fit_specs(cls, specs: Iterable[TaskSpec], labels: UrgencyClassifier | None = None,
                  smoothing: float = 1.0) -> KeywordUrgencyClassifier:
        """Learn from task specs labelled by ``labels`` (TUF classes by default)."""
        labels = labels or TufClassUrgency()
        specs = list(specs)
        return cls.fit([s.task for s in specs], [labels.classify(s) for s in specs], smoothing)

    def classify_text(self, text: str) -> int:
        if self._model is not None:
            return self._model.predict(_words(text))
        for pattern, level in self.rules:
            if pattern.search(text):
                return level
        return self.default_level

    def classify(self, spec: TaskSpec) -> int:
        return self.classify_text(spec.task)


_WORD = re.compile(r'\[[a-z]\]|[a-z]+')


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class _NaiveBayes:
    log_prior: dict[int, float]
    log_likelihood: dict[int, dict[str, float]]
    log_unseen: dict[int, float]

    @classmethod
    def fit(cls, documents: list[list[str]], labels: list[int], smoothing: float
            ) -> _NaiveBayes:
        vocabulary = {w for d in documents for w in d}
        counts: dict[int, Counter[str]] = defaultdict(Counter)
        for document, label in zip(documents, labels, strict=True):
            counts[label].update(document)
        n = len(labels)
        share = Counter(labels)
        log_prior = {k: math.log(share[k] / n) for k in share}
        log_likelihood: dict[int, dict[str, float]] = {}
        log_unseen: dict[int, float] = {}
        for label, words in counts.items():
            total = sum(words.values()) + smoothing * (len(vocabulary) + 1)
            log_likelihood[label] = {w: math.log((c + smoothing) / total)
                                     for w, c in words.items()}
            log_unseen[label] = math.log(smoothing / total)
        for label in share:
            if label not in counts:
                log_likelihood[label] = {}
                log_unseen[label] = -math.log(len(vocabulary) + 1)
        return cls(log_prior, log_likelihood, log_unseen)

    def predict(self, words: list[str]) -> int:
        def score(label: int) -> float:
            table, unseen = self.log_likelihood[label], self.log_unseen[label]
            return self.log_prior[label] + sum(table.get(w, unseen) for w in words)

        return max(sorted(self.log_prior), key=lambda label: (score(label), -label))


@lru_cache(maxsize=1)
def bundled_length_predictor() -> BucketLengthPredictor:
    """The bucket predictor fitted on the bundled trace set (fitted once per process)."""
    return BucketLengthPredictor.fit(load_trace_set())
