"""``lrtrace``: record, profile, fit, replay and inspect LRTrace bags.

A thin ``main(argv) -> int`` over library calls; errors print ``ERROR: …`` and return 1.

* ``record``  -- simulate a workload and record every task into a bag;
* ``profile`` -- drive every skill of a robot over a grid of arguments through the skill
  executor and record each execution (``--backend sim``: the simulated backend);
* ``fit``     -- refit a robot profile's execution-time models from recorded skills;
* ``replay``  -- replay recorded traces through the simulated fleet;
* ``inspect`` -- tables of a bag's tasks, segments and skills, and a timeline figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timelyllm_ros.errors import TimelyError

PROFILE_GRID_POINTS = 13
"""Argument values per numeric skill in ``lrtrace profile`` (e.g. 20, 60, …, 500 cm)."""


def cmd_record(args: argparse.Namespace) -> int:
    from lrtrace.recorder import record_simulation, with_drawn_skill_times
    from lrtrace.workloads import resolve_workload
    from timelyllm_ros.errors import TraceFormatError
    from timelyllm_ros.scheduler import SchedulerConfig
    from timelyllm_ros.simulation import simulate

    if Path(args.out).exists():
        raise TraceFormatError(f'{args.out} exists already, not overwriting')
    name, tasks = resolve_workload(args.workload, seed=args.seed,
                                   workload_file=args.workload_file)
    if args.limit is not None:
        tasks = sorted(tasks, key=lambda t: t.arrival_time)[:args.limit]
    tasks = with_drawn_skill_times(tasks, seed=args.seed)
    result = simulate(tasks, args.policy, seed=args.seed,
                      config=SchedulerConfig(comm_s=args.comm_ms / 1000.0),
                      robot_jitter=args.jitter)
    source = (f'simulation: workload {name}, policy {args.policy}, seed {args.seed}; '
              f'simulated engine and robots, not hardware')
    counts = record_simulation(result, args.out, chunk_size=args.chunk_size, source=source,
                               info={'workload': name, 'seed': str(args.seed)})
    print(f'recorded {counts["/lrtrace/tasks"]} tasks, {counts["/lrtrace/segments"]} segments, '
          f'{counts["/lrtrace/skills"]} skill executions into {args.out}')
    return 0


def _grid(lo: float | None, hi: float | None, integer: bool) -> list[float]:
    """Argument values to profile: from the lowest positive limit to the upper limit."""
    top = hi if hi is not None else 100.0
    bottom = lo if lo is not None and lo > 0 else top / PROFILE_GRID_POINTS
    values = [bottom + (top - bottom) * i / (PROFILE_GRID_POINTS - 1)
              for i in range(PROFILE_GRID_POINTS)]
    return sorted({round(v) for v in values}) if integer else [round(v, 3) for v in values]


def profile_calls(profile: Any) -> list[tuple[str, str]]:
    """``(skill, call text)`` pairs covering every skill of a profile once per grid point.

    The first numeric argument runs over its grid; other numeric arguments take 0 (or their
    lower limit when 0 is outside it), string arguments ``'target'``.
    """
    calls: list[tuple[str, str]] = []
    for skill in profile.skills:
        numeric = [a for a in skill.args if a.type != 'str']
        grid: list[float] = _grid(numeric[0].min, numeric[0].max, numeric[0].type == 'int') \
            if numeric else [0.0]
        for value in grid:
            literals = []
            for arg in skill.args:
                if arg.type == 'str':
                    literals.append("'target'")
                    continue
                v = value if arg is numeric[0] else (
                    0.0 if (arg.min is None or arg.min <= 0) and (arg.max is None or arg.max >= 0)
                    else arg.min)
                literals.append(str(int(v)) if arg.type == 'int' else f'{float(v):g}')
            calls.append((skill.name, f'{skill.short}({", ".join(literals)})'))
    return calls


def cmd_profile(args: argparse.Namespace) -> int:
    if importlib.util.find_spec('timelyllm_ros.robots.executor') is None:
        print('ERROR: needs the robot backends (issue 4 step 8)', file=sys.stderr)
        return 1
    import numpy as np

    from lrtrace.recorder import TraceRecorder
    from timelyllm_ros.clock import SimClock
    from timelyllm_ros.errors import TraceFormatError
    from timelyllm_ros.profiles import load_profile
    from timelyllm_ros.request import Segment
    from timelyllm_ros.robots.executor import SkillExecutor
    from timelyllm_ros.segmenter import segment_text

    profile = load_profile(args.robot)
    if args.backend != 'sim':
        raise TraceFormatError(f'backend {args.backend!r} is not available here; only '
                               f"'sim' (the simulated backend) is")
    from timelyllm_ros.robots.sim_backend import SimulatedBackend

    clock = SimClock()
    backend = SimulatedBackend(profile, clock, rng=np.random.default_rng(args.seed),
                               jitter=args.jitter)
    executor = SkillExecutor(backend, clock)
    robot_id = f'{profile.name}-profile'
    source = (f'lrtrace profile: robot {profile.name}, backend {args.backend} '
              f'(simulated from the profile models, not hardware), jitter {args.jitter}')
    skills = 0
    with TraceRecorder(args.out, source=source,
                       info={'robot': profile.name, 'backend': args.backend}) as recorder:
        index = 0
        for skill, text in profile_calls(profile):
            statements = tuple(s for cut in segment_text(profile, text) for s in cut.statements)
            if len(statements) != 1 or statements[0].error:
                raise TraceFormatError(f'{profile.name}: profiling call {text!r} does not parse')
            for _ in range(args.repeats):
                now = clock.now()
                segment = Segment(index=index, text=text, statements=statements, cut_time=now,
                                  dispatch_time=now, estimated_exec_s=0.0, tokens=0,
                                  is_last=True)
                execution = executor.execute(segment)
                task_id = f'profile-{skill}'
                for record in execution.skills:
                    recorder.record_skill(robot_id, task_id, index, record)
                    skills += 1
                recorder.record_segment_done(robot_id, task_id, index, execution.start_time,
                                             execution.end_time, execution.success,
                                             execution.error)
                index += 1
    print(f'profiled {len(profile.skills)} skills of {profile.name}: {skills} skill executions '
          f'into {args.out}')
    return 0


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return '-'
    return f'{value:.4f}' if isinstance(value, float) else str(value)


def _model_text(model: dict[str, Any]) -> str:
    kind = model.get('kind')
    if kind == 'parametric':
        terms = ' + '.join(f'{c:.6g}' + (f'·x^{i}' if i > 1 else '·x' if i == 1 else '')
                           for i, c in enumerate(model['coefficients']))
        return f'parametric in {model["argument"]}: {terms}'
    if kind == 'sampled':
        samples = model.get('samples') or []
        return (f'sampled: {len(samples)} values, mean {sum(samples) / len(samples):.4g} s'
                if samples else f'sampled: uniform {model.get("uniform")}')
    return f'constant: {model.get("seconds", float("nan")):.4g} s'


def cmd_fit(args: argparse.Namespace) -> int:
    from lrtrace.fit import fit_profile, write_profile

    fitted, report = fit_profile(args.bags, args.robot, reference=args.reference)
    if args.out:
        write_profile(fitted, args.out)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        rows = [(name, str(f.samples), _fmt(f.rel_error), _model_text(f.model))
                for name, f in report.skills.items()]
        header = ('skill', 'samples', 'rel_error', 'model')
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        for row in [header, *rows]:
            print('  '.join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True))
                  + '  ' + row[3])
        for name, why in report.skipped.items():
            print(f'skipped {name}: {why}')
    if args.out:
        print(f'wrote {args.out}', file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from lrtrace.replay import replay
    from timelyllm_ros.cli import format_table
    from timelyllm_ros.scheduler import SchedulerConfig

    summary = replay(args.bags, args.workload_spec, seed=args.seed, policy=args.policy,
                     config=SchedulerConfig(comm_s=args.comm_ms / 1000.0))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + '\n')
    print(format_table('per task class', summary['by_class'], 'class'))  # type: ignore[arg-type]
    print(format_table('per task type', summary['by_type'], 'type'))  # type: ignore[arg-type]
    print(format_table('overall', {'all': summary['overall']}, ''))  # type: ignore[dict-item]
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from lrtrace.inspect import format_table, plot_timeline, segment_rows, skill_rows, task_rows
    from lrtrace.reader import read_bag

    bag = read_bag(args.bag)
    print(f'{args.bag}: LRTrace v{bag.version}, {len(bag.tasks)} tasks, '
          f'{len(bag.segment_done)} executed segments, {len(bag.skills)} skill executions'
          + (' (recording was cut short: read up to its last complete chunk)'
             if bag.truncated else ''))
    if bag.source:
        print(f'source: {bag.source}')
    print(format_table(task_rows(bag), ['task', 'robot', 'type', 'status', 'arrival_s',
                                        'segments', 'tokens', 'response_s', 'plan']))
    if args.segments:
        print(format_table(segment_rows(bag)))
    if args.skills:
        print(format_table(skill_rows(bag), ['task', 'segment', 'skill', 'call', 'start_s',
                                             'seconds', 'success']))
    if args.plot:
        tasks = args.tasks.split(',') if args.tasks else None
        print(f'wrote {plot_timeline(bag, args.plot, tasks)}')
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='lrtrace', description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='command', required=True)

    record = sub.add_parser('record', help='simulate a workload and record every task')
    record.add_argument('--workload', default='wid1', help='built-in or authors workload')
    record.add_argument('--workload-file', help='authors-format JSON or workload spec YAML')
    record.add_argument('--policy', default='timelyllm')
    record.add_argument('--seed', type=int, default=0)
    record.add_argument('--limit', type=int, help='record only the first N tasks')
    record.add_argument('--jitter', type=float, default=0.0,
                        help='relative std of simulated execution times')
    record.add_argument('--comm-ms', type=float, default=8.0, help='network latency (ms)')
    record.add_argument('--chunk-size', type=int, default=32 * 1024,
                        help='bytes per flushed MCAP chunk')
    record.add_argument('--out', required=True, help='bag directory to create')
    record.set_defaults(func=cmd_record)

    profile = sub.add_parser('profile', help='profile every skill of a robot into a bag')
    profile.add_argument('--robot', required=True, help='tello, indy7 or a profile YAML')
    profile.add_argument('--backend', default='sim', help="robot backend (here: 'sim')")
    profile.add_argument('--repeats', type=int, default=3, help='runs per argument value')
    profile.add_argument('--jitter', type=float, default=0.0,
                         help='relative std of the simulated backend')
    profile.add_argument('--seed', type=int, default=0)
    profile.add_argument('--out', required=True, help='bag directory to create')
    profile.set_defaults(func=cmd_profile)

    fit = sub.add_parser('fit', help='refit execution-time models from recorded skills')
    fit.add_argument('bags', nargs='+', metavar='BAG')
    fit.add_argument('--robot', required=True, help='tello, indy7 or a profile YAML')
    fit.add_argument('--reference', help='profile rel_error compares with (default --robot)')
    fit.add_argument('--json', action='store_true', help='print the report as JSON')
    fit.add_argument('--out', help='write the fitted profile YAML here')
    fit.set_defaults(func=cmd_fit)

    replay = sub.add_parser('replay', help='replay recorded traces through the simulated fleet')
    replay.add_argument('bags', nargs='+', metavar='BAG')
    replay.add_argument('--workload-spec', help='built-in workload name or spec YAML drawn '
                        'over the recorded traces (default: the recorded arrivals)')
    replay.add_argument('--policy', default='timelyllm')
    replay.add_argument('--seed', type=int, default=0)
    replay.add_argument('--comm-ms', type=float, default=8.0, help='network latency (ms)')
    replay.add_argument('--json', help='also write the summary to this file')
    replay.set_defaults(func=cmd_replay)

    inspect = sub.add_parser('inspect', help="tables of a bag's tasks, segments and skills")
    inspect.add_argument('bag', metavar='BAG')
    inspect.add_argument('--segments', action='store_true', help='also list segments')
    inspect.add_argument('--skills', action='store_true', help='also list skill executions')
    inspect.add_argument('--plot', help='write the timeline figure (PNG) here')
    inspect.add_argument('--tasks', help='task ids to plot, comma separated')
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``lrtrace`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TimelyError as err:
        print(f'ERROR: {err}', file=sys.stderr)
        return 1


if __name__ == '__main__':
    sys.exit(main())
