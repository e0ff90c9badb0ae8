"""``lrtrace``: record, profile, fit, replay and inspect LRTrace bags.

A thin ``main(argv) -> int`` over library calls. Input refused (an argument out of range, a
hostile or invalid file) prints ``error: <where>: <field>: <reason>`` and returns 2 before any
work starts; other errors print ``ERROR: …`` and return 1. A bag or file to write (``--out``,
``--json``, ``--plot``) must be in a directory that exists.

* ``record``  -- simulate a workload and record every task into a bag;
* ``profile`` -- drive every skill of a robot over a grid of arguments through the skill
  executor and record each execution (``--backend sim``: the simulated backend;
  ``emulator``: the robot's loopback emulator through the real client; ``djitellopy`` /
  ``indydcp3``: a real Tello / Indy7 at ``--host``; see :mod:`lrtrace.profiling`);
* ``fit``     -- refit a robot profile's execution-time models from recorded skills (in
  real-robot seconds; ``rel_error`` against the configuration a profiling bag recorded);
* ``replay``  -- replay recorded traces through the simulated fleet;
* ``inspect`` -- tables of a bag's tasks, segments and skills, and a timeline figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timelyllm_ros.errors import run_command
from timelyllm_ros.safe_files import (
    RobotInputError,
    float_arg,
    int_arg,
    load_yaml,
    new_path,
    output_file,
    refusing_input,
)

SEED = int_arg(0)                    # numpy's generators take no negative seed
COMM_MS = float_arg(0.0, 3_600_000.0)
JITTER = float_arg(0.0, 10.0)        # relative standard deviation of execution times
MAX_PROFILE_CALLS = 100_000
"""Most calls of one skill an ``lrtrace profile`` may make (grid points x repeats)."""


def cmd_record(args: argparse.Namespace) -> int:
    from lrtrace.recorder import record_simulation, with_drawn_skill_times
    from timelyllm_ros.core.scheduler import SchedulerConfig
    from timelyllm_ros.errors import TraceFormatError
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import resolve_workload
    from timelyllm_ros.policies import FLEET_POLICY

    if Path(args.out).exists():
        raise TraceFormatError(f'{args.out} exists already, not overwriting')
    name, tasks = resolve_workload(args.workload, seed=args.seed,
                                   workload_file=args.workload_file)
    if args.limit is not None:
        tasks = sorted(tasks, key=lambda t: t.arrival_time)[:args.limit]
    tasks = with_drawn_skill_times(tasks, seed=args.seed)
    policy = args.policy if args.policy is not None else FLEET_POLICY
    result = simulate(tasks, policy, seed=args.seed,
                      config=SchedulerConfig(comm_s=args.comm_ms / 1000.0),
                      robot_jitter=args.jitter)
    source = (f'simulation: workload {name}, policy {policy}, seed {args.seed}; '
              f'simulated engine and robots, not hardware')
    counts = record_simulation(result, args.out, chunk_size=args.chunk_size, source=source,
                               info={'workload': name, 'seed': str(args.seed)})
    print(f'recorded {counts["/lrtrace/tasks"]} tasks, {counts["/lrtrace/segments"]} segments, '
          f'{counts["/lrtrace/skills"]} skill executions into {args.out}')
    return 0


MAX_COORDINATE = 1e6
"""Largest pose coordinate accepted (mm or degrees)."""


def _is_coordinate(x: object) -> bool:
    # abs() compares exactly: no NaN or inf passes, and 10**30 is refused without a float()
    # conversion that would overflow.
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= MAX_COORDINATE


def _read_poses(path: str) -> dict[str, list[float]]:
    """Object poses ``{name: [x, y, z, rx, ry, rz]}`` from a JSON or YAML file (JSON is
    YAML), read within the bounds of :mod:`timelyllm_ros.safe_files`; coordinates bounded."""
    from timelyllm_ros.errors import RobotError

    try:
        data = load_yaml(path, RobotInputError)
    except OSError as err:
        raise RobotError(f'{path}: cannot read poses: {err.strerror}') from None
    if not isinstance(data, dict) or not all(
            isinstance(v, list) and len(v) == 6 and all(map(_is_coordinate, v))
            for v in data.values()):
        raise RobotInputError(path, 'poses must map object names to [x, y, z, rx, ry, rz] '
                              f'(numbers within +-{MAX_COORDINATE:g})')
    return {str(k): [float(x) for x in v] for k, v in data.items()}


def cmd_profile(args: argparse.Namespace) -> int:
    from lrtrace.profiling import profile_robot

    if args.grid is not None and args.repeats is not None and (
            args.grid * args.repeats > MAX_PROFILE_CALLS):
        raise RobotInputError('', f'{args.grid} x {args.repeats} calls per skill, more than '
                              f'{MAX_PROFILE_CALLS}', '--grid x --repeats')
    poses = _read_poses(args.poses) if args.poses else None
    run = profile_robot(args.robot, args.backend, args.out, grid=args.grid,
                        repeats=args.repeats, time_scale=args.time_scale, host=args.host,
                        poses=poses, seed=args.seed, jitter=args.jitter)
    executions = sum(run.samples.values())
    scale = f', time_scale {run.time_scale:g}' if run.backend == 'emulator' else ''
    runs = 'run' if run.repeats == 1 else 'runs'
    print(f'profiled {len(run.samples)} skills of {run.robot} on backend {run.backend} '
          f'({run.grid} grid points x {run.repeats} {runs}{scale}): {executions} skill '
          f'executions into {run.path} in {run.wall_s:.1f} s')
    for name, count in run.samples.items():
        print(f'  {name}: {count}')
    for name, why in run.skipped.items():
        print(f'skipped {name}: {why}')
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
        for name, fit in report.skills.items():
            if fit.note:     # what was clamped, floored or dropped to fit it
                print(f'note {name}: {fit.note}')
        for name, why in report.skipped.items():
            print(f'skipped {name}: {why}')
    if args.out:
        print(f'wrote {args.out}', file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from lrtrace.replay import replay
    from timelyllm_ros.core.scheduler import SchedulerConfig
    from timelyllm_ros.evaluation.tables import summary_tables
    from timelyllm_ros.policies import FLEET_POLICY

    summary = replay(args.bags, args.workload_spec, seed=args.seed,
                     policy=args.policy if args.policy is not None else FLEET_POLICY,
                     config=SchedulerConfig(comm_s=args.comm_ms / 1000.0))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + '\n')
    print(summary_tables(summary))
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
    record.add_argument('--policy', help="scheduling policy (default: the fleet's, as the "
                        'planner node runs it)')
    record.add_argument('--seed', type=SEED, default=0)
    record.add_argument('--limit', type=int_arg(1), help='record only the first N tasks')
    record.add_argument('--jitter', type=JITTER, default=0.0,
                        help='relative std of simulated execution times (0 to 10)')
    record.add_argument('--comm-ms', type=COMM_MS, default=8.0, help='network latency (ms)')
    record.add_argument('--chunk-size', type=int_arg(1, 1 << 30), default=32 * 1024,
                        help='bytes per flushed MCAP chunk')
    record.add_argument('--out', type=new_path, required=True, help='bag directory to create')
    record.set_defaults(func=cmd_record)

    profile = sub.add_parser('profile', help='profile every skill of a robot into a bag')
    profile.add_argument('--robot', required=True, help='tello, indy7 or a profile YAML')
    profile.add_argument('--backend', default='sim',
                         help='sim (simulated), emulator (loopback emulator through the real '
                         'client), djitellopy (a real Tello) or indydcp3 (a real Indy7)')
    profile.add_argument('--grid', type=int_arg(None, 1000), default=None,
                         help='argument values per numeric skill, calls per constant skill '
                         '(default: 13 sim, 6 otherwise)')
    profile.add_argument('--repeats', type=int_arg(None, 1000), default=None,
                         help='runs of the whole grid (default: 3 sim, 1 tello emulator, '
                         '2 otherwise)')
    profile.add_argument('--time-scale', type=float, default=None,
                         help='emulator only: emulated durations = model x this (default: '
                         '0.05 tello, 0.25 indy7)')
    profile.add_argument('--host', help="the robot's address (real backends), or the loopback "
                         'address the emulator listens on')
    profile.add_argument('--poses', help='indydcp3: JSON/YAML {object: [x, y, z, rx, ry, rz]} '
                         'for move_to/pick/place')
    profile.add_argument('--jitter', type=JITTER, default=0.0,
                         help='relative std of the simulated backend (0 to 10)')
    profile.add_argument('--seed', type=SEED, default=0)
    profile.add_argument('--out', type=new_path, required=True, help='bag directory to create')
    profile.set_defaults(func=cmd_profile)

    fit = sub.add_parser('fit', help='refit execution-time models from recorded skills')
    fit.add_argument('bags', nargs='+', metavar='BAG')
    fit.add_argument('--robot', required=True, help='tello, indy7 or a profile YAML')
    fit.add_argument('--reference', help='profile rel_error compares with (default --robot)')
    fit.add_argument('--json', action='store_true', help='print the report as JSON')
    fit.add_argument('--out', type=output_file, help='write the fitted profile YAML here')
    fit.set_defaults(func=cmd_fit)

    replay = sub.add_parser('replay', help='replay recorded traces through the simulated fleet')
    replay.add_argument('bags', nargs='+', metavar='BAG')
    replay.add_argument('--workload-spec', help='built-in workload name or spec YAML drawn '
                        'over the recorded traces (default: the recorded arrivals)')
    replay.add_argument('--policy', help="scheduling policy (default: the fleet's, as the "
                        'planner node runs it)')
    replay.add_argument('--seed', type=SEED, default=0)
    replay.add_argument('--comm-ms', type=COMM_MS, default=8.0, help='network latency (ms)')
    replay.add_argument('--json', type=output_file, help='also write the summary to this file')
    replay.set_defaults(func=cmd_replay)

    inspect = sub.add_parser('inspect', help="tables of a bag's tasks, segments and skills")
    inspect.add_argument('bag', metavar='BAG')
    inspect.add_argument('--segments', action='store_true', help='also list segments')
    inspect.add_argument('--skills', action='store_true', help='also list skill executions')
    inspect.add_argument('--plot', type=output_file, help='write the timeline figure (PNG) here')
    inspect.add_argument('--tasks', help='task ids to plot, comma separated')
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``lrtrace`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_command(refusing_input(args.func), args)


if __name__ == '__main__':
    sys.exit(main())
