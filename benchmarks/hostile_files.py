"""Hostile-files campaign (issue 31): files made to hurt a parser, fed to every loader of the
project and, for a sample, to the command lines. Prints counts that must be 0.

    python3 benchmarks/hostile_files.py --seed 0 --cases 50 [--json]

Each case is one file, drawn by the seed from a class (alias bombs, recursive aliases, deep
YAML or JSON, huge / infinite / NaN numbers, values of the wrong type, bytes that are not
UTF-8, truncated files, oversized files, /dev/zero) applied to a real document of one loader
(a workload spec, an authors' workload, the trace set, a robot profile, a calibration, a
poses file). Every case goes to every loader; a workload a loader accepts is also drawn and
simulated, where a NaN or an endless spec used to hang.

Counted (every one must be 0):
- ``hostile_file_crashes``: a loader raised an exception of a type it does not promise
  (WorkloadError, ProfileError, EngineError, RobotError), or a command line printed a
  traceback or exited with a status other than 2 (0 where the loaders accepted the file);
- ``hostile_file_hangs``: a loader ran past :data:`CALL_LIMIT_S` or ran out of the
  :data:`MEMORY_LIMIT` address space, or a command line ran past :data:`CLI_LIMIT_S`.

The loaders run in one child process under that memory limit, so that a regression fails
the campaign instead of taking the machine down.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 4 << 30          # address space of the child that runs the loaders (bytes)
CALL_LIMIT_S = 60.0             # one loader on one file, drawing and simulating included
CLI_LIMIT_S = 120.0             # one command line
CLASSES = ('alias_bomb', 'recursive_alias', 'deep_yaml', 'deep_json', 'huge_number',
           'not_finite', 'wrong_type', 'not_utf8', 'truncated', 'oversize', 'dev_zero')
SENTINEL = 'HOSTILE_NUMBER'
ROWS = 'rows.json'              # what the loaders' child found, one row per case


# -- the documents the hostile files are made from -------------------------------------------
def base_documents() -> dict[str, tuple[str, object]]:
    """Per loader, a valid document and its format ('yaml' or 'json')."""
    from timelyllm_ros.engines.calibration import CALIBRATION_DIR, DEFAULT_CALIBRATION
    from timelyllm_ros.language.profiles import PROFILES_DIR
    from timelyllm_ros.language.traces import DERIVED_TRACES

    def data(path: Path) -> object:
        return yaml.safe_load(path.read_text(encoding='utf-8'))   # bundled files: trusted

    record = {'trigger time': 1.0, 'agent_id': 0, 'trace_id': 4, 'task_input': 'find scissors',
              'exe_time_detail': [['s(', 1.5], ['g(', 2.5]], 'tuf': [1, 1, 1.5]}
    return {
        'workload_spec': ('yaml', {'name': 'w', 'eps': 0.25, 'max_tpe': 2,
                                   'trace_ids': [1, 2, 3], 'agents': 4, 'duration_s': 20.0}),
        'authors_workload': ('json', [record, {**record, 'trigger time': 3.0, 'agent_id': 1}]),
        'trace_set': ('yaml', data(DERIVED_TRACES)),
        'profile': ('yaml', data(PROFILES_DIR / 'tello.yaml')),
        'calibration': ('yaml', data(CALIBRATION_DIR / f'{DEFAULT_CALIBRATION}.yaml')),
        'poses': ('yaml', {'cup': [0.1, 0.2, 0.3, 0.0, 180.0, 0.0]}),
    }


def _leaves(node: object, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every value of a parsed document (containers included, the root excluded)."""
    found: list[tuple[Any, ...]] = [path] if path else []
    items: Sequence[tuple[Any, object]] = (
        list(node.items()) if isinstance(node, dict) else
        list(enumerate(node)) if isinstance(node, list) else [])
    for key, value in items:
        found += _leaves(value, (*path, key))
    return found


