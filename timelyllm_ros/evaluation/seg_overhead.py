"""Segmentation overhead on a real engine (paper 000 Table 4): segmented vs whole generation.

For each trace the same prompt (the trace's task in its robot profile's prompt) is generated
greedily twice on one engine: once without segmentation and once cut at every segment boundary
(the robot profile's segment pattern, :class:`~timelyllm_ros.language.segmenter.Segmenter`): at
each cut the generation is paused and resumed at once, as if its robot needed the next segment
right away. The overhead is the extra engine time of the segmented run; ``prefix_reuse`` is the
fraction of the resumed generations' kept tokens that the engine served from kept KV state
instead of recomputing them (``StepResult.prefix_cached_tokens`` against
``StepResult.prefill_tokens`` of the iteration after each resume); ``identical`` says whether
the segmented output token ids equal the unsegmented ones.

A warm-up run of each prompt comes first; with ``repeats`` > 1 the two runs alternate and the
medians are compared. Both measured runs start from the same prompt cache: ``warm`` (the
warm-up left the robot's prompt prefix cached, as in a serving engine) or ``cold`` (the engine
forgets its prefixes before each run, so every run prefills its whole prompt, as the paper's
separate test runs did: Table 4's totals, e.g. 354 ms for trace 6, hold a full 1331-token
prefill).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from timelyllm_ros.engines.base import Engine, EngineRequest
from timelyllm_ros.errors import EngineError
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import Segmenter

PromptCache = Literal['warm', 'cold']


@dataclass(frozen=True, slots=True)
class GenerationRun:
    """One generation of a trace's prompt."""

    engine_s: float                     # engine iterations, as the engine reports them (s)
    host_s: float                       # wall time of the pause/resume calls (s)
    output: tuple[int, ...]             # output token ids, as the engine's steps gave them
    text: str                           # the output text
    cuts: int                           # segment boundaries met
    resumes: int                        # pause/resume cycles done (segmented run)
    served_tokens: int                  # tokens served from kept KV on resume
    recomputed_tokens: int              # tokens prefilled again on resume
    steps: int                          # engine iterations

    @property
    def seconds(self) -> float:
        """Engine iterations plus pause/resume calls (s)."""
        return self.engine_s + self.host_s


def generate(engine: Engine, request: EngineRequest, profile: RobotProfile,
             segmented: bool) -> GenerationRun:
    """Generate one request to its end, alone on the engine; pause and resume it at every
    segment boundary when ``segmented``.

    Raises:
        EngineError: the engine failed, or the generation never ended.
    """
    engine.register(request)
    request_id = request.request_id
    segmenter = Segmenter(profile)
    engine_s = host_s = 0.0
    pieces: list[str] = []
    ids: list[int] = []
    cuts = resumes = served = recomputed = steps = 0
    resumed = False
    try:
        engine.run(request_id)
        limit = 4 * request.max_tokens + 16
        while True:
            steps += 1
            if steps > limit:
                raise EngineError(f'{request_id}: the generation did not end in {limit} '
                                  f'iterations')
            result = engine.step()
            engine_s += result.duration_s
            if resumed:     # until its first token (a step later under async scheduling)
                served += result.prefix_cached_tokens
                recomputed += result.prefill_tokens
                resumed = not result.produced(request_id) and request_id not in result.finished
            ids.extend(result.token_ids.get(request_id, ()))
            piece = result.text.get(request_id)
            if piece is not None:
                pieces.append(piece)
                if segmenter.feed(piece) is not None:
                    cuts += 1
                    if segmented and request_id not in result.finished:
                        started = time.perf_counter()
                        engine.pause(request_id)
                        engine.run(request_id)
                        host_s += time.perf_counter() - started
                        resumes += 1
                        resumed = True
            if request_id in result.finished or request_id not in engine.running:
                break
    finally:
        engine.release(request_id)
    return GenerationRun(engine_s, host_s, tuple(ids), ''.join(pieces), cuts, resumes, served,
                         recomputed, steps)


