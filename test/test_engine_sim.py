"""The calibrated simulated engine: latency model, loading errors, steps, KV and prefix caching."""

from __future__ import annotations

from collections.abc import Collection

import pytest
import yaml
from utils import tiny_calibration

from timelyllm_ros.engines import create_engine
from timelyllm_ros.engines.base import EngineRequest, StepResult
from timelyllm_ros.engines.calibration import (
    CALIBRATION_DIR,
    DEFAULT_CALIBRATION,
    Calibration,
    load_calibration,
)
from timelyllm_ros.engines.kv import KvCacheManager
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import EngineError

CAL = load_calibration()
SCRIPT = ('mf', '(', '50', ')')


def _request(request_id: str, prompt_tokens: int = 100, script=SCRIPT, max_tokens: int = 64,
             prefix_id: str | None = None, prefix_tokens: int = 0) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt='p', prompt_tokens=prompt_tokens,
                         max_tokens=max_tokens, script=script, prefix_id=prefix_id,
                         prefix_tokens=prefix_tokens)


# -- calibration -----------------------------------------------------------------------------
@pytest.mark.parametrize(('tokens', 'ms'), [
    (0, 0.0),
    (-3, 0.0),
    (1, 21.9),                                       # table points
    (1331, 133.31),
    (2884, 328.0),
    (666, 21.9 + (133.31 - 21.9) * 665 / 1330),      # midpoint: 77.605
    (2107.5, (133.31 + 328.0) / 2),                  # midpoint of the 2nd piece: 230.655
    (4437, 328.0 + (328.0 - 133.31)),                # extrapolated one span further: 522.69
])
def test_prefill_s(tokens: float, ms: float) -> None:
    assert CAL.prefill_s(tokens) == pytest.approx(ms / 1000, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(('batch', 'context', 'ms'), [
    (0, 0, 0.0),
    (1, 2884, 21.9),                                 # table point at the reference context
    (4, 4 * 2884, 23.325),
    (256, 256 * 2884, 143.025),
    (3, 3 * 2884, (22.375 + 23.325) / 2),            # interpolated: 22.85
    (512, 512 * 2884, 143.025 + (143.025 - 82.225) / 128 * 256),   # extrapolated: 264.625
    (1, 2884 + 1000, 21.9 + 0.13),                   # +0.00013 ms per extra context token
    (1, 0, 21.9 - 0.00013 * 2884),                   # shorter context is cheaper
])
def test_decode_s(batch: int, context: int, ms: float) -> None:
    assert CAL.decode_s(batch, context) == pytest.approx(ms / 1000, rel=1e-12, abs=1e-15)


def test_a_noisy_calibration_never_gives_a_negative_time() -> None:
    """Measured on a busy machine, a decode curve can fall with the batch and a prefill curve
    can start steep: extrapolated, they went below zero and ran the simulated clock back
    (validate-sim on the CPU engine: 'clock cannot go back')."""
    falling = tiny_calibration(
        prefill_ms={'tokens': [16, 128], 'ms': [30.0, 5.0]},
        decode_ms={'reference_context_tokens': 500, 'batch': [1, 4, 8], 'ms': [20.0, 12.0, 3.0]},
        decode_ms_per_context_token=0.05)
    assert falling.prefill_s(1000) == 0.0 and falling.prefill_s(16) == pytest.approx(0.03)
    assert falling.decode_s(32, 32 * 500) == 0.0          # the curve extrapolated below zero
    assert falling.decode_s(1, 10) == 0.0                 # a short context subtracted too much
    assert falling.decode_s(1, 500) == pytest.approx(0.02)


def test_swap_in_s() -> None:
    # 1331 tokens at 0.00714 ms/token = 9.50334 ms (paper §4.1: 9.50 ms)
    assert CAL.swap_in_s(1331) == pytest.approx(0.00950334)
    assert (CAL.gpu_kv_tokens, CAL.block_size, CAL.max_num_seqs) == (32768, 16, 256)


def test_load_by_path_equals_by_name() -> None:
    assert load_calibration(CALIBRATION_DIR / f'{DEFAULT_CALIBRATION}.yaml') == CAL


def _write(tmp_path, data) -> str:
    path = tmp_path / 'broken.yaml'
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding='utf-8')
    return str(path)


