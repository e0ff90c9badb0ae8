"""Output-length predictors and urgency classifiers (the rival policies' predictor seams)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from utils import make_spec

from timelyllm_ros.core.predictors import (
    BucketLengthPredictor,
    KeywordUrgencyClassifier,
    LengthPredictor,
    OracleLengthPredictor,
    TufClassUrgency,
    UrgencyClassifier,
    length_errors,
    length_examples,
)
from timelyllm_ros.core.tuf import NORMAL, URGENT, Tuf
from timelyllm_ros.evaluation.workloads import resolve_workload
from timelyllm_ros.language.traces import load_trace_set

CLASS_LEVEL = {'urgent': 0, 'normal': 1, 'arm': 1, 'chatbot': 2}


def typed_spec(task_type: str, profile: str = 'tello', task_class: str = 'normal'):
    """A spec of a given task type (arm tasks carry the normal TUF, as in the workloads)."""
    tuf = NORMAL if task_class == 'arm' else None
    return replace(make_spec(profile=profile, task_class=task_class, tuf=tuf),
                   task_type=task_type)


@pytest.fixture(scope='module')
def traces():
    return load_trace_set()


@pytest.fixture(scope='module')
def wid1():
    return resolve_workload('wid1', seed=0)[1]


def test_fit_on_shipped_traces_predicts_each_task_types_bucket_upper_edge(traces) -> None:
    predictor = BucketLengthPredictor.fit(traces)
    assert isinstance(predictor, LengthPredictor)
    for trace in traces.traces:
        spec = typed_spec(trace.task_type, trace.robot, trace.task_class)
        true = len(trace.pieces)
        predicted = predictor.predict(spec)
        assert predicted == math.ceil(true / 16) * 16          # upper edge of its bucket
        assert 0 <= predicted - true < 16


def test_errors_on_wid1_are_measurable_and_bounded_by_the_bucket_width(traces, wid1) -> None:
    errors = BucketLengthPredictor.fit(traces).errors(wid1)
    assert errors['n'] == len(wid1)
    assert 0 < errors['mae'] < 16 and errors['mae'] <= errors['rmse'] < 16
    assert errors['bias'] == pytest.approx(errors['mae'])      # upper edges never under-predict
    assert math.isfinite(errors['r2'])
    # Buckets of one token are exact; coarser buckets are worse (R² drops).
    exact = BucketLengthPredictor.fit(traces, bucket_tokens=1).errors(wid1)
    assert exact['mae'] == exact['rmse'] == 0.0 and exact['r2'] == 1.0
    coarse = BucketLengthPredictor.fit(traces, bucket_tokens=64).errors(wid1)
    assert coarse['r2'] < errors['r2'] < exact['r2']


def test_fit_from_specs_matches_fit_from_traces(traces, wid1) -> None:
    from_specs = BucketLengthPredictor.fit(wid1)
    from_traces = BucketLengthPredictor.fit(traces)
    assert all(from_specs.predict(s) == from_traces.predict(s) for s in wid1)
    assert len(length_examples(traces)) == len(traces.traces)


def test_unknown_task_type_falls_back_to_profile_then_global(traces) -> None:
    predictor = BucketLengthPredictor.fit(traces)
    arm = typed_spec('T99', 'indy7', 'arm')
    assert predictor.predict(arm) == predictor.by_profile['indy7'] * 16 == 80
    alien = replace(typed_spec('T99'), profile='rover')
    assert predictor.predict(alien) == predictor.global_label * 16
    assert BucketLengthPredictor().predict(alien) == 32              # nothing learnt: default


def test_mode_of_a_group_breaks_ties_towards_the_larger_bucket() -> None:
    specs = [replace(make_spec(f't{i}', plan=plan), task_type='X')
             for i, plan in enumerate(['tp()', "l('" + 'a' * 40 + "')"])]
    predictor = BucketLengthPredictor.fit(specs, bucket_tokens=4)
    lengths = sorted(len(s.script) for s in specs)
    assert predictor.predict(specs[0]) == math.ceil(lengths[-1] / 4) * 4


def test_max_tokens_caps_and_parameters_are_checked(traces) -> None:
    capped = BucketLengthPredictor.fit(traces, max_tokens=50)
    arm = typed_spec('T10', 'indy7', 'arm')
    assert capped.predict(arm) == 50
    with pytest.raises(ValueError, match='bucket width'):
        BucketLengthPredictor(bucket_tokens=0)
    with pytest.raises(ValueError, match='noise'):
        BucketLengthPredictor(noise=1.5)
    with pytest.raises(ValueError, match='no example'):
        BucketLengthPredictor.fit([])
    with pytest.raises(ValueError, match='no script'):
        BucketLengthPredictor.fit([make_spec(plan=None)])


def test_seeded_noise_is_deterministic_bounded_and_worse(traces, wid1) -> None:
    clean = BucketLengthPredictor.fit(traces, bucket_tokens=1)
    noisy = BucketLengthPredictor.fit(traces, bucket_tokens=1, noise=0.5, seed=3)
    again = BucketLengthPredictor.fit(traces, bucket_tokens=1, noise=0.5, seed=3)
    other = BucketLengthPredictor.fit(traces, bucket_tokens=1, noise=0.5, seed=4)
    assert [noisy.predict(s) for s in wid1] == [again.predict(s) for s in wid1]
    assert [noisy.predict(s) for s in wid1] != [other.predict(s) for s in wid1]
    for spec in wid1:
        base = clean.predict(spec)
        assert abs(noisy.predict(spec) - base) <= 0.5 * base + 1
    assert noisy.errors(wid1)['mae'] > clean.errors(wid1)['mae'] == 0.0


def test_oracle_is_perfect(wid1) -> None:
    errors = length_errors(OracleLengthPredictor(), wid1)
    assert errors['mae'] == 0.0 and errors['r2'] == 1.0
    assert OracleLengthPredictor(default=7).predict(make_spec(plan=None)) == 7


def test_tuf_class_urgency_levels() -> None:
    classifier = TufClassUrgency()
    assert isinstance(classifier, UrgencyClassifier)
    for task_class, level in CLASS_LEVEL.items():
        assert classifier.classify(make_spec(task_class=task_class,
                                             tuf=NORMAL if task_class == 'arm' else None)) == level
    # An unknown class is matched by its TUF, else it is the least urgent.
    assert classifier.classify(make_spec(task_class='inspection', tuf=URGENT)) == 0
    assert classifier.classify(make_spec(task_class='inspection', tuf=NORMAL)) == 1
    odd = Tuf(beta=3.0, ert_s=5.0, alpha=-0.1)
    assert classifier.classify(make_spec(task_class='inspection', tuf=odd)) == 3
    assert TufClassUrgency({'urgent': 0}, unknown_level=7).classify(make_spec()) == 7


def test_keyword_rules_agree_with_the_tuf_classes_of_the_shipped_traces(traces) -> None:
    classifier = KeywordUrgencyClassifier()
    assert isinstance(classifier, UrgencyClassifier)
    for trace in traces.traces:
        assert classifier.classify_text(trace.task) == CLASS_LEVEL[trace.task_class], trace.task
    assert classifier.classify(make_spec(task='a dog is chasing me')) == 0
    assert classifier.classify(make_spec(task='water the plants')) == 1


def test_bag_of_words_model_learns_urgency_from_labelled_lines(traces) -> None:
    lines = [t.task for t in traces.traces]
    levels = [CLASS_LEVEL[t.task_class] for t in traces.traces]
    model = KeywordUrgencyClassifier.fit(lines, levels)
    assert [model.classify_text(x) for x in lines] == levels       # fits its training set
    held_out = {
        'Scene: [cat] Task: [E] You provided me with plan mf,80, but I encountered a failure '
        'because a cat is approaching me. Execution history: mf(20)': 0,
        'Scene: [shelf_2] Task: [A] Could you find the red cup on the shelf?': 1,
        'Tell me a short story about a drone.': 2,
    }
    assert {x: model.classify_text(x) for x in held_out} == held_out
    with pytest.raises(ValueError):
        KeywordUrgencyClassifier.fit(lines, levels[:-1])


def test_fit_specs_labels_with_the_tuf_classes(wid1) -> None:
    model = KeywordUrgencyClassifier.fit_specs(wid1[:60])
    labels = TufClassUrgency()
    assert all(model.classify(s) == labels.classify(s) for s in wid1)