def _get(node: Any, path: tuple[Any, ...]) -> object:
    for key in path:
        node = node[key]
    return node


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _replace(node: object, path: tuple[Any, ...], value: object) -> object:
    if not path:
        return value
    head, *rest = path
    copy: Any = dict(node) if isinstance(node, dict) else list(node)  # type: ignore[call-overload]
    copy[head] = _replace(copy[head], tuple(rest), value)
    return copy


def _dump(fmt: str, document: object) -> str:
    if fmt == 'json':
        return json.dumps(document)     # writes NaN and Infinity as Python's json does
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True)


def _bomb(rng: random.Random) -> str:
    levels, width = rng.randint(6, 12), rng.randint(4, 12)
    lines = [f'l0: &l0 [{", ".join(["lol"] * width)}]']
    lines += [f'l{i}: &l{i} [{", ".join([f"*l{i - 1}"] * width)}]' for i in range(1, levels)]
    return '\n'.join(lines) + '\n'


def hostile_bytes(kind: str, fmt: str, document: object, rng: random.Random,
                  max_bytes: int) -> bytes:
    """One hostile file of class ``kind`` made from a loader's document."""
    text = _dump(fmt, document)
    if kind == 'alias_bomb':
        return _bomb(rng).encode()
    if kind == 'recursive_alias':
        return rng.choice([b'a: &a [1, *a]\n', b'&a {x: *a}\n', b'a: &a {b: [*a]}\n'])
    if kind == 'deep_yaml':
        depth = rng.choice([40, 1000, 100_000])
        if rng.random() < 0.5:
            return b'[' * depth
        return ''.join(f'{" " * i}k{i}:\n' for i in range(min(depth, 2000))).encode()
    if kind == 'deep_json':
        depth = rng.choice([40, 1000, 100_000])
        opener, closer = rng.choice([('[', ']'), ('{"a": ', '}')])
        return (opener * depth + '1' + closer * depth).encode()
    leaves = _leaves(document)
    if kind in ('huge_number', 'not_finite', 'wrong_type') and leaves:
        # Numbers are where the loaders' checks live: hit them first, one to three at once.
        numbers = [where for where in leaves if _is_number(_get(document, where))]
        places = rng.sample(numbers or leaves, k=min(len(numbers or leaves), rng.randint(1, 3)))
        for where in places:
            if kind == 'wrong_type':
                value: object = rng.choice([None, True, 'text', [], {}, [[1, 2], 3], {'a': [1]},
                                            -1, 0])
            elif kind == 'not_finite':
                value = rng.choice([float('nan'), float('inf'), float('-inf')])
            else:
                value = SENTINEL
            document = _replace(document, where, value)
        number = rng.choice(['9' * rng.randint(20, 6000), '1e400', '-1e400', '1e308',
                             str(10 ** 30), '-' + '9' * 25, '1.0e+9', '-1'])
        marked = _dump(fmt, document)
        return marked.replace(f'"{SENTINEL}"', number).replace(SENTINEL, number).encode()
    raw = text.encode()
    if kind == 'not_utf8':
        at = rng.randrange(len(raw) + 1)
        return raw[:at] + rng.choice([b'\xff', b'\xc3(', b'\xed\xa0\x80', b'\x80\x80']) + raw[at:]
    if kind == 'truncated':
        return raw[:rng.randrange(len(raw))]
    if kind == 'oversize':
        padding = (b' ' if fmt == 'json' else b'#' * 99 + b'\n') * (max_bytes // 50 + 1)
        return raw + padding[:max_bytes + 1]
    return raw    # a class without a document to mutate: the document itself


# -- the loaders -----------------------------------------------------------------------------
def loaders() -> dict[str, tuple[Callable[[Path], object], tuple[type[Exception], ...]]]:
    """Per loader, how to call it on a file (drawing and simulating a workload it accepts,
    simulating a few tasks on a calibration it accepts) and the exceptions it promises."""
    from lrtrace.cli import _read_poses
    from timelyllm_ros.engines import create_engine
    from timelyllm_ros.errors import EngineError, ProfileError, RobotError, WorkloadError
    from timelyllm_ros.evaluation.simulation import simulate
    from timelyllm_ros.evaluation.workloads import (
        BUILTIN_WORKLOADS,
        generate_tasks,
        load_authors_workload,
        load_workload_spec,
    )
    from timelyllm_ros.language.profiles import load_profile_file
    from timelyllm_ros.language.traces import load_trace_set

    def spec(path: Path) -> object:
        tasks = generate_tasks(load_workload_spec(path), seed=0)
        return simulate(tasks[:20], 'timelyllm') if tasks else None

    def authors(path: Path) -> object:
        return simulate(load_authors_workload(path)[:20], 'timelyllm')

    few = generate_tasks(BUILTIN_WORKLOADS['wid1'], seed=0)[:5]

    def calibration(path: Path) -> object:
        return simulate(few, 'timelyllm', engine=create_engine('sim', calibration=str(path)))

    return {
        'workload_spec': (spec, (WorkloadError,)),
        'authors_workload': (authors, (WorkloadError,)),
        'trace_set': (load_trace_set, (WorkloadError,)),
        'profile': (load_profile_file, (ProfileError,)),
        'calibration': (calibration, (EngineError,)),
        'poses': (lambda path: _read_poses(str(path)), (RobotError,)),
    }


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Timeout


def case_file(workdir: Path, seed: int, case: int) -> tuple[str, str, Path]:
    """The ``case``-th hostile file of a seed: (class, base document, path)."""
    rng = random.Random(f'{seed}:{case}')
    kind = CLASSES[case % len(CLASSES)] if case < len(CLASSES) else rng.choice(CLASSES)
    documents = base_documents()
    base = rng.choice(sorted(documents))
    path = workdir / f'case-{case}.yaml'    # .yaml: calibrations are taken by path only then
    if kind == 'dev_zero':
        path.symlink_to('/dev/zero')
        return kind, base, path
    fmt, document = documents[base]
    max_bytes = (64 << 20) if base in ('authors_workload', 'trace_set') else 1 << 20
    if kind == 'oversize' and max_bytes > 1 << 20:
        base, (fmt, document), max_bytes = 'workload_spec', documents['workload_spec'], 1 << 20
    path.write_bytes(hostile_bytes(kind, fmt, document, rng, max_bytes))
    return kind, base, path


def run_loaders(seed: int, cases: int, workdir: Path) -> list[dict[str, Any]]:
    """Every case through every loader, in this process; one row per case."""
    calls = loaders()
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    for case in range(cases):
        kind, base, path = case_file(workdir, seed, case)
        row: dict[str, Any] = {'case': case, 'class': kind, 'base': base, 'path': str(path),
                               'accepted': [], 'crashes': [], 'hangs': []}
        for name, (call, promised) in calls.items():
            signal.setitimer(signal.ITIMER_REAL, CALL_LIMIT_S)
            try:
                call(path)
                row['accepted'].append(name)
            except promised:
                pass
            except (_Timeout, MemoryError) as err:
                row['hangs'].append(f'{name}: {type(err).__name__}')
            except Exception as err:  # noqa: BLE001 - what the campaign counts
                row['crashes'].append(f'{name}: {type(err).__name__}: {str(err)[:200]}')
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        rows.append(row)
    return rows


# -- the command lines -----------------------------------------------------------------------
def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _child(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """A Python child bounded in time and memory; None when it ran past ``timeout_s``."""
    env = {**os.environ, 'OPENBLAS_NUM_THREADS': '1', 'MPLBACKEND': 'Agg',
           'PYTHONPATH': os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get('PYTHONPATH')]))}
    try:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              timeout=timeout_s, preexec_fn=_limit_memory, env=env, cwd=REPO,
                              check=False)
    except subprocess.TimeoutExpired:
        return None


