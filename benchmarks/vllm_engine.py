"""The vLLM engine against raw vLLM, side by side in one process on the same model and prompts.

    python3 benchmarks/vllm_engine.py --model DIR [--engine-opt KEY=VALUE ...]
        [--batch-sizes 1,8,32] [--prompt-tokens 240] [--decode-steps 48]
        [--variants raw,engine,processor,grammar,grammar-read] [--min-statements N]
        [--json FILE]

One after the other, each started after the previous one is closed:

* ``raw``: vLLM's ``LLMEngine`` as a user drives it (token-id prompts, ``add_request``,
  ``step``), with prefix caching, in this process;
* ``engine``: the project's engine with ``grammar=False`` (vLLM chooses the tokens);
* ``processor``: the engine with its logits processor installed (``grammar=True``), requests
  without grammar or penalty: what the processor alone costs (vLLM's V1 model runner);
* ``grammar``: the planner's path: the tello plan grammar grounded in the prompt (its objects
  named only from its words, as the planner grounds a goal's), the repetition penalty, early end;
* ``grammar-read``: the same, with the processor reading each row's argmax and checking it before
  masking (what it does on a CPU) instead of masking every row on the device and reading
  nothing back (what it does on a GPU): the two rules side by side in one run.

Plans under the grammar may not end before ``--min-statements`` statements (by default as many as
the decode steps: they run to the token limit, as raw vLLM's ``ignore_eos`` requests do). The
planner's grammar is otherwise unchanged, so each step masks every row as the planner's does;
with dummy weights a plan free to end ends after a few tokens, and no step would decode a whole
batch of 32 (``--min-statements 0``: the planner's grammar as it is).

For each: decode time per step at each batch size (the median over steps that decoded the
whole batch: every member had its first token and the step prefilled nothing, so the chunks of
a batch's prompt prefill are not counted; the engine's whole ``step()``, its Python included;
the count of such steps beside it; with the logits processor, the time its ``apply`` took in
those steps, on the host), the prefill step of
the batch's prompts, and a resume (a generation cut after 16 tokens and run again: the step that
brings it back, served from the prefix cache). Then the ratios to raw, and the memory before
each start and after each close (CUDA: free device memory; CPU: this process's RSS), which shows
whether ``close()`` gives the memory back (a second engine of the same settings starts in the same
process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import yaml

VARIANTS = ('raw', 'engine', 'grammar', 'processor', 'grammar-read')
WORDS = ('the drone flies over the table and looks for a red box near the window while the arm '
         'waits').split()
RESUME_AFTER = 16


def prompt_text(salt: int, words: int) -> str:
    """A prompt of about ``words`` tokens that shares no prefix block with another salt's."""
    return ' '.join([f'#{salt}', *(WORDS[(i + salt) % len(WORDS)] for i in range(words - 1))])


def memory() -> dict[str, float]:
    """Free device memory (CUDA) or this process's resident memory (CPU), in GiB."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {'cuda_free_gib': free / 2**30, 'cuda_total_gib': total / 2**30}
    with open('/proc/self/statm') as statm:
        pages = int(statm.read().split()[1])
    return {'rss_gib': pages * os.sysconf('SC_PAGE_SIZE') / 2**30}


def median_ms(times: list[float]) -> float | None:
    return statistics.median(times) * 1e3 if times else None


def run_raw(model: str, options: dict[str, str], prompts: dict[int, list[list[int]]],
            steps: int) -> dict[str, Any]:
    """Raw vLLM: each batch's prompts as token ids, greedy, ``ignore_eos``."""
    os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    from timelyllm_ros.engines.vllm_engine import compile_hooks_added, shutdown_vllm

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    if 'kv_cache_gb' in options:      # what the engine sets for this option (CPU build)
        os.environ['VLLM_CPU_KVCACHE_SPACE'] = str(options['kv_cache_gb'])
    args = {k: yaml.safe_load(v) for k, v in options.items() if k in fields}
    with compile_hooks_added() as hooks:
        llm = LLMEngine.from_engine_args(EngineArgs(model=model, enable_prefix_caching=True,
                                                    **args))
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)
    out: dict[str, Any] = {'decode_ms': {}, 'prefill_ms': {}}
    rid = 0
    outputs: dict[str, list[int]] = {}
    for batch, batch_prompts in prompts.items():
        names = []
        for ids in batch_prompts:
            rid += 1
            names.append(str(rid))
            llm.add_request(str(rid), TokensPrompt(prompt_token_ids=ids), params)
        decode: list[float] = []
        first = None
        while llm.has_unfinished_requests():
            live = llm.get_num_unfinished_requests()
            formed = all(outputs.get(name) for name in names)   # no prompt left to prefill
            start = time.perf_counter()
            for output in llm.step():
                outputs.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
            took = time.perf_counter() - start
            if first is None:
                first = took
            elif live == batch and formed:
                decode.append(took)
        out['decode_ms'][batch] = median_ms(decode[1:-1])
        out.setdefault('decode_steps', {})[batch] = len(decode[1:-1])
        out['prefill_ms'][batch] = first * 1e3 if first is not None else None
        if 'resume_ms' not in out:
            # a resume, as the engine makes it: the first prompt and its first RESUME_AFTER
            # outputs as a new request's prompt
            resumed = batch_prompts[0] + outputs[names[0]][:RESUME_AFTER]
            llm.add_request('resume', TokensPrompt(prompt_token_ids=resumed),
                            SamplingParams(max_tokens=1, temperature=0.0))
            start = time.perf_counter()
            while 'resume_cached_tokens' not in out:     # to its first token
                for output in llm.step():
                    out['resume_cached_tokens'] = int(output.num_cached_tokens or 0)
            out['resume_ms'] = (time.perf_counter() - start) * 1e3
            while llm.has_unfinished_requests():
                llm.step()
    shutdown_vllm(llm, hooks)
    return out


