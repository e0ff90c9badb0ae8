"""Measure an engine's latency model and write the calibration file the simulator reads.

Everything goes through the generic :class:`~timelyllm_ros.engines.base.Engine` interface
(register, run, step, release), so any engine can be calibrated: prefill time against prompt
length (one prefill iteration of a single prompt, no prefix), decode-step time against batch
size at a reference context, and the extra cost of a longer context. The figures are the
``duration_s`` the engine reports for each iteration (measured wall time for real engines).
The engine's own behaviour goes in the ``engine`` section (schema 2): how it resumes a
suspended generation, its prefill token budget and join limit as the engine declares them
(:meth:`~timelyllm_ros.engines.base.Engine.behaviour`), and the fixed host cost of an
iteration, measured as an iteration's wall time less the time in the model's forward pass
where the engine times that apart (llama.cpp). The curves then hold the model's time alone,
so that curve + fixed cost = what was measured. The result validates as
:class:`~timelyllm_ros.engines.calibration.Calibration` and is written as YAML with the model,
hardware, engine, date and each figure's provenance.
"""

from __future__ import annotations

import datetime
import itertools
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from timelyllm_ros.engines.base import Engine, EngineRequest
from timelyllm_ros.engines.calibration import SCHEMA_VERSION, Calibration, piecewise_linear
from timelyllm_ros.engines.llamacpp import usable_cores
from timelyllm_ros.errors import EngineError

# Filler text: plain words, so every tokenizer splits it into roughly one token per word.
_FILLER = ('the drone flies over the table and looks for a red box near the window while '
           'the arm waits ').split()

PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)
BATCH_SIZES = (1, 2, 4, 8)


def hardware_label(device: str = 'cpu') -> str:
    """Where an engine runs: its accelerator as the engine names it
    (:attr:`~timelyllm_ros.engines.base.EngineStats.hardware`, e.g. ``NVIDIA H100 80GB HBM3``),
    then this machine's CPU model and usable cores; the CPU alone for an engine on the CPU."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path('/proc/cpuinfo').read_text(encoding='utf-8').splitlines():
            if line.startswith('model name'):
                cpu = line.split(':', 1)[1].strip()
                break
    except OSError:
        pass
    host = f'CPU: {cpu}, {usable_cores()} cores ({platform.system()} {platform.machine()})'
    if not device or device.lower() == 'cpu':
        return host
    return f'GPU: {device}; host {host}'


def _text(words: int, salt: int) -> str:
    # A salt word first, so that no two prompts share a prefix (no prefix caching effects).
    body = [_FILLER[(i + salt) % len(_FILLER)] for i in range(max(0, words - 1))]
    return ' '.join([f'#{salt}', *body])


_SALTS = itertools.count(1)
"""Every probe prompt's salt, unique in the process: two measurements that each numbered their
prompts from 1 sent vLLM the same prompt twice, and its prefix cache served the second (a
1,700-word decode prompt after an 850-word one of the same salt prefilled only 853 tokens)."""


class _Probe:
    """Requests with fresh ids and prompts over one engine."""

    def __init__(self, engine: Engine, force_tokens: int) -> None:
        self.engine = engine
        self.force_tokens = force_tokens

    def request(self, words: int, max_tokens: int, prefix_words: int = 0) -> str:
        """A fresh prompt of ``words`` words; with ``prefix_words``, after a prefix that every
        such request shares (prefix id ``__calibrate_prefix``)."""
        salt = next(_SALTS)
        request_id = f'__calibrate_{salt}'
        script = tuple(' a' for _ in range(max(max_tokens, self.force_tokens)))
        prompt = _text(words, salt)
        if prefix_words:
            prompt = f'{_text(prefix_words, 0)} {prompt}'
        self.engine.register(EngineRequest(
            request_id=request_id, prompt=prompt, prompt_tokens=max(1, words + prefix_words),
            max_tokens=max_tokens, script=script,
            prefix_id='__calibrate_prefix' if prefix_words else None,
            prefix_tokens=prefix_words))
        return request_id


@dataclass(frozen=True, slots=True)
class FirstOutput:
    """The iterations from a generation's join to its first token, together."""

    ms: float                  # their time
    prefill_tokens: int        # tokens prefilled
    cached_tokens: int         # prompt tokens served from a cached prefix
    steps: int                 # iterations it took


