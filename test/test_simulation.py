"""Whole-fleet simulation: invariants, determinism, the paper's directions, workloads, metrics."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from utils import make_scheduler, make_spec

from timelyllm_ros.core.request import Generation, Segment, TaskStatus
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.core.tuf import NORMAL, Tuf
from timelyllm_ros.engines import create_engine
from timelyllm_ros.errors import WorkloadError
from timelyllm_ros.evaluation.metrics import TaskMetrics, aggregate, group_by, task_metrics
from timelyllm_ros.evaluation.simulation import SimulationResult, simulate
from timelyllm_ros.evaluation.workloads import (
    AUTHORS_WORKLOADS,
    WorkloadSpec,
    generate_tasks,
    load_authors_workload,
    parse_composition,
    resolve_workload,
)
from timelyllm_ros.language.profiles import load_profile

COMM = SchedulerConfig().comm_s
HOT = WorkloadSpec(name='hot', eps=1.0, max_tpe=8, trace_ids=list(range(1, 9)), agents=25,
                   duration_s=60)

_RUNS: dict[tuple, SimulationResult] = {}


def _sim(workload: str, policy: str, seed: int = 0, prefix_caching: bool = True
         ) -> SimulationResult:
    key = (workload, policy, seed, prefix_caching)
    if key not in _RUNS:
        if workload == 'hot':
            tasks = generate_tasks(HOT, seed)
        else:
            tasks = resolve_workload(workload, seed=seed)[1]
        engine = create_engine('sim', prefix_caching=prefix_caching)
        _RUNS[key] = simulate(tasks, policy, seed=seed, engine=engine)
    return _RUNS[key]


def _by_class(result: SimulationResult) -> dict[str, dict[str, float | int]]:
    return group_by([task_metrics(g) for g in result.generations], 'task_class')


# -- invariants ------------------------------------------------------------------------------
def test_wid1_every_task_finished_and_times_add_up() -> None:
    result = _sim('wid1', 'timelyllm')
    tasks = resolve_workload('wid1', seed=0)[1]
    assert len(result.generations) == len(tasks) == 276
    assert result.rejected == []
    for generation in result.generations:
        assert generation.status == TaskStatus.FINISHED, generation.error
        m = task_metrics(generation)
        segments = generation.segments
        previous_end = generation.spec.arrival_time
        waits, execs = [], []
        for k, segment in enumerate(segments):
            assert segment.index == k
            wait = segment.start_time - previous_end
            assert wait >= 0.0                       # executed in order, no overlap
            assert segment.start_time >= segment.dispatch_time + COMM - 1e-12
            assert segment.end_time >= segment.start_time
            waits.append(wait)
            execs.append(segment.exec_s)
            previous_end = segment.end_time
        assert segments[-1].is_last and not any(s.is_last for s in segments[:-1])
        assert m.completion_time_s == pytest.approx(sum(waits) + sum(execs), abs=1e-9)
        assert m.completion_time_s == pytest.approx(m.waiting_time_s + m.execution_time_s,
                                                    abs=1e-9)
        assert m.response_time_s == pytest.approx(waits[0], abs=1e-12)
        assert m.completed and m.error == ''
    assert result.sim_time_s >= max(g.done_time for g in result.generations) - 1e-9
    assert max(result.batch_sizes) <= 256


def test_same_seed_same_metrics_other_seed_other_arrivals() -> None:
    tasks = resolve_workload('wid1', seed=0)[1]
    again = simulate(resolve_workload('wid1', seed=0)[1], 'timelyllm')
    first = _sim('wid1', 'timelyllm')
    assert [task_metrics(g) for g in again.generations] == [
        task_metrics(g) for g in first.generations]
    assert resolve_workload('wid1', seed=0)[1] == tasks
    other = resolve_workload('wid1', seed=1)[1]
    assert [t.arrival_time for t in other] != [t.arrival_time for t in tasks]


# -- the paper's directions -------------------------------------------------------------------
def test_wid1_timelyllm_urgent_utility_beats_vllm() -> None:
    timely = _by_class(_sim('wid1', 'timelyllm'))
    vllm = _by_class(_sim('wid1', 'vllm'))
    assert timely['urgent']['utility_mean'] > vllm['urgent']['utility_mean']
    assert timely['urgent']['completed'] == vllm['urgent']['completed'] == 112


def test_seg_edf_favours_urgent_over_seg_fcfs_under_contention() -> None:
    # Without prefix caching every arrival re-prefills its whole prompt: the engine is
    # saturated and the order in which requests are served matters.
    edf = _by_class(_sim('hot', 'seg-edf', prefix_caching=False))
    fcfs = _by_class(_sim('hot', 'seg-fcfs', prefix_caching=False))
    assert edf['urgent']['utility_mean'] >= fcfs['urgent']['utility_mean']
    assert edf['normal']['utility_mean'] <= fcfs['normal']['utility_mean']
    # the contention is real: both lose utility
    assert fcfs['urgent']['utility_mean'] < 2.0 and fcfs['normal']['utility_mean'] < 1.0


def test_wid3_timelyllm_waits_less_than_vllm() -> None:
    timely = aggregate([task_metrics(g) for g in _sim('wid3', 'timelyllm').generations])
    vllm = aggregate([task_metrics(g) for g in _sim('wid3', 'vllm').generations])
    assert timely['completed'] == vllm['completed'] == timely['tasks']
    assert timely['waiting_time_mean_s'] < vllm['waiting_time_mean_s']


# -- the authors' workloads -------------------------------------------------------------------
@pytest.mark.parametrize('name', sorted(AUTHORS_WORKLOADS))
def test_authors_workload_uses_measured_times(name: str) -> None:
    tasks = resolve_workload(name)[1]
    records = json.loads(AUTHORS_WORKLOADS[name].read_text(encoding='utf-8'))
    assert len(tasks) == len(records)
    result = simulate(tasks, 'timelyllm')
    assert result.rejected == []
    assert all(g.status == TaskStatus.FINISHED for g in result.generations)
    matched = 0
    for generation in result.generations:
        spec = generation.spec
        profile = load_profile(spec.profile)
        recorded = Counter(profile.skill(s).name for s, _ in spec.skill_times)
        planned = Counter(c.skill for seg in generation.segments for c in seg.calls)
        if recorded == planned and all(s.kind == 'skill' for seg in generation.segments
                                       for s in seg.statements):
            # every planned skill took exactly its measured time
            m = task_metrics(generation)
            assert m.execution_time_s == pytest.approx(sum(t for _, t in spec.skill_times),
                                                       abs=1e-9)
            matched += 1
    assert matched > 0
    # the first record (by trigger time): its plan uses exactly its recorded skills
    first = min(records, key=lambda r: r['trigger time'])
    generation = result.generations[0]
    assert generation.spec.arrival_time == first['trigger time']
    assert task_metrics(generation).execution_time_s == pytest.approx(
        first['task_exe_time'], abs=1e-9)


def test_authors_drone_first_task_by_hand() -> None:
    tasks = resolve_workload('authors-drone')[1]
    first = tasks[0]
    # record 0: trace 4 -> T5 "s('scissors');g('scissors')", measured s( 1.5563, g( 2.4613
    assert first.task_type == 'T5' and first.skill_times == (('s(', 1.5563), ('g(', 2.4613))
    assert first.tuf == NORMAL and first.robot_id == 'tello-00'
    result = simulate(tasks[:1], 'timelyllm')
    [generation] = result.generations
    assert [round(s.exec_s, 9) for s in generation.segments] == [1.5563, 2.4613]


# -- workload errors --------------------------------------------------------------------------
def test_unknown_workload() -> None:
    with pytest.raises(WorkloadError, match="unknown workload 'wid9'; known: wid1"):
        resolve_workload('wid9')


@pytest.mark.parametrize('text', ['(1,2', '1,,2', 'a', '()', '(1,(2))', ''])
def test_bad_composition(text: str) -> None:
    with pytest.raises(WorkloadError):
        parse_composition(text)
    with pytest.raises(WorkloadError):
        resolve_workload('wid1', composition=text)


def test_bad_composition_in_spec() -> None:
    with pytest.raises(WorkloadError):
        WorkloadSpec(name='x', eps=1, max_tpe=1, trace_ids=[1], agents=1, duration_s=1,
                     composition='(1,2')


def test_max_tpe_above_agents() -> None:
    spec = WorkloadSpec(name='small', eps=1, max_tpe=8, trace_ids=[1], agents=4, duration_s=10)
    with pytest.raises(WorkloadError, match='max_tpe 8 > agents 4'):
        generate_tasks(spec, 0)


def test_story_workloads_serve_the_same_stories_by_sentence_and_by_paragraph() -> None:
    from timelyllm_ros.language.profiles import load_profile
    from timelyllm_ros.language.segmenter import Segmenter

    _, sentences = resolve_workload('story', seed=3)
    _, paragraphs = resolve_workload('story-para', seed=3)
    assert [t.script for t in sentences] == [t.script for t in paragraphs]
    assert {t.profile for t in sentences} == {'chatbot'}
    assert {t.profile for t in paragraphs} == {'chatbot_paragraph'}
    story = paragraphs[0].script
    cut = {}
    for name in ('chatbot', 'chatbot_paragraph'):
        segmenter = Segmenter(load_profile(name))
        cut[name] = sum(segmenter.feed(piece) is not None for piece in story)
    # every paragraph of a story ends in a sentence: more sentence cuts than paragraph cuts
    assert 2 <= cut['chatbot_paragraph'] < cut['chatbot']


def test_profile_override_must_name_a_profile_of_the_traces_kind() -> None:
    spec = WorkloadSpec(name='x', eps=1, max_tpe=1, trace_ids=[1], agents=1, duration_s=10,
                        profile='chatbot_paragraph')
    with pytest.raises(WorkloadError, match="profile 'chatbot_paragraph' is a chatbot, trace 1 "
                                            'is for a drone'):
        generate_tasks(spec, 0)
    with pytest.raises(WorkloadError, match='profile'):
        generate_tasks(spec.model_copy(update={'profile': 'nosuchrobot'}), 0)
    with pytest.raises(ValueError, match='profile'):
        WorkloadSpec(name='x', eps=1, max_tpe=1, trace_ids=[1], agents=1, duration_s=10,
                     profile='../tello')


def test_unknown_trace_id() -> None:
    spec = WorkloadSpec(name='x', eps=1, max_tpe=1, trace_ids=[99], agents=1, duration_s=10)
    with pytest.raises(WorkloadError, match='unknown trace id 99'):
        generate_tasks(spec, 0)


@pytest.mark.parametrize(('content', 'match'), [
    ([{'trigger time': 1.0, 'agent_id': 0, 'trace_id': 4, 'task_input': 'x',
       'exe_time_detail': [['s(', 1.0]]}], 'record 0'),                       # no tuf
    ([{'trigger time': 1.0, 'agent_id': 0, 'trace_id': 4, 'task_input': 'x',
       'exe_time_detail': [['s(', 1.0]], 'tuf': [1, 1, 0.5]}], 'record 0'),   # zero < ERT
    ([{'trigger time': 1.0, 'agent_id': 0, 'trace_id': 42, 'task_input': 'x',
       'exe_time_detail': [['s(', 1.0]], 'tuf': [1, 1, 1.5]}], 'unknown trace id'),
    ([{'trigger time': 1.0, 'agent_id': 0, 'trace_id': 4, 'task_input': 'x',
       'exe_time_detail': [['s(', 'fast']], 'tuf': [1, 1, 1.5]}], 'record 0'),
    ([], 'non-empty list'),
    ({'a': 1}, 'non-empty list'),
    ('not json {', 'not valid JSON'),
])
def test_authors_file_malformed(tmp_path, content, match: str) -> None:
    path = tmp_path / 'bad.json'
    path.write_text(content if isinstance(content, str) else json.dumps(content),
                    encoding='utf-8')
    with pytest.raises(WorkloadError, match=match):
        load_authors_workload(path)
    with pytest.raises(WorkloadError, match=match):
        resolve_workload(workload_file=str(path))


def test_authors_file_good_record(tmp_path) -> None:
    path = tmp_path / 'one.json'
    path.write_text(json.dumps([{'trigger time': 2.5, 'agent_id': 3, 'trace_id': 5,
                                 'task_input': 'go right', 'exe_time_detail': [['mr', 2.0]],
                                 'tuf': [2, 0.2, 0.5]}]), encoding='utf-8')
    name, [task] = resolve_workload(workload_file=str(path))
    assert name == 'one'
    assert (task.task_type, task.robot_id, task.arrival_time) == ('T6', 'tello-03', 2.5)
    assert task.tuf.beta == 2 and task.tuf.ert_s == 0.2 and task.tuf.zero_s == pytest.approx(0.5)


def test_composition_events() -> None:
    spec = WorkloadSpec(name='comp', eps=1.0, max_tpe=2, trace_ids=[1, 2, 8], agents=5,
                        duration_s=10, composition='(1,2),8')
    assert parse_composition('(1,2),8') == [[1, 2], [8]]
    tasks = generate_tasks(spec, 0)
    events: dict[float, list] = {}
    for task in tasks:
        events.setdefault(task.arrival_time, []).append(task)
    groups = list(events.values())
    assert len(groups) >= 4
    for i, group in enumerate(groups):
        expected = ['T1', 'T2'] if i % 2 == 0 else ['T8']
        assert [t.task_type for t in group] == expected
        assert [t.task_class for t in group] == (['normal', 'normal'] if i % 2 == 0
                                                 else ['urgent'])
        assert len({t.robot_id for t in group}) == len(group)     # distinct agents
    assert [t.task_id for t in tasks] == [f'task-{i:04d}' for i in range(len(tasks))]
    assert generate_tasks(spec, 0) == tasks


# -- metrics ---------------------------------------------------------------------------------
def _row(task_id: str, task_class: str, task_type: str, status: str, response: float,
         waiting: float, execution: float, utility: float, utility_max: float,
         plan_utility: float) -> TaskMetrics:
    finished = status == 'FINISHED'
    nan = math.nan
    return TaskMetrics(
        task_id=task_id, robot_id='r', task_class=task_class, task_type=task_type,
        status=status, arrival_time=0.0, segments=2, response_time_s=response if finished else nan,
        waiting_time_s=waiting if finished else nan,
        execution_time_s=execution if finished else nan,
        completion_time_s=waiting + execution if finished else nan, utility=utility,
        utility_max=utility_max, plan_utility=plan_utility, suspensions=1, error='')


ROWS = [
    _row('a', 'normal', 'T2', 'FINISHED', 0.5, 1.0, 4.0, 1.0, 1.0, 2.0),
    _row('b', 'urgent', 'T10', 'FINISHED', 0.35, 0.5, 2.5, 1.0, 2.0, 3.0),
    _row('c', 'normal', 'T1', 'FAILED', 0.0, 0.0, 0.0, 0.0, 1.0, 0.0),
]


def test_aggregate_by_hand() -> None:
    m = aggregate(ROWS)
    assert m['tasks'] == 3 and m['completed'] == 2
    assert m['utility_mean'] == pytest.approx(2.0 / 3)            # failed task counts as 0
    assert m['utility_max'] == pytest.approx(4.0 / 3)             # sum of beta / n
    assert m['response_time_mean_s'] == pytest.approx(0.425)      # failed one left out
    assert m['waiting_time_mean_s'] == pytest.approx(0.75)
    assert m['completion_time_mean_s'] == pytest.approx(4.0)      # (5 + 3) / 2
    assert m['response_time_p95_s'] == pytest.approx(0.35 + 0.95 * 0.15)
    assert m['plan_utility_mean'] == pytest.approx(5.0 / 3)


def test_rival_metrics_by_hand() -> None:
    rows = [*ROWS, _row('k', 'urgent', 'T10', 'KILLED', 0.0, 0.0, 0.0, 0.0, 2.0, 0.0)]
    rows[0] = replace(rows[0], slo_met=True)
    m = aggregate(rows)
    assert m['killed'] == 1
    assert m['completion_rate'] == pytest.approx(2 / 4)
    assert m['slo_attainment'] == pytest.approx(1 / 4)
    assert m['response_time_p99_s'] == pytest.approx(0.35 + 0.99 * 0.15)
    assert m['completion_time_p95_s'] == pytest.approx(3.0 + 0.95 * 2.0)
    assert m['completion_time_p99_s'] == pytest.approx(3.0 + 0.99 * 2.0)


def test_slo_met_means_completed_within_ert() -> None:
    tasks = [make_spec('fast', tuf=Tuf(beta=1.0, ert_s=10.0, alpha=-1.0)),
             make_spec('slow', tuf=Tuf(beta=1.0, ert_s=0.0, alpha=-1.0))]
    result = simulate(tasks, 'timelyllm', seed=0)
    by_id = {g.task_id: task_metrics(g) for g in result.generations}
    assert by_id['fast'].slo_met
    assert not by_id['slow'].slo_met          # any response time > 0 misses an ERT of 0


def test_aggregate_empty_and_all_failed() -> None:
    empty = aggregate([])
    assert empty['tasks'] == 0 and empty['completed'] == 0
    assert math.isnan(empty['utility_mean']) and math.isnan(empty['utility_max'])
    failed = aggregate(ROWS[2:])
    assert failed['utility_mean'] == 0.0 and failed['utility_max'] == 1.0
    assert math.isnan(failed['response_time_mean_s'])
    assert math.isnan(failed['response_time_p95_s'])


def test_group_by() -> None:
    by_class = group_by(ROWS, 'task_class')
    assert list(by_class) == ['normal', 'urgent']
    assert by_class['normal']['tasks'] == 2 and by_class['normal']['completed'] == 1
    assert by_class['normal']['utility_mean'] == 0.5
    assert by_class['normal']['utility_max'] == 1.0
    assert by_class['normal']['response_time_mean_s'] == 0.5
    assert by_class['urgent']['utility_max'] == 2.0
    assert list(group_by(ROWS, 'task_type')) == ['T1', 'T2', 'T10']     # natural order


def test_task_metrics_from_a_run() -> None:
    scheduler, clock, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec())
    while scheduler.has_work:
        scheduler.tick()
    clock.advance_to(5.5)                       # the robot reports once it is done
    scheduler.report_segment('t0', 0, 1.0, 3.0)
    scheduler.report_segment('t0', 1, 3.5, 5.5)
    m = task_metrics(generation)
    # waits: 1.0 - 0 = 1.0 and 3.5 - 3.0 = 0.5; executions 2.0 + 2.0
    assert (m.response_time_s, m.waiting_time_s, m.execution_time_s) == (1.0, 1.5, 4.0)
    assert m.completion_time_s == 5.5
    # TUF₀(1.0) = 1 (at ERT); TUF₁(0.5) = -2 * 0.5 + 1 = 0; plan utility = 1 + 0
    assert m.utility == 1.0 and m.plan_utility == 1.0 and m.utility_max == 1.0
    # suspended once: the plan ended right after its second segment, without a resume
    assert m.status == 'FINISHED' and m.segments == 2 and m.suspensions == 1


def test_task_metrics_failed() -> None:
    scheduler, _, _ = make_scheduler('timelyllm')
    generation = scheduler.submit(make_spec(plan='fly(3)'))
    while scheduler.has_work:
        scheduler.tick()
    m = task_metrics(generation)
    assert m.status == 'FAILED' and m.utility == 0.0 and m.plan_utility == 0.0
    assert all(np.isnan([m.response_time_s, m.waiting_time_s, m.completion_time_s]))
    assert 'no executable skill' in m.error
    agg = aggregate([m])
    assert agg['utility_mean'] == 0.0 and math.isnan(agg['completion_time_mean_s'])


def _ended(status: TaskStatus, done: float | None, starts: tuple[tuple[float, float], ...] = (),
           task_class: str = 'normal') -> Generation:
    """A goal (arrived at 0) whose robot started and ended the given segments."""
    generation = Generation(make_spec(task_class=task_class), seq=0, status=status)
    generation.done_time = math.nan if done is None else done
    for index, (start, end) in enumerate(starts):
        generation.segments.append(Segment(
            index=index, text='mf(50);', statements=(), cut_time=start, dispatch_time=start,
            estimated_exec_s=1.0, tokens=5, start_time=start, end_time=end))
    return generation


def test_a_goal_without_its_plan_scores_its_tuf_when_the_robot_learns_it() -> None:
    """Issue 26: min(0, TUF₀(t)) at the ending; never more than serving the goal then."""
    early = task_metrics(_ended(TaskStatus.KILLED, done=0.3))
    assert early.utility == 0.0 and early.plan_utility == 0.0      # TUF₀(0.3) = β: capped
    late = task_metrics(_ended(TaskStatus.KILLED, done=2.0))
    assert late.utility == pytest.approx(NORMAL.utility(2.0)) == pytest.approx(-1.0)
    assert late.plan_utility == pytest.approx(-1.0)
    urgent = task_metrics(_ended(TaskStatus.FAILED, done=0.8, task_class='urgent'))
    assert urgent.utility == pytest.approx(2.0 - 6.6667 * 0.6, abs=1e-3)
    # a late kill costs exactly what the late plan would have earned as a response
    served = task_metrics(_ended(TaskStatus.FINISHED, done=5.0, starts=((2.0, 5.0),)))
    assert served.utility == late.utility
    assert late.response_time_s != late.response_time_s              # left out of time means


def test_an_open_goal_scores_at_the_end_of_the_run() -> None:
    waiting = _ended(TaskStatus.WAITING, done=None)
    assert task_metrics(waiting).utility == 0.0                      # no time given: 0
    assert task_metrics(waiting, now=3.0).utility == pytest.approx(NORMAL.utility(3.0))


def test_plan_utility_counts_started_segments_and_the_one_waited_for() -> None:
    # s₀ started at 0.5 (TUF₀ = 1), ended at 2.0; killed at 3.0 while the robot waited 1 s
    # for s₁: TUF₁(1.0) = -1, so the plan scores 1 - 1 = 0; the response counts the ending
    killed = task_metrics(_ended(TaskStatus.KILLED, done=3.0, starts=((0.5, 2.0),)))
    assert killed.plan_utility == pytest.approx(1.0 + NORMAL.utility_suspended(1.0))
    assert killed.utility == pytest.approx(NORMAL.utility(3.0))
    # a robot still executing s₀ when the goal ended was waiting for nothing yet
    busy = task_metrics(_ended(TaskStatus.FAILED, done=3.0, starts=((0.5, math.nan),)))
    assert busy.plan_utility == 1.0


def test_floored_utility_beside_the_signed_one() -> None:
    rows = [task_metrics(_ended(TaskStatus.KILLED, done=2.0)),
            task_metrics(_ended(TaskStatus.FINISHED, done=2.0, starts=((0.5, 2.0),)))]
    m = aggregate(rows)
    assert m['utility_mean'] == pytest.approx((-1.0 + 1.0) / 2)
    assert m['utility_floored_mean'] == pytest.approx(0.5)
    assert m['plan_utility_floored_mean'] == pytest.approx(0.5)
    assert m['completion_rate'] == 0.5


# -- batch modes and the paper's setup ---------------------------------------------------------
def test_fixed_batch_mode_admits_by_cap_and_memory_only() -> None:
    """At a cap of 6 under load, latency-guided admission keeps some batches below the cap;
    the paper's fixed mode fills it whenever enough generations wait."""
    tasks = generate_tasks(HOT, 0)
    runs = {mode: simulate(tasks, 'timelyllm', seed=0, engine=create_engine('sim'),
                           config=SchedulerConfig(max_batch=6, batch_mode=mode))
            for mode in ('latency-guided', 'fixed')}
    assert max(runs['fixed'].batch_sizes) == 6
    assert np.mean(runs['fixed'].batch_sizes) > np.mean(runs['latency-guided'].batch_sizes)
    with pytest.raises(Exception, match='batch_mode'):
        SchedulerConfig(batch_mode='elastic')   # type: ignore[arg-type]


