"""The vllm-server engine against vLLM's own benchmark client, on the same running server, the
same requests, one after the other (issue 30: the remote engine's overhead, goal <= 1.1x).

    python3 benchmarks/vllm_server.py --endpoint http://127.0.0.1:8000 --model DIR
        [--requests 8] [--prompt-words 300] [--output-tokens 64] [--rounds 3]
        [--modes plain,plan] [--cut-every 10] [--json FILE]

Runs where vLLM imports (its client, ``vllm.benchmarks.lib.endpoint_request_func``, is the one
``vllm bench serve`` uses). The server must load this package's processor for the ``plan`` mode
(``--logits-processors timelyllm_ros.engines.vllm_engine:ForcedTokensLogitsProcessor``).

Per round, ``--requests`` generations start at once, each a distinct token-id prompt of
about ``--prompt-words`` words of the tello prompt (a shared prefix), then a task line
of its own:

* ``vllm-client``: ``async_request_openai_completions`` for each, gathered; greedy, the same
  body the engine sends (with the plan mode's ``vllm_xargs``);
* ``engine``: the vllm-server engine registers, runs and steps them to their end (one token
  handed out per generation per step, as the scheduler sees them);
* ``engine-cut``: the same, each generation paused and resumed every ``--cut-every`` tokens
  (one request per segment, as plans are served).

Modes: ``plain`` (no grammar, no penalty: vLLM's own greedy choice) and ``plan`` (the tello
plan grammar, the repetition penalty and early end through the servers' processor: the
planner's path). Reported per variant: the median round's wall time, output tokens, tokens
per second, and the ratio of the engine's wall time to the client's on the same tokens (both
generate the same greedy tokens: checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from functools import partial
from typing import Any

from timelyllm_ros.core.plan_requests import REPETITION_PENALTY
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.vllm_engine import DECODING_KEY
from timelyllm_ros.engines.vllm_server import VllmServerEngine
from timelyllm_ros.language.grammar import plan_grammar
from timelyllm_ros.language.profiles import load_profile


def _prompts(count: int, words: int, salt: int) -> list[str]:
    """Distinct prompts: the tello profile's prompt cut to about ``words`` words, each ending
    with a task line of its own (a shared prefix, as a fleet's goals of one kind)."""
    base = load_profile('tello').build_prompt('find the cat').split(' ')[:words]
    return [' '.join(base) + f'\nTask {salt}-{index}: find object {index} and land next to '
            'it.\nPlan:' for index in range(count)]


def _decoding(mode: str, output_tokens: int) -> dict[str, Any] | None:
    if mode == 'plain':
        return None
    grammar = plan_grammar(load_profile('tello'), ['cat', 'table'])
    assert grammar is not None
    return {'grammar': grammar.gbnf, 'kept': [], 'max_tokens': output_tokens,
            'end_within': 0, 'repetition_penalty': REPETITION_PENALTY}


def run_client(url: str, model: str, prompts: list[list[int]], output_tokens: int,
               decoding: dict[str, Any] | None) -> tuple[float, list[int]]:
    """vLLM's benchmark client: every request at once; the wall time and tokens each got."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    extra: dict[str, Any] = {'temperature': 0.0}
    if decoding is not None:
        extra['vllm_xargs'] = {DECODING_KEY: json.dumps(decoding)}

    async def everything() -> tuple[float, list[int]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            started = time.perf_counter()
            outputs = await asyncio.gather(*(async_request_openai_completions(
                RequestFuncInput(prompt=prompt, api_url=url + '/v1/completions',
                                 prompt_len=len(prompt), output_len=output_tokens,
                                 model=model, extra_body=extra), session)
                for prompt in prompts))
            wall = time.perf_counter() - started
        for output in outputs:
            if not output.success:
                raise RuntimeError(f'vLLM client request failed: {output.error}')
        return wall, [int(o.output_tokens) for o in outputs]

    return asyncio.run(everything())


def run_engine(engine: VllmServerEngine, prompts: list[str], output_tokens: int,
               decoding: dict[str, Any] | None, cut_every: int | None,
               tag: str) -> tuple[float, list[int]]:
    """The engine: register, run and step every request to its end (paused and resumed every
    ``cut_every`` tokens); the wall time and tokens each got."""
    names = []
    for index, prompt in enumerate(prompts):
        name = f'{tag}-{index}'
        engine.register(EngineRequest(
            name, prompt, 0, output_tokens, grammar=decoding['grammar'] if decoding else None,
            repetition_penalty=decoding['repetition_penalty'] if decoding else 1.0))
        names.append(name)
    started = time.perf_counter()
    for name in names:
        engine.run(name)
    produced = dict.fromkeys(names, 0)
    while engine.running:
        result = engine.step()
        for name in result.text:
            produced[name] += 1
            if cut_every and produced[name] % cut_every == 0 and name not in result.finished:
                engine.pause(name)
                engine.run(name)
        if result.failed or result.preempted:
            raise RuntimeError(f'engine failure: {result.failed or result.preempted}')
    wall = time.perf_counter() - started
    counts = [len(engine.token_ids(name)) for name in names]
    for name in names:
        engine.release(name)
    return wall, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--endpoint', required=True)
    parser.add_argument('--model', required=True, help="a local copy of the server's model")
    parser.add_argument('--requests', type=int, default=8)
    parser.add_argument('--prompt-words', type=int, default=300)
    parser.add_argument('--output-tokens', type=int, default=64)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--modes', default='plain,plan')
    parser.add_argument('--cut-every', type=int, default=10)
    parser.add_argument('--json', default=None)
    args = parser.parse_args(argv)
    engine = VllmServerEngine(args.model, endpoints=args.endpoint,
                              max_num_seqs=args.requests)
    report: dict[str, Any] = {'endpoint': args.endpoint, 'requests': args.requests,
                              'prompt_words': args.prompt_words,
                              'output_tokens': args.output_tokens, 'rounds': args.rounds}
    try:
        for mode in args.modes.split(','):
            decoding = _decoding(mode, args.output_tokens)
            walls: dict[str, list[float]] = {'vllm-client': [], 'engine': [], 'engine-cut': []}
            tokens: dict[str, list[int]] = {}
            for round_ in range(args.rounds + 1):          # round 0 warms the prefix cache
                prompts = _prompts(args.requests, args.prompt_words, round_)
                # the ids the engine sends for each prompt, for the client to send the same
                ids = [engine._prompt_ids(EngineRequest('', text, 0, 1)) for text in prompts]
                runs = {
                    'vllm-client': partial(run_client, args.endpoint, engine.served_model,
                                           ids, args.output_tokens, decoding),
                    'engine': partial(run_engine, engine, prompts, args.output_tokens,
                                      decoding, None, f'{mode}{round_}'),
                    'engine-cut': partial(run_engine, engine, prompts, args.output_tokens,
                                          decoding, args.cut_every, f'{mode}{round_}c'),
                }
                for variant, run in runs.items():
                    wall, counts = run()
                    if round_:
                        walls[variant].append(wall)
                        tokens[variant] = counts
            same = len(set(map(tuple, tokens.values()))) == 1
            client = statistics.median(walls['vllm-client'])
            rows = {}
            for variant, times in walls.items():
                median = statistics.median(times)
                total = sum(tokens[variant])
                rows[variant] = {'wall_s': round(median, 4), 'output_tokens': total,
                                 'tokens_per_s': round(total / median, 1),
                                 'vs_client': round(median / client, 3),
                                 'rounds_s': [round(t, 4) for t in times]}
            report[mode] = {'same_token_counts': same, **rows}
            print(f'{mode}: same tokens {same}')
            for variant, row in rows.items():
                print(f'  {variant:12s} {row["wall_s"]:8.3f} s  {row["output_tokens"]:5d} tok  '
                      f'{row["tokens_per_s"]:8.1f} tok/s  x{row["vs_client"]:.3f} vs client')
        report['resume_stats'] = engine.resume_stats
    finally:
        engine.close()
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == '__main__':
    sys.exit(main())
