"""Hostile datagrams against the Tello backend during its skills (issue 31, item 8).

    python3 benchmarks/hostile_datagrams.py [--cases 40] [--seed 0] [--json]

It starts the loopback Tello emulator on 127.0.0.1 and one :class:`TelloBackend` driving it
through djitellopy, takes off, and then, case by case, performs one random motion while a
hostile sender on 127.0.0.1 (the drone's IP, another port: what a host on the drone's network
can do without spoofing an address) fires one to four seeded datagrams at the backend, the
first ones as soon as the emulator has the motion's command. The kinds, in turn:

* ``non_ascii_state`` / ``non_ascii_reply``: bytes that do not decode as ASCII, to the state
  port / to the socket the backend's commands leave from;
* ``truncated_state``: a real state line of the emulator, cut short;
* ``garbage_state``: ``key:value;`` text that is no state line (wrong fields, non-numbers);
* ``huge_state`` / ``huge_reply``: 4 KiB to 60 KiB of noise;
* ``spoofed_ok`` / ``spoofed_error``: a reply (``ok``, ``OK``, ``ok\\r\\n``, ``error``) from a
  port other than the drone's command port.

Counted (each must be 0):

* ``tello_spoofed_success``: a motion that ended as a success before the emulator had sent
  its reply (the emulator logs each reply before it leaves, ``TelloEmulator.replies``);
* ``tello_frozen_state``: after a motion, ``state()`` kept giving a state that differs from
  the emulator's height and heading for 2 s, while the backend did not say that it has no
  current state (``state_problem()``);
* ``tello_crashes``: an exception out of ``perform()`` or ``state()`` (a valid motion of a
  flying drone must succeed whatever arrives from elsewhere), or an error logged by the
  backend's receivers or djitellopy (a datagram that raised where it was handled).

:func:`run_hostile_datagrams_campaign` returns the counts with ``cases``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from timelyllm_ros.core.clock import WallClock
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.robots.emulators.tello import TelloEmulator

HOST = '127.0.0.1'
TIME_SCALE = 0.15          # motions of 0.3-0.8 s: several djitellopy polls (0.1 s) each
FROZEN_WAIT_S = 2.0        # how long a state may lag behind the emulator after a motion
KINDS = ('non_ascii_state', 'non_ascii_reply', 'truncated_state', 'garbage_state',
         'huge_state', 'huge_reply', 'spoofed_ok', 'spoofed_error')


class _ErrorsOnly(logging.Filter):
    """Only errors: each dropped datagram is a warning (expected here), each command two INFO
    lines of djitellopy. A filter, not a level: djitellopy sets its logger's level when it is
    first imported, which happens when the backend connects."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