def trace_request(trace, request_id: str, profile: RobotProfile,  # type: ignore[no-untyped-def]
                  max_tokens: int | None = None) -> EngineRequest:
    """The engine request of a trace: its task in its robot's prompt, its plan as script."""
    from timelyllm_ros.language.traces import approx_tokenize

    task_tokens = min(len(approx_tokenize(trace.task)) + 4, trace.prompt_tokens)
    return EngineRequest(
        request_id=request_id, prompt=profile.build_prompt(trace.task),
        prompt_tokens=trace.prompt_tokens, max_tokens=max_tokens or profile.max_tokens,
        script=trace.pieces, prefix_id=profile.name,
        prefix_tokens=trace.prompt_tokens - task_tokens)


def segmentation_overhead(
    engine: Engine,
    trace_ids: Sequence[int],
    repeats: int = 1,
    max_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
    prompt_cache: PromptCache = 'warm',
) -> dict[str, dict[str, object]]:
    """Per trace: overhead_ms, overhead_pct, prefix_reuse, identical (and details).

    Args:
        engine: the engine to measure (shared by every run; generations run one at a time).
        trace_ids: ids of the bundled derived traces (lrtrace).
        repeats: measured pairs of runs per trace (medians are compared).
        max_tokens: generation limit (default: the robot profile's).
        progress: called with a label before each trace.
        prompt_cache: ``warm`` (the prompt prefix stays cached between runs) or ``cold``
            (:meth:`~timelyllm_ros.engines.base.Engine.reset_prefix_cache` before each run).

    Raises:
        WorkloadError: unknown trace id.
        EngineError: the engine failed.
    """
    from timelyllm_ros.language.traces import load_trace_set

    traces = load_trace_set()
    results: dict[str, dict[str, object]] = {}
    for trace_id in trace_ids:
        trace = traces.get(trace_id)
        if progress is not None:
            progress(f'trace {trace_id}')
        profile = load_profile(trace.robot)

        def request(tag: str, trace=trace, profile=profile) -> EngineRequest:  # type: ignore[no-untyped-def]
            return trace_request(trace, f'__seg_{trace.id}_{tag}', profile, max_tokens)

        generate(engine, request('warmup'), profile, segmented=False)
        whole: list[GenerationRun] = []
        cut: list[GenerationRun] = []
        for i in range(max(1, repeats)):
            order = (False, True) if i % 2 == 0 else (True, False)
            for segmented in order:
                if prompt_cache == 'cold':
                    engine.reset_prefix_cache()
                run = generate(engine, request(f'{"seg" if segmented else "whole"}{i}'),
                               profile, segmented)
                (cut if segmented else whole).append(run)
        whole_s = statistics.median(r.seconds for r in whole)
        cut_s = statistics.median(r.seconds for r in cut)
        engine_overhead_s = (statistics.median(r.engine_s for r in cut)
                             - statistics.median(r.engine_s for r in whole))
        served = sum(r.served_tokens for r in cut)
        recomputed = sum(r.recomputed_tokens for r in cut)
        identical = all(r.output == whole[0].output and r.text == whole[0].text
                        for r in (*whole, *cut))
        results[str(trace_id)] = {
            'overhead_ms': round((cut_s - whole_s) * 1000.0, 3),
            'overhead_pct': round(100.0 * (cut_s - whole_s) / whole_s, 3) if whole_s else None,
            'prefix_reuse': (round(served / (served + recomputed), 6)
                             if served + recomputed else None),
            'identical': identical,
            'engine_overhead_ms': round(engine_overhead_s * 1000.0, 3),
            'host_ms': round(statistics.median(r.host_s for r in cut) * 1000.0, 3),
            'whole_ms': round(whole_s * 1000.0, 3),
            'segmented_ms': round(cut_s * 1000.0, 3),
            'resumes': cut[0].resumes,
            'output_tokens': len(whole[0].output),
            'output': whole[0].text,
        }
    return results