def first_output(engine: Engine, request_id: str, limit: int = 8) -> FirstOutput:
    """Step a just-joined generation until its first token comes out, and time every step
    from its join to that token.

    On an engine that hands each iteration's output out at once that is the prefill
    iteration (or its chunks). Under vLLM's asynchronous scheduling a step launches an
    iteration and returns without waiting while its queue has room: the join's first step
    launches the prefill and reports nothing, and the next one waits for it and reports the
    prefill with the first token, its time only the prefill's rest (on an H200, vLLM 0.26.0:
    42 ms and 7.6 ms for 963 tokens). Timing only the steps that report the join made a
    1 026-token prefill cost 6 ms there. A step may also wait for an iteration still in
    flight from earlier work; the probes ask for one token, which vLLM schedules no iteration
    past, so nothing of theirs is left in flight.

    Raises:
        EngineError: no token within ``limit`` iterations.
    """
    ms = 0.0
    prefill = cached = 0
    for steps in range(1, limit + 1):
        result = engine.step()
        ms += result.duration_s * 1000.0
        prefill += result.prefill_tokens
        cached += result.prefix_cached_tokens
        if result.produced(request_id) or request_id in result.finished:
            return FirstOutput(ms, prefill, cached, steps)
    raise EngineError(f'{request_id}: no token in {limit} iterations after it joined')


def measure_prefill(engine: Engine, lengths: Sequence[int] = PREFILL_TOKENS,
                    repeats: int = 2) -> list[tuple[int, float]]:
    """(tokens prefilled, median ms) of one prefill iteration per prompt length. A first,
    unrecorded probe waits out whatever earlier work left in flight."""
    probe = _Probe(engine, 4)
    points: list[tuple[int, float]] = []
    for words in (lengths[0], *lengths):
        samples: list[float] = []
        tokens = 0
        for _ in range(repeats):
            request_id = probe.request(words, 1)
            engine.run(request_id)
            try:
                output = first_output(engine, request_id)
            finally:
                engine.release(request_id)
            tokens = output.prefill_tokens or words
            samples.append(output.ms)
        points.append((tokens, statistics.median(samples)))
    points = points[1:]
    points.sort()
    merged: dict[int, float] = {}
    for tokens, ms in points:        # a tokenizer may map two lengths to one count
        merged.setdefault(tokens, ms)
    return sorted(merged.items())


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """Decode iterations of one batch, measured."""

    batch: int
    median_ms: float           # a decode iteration of the same members as the one before
    first_ms: float            # the first decode of these members (the batch just changed)
    context: int               # mean context tokens of a member

    @property
    def change_ms_per_token(self) -> float:
        """The first decode's extra time per KV token of the batch (restacking it)."""
        return max(0.0, self.first_ms - self.median_ms) / max(1, self.context * self.batch)


def measure_decode(engine: Engine, batch: int, context_words: int,
                   steps: int = 8) -> DecodePoint:
    """Decode iterations of ``batch`` generations: the first one after they joined, and the
    median of the ``steps`` after it. An iteration counts once every member has had its first
    token (under asynchronous scheduling a step reports the iteration before it: a leftover
    of earlier work, or the prefill, would otherwise pass for a decode). Where the engine
    hands outputs out an iteration late (``outputs_one_iteration_late``), a step's time is
    that of the iteration after the one it reports: an iteration's time is the step's
    before."""
    late = engine.behaviour().outputs_one_iteration_late
    previous_ms = 0.0
    probe = _Probe(engine, steps + 4)
    ids = [probe.request(context_words, steps + 4) for _ in range(batch)]
    context = 0
    try:
        for request_id in ids:
            engine.run(request_id)
        samples: list[float] = []
        started: set[str] = set()
        guard = 0
        while len(samples) <= steps and engine.running and guard < steps * 4 + len(ids) * 4:
            guard += 1
            result = engine.step()
            step_ms = result.duration_s * 1000.0
            iteration_ms, previous_ms = (previous_ms if late else step_ms), step_ms
            ours = {r for r in ids if result.produced(r)}
            formed = len(started) == len(ids)
            started |= ours
            if result.prefill_tokens:
                # A member's context is its whole prompt, computed or served from a cache.
                context += result.prefill_tokens + result.prefix_cached_tokens
                continue
            if formed and ours and result.batch_size == batch:
                samples.append(iteration_ms)
        if len(samples) < 2:
            raise EngineError(f'no decode iteration at batch {batch} could be measured')
    finally:
        for request_id in ids:
            engine.release(request_id)
    mean_context = context // batch if context else context_words
    return DecodePoint(batch, statistics.median(samples[1:]), samples[0], mean_context)


