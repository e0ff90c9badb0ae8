"""The CPU engine against raw llama.cpp, side by side in one process, at several thread counts,
on an idle machine and on a busy one.

    python3 benchmarks/llamacpp_engine.py [--model smollm2] [--threads 1,2] [--busy 0,1]
        [--batch-sizes 1,8] [--prompt-words 300] [--steps 24] [--rounds 3] [--json FILE]

For each thread count and each number of busy processes (``--busy N`` starts N processes that
spin on a core each for the measurement, as a ROS graph or a second program would): decode time
per step at each batch size for

* ``raw``: llama.cpp's C API through llama-cpp-python as a user drives it (one ``llama_batch``
  of the sequences' next tokens, ``llama_decode``, the argmax of each sequence's logits), on
  its own context with the engine's context settings;
* ``engine``: the project's engine, its whole ``step()``.

Both over the same prompt ids, alternating ``--rounds`` times (the median of each), so that a
change in the machine's load hits both. The ratios engine/raw are the engine's overhead; the
figures across thread counts and load give the thread rule (README, CPU engine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from typing import Any

import numpy as np

from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.llamacpp import LlamaCppEngine

WORDS = ('the drone flies over the table and looks for a red box near the window while the arm '
         'waits').split()


def words(n: int, salt: int) -> str:
    return ' '.join([f'#{salt}', *(WORDS[(i + salt) % len(WORDS)] for i in range(n - 1))])


def spin(stop: Any) -> None:
    """A busy core until ``stop`` is set."""
    while not stop.is_set():
        sum(range(10_000))


class RawLlama:
    """llama.cpp driven directly: one context with the engine's settings, greedy decode of a
    batch of sequences."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        import llama_cpp as llama

        self.llama = llama
        params = llama.llama_model_default_params()
        params.use_extra_bufts = False
        self.model = llama.llama_model_load_from_file(engine.model_path.encode(), params)
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = engine.kv_tokens
        cparams.n_batch = engine.n_batch
        cparams.n_ubatch = engine.n_batch
        cparams.n_seq_max = 16
        cparams.n_threads = cparams.n_threads_batch = engine.threads
        cparams.kv_unified = True
        cparams.no_perf = True
        cparams.flash_attn_type = (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if engine.flash_attn
                                   else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.batch = llama.llama_batch_init(engine.n_batch, 0, 1)

    def _decode(self, items: list[tuple[int, list[int], int]]) -> list[int]:
        """Feed (seq, tokens, first position) items; the argmax after each item's last."""
        batch, n, last = self.batch, 0, []
        for seq, tokens, pos in items:
            for j, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos + j, 1
                batch.seq_id[n][0], batch.logits[n] = seq, 0
                n += 1
            batch.logits[n - 1] = 1
            last.append(n - 1)
        batch.n_tokens = n
        if self.llama.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError('llama_decode failed')
        out = []
        for index in last:
            row = np.ctypeslib.as_array(self.llama.llama_get_logits_ith(self.ctx, index),
                                        shape=(self.n_vocab,))
            out.append(int(row.argmax()))
        return out

    def decode_ms(self, prompts: list[list[int]], steps: int) -> float:
        """Median time of one decode step of all the prompts' sequences."""
        memory = self.llama.llama_get_memory(self.ctx)
        self.llama.llama_memory_clear(memory, True)
        nxt = [self._decode([(seq, ids, 0)])[0] for seq, ids in enumerate(prompts)]
        times = []
        for step in range(steps):
            started = time.perf_counter()
            nxt = self._decode([(seq, [token], len(prompts[seq]) + step)
                                for seq, token in enumerate(nxt)])
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    def close(self) -> None:
        self.llama.llama_batch_free(self.batch)
        self.llama.llama_free(self.ctx)
        self.llama.llama_model_free(self.model)


def engine_decode_ms(engine: LlamaCppEngine, texts: list[str], steps: int, tag: str) -> float:
    """Median time of one engine ``step()`` that decodes the whole batch."""
    rids = [f'{tag}-{i}' for i in range(len(texts))]
    for rid, text in zip(rids, texts, strict=True):
        engine.register(EngineRequest(rid, text, 1, steps + 2))
        engine.run(rid)
    engine.step()                                   # the prompts' prefill
    times = []
    while len(times) < steps and len(engine.running) == len(rids):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    for rid in rids:
        engine.release(rid)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='smollm2', help='smollm2, gemma3-270m or a .gguf')
    parser.add_argument('--threads', default='1,2')
    parser.add_argument('--busy', default='0,1', help='spinning processes beside the run')
    parser.add_argument('--batch-sizes', default='1,8')
    parser.add_argument('--prompt-words', type=int, default=300)
    parser.add_argument('--steps', type=int, default=24)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--json', default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(',')]
    results: list[dict[str, Any]] = []
    print(f"{'threads':>7} {'busy':>4} {'batch':>5} {'raw ms':>8} {'engine ms':>9} {'×raw':>5}")
    for threads in (int(t) for t in args.threads.split(',')):
        engine = LlamaCppEngine(model=args.model, max_num_seqs=max(batches), threads=threads,
                                kv_tokens=16384)
        raw = RawLlama(engine)
        for busy in (int(b) for b in args.busy.split(',')):
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True)
                        for _ in range(busy)]
            for process in spinners:
                process.start()
            try:
                for batch in batches:
                    texts = [words(args.prompt_words, 1000 * batch + i) for i in range(batch)]
                    # the very ids the engine feeds (its tokenizer, its BOS rule)
                    prompts = [engine._prompt_ids(EngineRequest('p', t, 1, 1)) for t in texts]
                    raw_ms, engine_ms = [], []
                    for round_ in range(args.rounds):
                        raw_ms.append(raw.decode_ms(prompts, args.steps))
                        engine_ms.append(engine_decode_ms(engine, texts, args.steps,
                                                          f'{busy}-{batch}-{round_}'))
                    row = {'threads': threads, 'busy': busy, 'batch': batch,
                           'raw_ms': statistics.median(raw_ms),
                           'engine_ms': statistics.median(engine_ms)}
                    row['ratio'] = row['engine_ms'] / row['raw_ms']
                    results.append(row)
                    print(f"{threads:>7} {busy:>4} {batch:>5} {row['raw_ms']:>8.2f} "
                          f"{row['engine_ms']:>9.2f} {row['ratio']:>5.3f}", flush=True)
            finally:
                stop.set()
                for process in spinners:
                    process.join()
        raw.close()
        engine.close()
    if args.json:
        with open(args.json, 'w') as out:
            json.dump({'model': args.model, 'cpus': multiprocessing.cpu_count(),
                       'results': results}, out, indent=1)


if __name__ == '__main__':
    main()