def long_plans(gbnf: str, statements: int) -> str:
    """A plan grammar whose plans hold at least ``statements`` statements: the repetition of
    the plan's top-level statements given a lower bound (end of text is refused until then).
    It is the root's, or under a flight rule the ``flying`` rule's, which then no longer
    begins with a landing (a plan of one ``ld()`` would end at once)."""
    repeated = '(sep stmt-0-20)*'
    lines = gbnf.split('\n')
    if not lines[0].startswith('root ::='):
        raise ValueError(f'not a plan grammar root: {lines[0]!r}')
    flying = 'flying ::= (stmt-0-20 (sep stmt-0-20)* (sep landed)?) | landed'
    if repeated in lines[0]:
        at, opening = 0, ''
    elif flying in lines:
        at, opening = lines.index(flying), ' | landed'
    else:
        raise ValueError(f'not a plan grammar root: {lines[0]!r}')
    if statements <= 1:
        return gbnf
    bounded = lines[at].replace(repeated, f'(sep stmt-0-20){{{statements - 1},}}')
    lines[at] = bounded.removesuffix(opening)
    return '\n'.join(lines)


@contextlib.contextmanager
def processor_timed(times: list[float]) -> Iterator[None]:
    """Each call of the engine's logits processor appends its host time to ``times`` (vLLM
    runs in this process: the class is patched where vLLM calls it)."""
    from timelyllm_ros.engines.vllm_engine import _forced_tokens_processor

    processor: Any = _forced_tokens_processor()
    apply = processor.apply

    def timed(self: Any, logits: Any) -> Any:
        start = time.perf_counter()
        try:
            return apply(self, logits)
        finally:
            times.append(time.perf_counter() - start)

    processor.apply = timed
    try:
        yield
    finally:
        processor.apply = apply


def run_engine(model: str, options: dict[str, str], prompts: dict[int, list[str]],
               steps: int, variant: str, min_statements: int) -> dict[str, Any]:
    """The project's engine over the same prompts; its whole ``step()`` is timed."""
    from timelyllm_ros.core.plan_requests import REPETITION_PENALTY
    from timelyllm_ros.engines import create_engine
    from timelyllm_ros.engines.base import EngineRequest
    from timelyllm_ros.engines.vllm_engine import VllmEngine
    from timelyllm_ros.language.grammar import plan_grammar
    from timelyllm_ros.language.grounding import task_objects
    from timelyllm_ros.language.profiles import load_profile

    engine = create_engine('vllm', model, grammar=variant != 'engine', **options)
    assert isinstance(engine, VllmEngine)
    profile = load_profile('tello')
    planner = variant == 'grammar'

    def request(rid: str, text: str, tokens: int) -> EngineRequest:
        plans = plan_grammar(profile, task_objects(text)) if planner else None
        grammar = long_plans(plans.gbnf, min_statements) if plans is not None else None
        return EngineRequest(rid, text, 1, tokens, grammar=grammar,
                             end_within=2 * profile.max_segment_tokens if planner else 0,
                             repetition_penalty=REPETITION_PENALTY if planner else 1.0)

    out: dict[str, Any] = {'decode_ms': {}, 'prefill_ms': {}, 'vllm_step_ms': {},
                           'processor_ms': {}}
    applied: list[float] = []
    with processor_timed(applied):
        run_batches(engine, prompts, request, steps, out, applied)
    run_resume(engine, prompts, request, out)
    out['logits_processor'] = engine.logits_processor
    engine.close()
    return out