def measure_context_prefill(engine: Engine, fresh_ms: Callable[[int], float],
                            fixed_ms: float, prefix_words: int = 512, suffix_words: int = 64,
                            repeats: int = 2) -> float | None:
    """ms per new token and per context token of a prefill over a cached prefix (a prompt
    sharing another's prefix, a resume tail): the iteration less a fresh prefill of as many
    tokens (``fresh_ms``) and the fixed cost; None when the engine shared no prefix."""
    probe = _Probe(engine, 4)
    first = probe.request(4, 1, prefix_words)
    engine.run(first)
    try:
        first_output(engine, first)     # the prefix is prefilled and cached
    finally:
        engine.release(first)
    samples: list[float] = []
    for _ in range(repeats):
        request_id = probe.request(suffix_words, 1, prefix_words)
        engine.run(request_id)
        try:
            output = first_output(engine, request_id)
        finally:
            engine.release(request_id)
        if not (output.cached_tokens and output.prefill_tokens):
            return None
        extra = output.ms - fixed_ms - fresh_ms(output.prefill_tokens)
        samples.append(extra / (output.prefill_tokens * output.cached_tokens))
    return max(0.0, statistics.median(samples))


def measure_iteration_overhead(engine: Engine, context_words: int = 256,
                               steps: int = 16) -> float | None:
    """Median ms of a batch-1 decode iteration spent outside the model's forward pass
    (scheduling, sampling, detokenizing, grammar); None when the engine does not time its
    forward pass apart (``EngineStats.model_s`` stays 0)."""
    probe = _Probe(engine, steps + 4)
    request_id = probe.request(context_words, steps + 4)
    samples: list[float] = []
    try:
        engine.run(request_id)
        for _ in range(steps + 2):
            if not engine.running:
                break
            before = engine.stats().model_s
            result = engine.step()
            model_s = engine.stats().model_s - before
            if not result.prefill_tokens and model_s > 0:
                samples.append(max(0.0, result.duration_s - model_s) * 1000.0)
    finally:
        engine.release(request_id)
    return statistics.median(samples) if samples else None


def measure_swap(engine: Engine, context_words: int = 256) -> None:
    """Swap one generation's KV to host memory and back (engines that can evict count it)."""
    probe = _Probe(engine, 8)
    request_id = probe.request(context_words, 8)
    try:
        engine.run(request_id)
        engine.step()
        engine.step()
        engine.evict(request_id, 'host')
        engine.run(request_id)
        engine.step()
    except EngineError:
        pass                                  # the engine cannot evict: estimate instead
    finally:
        engine.release(request_id)


def prefill_lengths(lengths: Sequence[int], edges: Sequence[int]) -> list[int]:
    """The prompt lengths (words) of the prefill curve: those asked for and, at each of the
    engine's cost edges (tokens), one a little below and one a little above it (a prompt of
    N words is N+1 to N+3 tokens), so that the curve steps where the engine does instead of
    spreading the step over the points around it."""
    around = {n for edge in edges for n in (edge - 8, edge + 4) if n > 0}
    return sorted(set(lengths) | around)


