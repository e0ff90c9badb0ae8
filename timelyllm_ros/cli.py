"""``timelyllm``: run a simulated fleet, benchmark policies, measure overheads.

A thin ``main(argv) -> int`` over library calls. Input refused (an argument out of range, a
hostile or invalid file) prints ``error: <where>: <field>: <reason>`` and returns 2 before any
work starts or any output is written; other errors print ``ERROR: …`` and return 1. A file
to write (``--json``, ``--plans``, ``calibrate --out``) must be in a directory that exists;
the output folders of ``bench`` and ``reproduce`` are created.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from timelyllm_ros.core.admission import BATCH_MODES
from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.errors import run_command
from timelyllm_ros.evaluation.tables import (
    format_value,
    metrics_matrix,
    metrics_table,
    summary_tables,
    text_table,
)
from timelyllm_ros.safe_files import (
    WorkloadInputError,
    float_arg,
    int_arg,
    int_list_arg,
    output_file,
    refusing_input,
)


def _load_tasks(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from timelyllm_ros.evaluation.workloads import resolve_workload

    name, tasks = resolve_workload(args.workload, seed=args.seed,
                                   workload_file=args.workload_file, composition=args.compose)
    if args.tasks is not None:
        # Scaled down for a slow engine: the first N tasks by arrival.
        tasks = sorted(tasks, key=lambda t: t.arrival_time)[:args.tasks]
        name = f'{name}[:{args.tasks}]'
    if not tasks:
        raise WorkloadInputError(name, 'no task to run (a longer duration_s or a higher eps)',
                                 'workload')
    return name, tasks


if TYPE_CHECKING:
    from timelyllm_ros.engines import Engine


def _engine_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """EngineOptions from --engine, --model, --engine-opt, --calibration, --no-prefix-cache."""
    from timelyllm_ros.evaluation.bench import EngineOptions

    return EngineOptions(args.calibration, not args.no_prefix_cache, args.engine,
                         tuple(_engine_option_values(args).items()),
                         replicas=getattr(args, 'replicas', 1),
                         request_latency_s=getattr(args, 'request_latency_ms', 0.0) / 1000)


def _engine_option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of the command line: ``--model``, ``--engine-opt KEY=VALUE`` and,
    for an engine that takes it, ``--force-script``/``--free-generation`` (create_engine
    checks them)."""
    from timelyllm_ros.engines import engine_options, parse_engine_options

    options: dict[str, Any] = dict(parse_engine_options(args.engine_opt or []))
    if args.model:
        options['model'] = args.model
    if args.force_script is not None and 'force_script' in engine_options(args.engine):
        options['force_script'] = args.force_script
    return options


def _replays_plans(engine: str) -> bool:
    """Whether an engine replays recorded plans (the simulator) instead of generating them."""
    from timelyllm_ros.engines import engine_class

    return 'scripted_plans' in engine_class(engine).capabilities


def _config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(comm_s=args.comm_ms / 1000.0, max_batch=args.max_batch,
                           batch_mode=getattr(args, 'batch_mode', 'latency-guided'),
                           grammar=not getattr(args, 'no_grammar', False),
                           suspend_on_next_statement=not getattr(args, 'suspend_at_cut', False))


def cmd_run(args: argparse.Namespace) -> int:
    from timelyllm_ros.evaluation.bench import run_summary
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.policies import FLEET_POLICY

    name, tasks = _load_tasks(args)
    engine = _engine_options(args)
    policy = args.policy if args.policy is not None else FLEET_POLICY
    print(f'workload {name}: {len(tasks)} tasks, policy {policy}, seed {args.seed}, '
          f'engine {args.engine}')
    result = simulate(tasks, policy, seed=args.seed, config=_config(args),
                      engine=engine.build(), robot_jitter=args.robot_jitter or 0.0)
    summary = run_summary(result)
    print(summary_tables(summary))
    run = summary['run']
    print(f"simulated {run['sim_time_s']:.1f} s in {run['wall_time_s']:.2f} s wall "
          f"({run['speedup']:.0f}x real time), {run['engine_iterations']} engine iterations, "
          f"mean batch {run['mean_batch_size']:.2f}, "
          f"{run['decision_ms_mean']:.3f} ms deciding per iteration")
    for spec, reason in result.rejected:
        print(f'rejected {spec.task_id}: {reason}')
    failed = [g for g in result.generations if g.error]
    for generation in failed[:10]:
        print(f'{generation.task_id} {generation.status.name}: {generation.error}')
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + '\n')
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from timelyllm_ros.evaluation.bench import regime_engine, run_bench
    from timelyllm_ros.policies import resolve_policy_names

    if args.matrix:
        return _bench_matrix(args)
    name, tasks = _load_tasks(args)
    policies = resolve_policy_names(args.policies)
    regimes: list[str] = args.regimes or ['default', 'contended']
    engines = {regime: regime_engine(regime, _engine_options(args)) for regime in regimes}
    sizes: list[int] = args.batch_sizes or []
    steps = len(regimes) * len(policies) + len(sizes) * len(
        [p for p in ('vllm', 'timelyllm') if p in policies] or policies)
    summaries: dict[str, dict[str, Any]] = {}
    with tqdm(total=steps, desc=f'bench {name}', unit='run', disable=args.quiet,
              file=sys.stderr) as bar:
        started = False

        def progress(label: str) -> None:
            nonlocal started
            bar.set_postfix_str(label)
            bar.update(1 if started else 0)
            started = True

        for index, regime in enumerate(regimes):
            # the first regime in --out, as before; the others in a folder each beside it
            out = Path(args.out) if index == 0 else Path(args.out) / regime
            summaries[regime] = run_bench(
                name, tasks, policies, out, seed=args.seed, config=_config(args),
                robot_jitter=args.robot_jitter or 0.0, engine=engines[regime],
                batch_sizes=sizes if index == 0 else (), progress=progress, regime=regime)
        bar.update(steps - bar.n)
    for index, (regime, summary) in enumerate(summaries.items()):
        _print_bench(name, tasks, args, regime, summary, details=index == 0)
    if len(summaries) > 1:
        print(_regimes_table(summaries))
    print(f'wrote {Path(args.out) / "summary.json"}, tasks.csv and figures'
          + ''.join(f'; {regime} in {Path(args.out) / regime}' for regime in regimes[1:]))
    return 0