def run_batches(engine: Any, prompts: dict[int, list[str]], request: Callable[..., Any],
                steps: int, out: dict[str, Any], applied: list[float]) -> None:
    """Each batch's prompts decoded together to their end; the steps timed."""
    seq = 0
    for batch, texts in prompts.items():
        rids = []
        for text in texts:
            seq += 1
            rids.append(f'r{seq}')
            engine.register(request(rids[-1], text, steps))
            engine.run(rids[-1])
        decode: list[float] = []
        inside: list[float] = []
        processor: list[float] = []
        first = None
        while engine.running:
            live = len(engine.running)
            formed = all(engine.token_ids(rid) for rid in rids)
            calls = len(applied)
            start = time.perf_counter()
            result = engine.step()
            took = time.perf_counter() - start
            if first is None:
                first = took
            elif live == batch and formed and not result.prefill_tokens:
                decode.append(took)
                inside.append(result.duration_s)
                processor.append(sum(applied[calls:]))
        for rid in rids:
            engine.release(rid)
        out['decode_ms'][batch] = median_ms(decode[1:-1])
        out.setdefault('decode_steps', {})[batch] = len(decode[1:-1])
        out['vllm_step_ms'][batch] = median_ms(inside[1:-1])
        out['processor_ms'][batch] = median_ms(processor[1:-1]) if applied else None
        out['prefill_ms'][batch] = first * 1e3 if first is not None else None


def run_resume(engine: Any, prompts: dict[int, list[str]], request: Callable[..., Any],
               out: dict[str, Any]) -> None:
    """The step that brings back a generation cut after ``RESUME_AFTER`` tokens."""
    # a resume: cut after RESUME_AFTER tokens, run again, time the step that brings it back
    rid = 'resume'
    engine.register(request(rid, prompts[min(prompts)][0], RESUME_AFTER + 8))
    engine.run(rid)
    while len(engine.token_ids(rid)) < RESUME_AFTER and rid in engine.running:
        engine.step()
    engine.pause(rid)
    engine.run(rid)
    start = time.perf_counter()
    cached = 0
    while rid in engine.running:                    # to its first token
        result = engine.step()
        cached += result.prefix_cached_tokens
        if result.token_ids.get(rid):
            break
    out['resume_ms'] = (time.perf_counter() - start) * 1e3
    out['resume_cached_tokens'] = cached
    engine.release(rid)