def measure(engine: Engine, model: str, engine_name: str, *,
            lengths: Sequence[int] = PREFILL_TOKENS, batch_sizes: Sequence[int] = BATCH_SIZES,
            context_words: int = 256, long_context_words: int = 1024, context_batch: int = 1,
            steps: int = 8,
            repeats: int = 2, progress: Callable[[str], None] | None = None,
            hardware: str | None = None, command: str = '') -> Calibration:
    """Measure an engine and return its calibration.

    Args:
        engine: the engine (fresh; calibration registers and releases its own requests).
        model: model label written to the file.
        engine_name: engine label written to the file.
        lengths: prompt lengths (in filler words, about one token each) of the prefill curve.
        batch_sizes: batch sizes of the decode curve (capped at the engine's max_num_seqs).
        context_words: prompt length of the decode measurements (the reference context).
        long_context_words: a longer prompt, for the cost per extra context token.
        context_batch: measure that cost on a batch of this many long prompts (one of
            ``batch_sizes``) instead of one: a GPU's per-token cost shows over a batch.
        steps: decode iterations measured per point.
        repeats: prefill measurements per length.
        progress: called with a short label before each measurement.
        hardware: hardware label (default: :func:`hardware_label` of the engine's device).
        command: the command line, recorded in ``source``.
    """
    say = progress or (lambda _label: None)
    say('warm-up')
    engine.warmup()
    say('prefill')
    prefill = measure_prefill(engine, prefill_lengths(lengths, engine.cost_edges), repeats)
    decode: list[tuple[int, float]] = []
    changes: list[float] = []
    reference = 0
    for batch in sorted({min(b, engine.max_num_seqs) for b in batch_sizes}):
        say(f'decode batch {batch}')
        point = measure_decode(engine, batch, context_words, steps)
        decode.append((batch, point.median_ms))
        changes.append(point.change_ms_per_token)
        if batch == 1:
            reference = point.context
    say('decode long context')
    long_point = measure_decode(engine, 1, long_context_words, steps)
    long_ms, long_context = long_point.median_ms, long_point.context
    # The cost per context token as the simulator applies it, over a batch's whole context,
    # from a batch at the long context where asked (on an H200, vLLM 0.26.0, the batch-1 pair
    # gave 1.8 ms for 865 tokens, ~80x what reading their KV takes, and a batch of 12
    # sequences of ~900 tokens decoded in 6.6 ms where it predicted 8.3; on a CPU engine the
    # batch-1 pair held, and a batch of long prompts takes minutes to prefill there).
    widest = min(context_batch, max(b for b, _ in decode))
    wide_point: DecodePoint | None = None
    if widest > 1 and widest in dict(decode):
        say(f'decode long context, batch {widest}')
        try:
            wide_point = measure_decode(engine, widest, long_context_words, steps)
        except EngineError:
            wide_point = None             # the long contexts do not fit together: batch 1
    # Charged only where every batch size shows it: a first decode slower by noise alone
    # does not repeat at each point.
    change = min(changes)
    say('iteration overhead')
    overhead = measure_iteration_overhead(engine, context_words, steps * 2)
    say('swap')
    measure_swap(engine, context_words)
    base_ms = dict(decode).get(1, decode[0][1])
    per_token = single = max(0.0, (long_ms - base_ms) / max(1, long_context - reference))
    context_basis = f'a {long_context}-token context at batch 1'
    if wide_point is not None and wide_point.context > reference:
        extra = widest * (wide_point.context - reference)
        per_token = max(0.0, (wide_point.median_ms - dict(decode)[widest]) / extra)
        context_basis = (f'{widest} sequences of {wide_point.context} context tokens (batch 1 '
                         f'at {long_context} gave {single:.6f} ms a token)')
    stats = engine.stats()
    kv_bytes = stats.kv_bytes_per_token
    kv_tokens = stats.kv_capacity_tokens
    swap_bytes = float(stats.swap_bytes)
    swap_s = stats.swap_s
    swap_ms_per_token = (swap_s * 1000.0 / (swap_bytes / kv_bytes)
                         if swap_bytes and kv_bytes else 0.0)
    if not swap_ms_per_token and kv_bytes:
        swap_ms_per_token = kv_bytes / 5e9 * 1000.0      # host memcpy, ~5 GB/s
    fixed = overhead or 0.0
    points_ms = [round(max(0.0, ms - fixed), 3) for _, ms in prefill]
    say('prefill over a cached prefix')
    context_prefill = measure_context_prefill(
        engine, lambda tokens: piecewise_linear(tokens, [t for t, _ in prefill], points_ms),
        fixed,
        prefix_words=context_words * 2, suffix_words=64)
    behaviour = engine.behaviour().model_copy(update={
        'iteration_overhead_ms': round(fixed, 3),
        'batch_change_ms_per_token': round(change, 6)})
    date = datetime.date.today().isoformat()
    hardware = hardware or hardware_label(engine.stats().hardware)
    source = (f'Measured by `timelyllm calibrate` on {date}: engine {engine_name}, model {model}, '
              f'on {hardware}. Prefill: one iteration of one prompt of N tokens (median of '
              f'{repeats}); decode: median of {steps} iterations per batch size, each sequence '
              f'holding about {reference} context tokens; context cost from '
              f'{context_basis}. kv_bytes_per_token and the KV '
              f"capacity are the engine's; swap-in is the measured host restore speed when "
              f'the engine swapped during the run, else a 5 GB/s memcpy estimate.'
              + (f' Command: {command}' if command else ''))
    declared = f'declared by the {engine_name} engine ({type(engine).__name__}.behaviour)'
    data = {
        'schema_version': SCHEMA_VERSION,
        'model': model,
        'gpu': hardware,
        'source': source,
        'prefill_ms': {'tokens': [t for t, _ in prefill], 'ms': points_ms},
        'decode_ms': {'reference_context_tokens': reference,
                      'batch': [b for b, _ in decode],
                      'ms': [round(max(0.0, ms - fixed), 3) for _, ms in decode]},
        'decode_ms_per_context_token': round(per_token, 6),
        'prefill_ms_per_context_token': round(context_prefill or 0.0, 8),
        'kv_bytes_per_token': max(1, kv_bytes),
        'gpu_kv_tokens': max(1, kv_tokens or 16384),
        'host_kv_tokens': max(1, kv_tokens or 16384) * 4,
        'block_size': engine.kv_block_size,
        'swap_in_ms_per_token': round(swap_ms_per_token, 6),
        'max_num_seqs': engine.max_num_seqs,
        'engine': behaviour.model_dump(),
        'provenance': {
            'prefill_ms': f'measured, {date}, less the fixed iteration cost',
            'prefill_ms_per_context_token': (
                f'measured, {date}: a 64-word prompt after a cached {context_words * 2}-word '
                'prefix, less a fresh prefill of as many tokens' if context_prefill is not None
                else 'not measured: the engine shared no prompt prefix'),
            'decode_ms': f'measured, {date}, less the fixed iteration cost',
            'engine.iteration_overhead_ms': (
                f'measured, {date}: median batch-1 decode iteration wall time less the time '
                'in the forward pass' if overhead is not None else
                'not separable: the engine does not time its forward pass apart, so the '
                'fixed cost stays inside the measured curves'),
            'engine.batch_change_ms_per_token': (
                f'measured, {date}: the first decode of a batch that just formed less the '
                'median of the next ones, per KV token of the batch; the smallest over the '
                'batch sizes'),
            'engine.resume': declared, 'engine.prefill_token_budget': declared,
            'engine.max_joins_per_iteration': declared,
            'engine.outputs_one_iteration_late': declared, 'engine.prompt_cache': declared,
            'block_size': declared, 'max_num_seqs': declared,
        },
    }
    if len(data['prefill_ms']['tokens']) < 2:  # type: ignore[index]
        raise EngineError('the prefill curve needs at least two distinct prompt lengths')
    return Calibration.model_validate(data)


def write_calibration(calibration: Calibration, path: str | Path, header: str = '') -> Path:
    """Write a calibration as YAML (an optional comment header first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = calibration.model_dump()
    sections = {k: data.pop(k) for k in ('engine', 'provenance')}
    # Number lists stay on one line; the engine section and provenance read as blocks.
    text = yaml.safe_dump(data, sort_keys=False, width=99, default_flow_style=None)
    text += yaml.safe_dump(sections, sort_keys=False, width=99, default_flow_style=False)
    comment = ''.join(f'# {line}\n' for line in header.splitlines())
    path.write_text(comment + text, encoding='utf-8')
    return path