def cli_commands(row: dict[str, Any], workdir: Path) -> list[tuple[list[str], bool]]:
    """Command lines reading a case's file, each with whether its loader accepted the file."""
    path = Path(row['path'])
    as_json = workdir / f'case-{row["case"]}.json'     # --workload-file reads .json as authors'
    if not as_json.exists():
        as_json.symlink_to(path.resolve())
    accepted = set(row['accepted'])
    return [
        (['-m', 'timelyllm_ros', 'run', '--workload-file', str(path), '--tasks', '3'],
         'workload_spec' in accepted),
        (['-m', 'timelyllm_ros', 'run', '--workload-file', str(as_json), '--tasks', '3'],
         'authors_workload' in accepted),
        (['-m', 'timelyllm_ros', 'run', '--calibration', str(path), '--tasks', '3'],
         'calibration' in accepted),
    ]


def run_hostile_files_campaign(seed: int, cases: int) -> dict[str, int]:
    """Generate ``cases`` hostile files from ``seed``, feed each to every loader (in a child
    process bounded in memory) and a sample of them to the command lines.

    Returns:
        ``{'cases': n, 'hostile_file_crashes': k, 'hostile_file_hangs': k}``.
    """
    return _campaign(seed, cases)['counts']


def _campaign(seed: int, cases: int) -> dict[str, Any]:
    crashes: list[str] = []
    hangs: list[str] = []
    with tempfile.TemporaryDirectory(prefix='hostile-files-') as tmp:
        workdir = Path(tmp)
        child = _child([str(Path(__file__).resolve()), '--loaders', '--seed', str(seed),
                        '--cases', str(cases), '--workdir', str(workdir)],
                       timeout_s=CALL_LIMIT_S * 6 * cases + 60)
        rows: list[dict[str, Any]] = []
        if child is None:
            hangs.append('loaders: the child ran past its time limit')
        elif child.returncode != 0:
            crashes.append(f'loaders: the child exited {child.returncode}: '
                           f'{child.stderr[-500:]}')
        else:
            rows = json.loads((workdir / ROWS).read_text(encoding='utf-8'))
        for row in rows:
            where = f'case {row["case"]} ({row["class"]} of {row["base"]})'
            crashes += [f'{where}: {c}' for c in row['crashes']]
            hangs += [f'{where}: {h}' for h in row['hangs']]
        wanted = max(1, cases // 10)      # each command line starts an interpreter: a sample
        sample = rows[::max(1, len(rows) // wanted)][:wanted]
        for row in sample:
            for argv, accepted in cli_commands(row, workdir):
                where = f'case {row["case"]} ({row["class"]} of {row["base"]}): {argv[3]}'
                result = _child(argv, CLI_LIMIT_S)
                if result is None:
                    hangs.append(f'{where}: ran past {CLI_LIMIT_S:g} s')
                elif 'Traceback' in result.stderr or result.returncode not in (
                        (0, 2) if accepted else (2,)):
                    crashes.append(f'{where}: exit {result.returncode}: '
                                   f'{result.stderr.strip()[-300:]}')
    return {'counts': {'cases': cases, 'hostile_file_crashes': len(crashes),
                       'hostile_file_hangs': len(hangs)},
            'crashes': crashes, 'hangs': hangs}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the campaign and print its counts (exit status 1 if any is not 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--cases', type=int, default=50, help='hostile files to make')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--json', action='store_true', help='print the result as JSON')
    parser.add_argument('--loaders', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--workdir', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loaders:        # the child: the loaders in-process, rows as JSON into the workdir
        workdir = Path(args.workdir)
        rows = run_loaders(args.seed, args.cases, workdir)
        (workdir / ROWS).write_text(json.dumps(rows), encoding='utf-8')
        return 0
    result = _campaign(args.seed, args.cases)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result['counts'].items():
            print(f'{key}: {value}')
        for line in result['crashes'] + result['hangs']:
            print(line)
    counts = result['counts']
    return 1 if counts['hostile_file_crashes'] or counts['hostile_file_hangs'] else 0


if __name__ == '__main__':
    sys.exit(main())