def with_argmax_read_first(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A run whose logits processor reads and checks each row's argmax before masking, on any
    device (vLLM runs in this process, so its processor finds the change)."""
    from timelyllm_ros.engines import vllm_engine

    decode_rows = vllm_engine._decode_rows
    vllm_engine._decode_rows = functools.partial(decode_rows, read_first=True)  # type: ignore
    try:
        return run()
    finally:
        vllm_engine._decode_rows = decode_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', required=True, help='a local Hugging Face model folder')
    parser.add_argument('--engine-opt', action='append', default=[], metavar='KEY=VALUE',
                        help='vllm.EngineArgs field for every variant (e.g. load_format=dummy)')
    parser.add_argument('--batch-sizes', default='1,8,32')
    parser.add_argument('--prompt-tokens', type=int, default=240)
    parser.add_argument('--decode-steps', type=int, default=48)
    parser.add_argument('--max-model-len', type=int, default=2048)
    parser.add_argument('--variants', default=','.join(VARIANTS))
    parser.add_argument('--min-statements', type=int, default=None,
                        help='statements a plan holds before it may end (default: the decode '
                             "steps; 0: the planner's grammar as it is)")
    parser.add_argument('--json', default=None, help='write the figures here too')
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(',')]
    variants = args.variants.split(',')
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f'unknown variants {sorted(unknown)}; known: {", ".join(VARIANTS)}')
    from timelyllm_ros.engines import parse_engine_options

    options = {'max_num_seqs': str(max(batches)), 'max_model_len': str(args.max_model_len),
               **parse_engine_options(args.engine_opt)}
    from transformers import AutoTokenizer

    from timelyllm_ros.engines.vllm_engine import free_vllm_memory

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts: dict[int, list[str]] = {}
    salt = 0
    for batch in batches:
        texts[batch] = []
        for _ in range(batch):
            salt += 1
            texts[batch].append(prompt_text(salt, args.prompt_tokens))
    ids = {b: [list(tokenizer.encode(t)) for t in ts] for b, ts in texts.items()}
    figures: dict[str, Any] = {'model': args.model, 'options': options,
                               'prompt_tokens': statistics.mean(
                                   len(i) for ps in ids.values() for i in ps),
                               'memory': [('before', memory())]}
    statements = args.decode_steps if args.min_statements is None else args.min_statements
    figures['min_statements'] = statements
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        'raw': lambda: run_raw(args.model, options, ids, args.decode_steps)}
    for variant in VARIANTS[1:]:
        runs[variant] = (lambda v=variant: run_engine(args.model, options, texts,
                                                      args.decode_steps, v, statements))
    runs['grammar-read'] = lambda: with_argmax_read_first(runs['grammar'])
    done: list[str] = []
    for variant in variants:
        started = time.perf_counter()
        try:
            figures[variant] = runs[variant]()
        except Exception as err:  # noqa: BLE001 - e.g. a start that finds no memory: say so
            figures.setdefault('failed', {})[variant] = f'{type(err).__name__}: {err}'
            print(f'{variant} failed: {type(err).__name__}: {err}', file=sys.stderr)
        else:
            figures[variant]['wall_s'] = time.perf_counter() - started
            done.append(variant)
        free_vllm_memory()     # the raw engine's (the project's engine's close() calls it)
        figures['memory'].append((f'after {variant} closed', memory()))
        report(figures, done, batches)     # so far (a long run may be cut)
    if args.json:
        with open(args.json, 'w') as out:
            json.dump(figures, out, indent=1, default=str)


def report(figures: dict[str, Any], variants: list[str], batches: list[int]) -> None:
    print(f"model {figures['model']}, prompts of {figures['prompt_tokens']:.0f} tokens, "
          f"plans of at least {figures['min_statements']} statements")
    head = ' '.join(f'decode b{b:<3}' for b in batches)
    print(f"{'variant':10} {head}  prefill b{batches[-1]:<3}  resume   cached  (ms; ×raw)")
    raw = figures.get('raw')
    for variant in variants:
        run = figures[variant]
        cells = []
        for b in batches:
            value = run['decode_ms'].get(b)
            base = raw['decode_ms'].get(b) if raw else None
            cells.append(cell(value, base))
        prefill = cell(run['prefill_ms'].get(batches[-1]),
                       raw['prefill_ms'].get(batches[-1]) if raw else None)
        resume = cell(run.get('resume_ms'), raw.get('resume_ms') if raw else None)
        print(f"{variant:10} {' '.join(cells)}  {prefill}  {resume}  "
              f"{run.get('resume_cached_tokens', '-'):>6}")
        if 'vllm_step_ms' in run:
            inner = ' '.join(f"{run['vllm_step_ms'][b] or 0:>11.2f}" for b in batches)
            print(f"{'  in step':10} {inner}  (vLLM's step() alone)")
        if any(run.get('processor_ms', {}).values()):
            host = ' '.join(f"{run['processor_ms'][b] or 0:>11.2f}" for b in batches)
            print(f"{'  processor':10} {host}  (its logits processor, on the host)")
        steps = ' '.join(f"{run.get('decode_steps', {}).get(b, 0):>11}" for b in batches)
        print(f"{'  steps':10} {steps}  (decode steps of the whole batch measured)")
    for label, reading in figures['memory']:
        print(f'memory {label}: ' + ', '.join(f'{k} {v:.2f}' for k, v in reading.items()))
    for variant, error in figures.get('failed', {}).items():
        print(f'{variant} FAILED: {error}')
    sys.stdout.flush()


def cell(value: float | None, base: float | None) -> str:
    if value is None:
        return f"{'-':>11}"
    if base:
        return f'{value:6.2f} {value / base:4.2f}'
    return f'{value:11.2f}'


if __name__ == '__main__':
    main()