def test_the_paper_setup_keeps_timelyllm_ahead_of_vllm_on_wid1() -> None:
    """With the engine described as the artifact runs vLLM 0.5.4 (max_num_seqs 8, one join
    per step, new-request resumes with their host cost), urgent goals still fare better."""
    tasks = resolve_workload('wid1', seed=0)[1]
    urgent = {}
    for policy in ('vllm', 'timelyllm'):
        engine = create_engine('sim', calibration='llama3-8b-fp16_rtx4090_vllm054')
        result = simulate(tasks, policy, seed=0, engine=engine)
        urgent[policy] = _by_class(result)['urgent']['utility_mean']
        if policy == 'timelyllm':
            assert engine.resumes > 0 and engine.resume_tokens > 0   # resumes were charged
    assert urgent['timelyllm'] > urgent['vllm']


def test_robot_jitter_makes_the_seed_matter_on_recorded_workloads() -> None:
    """Issue 26: the authors' workloads carry recorded arrivals and skill times, so the seed
    changed nothing; a robot jitter draws every execution time from it."""
    _, tasks = resolve_workload('authors-drone', seed=0)
    tasks = sorted(tasks, key=lambda t: t.arrival_time)[:12]

    def completions(seed: int, jitter: float) -> list[float]:
        result = simulate(tasks, 'timelyllm', seed=seed, robot_jitter=jitter)
        return [task_metrics(g).completion_time_s for g in result.generations]

    assert completions(0, 0.0) == completions(1, 0.0)          # recorded times: no draw
    assert completions(0, 0.1) != completions(1, 0.1)
    assert completions(1, 0.1) == completions(1, 0.1)          # and reproducible


@pytest.mark.parametrize('policy', ['timelyllm-share', 'semantic', 'continuum', 'timebill'])
def test_a_simulated_fleet_leaves_no_cyclic_garbage(policy: str) -> None:
    """The simulated fleet runs with the cyclic collector paused (its full collections scan
    every live object): that is safe only while the loop leaves no reference cycles behind.
    A run of the authors' arm workload (preemptions, resumes, a robot failing now and then)
    leaves none for the collector to find, and the collector's state is as it was."""
    import gc

    tasks = resolve_workload('authors-arm', 0)[1][:60]
    found: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == 'stop':
            found.append(info['collected'])

    during: list[bool] = []
    gc.collect()
    gc.callbacks.append(count)
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            result = simulate(tasks, policy, seed=0, robot_fail_probability=0.05,
                              progress=lambda _: during.append(gc.isenabled()))
            assert gc.isenabled() is enabled
            assert result.generations
            gc.collect()
    finally:
        gc.callbacks.remove(count)
        gc.enable()
    assert found and sum(found) == 0
    assert during and not any(during)          # paused through the loop