class _ErrorCount(logging.Handler):
    """Counts ERROR records: an exception that a receiver caught and logged."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _reply_port() -> int:
    """The port the backend's commands leave from (djitellopy's ``client_socket``)."""
    return int(sys.modules['djitellopy.tello'].client_socket.getsockname()[1])


def hostile_datagram(rng: random.Random, kind: str, emulator: TelloEmulator,
                     state_port: int) -> tuple[bytes, int]:
    """One datagram of ``kind`` and the local port it goes to."""
    if kind in ('non_ascii_state', 'non_ascii_reply'):
        body = bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
        body += bytes([rng.randrange(128, 256)])            # at least one non-ASCII byte
        return body, state_port if kind == 'non_ascii_state' else _reply_port()
    if kind == 'truncated_state':
        line = emulator.state_line().encode('ascii')
        return line[:rng.randrange(len(line) - 12)], state_port
    if kind == 'garbage_state':
        keys = ['h', 'bat', 'yaw', 'pitch', 'tof', 'x', '', 'h h']
        values = ['abc', '', '1e999', 'nan', '-', '12', '9' * 40, ':']
        text = ';'.join(f'{rng.choice(keys)}:{rng.choice(values)}'
                        for _ in range(rng.randint(1, 20)))
        return text.encode('ascii'), state_port
    if kind in ('huge_state', 'huge_reply'):
        body = bytes(rng.randrange(256) for _ in range(rng.randint(4096, 60_000)))
        return body, state_port if kind == 'huge_state' else _reply_port()
    reply = rng.choice([b'ok', b'OK', b'ok\r\n']) if kind == 'spoofed_ok' else b'error'
    return reply, _reply_port()


def _motion(rng: random.Random, height: int) -> SkillCall:
    """A valid motion of the hovering drone (vertical moves keep it between 40 and 240 cm)."""
    options = [('move_forward', 'mf', 'distance', 20, 100),
               ('move_backward', 'mb', 'distance', 20, 100),
               ('turn_cw', 'tc', 'degrees', 10, 90), ('turn_ccw', 'tu', 'degrees', 10, 90)]
    options.append(('move_up', 'mu', 'distance', 20, 60) if height < 180 else
                   ('move_down', 'md', 'distance', 20, 60))
    skill, short, name, low, high = rng.choice(options)
    value = rng.randint(low, high)
    return SkillCall(skill, short, {name: value}, f'{short}({value})')


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_hostile_datagrams_campaign(seed: int, cases: int, state_port: int | None = None
                                   ) -> dict[str, int]:
    """Run ``cases`` motions under hostile datagrams; the counts of what must never happen.

    Args:
        seed: seeds the motions, the datagrams and their timing.
        cases: motions to perform.
        state_port: the state port, if this process has no Tello backend yet (the first
            backend of a process chooses it for the whole process); default: a free one.

    Returns:
        ``cases``, ``tello_frozen_state``, ``tello_spoofed_success``, ``tello_crashes``.

    Raises:
        RobotError: the emulated drone cannot be connected or does not take off (the
            campaign has no drone to attack).
    """
    from timelyllm_ros.robots.tello import TelloBackend, client_state_port

    rng = random.Random(seed)
    profile = load_profile('tello')
    counts = dict.fromkeys(('tello_frozen_state', 'tello_spoofed_success', 'tello_crashes'), 0)
    errors, quiet = _ErrorCount(), _ErrorsOnly()
    loggers = [logging.getLogger(name) for name in ('timelyllm_ros.robots.tello', 'djitellopy')]
    for logger in loggers:
        logger.addHandler(errors)
        logger.addFilter(quiet)
    state_port = client_state_port() or state_port or _free_port()
    emulator = TelloEmulator(HOST, 0, state_port, profile=profile, time_scale=TIME_SCALE,
                             drain_per_s=0.0, idle_drain_per_s=0.0).start()
    backend = TelloBackend(profile, HOST, control_port=emulator.port, state_port=state_port,
                           clock=WallClock())
    try:
        backend.connect()
        backend.perform(SkillCall('takeoff', 'to', {}, 'to()'))
        for _ in range(cases):
            _case(rng, backend, emulator, state_port, counts)
    finally:
        backend.close()
        emulator.stop()
        for logger in loggers:
            logger.removeFilter(quiet)
            logger.removeHandler(errors)
    counts['tello_crashes'] += errors.count
    return {'cases': cases, **counts}


def _case(rng: random.Random, backend: Any, emulator: TelloEmulator, state_port: int,
          counts: dict[str, int]) -> None:
    call = _motion(rng, emulator.height)
    command = {'move_forward': 'forward', 'move_backward': 'back', 'move_up': 'up',
               'move_down': 'down', 'turn_cw': 'cw', 'turn_ccw': 'ccw'}[call.skill]
    command += f' {next(iter(call.args.values()))}'
    sent_before = len(emulator.commands)
    kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, 4))]
    delays = [rng.uniform(0.0, 0.05) for _ in kinds]

    def attack() -> None:
        _wait_for(lambda: len(emulator.commands) > sent_before, 5.0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as hostile:
            hostile.bind((HOST, 0))
            for kind, delay in zip(kinds, delays, strict=True):
                time.sleep(delay)
                data, port = hostile_datagram(rng_attack, kind, emulator, state_port)
                hostile.sendto(data, (HOST, port))

    rng_attack = random.Random(rng.random())  # the attacker's own stream: a thread of its own
    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    replies_before = len(emulator.replies)
    try:
        backend.perform(call)
    except Exception:  # noqa: BLE001 -- counted: a valid motion must not fail
        counts['tello_crashes'] += 1
    else:
        answered = [c for c, _ in emulator.replies[replies_before:]]
        if command not in answered:
            counts['tello_spoofed_success'] += 1
            # Let the real reply arrive, so that it cannot answer the next case's command.
            _wait_for(lambda: command in [c for c, _ in emulator.replies[replies_before:]],
                      5.0)
    attacker.join(5.0)
    try:
        current = _wait_for(
            lambda: (state := backend.state()) == {} or (
                state.get('h') == emulator.height and state.get('yaw') == emulator.yaw),
            FROZEN_WAIT_S)
        state = backend.state()
        said = getattr(backend, 'state_problem', lambda: '')()
    except Exception:  # noqa: BLE001 -- counted
        counts['tello_crashes'] += 1
        return
    if not current or (state == {} and not said):
        counts['tello_frozen_state'] += 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the campaign and print its counts (exit status 1 if any is not 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--cases', type=int, default=40, help='motions under attack')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--json', action='store_true', help='print the counts as JSON')
    args = parser.parse_args(argv)
    began = time.monotonic()
    result = run_hostile_datagrams_campaign(args.seed, args.cases)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f'{key}: {value}')
        print(f'({time.monotonic() - began:.0f} s)')
    return 1 if any(v for k, v in result.items() if k != 'cases') else 0


if __name__ == '__main__':
    sys.exit(main())