@pytest.mark.parametrize(('change', 'field'), [
    ({'gpu_kv_tokens': -5}, 'gpu_kv_tokens'),
    ({'block_size': 0}, 'block_size'),
    ({'prefill_ms': {'tokens': [1, 10], 'ms': [1.0]}}, 'prefill_ms'),
    ({'decode_ms': {'reference_context_tokens': 0, 'batch': [4, 1], 'ms': [1.0, 2.0]}},
     'decode_ms'),
    ({'surprise': 1}, 'surprise'),
])
def test_load_calibration_invalid_field(tmp_path, change: dict, field: str) -> None:
    data = CAL.model_dump()
    data.update(change)
    path = _write(tmp_path, data)
    with pytest.raises(EngineError) as info:
        load_calibration(path)
    assert path in str(info.value) and field in str(info.value)
    assert 'invalid calibration' in str(info.value)


def test_load_calibration_missing_field(tmp_path) -> None:
    data = CAL.model_dump()
    del data['swap_in_ms_per_token']
    path = _write(tmp_path, data)
    with pytest.raises(EngineError, match='swap_in_ms_per_token') as info:
        load_calibration(path)
    assert path in str(info.value)


def test_load_calibration_bad_yaml(tmp_path) -> None:
    path = _write(tmp_path, 'model: [unclosed\n')
    with pytest.raises(EngineError, match='not valid YAML') as info:
        load_calibration(path)
    assert path in str(info.value)


def test_load_calibration_unknown_name() -> None:
    with pytest.raises(EngineError) as info:
        load_calibration('gpt9_tpu99')
    message = str(info.value)
    assert "no calibration 'gpt9_tpu99'" in message
    assert DEFAULT_CALIBRATION in message.split('bundled: ')[1].split(', ')


def test_create_engine() -> None:
    engine = create_engine('sim', calibration=DEFAULT_CALIBRATION, max_num_seqs=6)
    assert isinstance(engine, SimulatedEngine) and engine.max_num_seqs == 6
    assert engine.calibration == CAL
    tiny = tiny_calibration()
    assert create_engine('sim', calibration=tiny).max_num_seqs == 4
    with pytest.raises(EngineError, match="unknown engine 'nope'; available: sim"):
        create_engine('nope')


# -- steps -----------------------------------------------------------------------------------
def test_prefill_then_decode_then_eos() -> None:
    engine = SimulatedEngine()
    engine.register(_request('a', prompt_tokens=100))
    assert engine.run_cost_s('a') == pytest.approx(CAL.prefill_s(100))
    engine.run('a')
    assert engine.running == ('a',)
    first = engine.step()
    # the prefill iteration computes the prompt and yields the first piece
    assert first.text == {'a': 'mf'} and first.finished == {}
    assert first.prefill_tokens == 100 and first.batch_size == 1
    assert first.duration_s == CAL.prefill_s(100)
    pieces, durations = [], []
    for _ in range(3):
        result = engine.step()
        assert result.prefill_tokens == 0 and result.finished == {}
        pieces.append(result.text['a'])
        durations.append(result.duration_s)
    assert pieces == ['(', '50', ')']
    # decode: one sequence holding 101, 102, 103 tokens
    assert durations == [CAL.decode_s(1, 101), CAL.decode_s(1, 102), CAL.decode_s(1, 103)]
    last = engine.step()
    assert last.text == {} and last.finished == {'a': 'eos'}
    assert last.duration_s == CAL.decode_s(1, 104)
    assert engine.running == ()
    assert engine.steps == 5
    assert engine.busy_s == pytest.approx(CAL.prefill_s(100) + sum(durations) + last.duration_s)
    assert engine.step().duration_s == 0.0        # nothing running


def test_max_tokens_gives_length() -> None:
    engine = SimulatedEngine()
    engine.register(_request('a', max_tokens=2))
    engine.run('a')
    assert engine.step().text == {'a': 'mf'}
    result = engine.step()
    assert result.text == {'a': '('} and result.finished == {'a': 'length'}
    assert engine.running == ()


