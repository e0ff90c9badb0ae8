"""What a goal's grounded plan grammar costs to build and compile, per goal.

    python3 benchmarks/plan_grammar.py [--model smollm2] [--repeats 5] [--json FILE]

For every robot task of the bundled and held-back trace sets, the plan grammar a live goal gets
(the profile's grammar grounded in the task's objects; for the Indy7 also its gripper rule) is
built from scratch (Python, :class:`~timelyllm_ros.language.grammar` with its cache cleared),
then compiled by the CPU engine's grammar sampler (llama.cpp, the model's vocabulary) and, when
llguidance is installed, by llguidance over the same vocabulary (the transformers and vLLM
engines' matcher: cold for a new scene, again for a goal of the same scene, which copies the
compiled matcher, and cold for the first goal of its grammar's shape, whose Lark text is
converted from GBNF, :func:`~timelyllm_ros.engines.constraint.gbnf_lark`). It prints the
median and the largest time per goal and robot kind, with the gripper rule and without it
(``gripper: null``), and the grammar's size. The per-token cost of a grammar is measured where
plans are generated: ``timelyllm plan-quality`` prints the grammar's share of decode time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from timelyllm_ros.engines.llamacpp import LlamaCppEngine
from timelyllm_ros.language import grammar as plan_grammars
from timelyllm_ros.language.grounding import task_objects
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.traces import load_trace_set, trace_set_path


def timed(action: Callable[[], object], repeats: int) -> float:
    """The median wall time of an action in ms."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='smollm2', help='the CPU engine model (vocabulary)')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--json', help='also write the figures to this file')
    args = parser.parse_args()

    engine = LlamaCppEngine(args.model, threads=1, max_num_seqs=1)
    llguidance = None
    try:
        from timelyllm_ros.engines import constraint
        from timelyllm_ros.engines.constraint import LlguidanceTokenizer
        pieces = [engine.piece(token) for token in range(engine.n_vocab)]
        eos = engine._llama.llama_vocab_eos(engine._vocab)
        llguidance = LlguidanceTokenizer.from_pieces(
            pieces, eos, None, lambda data: engine.tokenize(data.decode('utf-8', 'replace'),
                                                            special=False))
    except Exception as err:          # noqa: BLE001 - llguidance is optional here
        print(f'llguidance not measured: {err}')

    tasks = [t for name in ('derived', 'heldback')
             for t in load_trace_set(trace_set_path(name)).traces if t.robot in ('tello', 'indy7')]
    rows: dict[str, dict[str, list[float]]] = {}
    for trace in tasks:
        profile = load_profile(trace.robot)
        variants: dict[str, RobotProfile] = {'as shipped': profile}
        if profile.gripper is not None:
            variants['without gripper rule'] = profile.model_copy(update={'gripper': None})
        objects = task_objects(trace.task)
        for label, variant in variants.items():
            def build(variant: RobotProfile = variant,
                      objects: tuple[str, ...] = objects) -> str:
                plan_grammars._CACHE.clear()
                compiled = plan_grammars.plan_grammar(variant, objects)
                assert compiled is not None
                return compiled.gbnf

            gbnf = build()
            figures = rows.setdefault(f'{trace.robot}, {label}', {})
            figures.setdefault('build_ms', []).append(timed(build, args.repeats))
            figures.setdefault('llamacpp_ms', []).append(
                timed(lambda gbnf=gbnf: engine._grammar(gbnf), args.repeats))
            if llguidance is not None:
                def compile_llguidance(gbnf: str = gbnf, new_shape: bool = False) -> None:
                    llguidance._compiled.clear()
                    if new_shape:
                        constraint._LARK_SHAPES.clear()
                    llguidance.grammar(gbnf)
                # a goal of a new scene: its grammar's shape (robot kind and object count)
                # met before, converted to Lark once; and the first goal of its shape
                figures.setdefault('llguidance_ms', []).append(
                    timed(compile_llguidance, args.repeats))
                figures.setdefault('llguidance_shape_ms', []).append(
                    timed(lambda gbnf=gbnf: compile_llguidance(gbnf, True), args.repeats))
                # the next goal of the same scene: a copy of the compiled matcher
                figures.setdefault('llguidance_again_ms', []).append(
                    timed(lambda gbnf=gbnf: llguidance.grammar(gbnf), args.repeats))
            figures.setdefault('kbytes', []).append(len(gbnf) / 1e3)
    engine.close()

    summary = {}
    print(f'{len(tasks)} robot tasks, {args.model} vocabulary, median of {args.repeats} per goal')
    print(f'{"grammar":32s} {"figure":14s} {"median":>8s} {"max":>8s}')
    for key, figures in rows.items():
        summary[key] = {}
        for figure, values in figures.items():
            summary[key][figure] = {'median': statistics.median(values), 'max': max(values),
                                    'goals': len(values)}
            print(f'{key:32s} {figure:14s} {statistics.median(values):8.2f} {max(values):8.2f}')
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as out:
            json.dump(summary, out, indent=1)


if __name__ == '__main__':
    main()
