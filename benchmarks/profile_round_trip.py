"""Profile → fit round trip through the real vendor clients on the loopback emulators.

    python3 benchmarks/profile_round_trip.py [--json]

Each robot's emulator is driven through its real client (djitellopy for the Tello, IndyDCP3
for the Indy7) by ``lrtrace profile``; ``lrtrace fit`` then fits the recorded durations (in
real-robot seconds). Per fitted skill this prints ``rel_error``, the mean relative gap
between the fitted model and the model the emulator was configured with. The target is
≤ 5 % per skill. Durations are wall-clock measurements, so the figures move with the
machine's load: a benchmark, not a unit test (the unit test checks the round trip's shape).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from lrtrace.cli import main as lrtrace

RUNS = {
    'tello': ['--robot', 'tello', '--backend', 'emulator', '--grid', '4', '--repeats', '1',
              '--time-scale', '0.1'],
    'indy7': ['--robot', 'indy7', '--backend', 'emulator', '--grid', '4', '--repeats', '1',
              '--time-scale', '0.5'],
}
TARGET = 0.05


def round_trip(robot: str, workdir: Path) -> dict[str, object]:
    bag = workdir / robot
    with contextlib.redirect_stdout(io.StringIO()):
        if lrtrace(['profile', *RUNS[robot], '--out', str(bag)]) != 0:
            raise SystemExit(f'lrtrace profile failed for {robot}')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if lrtrace(['fit', str(bag), '--robot', robot, '--json']) != 0:
            raise SystemExit(f'lrtrace fit failed for {robot}')
    skills = json.loads(out.getvalue())['skills']
    errors = {name: entry['rel_error'] for name, entry in skills.items()}
    worst = max(e for e in errors.values() if e is not None)
    return {'rel_error': errors, 'worst': worst, 'within_target': worst <= TARGET}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        result = {robot: round_trip(robot, Path(workdir)) for robot in RUNS}
    if args.json:
        print(json.dumps(result))
    else:
        for robot, row in result.items():
            print(f'{robot}: worst rel_error {row["worst"]:.3%} (target {TARGET:.0%})')
            for name, error in row['rel_error'].items():  # type: ignore[union-attr]
                print(f'  {name:16s} {error:.3%}')
    return 0 if all(r['within_target'] for r in result.values()) else 1


if __name__ == '__main__':
    sys.exit(main())