def _bench_matrix(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from timelyllm_ros.evaluation.matrix import (
        DEFAULT_REGIMES,
        DEFAULT_SEEDS,
        DEFAULT_WORKLOADS,
        run_matrix,
    )
    from timelyllm_ros.evaluation.workloads import workload_names
    from timelyllm_ros.policies import FLEET_POLICY, resolve_policy_names

    workloads = (args.workloads.split(',') if args.workloads else list(DEFAULT_WORKLOADS))
    unknown = [w for w in workloads if w not in workload_names()]
    if unknown:
        raise WorkloadInputError(','.join(unknown), 'unknown workload', 'workloads')
    seeds: list[int] = args.seeds or list(DEFAULT_SEEDS)
    regimes: list[str] = args.regimes or list(DEFAULT_REGIMES)
    policies = resolve_policy_names(args.policies)
    judged = args.standing
    if judged is None and FLEET_POLICY in policies and len(policies) > 1:
        judged = FLEET_POLICY
    jitter = 0.1 if args.robot_jitter is None else args.robot_jitter
    with tqdm(total=len(workloads) * len(regimes) * len(seeds), desc='bench matrix',
              unit='cell', disable=args.quiet, file=sys.stderr) as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        run_matrix(Path(args.out), policies, workloads=workloads, regimes=regimes, seeds=seeds,
                   robot_jitter=jitter, config=_config(args), engine=_engine_options(args),
                   progress=progress, judged=judged)
    print((Path(args.out) / 'matrix.md').read_text(encoding='utf-8'), end='')
    print(f"wrote {Path(args.out) / 'matrix.json'}, matrix.md, matrix.png and every cell's "
          f'bench output under {args.out}/WORKLOAD/REGIME/seedN')
    return 0


def _print_bench(name: str, tasks: Sequence[object], args: argparse.Namespace, regime: str,
                 summary: dict[str, Any], details: bool) -> None:
    from timelyllm_ros.evaluation.bench import COMPARED_METRICS
    from timelyllm_ros.evaluation.plots import METRIC_LABELS

    engine = summary['engine']
    print(f'== regime {regime}: workload {name}: {len(tasks)} tasks, seed {args.seed}, engine '
          f"{engine['name']}, prefix caching {'on' if engine['prefix_caching'] else 'off'}"
          + (f", calibration {engine['calibration']}" if 'calibration' in engine else ''))
    results = summary['policies']
    if details:
        for policy, result in results.items():
            rows = {**result['by_class'], 'overall': result['overall']}
            print(metrics_table(f'[{policy}]', rows, 'class'))
        for key, label in (('utility_mean', 'time utility'),
                           ('response_time_mean_s', 'response time (s)'),
                           ('waiting_time_mean_s', 'robot waiting time (s)')):
            print(metrics_matrix(f'{label} per task type', results, key))
    for key in COMPARED_METRICS if details else ('utility_mean', 'utility_floored_mean'):
        print(metrics_matrix(f'{METRIC_LABELS.get(key, key)} per task class', results, key,
                            sections=('by_class',)))
    print('scheduling overhead (ms deciding per engine iteration): ' + ', '.join(
        f"{p} {r['run']['decision_ms_mean']:.3f}" for p, r in results.items()))
    if 'batch_sweep' in summary:
        print('batch sweep (overall utility):', json.dumps(summary['batch_sweep']))


def _regimes_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Overall signed and floored utility and completion rate, per policy and regime."""
    regimes = list(summaries)
    policies = list(next(iter(summaries.values()))['policies'])
    header = ['policy', *(f'{r} {m}' for r in regimes for m in ('utility', 'floored', 'done'))]
    body = []
    for policy in policies:
        row = [policy]
        for regime in regimes:
            overall = summaries[regime]['policies'][policy]['overall']
            row += [format_value(overall['utility_mean'], '{:.3f}'),
                    format_value(overall['utility_floored_mean'], '{:.3f}'),
                    format_value(overall['completion_rate'], '{:.0%}')]
        body.append(row)
    return text_table(header, body, title='overall, per regime')


def cmd_overhead(args: argparse.Namespace) -> int:
    from timelyllm_ros.evaluation.bench import scheduling_overhead

    costs = [scheduling_overhead(n, repeats=args.repeats, policy=args.policy)
             for n in args.queued]
    if args.json:
        print(json.dumps({str(c.queued): {'decision_ms': c.decision_ms, 'admitted': c.admitted,
                                          'per_admission_ms': c.per_admission_ms}
                          for c in costs}))
    else:
        for c in costs:
            print(f'{c.queued:>6} queued: {c.decision_ms:.4f} ms per decision (CPU), '
                  f'{c.admitted:g} admitted, {c.per_admission_ms:.4f} ms per admission')
    return 0


def cmd_simspeed(args: argparse.Namespace) -> int:
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.policies import resolve_policy_names

    name, tasks = _load_tasks(args)
    simulate(tasks[: min(len(tasks), 20)], 'timelyllm')   # warm imports and caches
    results = {}
    for policy in resolve_policy_names(args.policies):
        best = None
        for _ in range(args.repeats):
            result = simulate(tasks, policy, seed=args.seed, config=_config(args),
                              engine=_engine_options(args).build(),
                              robot_jitter=args.robot_jitter or 0.0)
            speed = result.sim_time_s / result.wall_time_s
            best = speed if best is None else max(best, speed)
        results[policy] = best
        print(f'{name} {policy:>19}: {best:8.0f} simulated s per wall s')
    if args.json:
        print(json.dumps(results))
    return 0


def _create_engine(args: argparse.Namespace) -> Engine:
    from timelyllm_ros.engines import create_engine

    options = _engine_option_values(args)
    if args.calibration is not None:
        options['calibration'] = args.calibration
    return create_engine(args.engine, **options)


def cmd_plan_quality(args: argparse.Namespace) -> int:
    from timelyllm_ros.evaluation.plan_quality import (
        QUALITY_KEYS,
        PlanOutcome,
        grammar_share,
        outcome_record,
        run_plan_quality,
        summarize,
    )
    from timelyllm_ros.evaluation.tables import format_value, text_table
    from timelyllm_ros.language.traces import load_trace_set, trace_set_path

    if _replays_plans(args.engine):
        print('error: plan-quality needs a real engine (--engine cpu|transformers|vllm): the '
              'simulator replays the recorded plans', file=sys.stderr)
        return 2
    traces = load_trace_set(trace_set_path(args.trace_set)).traces
    if args.tasks:
        wanted = set(args.tasks)
        traces = [t for t in traces if t.id in wanted]
    engine = _create_engine(args)
    try:
        engine.warmup()

        def progress(outcome: PlanOutcome) -> None:
            if not args.quiet:
                verdict = 'ok' if outcome.executed_ok else outcome.problem
                if outcome.verdict:
                    verdict = ', '.join(v for v in (verdict, outcome.verdict,
                                                    outcome.verdict_reason) if v)
                print(f'task {outcome.task} ({outcome.robot}, {outcome.tokens} tokens): '
                      f'{outcome.text.strip()!r} -> {verdict}', file=sys.stderr, flush=True)

        outcomes = run_plan_quality(engine, grammar=not args.no_grammar, traces=traces,
                                    progress=progress)
    finally:
        engine.close()
    summary = summarize(outcomes)
    if args.plans:
        Path(args.plans).write_text(json.dumps([outcome_record(o) for o in outcomes],
                                               indent=2) + '\n', encoding='utf-8')
    if args.json:
        print(json.dumps(summary))
        return 0
    formats = ('{:d}', '{:d}', '{:d}', '{:d}', '{:d}', '{:d}', '{:d}', '{:.1f}', '{:.2f}')
    groups = {robot: [o for o in outcomes if o.robot == robot] for robot in summary['by_robot']}
    groups['overall'] = outcomes
    rows = [[name, *(format_value(q[k], f) for k, f in zip(QUALITY_KEYS, formats, strict=True)),
             format_value(100.0 * grammar_share(groups[name]), '{:.1f}')]
            for name, q in [*summary['by_robot'].items(), ('overall', summary['overall'])]]
    grammar = 'without' if args.no_grammar else 'with'
    print(text_table(['robot', *QUALITY_KEYS, 'grammar % of decode'], rows,
                     title=f'plan quality, engine {args.engine}, {grammar} the grammar'))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import shlex

    from timelyllm_ros.evaluation.calibrate import measure, write_calibration

    engine = _create_engine(args)
    command = ''
    if Path(sys.argv[0]).name == 'timelyllm' and sys.argv[1:2] == ['calibrate']:
        command = 'timelyllm ' + shlex.join(sys.argv[1:])
    stats = engine.stats()
    model = args.label or stats.model or args.model or args.engine
    hardware = stats.hardware if engine.supports('scripted_plans') else None
    lengths: list[int] = args.prefill_tokens
    batches: list[int] = args.batch_sizes

    def progress(label: str) -> None:
        if not args.quiet:
            print(f'calibrate: {label}', file=sys.stderr, flush=True)

    calibration = measure(engine, str(model), args.engine, lengths=lengths, batch_sizes=batches,
                          context_words=args.context, long_context_words=args.long_context,
                          context_batch=args.context_batch,
                          steps=args.steps, repeats=args.repeats, progress=progress,
                          hardware=hardware,
                          command=command)
    path = write_calibration(calibration, args.out, header=(
        f'Latency model of {calibration.model} on {calibration.gpu}, engine {args.engine}.\n'
        f'Measured by this project with `timelyllm calibrate` (see source). Run the simulator '
        f'on it with\n`timelyllm run --calibration {Path(args.out).stem}` (bundled) or '
        f'--calibration {args.out}.'))
    prefill = calibration.prefill_ms
    decode = calibration.decode_ms
    print('prefill: ' + ', '.join(f'{t} tok {ms:.1f} ms' for t, ms in
                                    zip(prefill.tokens, prefill.ms, strict=True)))
    print(f'decode ({decode.reference_context_tokens} context tokens): ' + ', '.join(
        f'batch {b} {ms:.1f} ms' for b, ms in zip(decode.batch, decode.ms, strict=True)))
    print(f'decode per extra context token: {calibration.decode_ms_per_context_token:.6f} ms; '
          f'swap-in {calibration.swap_in_ms_per_token:.6f} ms/token')
    print(f'wrote {path}')
    return 0


_SEG_KEYS = ('overhead_ms', 'overhead_pct', 'prefix_reuse', 'identical')


def cmd_reproduce(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from timelyllm_ros.evaluation.bench import PAPER_CALIBRATION
    from timelyllm_ros.evaluation.reproduce import reproduce

    out = Path(args.out)
    real_engine = None
    if not _replays_plans(args.engine):
        def real_engine() -> Engine:      # --calibration is the simulator's, not this engine's
            from timelyllm_ros.engines import create_engine
            return create_engine(args.engine, **_engine_option_values(args))
    with tqdm(desc='reproduce', unit='experiment', disable=args.quiet,
              file=sys.stderr) as bar:
        started: list[str] = []

        def progress(label: str, total: int) -> None:
            bar.total = total
            if started:                   # the previous experiment is done
                bar.update(1)
            started.append(label)
            bar.set_postfix_str(label)

        summary = reproduce(out, args.calibration or PAPER_CALIBRATION, seed=args.seed,
                            progress=progress, real_engine=real_engine)
        bar.update(1)
    print((out / 'claims.md').read_text(encoding='utf-8'), end='')
    claims = summary['claims']
    holding = sum(c['holds'] for c in claims.values())
    directed = sum(c['direction_ok'] for c in claims.values())
    print(f'{holding} of {len(claims)} claims hold within their tolerance, {directed} in '
          f"direction; summary in {out / 'summary.json'}")
    return 0


def cmd_validate_sim(args: argparse.Namespace) -> int:
    from timelyllm_ros.engines.calibration import load_calibration
    from timelyllm_ros.evaluation.recording import load_recording, write_recording
    from timelyllm_ros.evaluation.validate_sim import COMPARED, compare, validate
    from timelyllm_ros.policies import resolve_policy_names

    def progress(label: str) -> None:
        if not args.quiet:
            print(f'validate-sim: {label}', file=sys.stderr, flush=True)

    if args.real:
        recording = load_recording(args.real)
        calibration = load_calibration(args.calibration) if args.calibration else None
        result = compare(recording, calibration=calibration, progress=progress)
        tasks = len(recording.runs[0].tasks) if recording.runs else 0
        against = (f'calibration {args.calibration}' if args.calibration
                   else 'its calibration')
        heading = (f'recording {args.real}: {tasks} tasks of {recording.workload or "?"} on '
                   f"{recording.engine.get('name', '?')} "
                   f"({recording.engine.get('hardware', '?')}), against the simulator on "
                   f'{against}')
    else:
        name, tasks_list = _load_tasks(args)
        # A calibration given here is the real engine's own (e.g. measured by `calibrate`
        # on the same machine just before): it replaces the short one measured otherwise.
        measured = load_calibration(args.calibration) if args.calibration else None
        real_engine = dataclasses.replace(_engine_options(args), calibration=None)
        result, recording = validate(
            tasks_list, resolve_policy_names(args.policies), real_engine,
            config=_config(args), seed=args.seed, robot_jitter=args.robot_jitter or 0.0,
            calibration=measured, workload=name, progress=progress)
        if args.record:
            write_recording(recording, args.record)
            progress(f'recording written to {args.record}')
        heading = (f'workload {name}: {len(tasks_list)} tasks on engine {args.engine} and on '
                   f'the simulator calibrated from it')
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    print(heading)
    for missing in recording.missing:
        print(f'  the recording lacks: {missing}')
    rows = []
    for policy, entry in result['policies'].items():
        errors = entry['median_abs_rel_error']
        rows.append([policy, *(format_value(errors[m], '{:.1%}') for m in COMPARED),
                     format_value(entry['real']['overall']['utility_mean'], '{:.3f}'),
                     format_value(entry['sim']['overall']['utility_mean'], '{:.3f}')])
    print(text_table(['policy', *(f'{m} err' for m in COMPARED), 'utility real',
                      'utility sim'], rows))
    print(f"ranking real {result['ranking']['real']}, sim {result['ranking']['sim']}: "
          f"{'same' if result['ranking_same'] else 'DIFFERENT'}")
    keys = (('engine_iterations', 'iterations', '{:d}'), ('engine_busy_s', 'busy s', '{:.2f}'),
            ('prefill_iteration_ms_median', 'prefill ms', '{:.1f}'),
            ('decode_after_change_ms_median', 'decode after change ms', '{:.1f}'),
            ('decode_iteration_ms_median', 'decode ms', '{:.1f}'))
    rows = [[policy, side, *(format_value(entry[side]['run'].get(k), p) for k, _, p in keys)]
            for policy, entry in result['policies'].items() for side in ('real', 'sim')]
    print(text_table(['policy', 'run', *(h for _, h, _ in keys)], rows,
                     title='engine iterations (medians)'))
    return 0


def cmd_seg_overhead(args: argparse.Namespace) -> int:
    from timelyllm_ros.evaluation.seg_overhead import segmentation_overhead

    engine = _create_engine(args)
    trace_ids: list[int] = args.traces

    def progress(label: str) -> None:
        if not args.json:
            print(f'seg-overhead: {label}', file=sys.stderr, flush=True)

    results = segmentation_overhead(engine, trace_ids, repeats=args.repeats,
                                    max_tokens=args.max_tokens, progress=progress,
                                    prompt_cache=args.prompt_cache)
    if args.json:
        keys = None if args.details else _SEG_KEYS
        print(json.dumps({'traces': {t: {k: v for k, v in r.items() if keys is None or k in keys}
                                     for t, r in results.items()}}))
        return 0
    header = ['trace', 'whole ms', 'segmented ms', 'overhead ms', 'overhead %', 'resumes',
              'prefix reuse', 'identical']
    rows = [[t, f"{r['whole_ms']:.1f}", f"{r['segmented_ms']:.1f}", f"{r['overhead_ms']:.1f}",
             format_value(r['overhead_pct'], '{:.2f}'), str(r['resumes']),
             format_value(r['prefix_reuse'], '{:.3f}'), str(r['identical'])]
            for t, r in results.items()]
    print(text_table(header, rows, title=f'segmentation overhead, engine {args.engine}'))
    for t, r in results.items():
        print(f'trace {t} output: {r["output"]!r}')
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    from timelyllm_ros.evaluation.workloads import (
        AUTHORS_WORKLOADS,
        BUILTIN_WORKLOADS,
        DEFAULT_BURST_S,
        OVERLOAD_WORKLOADS,
    )

    for spec in BUILTIN_WORKLOADS.values():
        print(f'{spec.name:14} {spec.description} (EPS {spec.eps}, max TPE {spec.max_tpe}, '
              f'traces {spec.trace_ids}, {spec.agents} agents, {spec.duration_s:g} s'
              f'{f", profile {spec.profile}" if spec.profile else ""})')
    for name, path in AUTHORS_WORKLOADS.items():
        print(f"{name:14} the TimelyLLM authors' workload {path.name} (CC BY 4.0)")
    for name, robots in OVERLOAD_WORKLOADS.items():
        print(f'{name:14} overload: {robots} drones, one goal each within {DEFAULT_BURST_S:g} s '
              f'(traces 1-8)')
    return 0


# Ranges of the numeric arguments (argparse refuses what is outside, exit status 2).
SEED = int_arg(0)                  # numpy's generators take no negative seed
MAX_BATCH = 4096
MAX_TOKENS = 1_000_000
BATCH_SIZES = int_list_arg(1, MAX_BATCH)
TRACE_IDS = int_list_arg(0, 1_000_000)


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    from timelyllm_ros.evaluation.workloads import workload_names

    parser.add_argument('--workload', default='wid1',
                        help=f'{"|".join(workload_names())} (default wid1)')
    parser.add_argument('--workload-file', help='authors-format JSON or workload spec YAML')
    parser.add_argument('--compose', help='programmable composition, e.g. "(1,2),8,9"')
    parser.add_argument('--seed', type=SEED, default=0,
                        help="seeds a generated workload's arrivals and the robots' execution "
                             "times drawn from their model; the authors' workloads carry "
                             'recorded arrivals and skill times, so on them only '
                             '--robot-jitter makes runs differ by seed')
    parser.add_argument('--robot-jitter', type=float_arg(0.0, 10.0), default=None, metavar='SD',
                        help='relative standard deviation drawn (from --seed) on every '
                             'simulated segment execution time, recorded or modelled '
                             '(default 0: the times as they are; 0.1 for bench --matrix)')
    parser.add_argument('--comm-ms', type=float_arg(0.0, 3_600_000.0), default=8.0,
                        help='network latency (ms)')
    parser.add_argument('--max-batch', type=int_arg(1, MAX_BATCH), default=None,
                        help='fixed batch cap')
    parser.add_argument('--batch-mode', choices=BATCH_MODES, default='latency-guided',
                        help="TimelyLLM's admission: latency-guided (§4.4, default) or fixed "
                             "(batch cap and memory only, as the paper's batch sweeps)")
    parser.add_argument('--suspend-at-cut', action='store_true',
                        help='suspend a segmented generation at each cut, as the paper states '
                             'it (default: once its next statement begins, so that a plan '
                             'ending there needs no resume)')
    parser.add_argument('--calibration', default=None, help='calibration name or YAML path')
    parser.add_argument('--no-prefix-cache', action='store_true',
                        help='engine without prefix caching (every prompt fully prefilled)')
    parser.add_argument('--replicas', type=int_arg(1, 64), default=1, metavar='N',
                        help='N simulated engines behind one queue and scheduler (a replica '
                             'pool: each generation stays on the replica it started on)')
    parser.add_argument('--request-latency-ms', type=float_arg(0.0), default=0.0, metavar='MS',
                        help="with --replicas: the network's share of each segment request "
                             '(to the replica and the first token back), as a pool of vllm '
                             'serve replicas has')
    parser.add_argument('--tasks', type=int_arg(1), default=None, metavar='N',
                        help='only the first N tasks by arrival (scale down for a slow engine)')
    _add_engine_args(parser, default_force=True)


def _add_engine_args(parser: argparse.ArgumentParser, default_force: bool) -> None:
    from timelyllm_ros.engines import ENGINES

    parser.add_argument('--engine', default='sim',
                        help=f'{"|".join(ENGINES)} or package.module:Class (default sim: the '
                             f'calibrated simulator; a real engine advances the simulated '
                             f'clock by its measured iteration times)')
    parser.add_argument('--model', default=None,
                        help='model of a real engine (cpu: smollm2, gemma3-270m or a .gguf)')
    parser.add_argument('--engine-opt', action='append', metavar='KEY=VALUE',
                        help='extra engine option, e.g. max_num_seqs=4 (repeatable)')
    force = parser.add_mutually_exclusive_group()
    force.add_argument('--force-script', dest='force_script', action='store_true',
                       default=default_force,
                       help="feed the traces' plan tokens instead of the argmax (real timing, "
                            'trace content)' + (' (default)' if default_force else ''))
    force.add_argument('--free-generation', dest='force_script', action='store_false',
                       help='greedy generation from the model' + (
                           '' if default_force else ' (default)'))
    parser.add_argument('--no-grammar', action='store_true',
                        help="generate robot plans without their profile's grammar (by default "
                             'a real engine constrains them to it; for comparison)')


def _regime_help() -> dict[str, str]:
    from timelyllm_ros.evaluation.bench import REGIMES

    return REGIMES


def _regimes_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(',') if n.strip()]
    unknown = [n for n in names if n not in _regime_help()]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f'regimes are distinct names among {", ".join(_regime_help())}, got {text!r}')
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='timelyllm', description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='command', required=True)

    run = sub.add_parser('run', help='simulate a fleet on a workload under one policy')
    _add_workload_args(run)
    run.add_argument('--policy', help="scheduling policy (default: the fleet's, as the "
                     'planner node runs it)')
    run.add_argument('--json', type=output_file, help='also write the summary to this file')
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser('bench', help='all policies side by side on one workload')
    _add_workload_args(bench)
    bench.add_argument('--policies', default='paper', help="'all', 'paper' or a,b,c")
    bench.add_argument('--out', default='bench-out', help='output directory')
    bench.add_argument('--batch-sizes', type=BATCH_SIZES,
                       help='also sweep fixed batch sizes, e.g. 1,2,4,6,8,12')
    bench.add_argument('--quiet', action='store_true', help='no progress bar')
    bench.add_argument('--regimes', type=_regimes_arg, default=None,
                       help='engine regimes, each a full run of the policies (default '
                            'default,contended; with --matrix default,contended,paper): '
                            + '; '.join(
                                f'{n}: {d.split(":")[0].split(" (")[0]}'
                                for n, d in _regime_help().items())
                            + '. The first goes to --out, the others to --out/REGIME')
    bench.add_argument('--matrix', action='store_true',
                       help='the benchmark matrix: --workloads × --regimes × --seeds × '
                            "--policies, with each figure's spread over the seeds "
                            '(matrix.json, matrix.md, matrix.png in --out); --robot-jitter '
                            'defaults to 0.1 there, so seeds matter on recorded workloads')
    bench.add_argument('--workloads', default=None,
                       help='with --matrix: comma-separated workloads (default wid1,wid2,wid3,'
                            'authors-drone,authors-arm,overload-1000)')
    bench.add_argument('--seeds', type=int_list_arg(0, 2**31), default=None,
                       help='with --matrix: seeds (default 0,1,2,3,4)')
    bench.add_argument('--standing', default=None, metavar='POLICY',
                       help='with --matrix: say where POLICY stands against the best other '
                            'policy in every cell and figure (ahead; level: within the '
                            "seeds' spread, or a response time within 10%% of the best; "
                            "behind); default: the fleet's policy when it is among several "
                            '--policies')
    bench.set_defaults(func=cmd_bench)

    overhead = sub.add_parser('overhead', help='median CPU time of one scheduling decision '
                                               '(the real decide(), a batch with room)')
    overhead.add_argument('--queued', type=int_list_arg(1, 1_000_000), default='1,8,100,10000',
                          help='queue sizes, e.g. 1,8,100 (each at most 1000000)')
    overhead.add_argument('--repeats', type=int_arg(1, 1_000_000), default=30,
                          help='decisions timed per queue size (each on a fresh queue)')
    overhead.add_argument('--policy', default='timelyllm')
    overhead.add_argument('--json', action='store_true')
    overhead.set_defaults(func=cmd_overhead)

    speed = sub.add_parser('simspeed', help='simulated seconds per wall-clock second')
    _add_workload_args(speed)
    speed.add_argument('--policies', default='paper')
    speed.add_argument('--repeats', type=int_arg(1, 1000), default=3)
    speed.add_argument('--json', action='store_true')
    speed.set_defaults(func=cmd_simspeed)

    calibrate = sub.add_parser('calibrate', help='measure an engine; write a calibration YAML')
    _add_engine_args(calibrate, default_force=True)
    calibrate.add_argument('--calibration', default=None, help='(--engine sim) the model')
    calibrate.add_argument('--out', type=output_file, required=True,
                           help='calibration YAML to write')
    calibrate.add_argument('--label', default=None, help='model label written to the file')
    calibrate.add_argument('--prefill-tokens', type=int_list_arg(1, MAX_TOKENS),
                           default='16,64,128,256,512,1024',
                           help='prompt lengths of the prefill curve')
    calibrate.add_argument('--batch-sizes', type=BATCH_SIZES, default='1,2,4,8',
                           help='decode batch sizes')
    calibrate.add_argument('--context', type=int_arg(1, MAX_TOKENS), default=256,
                           help='prompt tokens of each decode measurement (reference context)')
    calibrate.add_argument('--long-context', type=int_arg(1, MAX_TOKENS), default=1024,
                           help='longer prompt for the cost per context token')
    calibrate.add_argument('--context-batch', type=int_arg(1, 4096), default=1, metavar='N',
                           help='measure the cost per context token on N long prompts at once '
                                '(one of --batch-sizes; on a GPU the largest: a batch-1 pair '
                                'there reads a kernel change as a per-token cost)')
    calibrate.add_argument('--steps', type=int_arg(1, 10_000), default=8,
                           help='decode iterations per point')
    calibrate.add_argument('--repeats', type=int_arg(1, 1000), default=2,
                           help='prefill runs per length')
    calibrate.add_argument('--quiet', action='store_true')
    calibrate.set_defaults(func=cmd_calibrate)

    quality = sub.add_parser(
        'plan-quality', help="a real model's plans for the bundled tasks: parsed, within the "
                             "robot's limits, executed on the emulators")
    _add_engine_args(quality, default_force=False)
    quality.add_argument('--calibration', default=None, help=argparse.SUPPRESS)
    quality.add_argument('--trace-set', default='derived', metavar='NAME|FILE',
                         help='tasks and reference plans: derived (the bundled traces, '
                              'default), heldback and heldback2 (20 robot tasks each kept out '
                              'of every prompt; heldback2 written after the example pools) or '
                              'a trace-set YAML')
    quality.add_argument('--tasks', type=TRACE_IDS, default=None,
                         help='trace ids, e.g. 1,2,12 (default: all)')
    quality.add_argument('--json', action='store_true',
                         help='print {"overall": Q, "by_robot": {KIND: Q}} with Q = {plans, '
                              'parsed, within_limits, executed_ok, useful, partly, useless, '
                              'tokens_mean, decode_ms_per_token}')
    quality.add_argument('--plans', type=output_file, default=None, metavar='FILE',
                         help='also write every plan and its verdict to this JSON file')
    quality.add_argument('--quiet', action='store_true', help='no line per plan on stderr')
    quality.set_defaults(func=cmd_plan_quality)

    seg = sub.add_parser('seg-overhead',
                         help='segmented vs whole generation of traces on a real engine')
    _add_engine_args(seg, default_force=False)
    seg.add_argument('--calibration', default=None, help='(--engine sim) the model')
    seg.add_argument('--traces', type=TRACE_IDS, default='1,2,3', help='trace ids, e.g. 1,2,3')
    seg.add_argument('--repeats', type=int_arg(1, 1000), default=3,
                     help='measured pairs of runs per trace (medians)')
    seg.add_argument('--max-tokens', type=int_arg(1, MAX_TOKENS), default=None,
                     help="generation limit (default: the robot profile's)")
    seg.add_argument('--prompt-cache', choices=('warm', 'cold'), default='warm',
                     help="warm: the robot's prompt prefix stays cached between runs (a serving "
                          'engine); cold: every run prefills its whole prompt (separate runs, '
                          "as the paper's Table 4)")
    seg.add_argument('--json', action='store_true',
                     help='print {"traces": {ID: {overhead_ms, overhead_pct, prefix_reuse, '
                          'identical}}}')
    seg.add_argument('--details', action='store_true', help='with --json: every field')
    seg.set_defaults(func=cmd_seg_overhead)

    validate = sub.add_parser(
        'validate-sim', help='the same tasks on a real engine and on the simulator calibrated '
                             'from it: per-task errors and rankings')
    _add_workload_args(validate)
    validate.add_argument('--policies', default='vllm,timelyllm',
                          help='comma-separated policies (default vllm,timelyllm)')
    validate.add_argument('--json', action='store_true',
                          help='print {"policies": {NAME: {"median_abs_rel_error": {response, '
                               'waiting, completion}, "real": ..., "sim": ..., "tasks": ...}}, '
                               '"ranking_same": bool, ...}')
    validate.add_argument('--quiet', action='store_true', help='no progress on stderr')
    recorded = validate.add_mutually_exclusive_group()
    recorded.add_argument('--record', type=output_file, metavar='FILE',
                          help='also write the real runs and the calibration as a recording '
                               '(JSON), to compare the simulator with them later anywhere')
    recorded.add_argument('--real', metavar='FILE|NAME',
                          help='compare the simulator with a recording instead of running an '
                               'engine (a shipped one by name, e.g. cpu-smollm2-wid1); '
                               '--calibration then replaces the recorded one; without '
                               "--real, --calibration is the real engine's (measured by "
                               '`calibrate`), used instead of a short one measured first')
    validate.set_defaults(func=cmd_validate_sim)

    repro = sub.add_parser('reproduce',
                           help="the paper's figures, tables and claims, ours beside the paper's",
                           description='Every experiment runs on the simulator; with --engine '
                                       'cpu|transformers|vllm Table 4 is measured on that '
                                       'engine too.')
    repro.add_argument('--out', default='reproduce-out', help='output directory')
    _add_engine_args(repro, default_force=False)
    repro.add_argument('--calibration', default=None,
                       help="latency model (default: the paper's setup, "
                            'llama3-8b-fp16_rtx4090_vllm054)')
    repro.add_argument('--seed', type=SEED, default=0, help='seeds arrivals and robots')
    repro.add_argument('--quiet', action='store_true', help='no progress bar')
    repro.set_defaults(func=cmd_reproduce)

    workloads = sub.add_parser('workloads', help='list the bundled workloads')
    workloads.set_defaults(func=cmd_workloads)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(refusing_input(args.func), args)


if __name__ == '__main__':
    sys.exit(main())
