"""Figures of the CPU engine (llama.cpp, SmolLM2-135M-Instruct) on this machine.

    python3 benchmarks/cpu_engine.py [--model smollm2|gemma3-270m] [--threads N] [--json]

Prefill throughput (one ~800-token robot prompt), decode throughput of one sequence and of
batches, time to first token of a prompt whose 300-token prefix is cached vs cold, and the
cost of swapping one sequence's KV to host memory and back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.llamacpp import LlamaCppEngine
from timelyllm_ros.language.profiles import load_profile

WORDS = ('the drone flies over the table and looks for a red box near the window while the arm '
         'waits').split()


def words(n: int, salt: int) -> str:
    return ' '.join([f'#{salt}', *(WORDS[(i + salt) % len(WORDS)] for i in range(n - 1))])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--model', default='smollm2', help='smollm2, gemma3-270m or a .gguf')
    parser.add_argument('--threads', type=int, default=None)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--json', action='store_true')
    parser.add_argument('--flash-attn', type=int, default=None, help='1 or 0 (engine default)')
    args = parser.parse_args()
    options = {} if args.flash_attn is None else {'flash_attn': bool(args.flash_attn)}
    engine = LlamaCppEngine(model=args.model, max_num_seqs=8, threads=args.threads,
                            force_script=True, kv_tokens=16384, **options)
    engine.warmup()
    out: dict[str, object] = {'model': engine.model_label, 'threads': engine.threads,
                              'flash_attn': engine.flash_attn}
    seq = 0

    def new(prompt: str, tokens: int, prefix_id: str | None = None) -> str:
        nonlocal seq
        seq += 1
        rid = f'r{seq}'
        engine.register(EngineRequest(rid, prompt, 1, tokens, script=(' a',) * tokens,
                                      prefix_id=prefix_id))
        return rid

    # prefill: the tello prompt (no prefix cache)
    prompt = load_profile('tello').build_prompt('Could you find the cat? If so, go to it.')
    rates = []
    for _ in range(args.repeats):
        rid = new(prompt, 2)
        engine.run(rid)
        result = engine.step()
        rates.append(result.prefill_tokens / result.duration_s)
        engine.release(rid)
    out['prefill_tokens'] = result.prefill_tokens
    out['prefill_tok_s'] = round(statistics.median(rates), 1)

    # decode, one sequence and batches (about 300 context tokens each)
    for batch in (1, 2, 4, 8):
        ids = [new(words(300, 100 + seq + i), 40) for i in range(batch)]
        for rid in ids:
            engine.run(rid)
        steps = []
        while engine.running:
            result = engine.step()
            if not result.prefill_tokens and result.batch_size == batch:
                steps.append(result.duration_s)
        for rid in ids:
            engine.release(rid)
        step = statistics.median(steps)
        out[f'decode_b{batch}_ms'] = round(step * 1000, 2)
        out[f'decode_b{batch}_tok_s'] = round(batch / step, 1)

    # a 300-token prefix: cold prefill vs shared from the prefix cache (time to first token)
    prefix = words(300, 7)
    cold, warm = [], []
    for i in range(args.repeats):
        rid = new(prefix + f' task {i}', 2)      # no prefix_id: always cold
        engine.run(rid)
        cold.append(engine.step().duration_s)
        engine.release(rid)
    seed = new(prefix + ' seed task', 2, prefix_id='p300')
    engine.run(seed)
    engine.step()
    engine.release(seed)
    shared = []
    for i in range(args.repeats):
        rid = new(prefix + f' task {i}', 2, prefix_id='p300')
        engine.run(rid)
        result = engine.step()
        warm.append(result.duration_s)
        shared.append(result.prefix_cached_tokens)
        engine.release(rid)
    out['prefix_300_cold_ms'] = round(statistics.median(cold) * 1000, 1)
    out['prefix_300_reused_ms'] = round(statistics.median(warm) * 1000, 1)
    out['prefix_300_shared_tokens'] = shared[0]

    # swap one ~300-token sequence to host memory and back
    rid = new(words(300, 3), 8)
    engine.run(rid)
    engine.step()
    engine.step()
    started = time.perf_counter()
    engine.evict(rid, 'host')
    out_ms = (time.perf_counter() - started) * 1000
    engine.run(rid)
    result = engine.step()
    out['swap_seq_bytes'] = engine.swap_bytes // max(1, engine.swap_outs + engine.swap_ins)
    out['swap_out_ms'] = round(out_ms, 2)
    out['swap_in_and_decode_ms'] = round(result.duration_s * 1000, 2)
    engine.release(rid)
    engine.close()
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f'{key:28} {value}')


if __name__ == '__main__':
    main()