def test_empty_script_finishes_at_once() -> None:
    engine = SimulatedEngine()
    engine.register(_request('a', script=None))
    engine.run('a')
    result = engine.step()
    assert result.text == {} and result.finished == {'a': 'eos'}


def test_prefill_stalls_other_decodes() -> None:
    engine = SimulatedEngine()
    engine.register(_request('a', prompt_tokens=100))
    engine.run('a')
    engine.step()
    engine.register(_request('b', prompt_tokens=500))
    engine.run('b')
    stalled = engine.step()
    assert stalled.text == {'b': 'mf'}            # 'a' produced nothing this iteration
    assert stalled.duration_s == CAL.prefill_s(500)
    assert stalled.prefill_tokens == 500 and stalled.batch_size == 2
    both = engine.step()
    assert both.text == {'a': '(', 'b': '('}
    # context: a holds 101, b holds 501
    assert both.duration_s == CAL.decode_s(2, 602)
    assert engine.decode_step_s(2) == CAL.decode_s(2, 2 * (102 + 502) // 2)


def test_decode_step_s_model() -> None:
    engine = SimulatedEngine()
    # empty batch: the reference context per sequence
    assert engine.decode_step_s(4) == CAL.decode_s(4, 4 * 2884)


def test_pause_keeps_kv_resume_costs_nothing() -> None:
    engine = SimulatedEngine()
    engine.register(_request('a'))
    engine.run('a')
    engine.step()
    engine.pause('a')
    assert engine.running == ()
    assert engine.kv.location('a') == 'gpu'
    assert engine.run_cost_s('a') == 0.0
    engine.run('a')
    result = engine.step()
    assert result.prefill_tokens == 0 and result.text == {'a': '('}
    assert result.duration_s == CAL.decode_s(1, 101)


def test_eviction_to_host_then_swap_in() -> None:
    tiny = tiny_calibration()                         # 10 GPU blocks, 10 host blocks
    engine = SimulatedEngine(calibration=tiny)
    engine.register(_request('a', prompt_tokens=64))
    engine.run('a')
    engine.step()                                     # a holds 65 tokens = 5 blocks
    engine.pause('a')
    engine.register(_request('b', prompt_tokens=100))  # needs 116 tokens = 8 blocks > 5 free
    assert engine.can_run('b')
    engine.run('b')
    assert engine.kv.location('a') == 'host' and engine.kv.swaps_out == 1
    # resume cost: swap 65 tokens back at 0.01 ms/token
    assert engine.run_cost_s('a') == pytest.approx(65 * 0.01 / 1000)
    assert not engine.can_run('a')                    # 'b' (7 blocks) is running: 3 free < 6
    engine.release('b')
    engine.run('a')
    result = engine.step()
    assert result.duration_s == pytest.approx(65 * 0.01 / 1000)
    assert result.prefill_tokens == 0 and result.text == {}   # swap-in iteration only
    assert engine.step().text == {'a': '('}


def test_eviction_drops_when_host_full_then_reprefill() -> None:
    tiny = tiny_calibration(host_kv_tokens=0)
    engine = SimulatedEngine(calibration=tiny)
    engine.register(_request('a', prompt_tokens=64))
    engine.run('a')
    engine.step()
    engine.pause('a')
    engine.register(_request('b', prompt_tokens=100))
    engine.run('b')
    assert engine.kv.location('a') == 'none' and engine.kv.drops == 1
    assert engine.kv.swaps_out == 0
    # prompt + generated token re-prefilled: 65 tokens at 0.1 ms/token
    assert engine.run_cost_s('a') == pytest.approx(0.0065)
    engine.release('b')
    engine.run('a')
    result = engine.step()
    assert result.prefill_tokens == 65 and result.duration_s == pytest.approx(0.0065)
    assert result.text == {'a': '('}                # continues where it stopped


def test_prefix_caching() -> None:
    engine = SimulatedEngine()
    engine.register(_request('p1', prompt_tokens=1000, prefix_id='tello', prefix_tokens=900))
    engine.register(_request('p2', prompt_tokens=1050, prefix_id='tello', prefix_tokens=900))
    assert engine.kv.tokens('p1') == 100              # the shared prefix is counted once
    assert engine.run_cost_s('p1') == CAL.prefill_s(1000)
    engine.run('p1')
    assert (engine.prefix_hits, engine.prefix_misses) == (0, 1)
    assert engine.step().prefill_tokens == 1000
    # second request of the same prefix prefills only its task part
    assert engine.run_cost_s('p2') == CAL.prefill_s(150)
    engine.run('p2')
    assert (engine.prefix_hits, engine.prefix_misses) == (1, 1)
    result = engine.step()
    assert result.prefill_tokens == 150 and result.duration_s == CAL.prefill_s(150)
    # after a reset the next request of the prefix prefills its whole prompt again
    engine.reset_prefix_cache()
    engine.register(_request('p3', prompt_tokens=1000, prefix_id='tello', prefix_tokens=900))
    assert engine.run_cost_s('p3') == CAL.prefill_s(1000)


def test_a_decode_whose_members_changed_pays_the_batch_change_once() -> None:
    """The transformers engine restacks its batch's KV when the members change: the first
    decode of a new batch costs that much more, per KV token at the widest context."""
    cal = CAL.model_copy(update={'engine': CAL.engine.model_copy(
        update={'batch_change_ms_per_token': 0.01})})
    engine = SimulatedEngine(cal)
    for rid in ('a', 'b'):
        engine.register(_request(rid, prompt_tokens=500, max_tokens=8, script=('x',) * 8))
        engine.run(rid)
    engine.step()                                    # the prefill
    first, second = engine.step(), engine.step()
    assert first.duration_s - second.duration_s == pytest.approx(2 * 501 * 0.01e-3, rel=0.01)
    engine.pause('b')
    alone = engine.step()                            # members changed again: charged again
    assert alone.duration_s > engine.step().duration_s


def test_prefix_caching_off() -> None:
    engine = SimulatedEngine(prefix_caching=False)
    for rid in ('p1', 'p2'):
        engine.register(_request(rid, prompt_tokens=1000, prefix_id='tello', prefix_tokens=900))
        assert engine.kv.tokens(rid) == 1000
        engine.run(rid)
        assert engine.step().prefill_tokens == 1000
    assert (engine.prefix_hits, engine.prefix_misses) == (0, 0)


def test_fail_at_step() -> None:
    engine = SimulatedEngine(fail_at_step=2)
    engine.register(_request('a'))
    engine.run('a')
    engine.step()
    with pytest.raises(EngineError, match='simulated engine failure at iteration 2'):
        engine.step()


def test_engine_request_errors() -> None:
    engine = SimulatedEngine()
    engine.register(_request('a'))
    with pytest.raises(EngineError, match='already registered'):
        engine.register(_request('a'))
    with pytest.raises(EngineError, match='prefix_tokens'):
        engine.register(_request('b', prompt_tokens=10, prefix_id='x', prefix_tokens=11))
    with pytest.raises(EngineError, match="unknown request 'zz'"):
        engine.pause('zz')
    with pytest.raises(EngineError, match="unknown request 'zz'"):
        engine.run('zz')
    big = SimulatedEngine(calibration=tiny_calibration())
    big.register(_request('huge', prompt_tokens=500))
    assert not big.can_run('huge')
    with pytest.raises(EngineError, match='does not fit'):
        big.run('huge')


def test_release_frees_memory() -> None:
    engine = SimulatedEngine(calibration=tiny_calibration())
    engine.register(_request('a', prompt_tokens=100))
    engine.run('a')
    assert engine.kv.gpu_free == 3
    engine.release('a')
    assert engine.kv.gpu_free == 10 and engine.running == ()
    with pytest.raises(EngineError):
        engine.run('a')


def test_max_num_seqs() -> None:
    engine = SimulatedEngine(max_num_seqs=1)
    engine.register(_request('a'))
    engine.register(_request('b'))
    engine.run('a')
    assert engine.can_run('a') and not engine.can_run('b')


# -- KvCacheManager --------------------------------------------------------------------------
@pytest.mark.parametrize(('gpu', 'host', 'block'), [(0, 1, 16), (1, -1, 16), (1, 1, 0)])
def test_kv_invalid(gpu: int, host: int, block: int) -> None:
    with pytest.raises(ValueError):
        KvCacheManager(gpu, host, block)


def test_kv_blocks() -> None:
    kv = KvCacheManager(10, 4, 16)
    assert [kv.blocks(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_kv_accounting() -> None:
    kv = KvCacheManager(gpu_blocks=10, host_blocks=4, block_size=16)
    kv.add('a', 40)                                   # 3 blocks
    assert kv.location('a') == 'none' and kv.gpu_free == 10
    assert kv.dropped_tokens == 0                     # never built: nothing to rebuild
    assert kv.can_place('a', 16)                      # 56 tokens -> 4 blocks
    assert kv.place('a', 16) == 'none'
    assert kv.location('a') == 'gpu' and kv.gpu_free == 7
    assert kv.grow('a', 8) and kv.tokens('a') == 48 and kv.gpu_free == 7
    assert kv.grow('a') and kv.tokens('a') == 49 and kv.gpu_free == 6
    # already on the GPU: only the growth counts
    assert kv.can_place('a', 16 * 6 - 1) and not kv.can_place('a', 16 * 7)
    kv.add('b', 100)                                  # 7 blocks > 6 free
    assert not kv.can_place('b', 0)
    kv.pause('a')                                     # 'a' becomes evictable (4 blocks)
    assert kv.can_place('b', 0)
    assert kv.place('b', 0) == 'none'
    assert kv.location('a') == 'host' and kv.swaps_out == 1 and kv.gpu_free == 3
    kv.add('c', 30)                                   # 2 blocks
    kv.place('c', 0)
    assert kv.gpu_free == 1
    kv.pause('b')
    kv.pause('c')
    kv.add('d', 160)                                  # 10 blocks = 1 free + 7 + 2 evictable
    assert kv.can_place('d', 0) and not kv.can_place('d', 1)
    kv.place('d', 0)
    # host holds 'a' (4 of 4 blocks): 'b' and 'c' are dropped, least recently paused first
    assert (kv.location('b'), kv.location('c')) == ('none', 'none')
    assert kv.drops == 2 and kv.gpu_free == 0
    assert kv.tokens('b') == 100                      # length remembered for re-prefill
    assert kv.dropped_tokens == 100 + 30              # both must be rebuilt to run again
    # full GPU, nothing evictable: growth fails and changes nothing
    assert not kv.grow('d', 1) and kv.tokens('d') == 160
    kv.drop('d')
    assert kv.location('d') == 'none' and kv.gpu_free == 10 and kv.tokens('d') == 160
    kv.drop('d')                                      # dropped once, counted once
    assert kv.dropped_tokens == 100 + 30 + 160
    kv.shrink('c', 10)                                # compression forgets 10 of them
    kv.place('b', 0)                                  # rebuilt
    assert kv.dropped_tokens == 20 + 160
    kv.remove('c')
    kv.remove('b')
    assert kv.dropped_tokens == 160
    # swap 'a' back in: host blocks freed, so an eviction can go to the host again
    assert kv.place('a', 0) == 'host' and kv.gpu_free == 6
    kv.pause('a')
    kv.place('d', 0)                                  # evicts 'a' (4 blocks) to the host
    assert kv.location('a') == 'host' and kv.swaps_out == 2
    kv.remove('a')                                    # frees its host blocks
    kv.remove('d')
    assert kv.gpu_free == 10 and kv.dropped_tokens == 0
    kv.remove('missing')                              # no-op
    with pytest.raises(KeyError):
        kv.location('a')


def test_kv_pause_of_non_gpu_is_noop() -> None:
    kv = KvCacheManager(gpu_blocks=2, host_blocks=0, block_size=16)
    kv.add('a', 16)
    kv.pause('a')                                     # not placed: nothing to evict
    kv.add('b', 32)
    assert kv.can_place('b', 0)
    kv.place('b', 0)
    assert kv.gpu_free == 0 and kv.location('a') == 'none' and kv.drops == 0


def test_calibration_model_type() -> None:
    assert isinstance(CAL, Calibration)


def test_the_simulator_declares_its_capabilities_and_reports_stats() -> None:
    engine = SimulatedEngine()
    assert all(engine.supports(c) for c in ('evict', 'compress_kv', 'scripted_plans'))
    assert not engine.supports('grammar')
    engine.register(EngineRequest('a', 'p', 10, 5, script=('mf', '(', '5', '0', ')')))
    engine.run('a')
    produced = [engine.step() for _ in range(3)]
    assert [r.token_ids for r in produced] == [{'a': (0,)}, {'a': (1,)}, {'a': (2,)}]
    stats = engine.stats()
    assert stats.steps == 3 and stats.busy_s == pytest.approx(sum(r.duration_s for r in produced))
    assert stats.model == engine.calibration.model and stats.hardware.startswith('simulated ')
    assert engine.kv_accounting() is engine.kv and engine.cost_model() is engine.calibration
    with engine:
        pass                                          # a context manager; close() is a no-op


# -- engine behaviour (calibration schema 2) -------------------------------------------------
def _engine(**behaviour: object) -> SimulatedEngine:
    """The tiny calibration (prefill 0.1 ms/token, decode 20 ms + 10 ms per extra sequence,
    blocks of 16 tokens) with 100 blocks and an engine section."""
    return SimulatedEngine(tiny_calibration(schema_version=2, engine=behaviour,
                                            gpu_kv_tokens=1600))


def test_schema_1_files_load_with_the_idealised_engine_and_reject_an_engine_section():
    assert CAL.schema_version == 1 and CAL.engine.resume == 'kept_kv'
    assert CAL.engine.iteration_overhead_ms == 0 and CAL.engine.prefill_token_budget is None
    with pytest.raises(ValueError, match='schema_version: 2'):
        tiny_calibration(engine={'iteration_overhead_ms': 3.0})
    with pytest.raises(ValueError, match='resume'):
        tiny_calibration(schema_version=2, engine={'resume': 'teleport'})
    with pytest.raises(ValueError, match='schema_version'):
        tiny_calibration(schema_version=3)


def test_every_iteration_pays_the_fixed_cost():
    engine = _engine(iteration_overhead_ms=5.0)
    engine.register(_request('a', prompt_tokens=100))
    engine.run('a')
    assert engine.step().duration_s == pytest.approx(0.010 + 0.005)     # prefill 100 tokens
    assert engine.step().duration_s == pytest.approx(0.020 + 0.005)     # decode at batch 1


@pytest.mark.parametrize(('context', 'tail'), [
    (1, 1), (15, 15), (16, 16), (17, 1), (32, 16), (33, 1), (40, 8)])
def test_resume_tail_is_what_follows_the_last_full_block_the_cache_may_return(context, tail):
    cal = tiny_calibration(schema_version=2, engine={'resume': 'new_request_prefix_cache'})
    assert cal.resume_tail_tokens(context) == tail
    assert tiny_calibration().resume_tail_tokens(context) == 0          # kept KV: free


def test_a_new_request_resume_prefills_its_tail_once_and_stalls_the_batch():
    engine = _engine(resume='new_request_prefix_cache')
    for name in ('a', 'b'):
        engine.register(_request(name, prompt_tokens=20, script=('x',) * 10))
        engine.run(name)
    engine.step()                                                       # both prefilled
    engine.step()                                                       # 21 tokens each
    engine.pause('a')
    assert engine.run_cost_s('a') == pytest.approx(CAL_TINY_PREFILL_S * 6)  # 22 → tail 6
    engine.run('a')
    resumed = engine.step()
    assert resumed.prefill_tokens == 6 and resumed.text == {'a': 'x'}   # b stalled
    assert resumed.batch_size == 2 and resumed.prefix_cached_tokens == 22 - 6
    assert resumed.duration_s == pytest.approx(CAL_TINY_PREFILL_S * 6)
    assert (engine.resumes, engine.resume_tokens) == (1, 6)
    assert engine.step().text == {'a': 'x', 'b': 'x'}                   # then both decode
    # the same under kept KV: free, no stall
    kept = _engine()
    kept.register(_request('a', prompt_tokens=20, script=('x',) * 10))
    kept.run('a')
    kept.step()
    kept.pause('a')
    kept.run('a')
    assert kept.step().prefill_tokens == 0 and (kept.resumes, kept.resume_tokens) == (1, 0)


CAL_TINY_PREFILL_S = 0.0001     # the tiny calibration's prefill per token (s)


def test_join_limit_starts_one_prefill_per_iteration():
    engine = _engine(max_joins_per_iteration=1)
    for name in ('a', 'b', 'c'):
        engine.register(_request(name, prompt_tokens=100))
        engine.run(name)
    produced = [set(engine.step().text) for _ in range(3)]
    assert produced == [{'a'}, {'b'}, {'c'}]                            # one joins per step
    assert set(engine.step().text) == {'a', 'b', 'c'}


def test_chunked_prefill_spends_the_budget_beside_the_decodes():
    engine = _engine(prefill_token_budget=64)
    engine.register(_request('a', prompt_tokens=10, script=('x',) * 10))
    engine.run('a')
    assert engine.step().text == {'a': 'x'}                              # 10 ≤ 64: done at once
    engine.register(_request('b', prompt_tokens=100, script=('y',) * 10))
    engine.run('b')
    first = engine.step()                   # a decodes (1 token), b gets the other 63
    assert first.text == {'a': 'x'} and first.prefill_tokens == 63
    assert first.duration_s == pytest.approx(0.020 + 63 * CAL_TINY_PREFILL_S)
    second = engine.step()                  # b's last 37 tokens: its first token too
    assert second.text == {'a': 'x', 'b': 'y'} and second.prefill_tokens == 37


def test_a_prefill_over_a_cached_prefix_pays_for_attending_to_it():
    cal = tiny_calibration(schema_version=2, prefill_ms_per_context_token=0.001,
                           gpu_kv_tokens=1600)
    engine = SimulatedEngine(cal)
    engine.register(_request('a', prompt_tokens=120, prefix_id='kind', prefix_tokens=100))
    engine.run('a')
    assert engine.step().duration_s == pytest.approx(120 * CAL_TINY_PREFILL_S)  # cold
    engine.register(_request('b', prompt_tokens=120, prefix_id='kind', prefix_tokens=100))
    assert engine.run_cost_s('b') == pytest.approx(20 * CAL_TINY_PREFILL_S + 20 * 100 * 1e-6)
    engine.run('b')
    warm = engine.step()                 # 20 new tokens after 100 cached ones
    assert warm.prefill_tokens == 20
    assert warm.duration_s == pytest.approx(20 * CAL_TINY_PREFILL_S + 20 * 100 * 1e-6)


def test_outputs_one_iteration_late_hand_each_iteration_out_at_the_next_step():
    """vLLM on CUDA with this project's logits processor (issue 26, H200): a step runs its
    iteration to its end and hands out the outputs of the one before."""
    engine = _engine(outputs_one_iteration_late=True)
    engine.register(_request('a', prompt_tokens=100))
    engine.run('a')
    launched = engine.step()                      # the prefill ran; nothing handed out yet
    assert launched.text == {} and launched.duration_s == pytest.approx(0.010)
    first = engine.step()                         # the first decode ran; the prefill's token
    assert first.text == {'a': 'mf'} and first.prefill_tokens == 100
    assert first.duration_s == pytest.approx(0.020)
    pieces = [engine.step().text['a'] for _ in range(2)]
    assert pieces == ['(', '50']
    ended = engine.step()                         # ran the EOS iteration, hands out ')'
    assert ended.text == {'a': ')'} and ended.finished == {}
    assert engine.running == ()
    flush = engine.step()                         # vLLM decodes once more before it sees EOS
    assert flush.finished == {'a': 'eos'} and flush.duration_s == pytest.approx(0.020)
    assert engine.step().duration_s == 0.0
    assert engine.busy_s == pytest.approx(0.010 + 5 * 0.020)   # the flush's decode counted


def test_a_cut_under_late_outputs_throws_the_token_past_it_away():
    """The scheduler cuts on what it was handed; the token the engine computed past it is
    not kept: the resumed generation goes on from the cut, its text as if never cut."""
    engine = _engine(outputs_one_iteration_late=True)
    engine.register(_request('a', prompt_tokens=100))
    engine.run('a')
    engine.step()
    assert engine.step().text == {'a': 'mf'}      # 'a' computed '(' in that step too
    engine.pause('a')
    blocks_paused = engine.kv.tokens('a')
    assert blocks_paused == 101                   # prompt + 'mf': '(' taken back
    engine.run('a')
    text = ''.join(engine.step().text.get('a', '') for _ in range(6))
    assert text == '(50)' and engine.running == ()


def test_a_block_prefix_cache_serves_a_repeated_prompt_but_its_last_partial_block():
    """vLLM caches every full KV block (H200 recording: eight goals joining at once
    prefilled 118 new tokens of 7 174): a goal repeating an earlier prompt prefills what
    follows its last full block; another prompt, or the per-kind-prefix cache, all of it."""
    def first_prefill(engine: SimulatedEngine, request_id: str, prompt: str) -> int:
        engine.register(EngineRequest(request_id=request_id, prompt=prompt, prompt_tokens=100,
                                      max_tokens=4, script=SCRIPT))
        engine.run(request_id)
        return engine.step().prefill_tokens

    blocks = _engine(prompt_cache='blocks')
    assert first_prefill(blocks, 'a', 'go to the door') == 100
    assert first_prefill(blocks, 'b', 'go to the door') == 100 - 96    # 6 full blocks cached
    assert blocks.run_cost_s('b') == 0.0
    assert first_prefill(blocks, 'c', 'pick the cup') == 100
    blocks.reset_prefix_cache()
    assert first_prefill(blocks, 'd', 'go to the door') == 100
    kind_prefix = _engine()
    assert first_prefill(kind_prefix, 'a', 'go to the door') == 100
    assert first_prefill(kind_prefix, 'b', 'go to the door') == 100
    uncached = SimulatedEngine(blocks.calibration, prefix_caching=False)
    assert first_prefill(uncached, 'a', 'go to the door') == 100
    assert first_prefill(uncached, 'b', 'go to the door') == 100


class _CheckedTotal(SimulatedEngine):
    """The simulator, checking at every read of the decode-step model and after every
    iteration that the running batch's attended total it keeps equals the batch summed
    again."""

    checks = 0

    def _check(self) -> None:
        if self._running and self._attended_total is not None:
            assert self._attended_total == sum(self._attended_tokens(r) for r in self._running)
            self.checks += 1

    def _model_decode_step_s(self, batch_size: int) -> float:
        self._check()
        return super()._model_decode_step_s(batch_size)

    def step(self, only: Collection[str] | None = None) -> StepResult:
        result = super().step(only)
        self._check()
        return result


@pytest.mark.parametrize('late, prefix_caching, max_num_seqs', [
    (False, True, None),
    (False, False, 8),          # contended: dropped and swapped contexts
    (True, True, None),         # outputs one iteration late: cut tokens taken back
])
def test_the_kept_attended_total_is_the_batch_summed(late: bool, prefix_caching: bool,
                                                     max_num_seqs: int | None) -> None:
    """Joins, cuts, ends, preemptions, evictions, compression (TimeBill) and each iteration's
    tokens keep the total the decode-step model reads, exactly (integers)."""
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import resolve_workload
    from timelyllm_ros.policies import POLICIES

    _, tasks = resolve_workload('wid2', seed=0)
    calibration = CAL.model_copy(update={'engine': CAL.engine.model_copy(
        update={'outputs_one_iteration_late': late})})
    checks = 0
    for policy in POLICIES:
        engine = _CheckedTotal(calibration, prefix_caching=prefix_caching,
                               max_num_seqs=max_num_seqs)
        result = simulate(tasks, policy, seed=0, engine=engine)
        assert result.generations
        checks += engine.checks
    assert checks > 1000
