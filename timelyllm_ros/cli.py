"""``timelyllm``: run a simulated fleet, benchmark policies, measure overheads.

A thin ``main(argv) -> int`` over library calls; errors print ``ERROR: …`` and return 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from timelyllm_ros.errors import run_command
from timelyllm_ros.scheduler import SchedulerConfig

_TABLE_METRICS = (('tasks', 'tasks', '{:d}'), ('completed', 'done', '{:d}'),
                  ('utility_mean', 'utility', '{:.3f}'), ('utility_max', 'max', '{:.2f}'),
                  ('response_time_mean_s', 'response s', '{:.3f}'),
                  ('waiting_time_mean_s', 'waiting s', '{:.3f}'),
                  ('completion_time_mean_s', 'completion s', '{:.2f}'))


def _fmt(value: object, pattern: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return '-'
    return pattern.format(value)


def format_table(title: str, rows: dict[str, dict[str, object]], label: str) -> str:
    """A plain-text table: one row per group, the summary metrics as columns."""
    header = [label, *(h for _, h, _ in _TABLE_METRICS)]
    body = [[name, *(_fmt(m.get(k), p) for k, _, p in _TABLE_METRICS)]
            for name, m in rows.items()]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [title, '  '.join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ['  '.join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return '\n'.join(lines)


def format_matrix(title: str, results: dict[str, dict[str, object]], metric: str,
                  sections: Sequence[str] = ('by_type', 'by_class')) -> str:
    """Rows = task types and/or classes, then overall; columns = policies; cells = one metric."""
    policies = list(results)
    first = next(iter(results.values()))
    groups = [(section, g) for section in sections
              for g in first[section]] + [('overall', 'overall')]  # type: ignore[union-attr]
    with_max = metric == 'utility_mean'
    header = ['', *policies, *(['max'] if with_max else [])]
    body = []
    for section, group in groups:
        blocks = {p: results[p][section] if section == 'overall'
                  else results[p][section].get(group, {})  # type: ignore[union-attr]
                  for p in policies}
        row = [group, *(_fmt(blocks[p].get(metric), '{:.3f}') for p in policies)]
        if with_max:
            row.append(_fmt(blocks[policies[0]].get('utility_max'), '{:.2f}'))
        body.append(row)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [title, '  '.join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ['  '.join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return '\n'.join(lines)


def _load_tasks(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from lrtrace.workloads import resolve_workload

    return resolve_workload(args.workload, seed=args.seed, workload_file=args.workload_file,
                            composition=args.compose)


def _config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(comm_s=args.comm_ms / 1000.0, max_batch=args.max_batch)


def cmd_run(args: argparse.Namespace) -> int:
    from timelyllm_ros.bench import EngineOptions, run_summary
    from timelyllm_ros.simulation import simulate

    name, tasks = _load_tasks(args)
    engine = EngineOptions(args.calibration, not args.no_prefix_cache)
    print(f'workload {name}: {len(tasks)} tasks, policy {args.policy}, seed {args.seed}')
    result = simulate(tasks, args.policy, seed=args.seed, config=_config(args),
                      engine=engine.build())
    summary = run_summary(result)
    print(format_table('per task class', summary['by_class'], 'class'))  # type: ignore[arg-type]
    print(format_table('per task type', summary['by_type'], 'type'))  # type: ignore[arg-type]
    print(format_table('overall', {'all': summary['overall']}, ''))  # type: ignore[dict-item]
    run = summary['run']
    print(f"simulated {run['sim_time_s']:.1f} s in {run['wall_time_s']:.2f} s wall "  # type: ignore[index]
          f"({run['speedup']:.0f}x real time), {run['engine_iterations']} engine iterations, "  # type: ignore[index]
          f"mean batch {run['mean_batch_size']:.2f}, "  # type: ignore[index]
          f"{run['decision_ms_mean']:.3f} ms deciding per iteration")  # type: ignore[index]
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

    from timelyllm_ros.bench import COMPARED_METRICS, EngineOptions, run_bench
    from timelyllm_ros.plots import METRIC_LABELS
    from timelyllm_ros.policies import resolve_policy_names

    name, tasks = _load_tasks(args)
    policies = resolve_policy_names(args.policies)
    sizes = [int(s) for s in args.batch_sizes.split(',')] if args.batch_sizes else []
    steps = len(policies) + len(sizes) * len([p for p in ('vllm', 'timelyllm') if p in policies]
                                             or policies)
    with tqdm(total=steps, desc=f'bench {name}', unit='run', disable=args.quiet,
              file=sys.stderr) as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(0 if bar.n == 0 and not getattr(progress, 'started', False) else 1)
            progress.started = True  # type: ignore[attr-defined]

        summary = run_bench(name, tasks, policies, Path(args.out), seed=args.seed,
                            config=_config(args),
                            engine=EngineOptions(args.calibration, not args.no_prefix_cache),
                            batch_sizes=sizes, progress=progress)
        bar.update(steps - bar.n)
    print(f'workload {name}: {len(tasks)} tasks, seed {args.seed}, '
          f"prefix caching {'off' if args.no_prefix_cache else 'on'}")
    for policy, result in summary['policies'].items():  # type: ignore[union-attr]
        rows = {**result['by_class'], 'overall': result['overall']}
        print(format_table(f'[{policy}]', rows, 'class'))
    results = summary['policies']  # type: ignore[index]
    for key, label in (('utility_mean', 'time utility'),
                       ('response_time_mean_s', 'response time (s)'),
                       ('waiting_time_mean_s', 'robot waiting time (s)')):
        print(format_matrix(f'{label} per task type', results, key))
    for key in COMPARED_METRICS:
        print(format_matrix(f'{METRIC_LABELS.get(key, key)} per task class', results, key,
                            sections=('by_class',)))
    print('scheduling overhead (ms deciding per engine iteration): ' + ', '.join(
        f"{p} {r['run']['decision_ms_mean']:.3f}" for p, r in results.items()))  # type: ignore[union-attr]
    if 'batch_sweep' in summary:
        print('batch sweep (overall utility):', json.dumps(summary['batch_sweep']))
    print(f'wrote {Path(args.out) / "summary.json"}, tasks.csv and figures')
    return 0


def cmd_overhead(args: argparse.Namespace) -> int:
    from timelyllm_ros.bench import scheduling_overhead

    sizes = [int(s) for s in args.queued.split(',')]
    result = {str(n): scheduling_overhead(n, repeats=args.repeats, policy=args.policy) * 1000.0
              for n in sizes}
    if args.json:
        print(json.dumps(result))
    else:
        for n, ms in result.items():
            print(f'{n:>6} queued: {ms:.4f} ms per decision')
    return 0


def cmd_simspeed(args: argparse.Namespace) -> int:
    from timelyllm_ros.policies import resolve_policy_names
    from timelyllm_ros.simulation import simulate

    name, tasks = _load_tasks(args)
    simulate(tasks[: min(len(tasks), 20)], 'timelyllm')   # warm imports and caches
    results = {}
    for policy in resolve_policy_names(args.policies):
        best = None
        for _ in range(args.repeats):
            result = simulate(tasks, policy, seed=args.seed)
            speed = result.sim_time_s / result.wall_time_s
            best = speed if best is None else max(best, speed)
        results[policy] = best
        print(f'{name} {policy:>19}: {best:8.0f} simulated s per wall s')
    if args.json:
        print(json.dumps(results))
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    from lrtrace.workloads import AUTHORS_WORKLOADS, BUILTIN_WORKLOADS

    for spec in BUILTIN_WORKLOADS.values():
        print(f'{spec.name:14} {spec.description} (EPS {spec.eps}, max TPE {spec.max_tpe}, '
              f'traces {spec.trace_ids}, {spec.agents} agents, {spec.duration_s:g} s)')
    for name, path in AUTHORS_WORKLOADS.items():
        print(f"{name:14} the TimelyLLM authors' workload {path.name} (CC BY 4.0)")
    return 0


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--workload', default='wid1',
                        help='wid1|wid2|wid3|chat|authors-drone|authors-arm (default wid1)')
    parser.add_argument('--workload-file', help='authors-format JSON or workload spec YAML')
    parser.add_argument('--compose', help='programmable composition, e.g. "(1,2),8,9"')
    parser.add_argument('--seed', type=int, default=0, help='seeds arrivals and robots')
    parser.add_argument('--comm-ms', type=float, default=8.0, help='network latency (ms)')
    parser.add_argument('--max-batch', type=int, default=None, help='fixed batch cap')
    parser.add_argument('--calibration', default=None, help='calibration name or YAML path')
    parser.add_argument('--no-prefix-cache', action='store_true',
                        help='engine without prefix caching (every prompt fully prefilled)')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='timelyllm', description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='command', required=True)

    run = sub.add_parser('run', help='simulate a fleet on a workload under one policy')
    _add_workload_args(run)
    run.add_argument('--policy', default='timelyllm')
    run.add_argument('--json', help='also write the summary to this file')
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser('bench', help='all policies side by side on one workload')
    _add_workload_args(bench)
    bench.add_argument('--policies', default='paper', help="'all', 'paper' or a,b,c")
    bench.add_argument('--out', default='bench-out', help='output directory')
    bench.add_argument('--batch-sizes', help='also sweep fixed batch sizes, e.g. 1,2,4,6,8,12')
    bench.add_argument('--quiet', action='store_true', help='no progress bar')
    bench.set_defaults(func=cmd_bench)

    overhead = sub.add_parser('overhead', help='median time of one scheduling decision')
    overhead.add_argument('--queued', default='1,8,100,10000')
    overhead.add_argument('--repeats', type=int, default=200)
    overhead.add_argument('--policy', default='timelyllm')
    overhead.add_argument('--json', action='store_true')
    overhead.set_defaults(func=cmd_overhead)

    speed = sub.add_parser('simspeed', help='simulated seconds per wall-clock second')
    _add_workload_args(speed)
    speed.add_argument('--policies', default='paper')
    speed.add_argument('--repeats', type=int, default=3)
    speed.add_argument('--json', action='store_true')
    speed.set_defaults(func=cmd_simspeed)

    workloads = sub.add_parser('workloads', help='list the bundled workloads')
    workloads.set_defaults(func=cmd_workloads)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == '__main__':
    sys.exit(main())
