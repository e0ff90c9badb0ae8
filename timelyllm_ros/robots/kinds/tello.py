"""The Tello drone: :class:`~timelyllm_ros.robots.tello.TelloBackend` over djitellopy, on the
drone or on :class:`~timelyllm_ros.robots.emulators.tello.TelloEmulator`.

Profiling (``lrtrace profile``, backends ``emulator`` and ``djitellopy``): the drone takes off
and flies every move followed by its opposite (so it comes back), then lands; more take-off /
land pairs give those two the same number of calls. djitellopy polls its reply list every
100 ms (``time.sleep(0.1)`` in ``send_command_with_return``), so the time a call returns is
quantised to 100 ms, and it sleeps before a command sent less than ``TIME_BTW_COMMANDS``
(0.1 s) after the previous reply. The rig therefore takes a motion's end from the arrival of
the drone's reply at djitellopy's receiver thread (it stamps the client's reply list of that
drone), and leaves ``TIME_BTW_COMMANDS`` between calls so that the pause never falls inside a
measured call. What remains is the UDP round trip and the emulator's scheduling, about 1 ms.
Perception skills (no perception source here) and ``d``/``l``/``tp`` (performed locally) are
skipped with the reason.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from types import ModuleType
from typing import Any

from timelyllm_ros.core.clock import Clock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.robots.backend import RobotBackend, SkillRecord
from timelyllm_ros.robots.factory import open_robot
from timelyllm_ros.robots.kind import (
    Robot,
    RobotKind,
    RobotOptions,
    connect_to_emulator,
    register_kind,
)
from timelyllm_ros.robots.rig import Rig, Step, call_text, skill_grid

logger = logging.getLogger(__name__)

TELLO_HOST = '192.168.10.1'        # the drone's own Wi-Fi access point

_LOOPBACK_HOSTS = itertools.count()

# Every move is followed by its opposite (the drone comes back; the height stays >= 0).
PAIRS = {'move_forward': 'move_backward', 'move_left': 'move_right',
         'move_up': 'move_down', 'turn_cw': 'turn_ccw'}
LOCAL = {
    'delay': 'performed locally by TelloBackend (waits on its clock; exact by definition): '
             'no robot time to measure',
    'log': 'performed locally by TelloBackend (logged, no drone command): no robot time to '
           'measure',
    'take_picture': 'performed locally by TelloBackend (logged, no video stream, no drone '
                    'command): no robot time to measure',
}


class TelloKind(RobotKind):
    """The Ryze Tello: emulator and real drone through djitellopy."""

    name = 'tello'
    category = 'drone'
    backends = ('emulator', 'real')
    client = 'djitellopy'
    profiling_defaults = {'grid': 6, 'repeats': 1, 'time_scale': 0.05}

    def open(self, profile: RobotProfile, backend: str, address: str | None, clock: Clock,
             options: RobotOptions) -> Robot:
        from timelyllm_ros.robots.tello import TelloBackend, client_state_port

        # Only the options given: the backends keep their own defaults for the others.
        timeout: dict[str, Any] = ({} if options.command_timeout_s is None
                                   else {'command_timeout_s': options.command_timeout_s})
        if options.perception is not None:
            timeout['perception'] = options.perception
        if backend == 'real':
            try:
                host = socket.gethostbyname(address or TELLO_HOST)
            except OSError as err:
                raise RobotError(f'cannot resolve the Tello host {address!r}: {err}') from None
            try:
                drone = TelloBackend(profile, host=host, clock=clock, **timeout)
            except ValueError as err:
                raise RobotError(f'tello: {err}') from None
            drone.connect()
            return Robot(drone, f'Tello at {host} through djitellopy (TelloBackend); hardware',
                         host, _closers=[drone.close])
        from timelyllm_ros.robots.emulators.tello import TelloEmulator

        # djitellopy listens for state on one port per process; the first emulated drone of a
        # process picks a free one, so several controller processes can share a host.
        state_port = client_state_port() or _free_udp_port()
        host = address or (_loopback_host() if options.own_loopback_host else '127.0.0.1')
        battery: dict[str, Any] = ({'drain_per_s': 0.0, 'idle_drain_per_s': 0.0}
                                   if options.endless_battery else {})
        try:
            emulator = TelloEmulator(host, 0, state_port, profile=profile,
                                     time_scale=options.time_scale, **battery).start()
        except (OSError, ValueError) as err:
            raise RobotError(f'cannot start the Tello emulator on {host}: {err}') from None
        drone = connect_to_emulator(
            lambda: TelloBackend(profile, host=emulator.address[0], control_port=emulator.port,
                                 state_port=state_port, clock=clock, **timeout),
            emulator.stop, 'tello')
        description = (f'TelloEmulator on {host}:{emulator.port} driven through djitellopy by '
                       f'TelloBackend; emulated timing = profile {profile.name} models x '
                       f'time_scale {options.time_scale:g}; not hardware')
        return Robot(drone, description, host, emulator, {'emulator': 'TelloEmulator'},
                     [drone.close, emulator.stop])

    # -- profiling -------------------------------------------------------------------------
    def profiling_rig(self, profile: RobotProfile, emulated: bool, time_scale: float,
                      host: str | None, poses: Mapping[str, Sequence[float]]
                      ) -> AbstractContextManager[Rig]:
        return _tello_rig(profile, emulated, time_scale, host)

    def profiling_skip(self, name: str, backend: RobotBackend, emulated: bool,
                       poses: Mapping[str, Sequence[float]]) -> str | None:
        kind = type(backend).__name__
        if not backend.supports(name):
            return (f'not supported by {kind}' if name == 're_plan' else
                    f'perception skill: {kind} performs it only with a perception source '
                    '(vision model); there is none here')
        if name in LOCAL:
            return LOCAL[name]
        if name not in PAIRS and name not in PAIRS.values() and name not in ('takeoff', 'land'):
            return f'{kind} performs it without a drone command here'
        return None

    def profiling_plan(self, profile: RobotProfile, backend: RobotBackend, emulated: bool,
                       poses: Mapping[str, Sequence[float]]
                       ) -> tuple[list[str], dict[str, str]]:
        profiled, skipped = super().profiling_plan(profile, backend, emulated, poses)
        for first, second in PAIRS.items():
            if (first in profiled) != (second in profiled):
                lone = first if first in profiled else second
                profiled.remove(lone)
                skipped[lone] = 'flown only together with its opposite move, which is skipped'
        if ('takeoff' in profiled) != ('land' in profiled):
            lone = 'takeoff' if 'takeoff' in profiled else 'land'
            profiled.remove(lone)
            skipped[lone] = 'profiled only together with takeoff/land'
        return profiled, skipped

    def profiling_steps(self, profile: RobotProfile, profiled: Sequence[str], points: int,
                        poses: Mapping[str, Sequence[float]]) -> list[Step]:
        """One run: take off, every move and its opposite over the grid, land; then more
        take-off/land pairs so that every profiled skill has ``points`` calls."""
        steps: list[Step] = []
        flying = 'takeoff' in profiled and 'land' in profiled
        if flying:
            steps.append(Step('takeoff', call_text(profile.skill('takeoff'), None)))
        for first, second in PAIRS.items():
            if first not in profiled or second not in profiled:
                continue
            for value in skill_grid(profile.skill(first), points) or []:
                for name in (first, second):
                    steps.append(Step(name, call_text(profile.skill(name), value)))
        if flying:
            steps.append(Step('land', call_text(profile.skill('land'), None)))
            for _ in range(points - 1):
                steps += [Step('takeoff', call_text(profile.skill('takeoff'), None)),
                          Step('land', call_text(profile.skill('land'), None))]
        return steps


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(('127.0.0.1', 0))
        return int(probe.getsockname()[1])


def _loopback_host() -> str:
    """A loopback address of its own (any 127.x.y.z works on Linux)."""
    n = next(_LOOPBACK_HOSTS) % 250
    return f'127.0.3.{n + 1}' if sys.platform.startswith('linux') else '127.0.0.1'


class _ReplyStamps(list[Any]):
    """djitellopy's reply list of one drone that stamps each reply's arrival on a clock."""

    def __init__(self, clock: Clock, items: Sequence[Any] = ()) -> None:
        super().__init__(items)
        self.clock = clock
        self.stamps: list[float] = []

    def append(self, item: Any) -> None:
        self.stamps.append(self.clock.now())
        super().append(item)


class _TelloRig(Rig):
    """TelloBackend with reply stamping and the inter-command pause outside the calls; lands
    a drone left flying by a failed run."""

    def __init__(self, backend: RobotBackend, clock: Clock, description: str, ip: str,
                 meta: Mapping[str, str]) -> None:
        super().__init__(backend, clock, description, meta)
        self.ip = ip
        self.stamped = 0
        self.unstamped = 0
        self.flying = False
        self._stamps: _ReplyStamps | None = None
        self._mark = 0
        self._last_end = -math.inf

    def _client_module(self) -> ModuleType | None:
        # djitellopy is imported by TelloBackend.connect(); it is looked up, never imported
        # here (vendor libraries are imported only by their wrapper).
        return sys.modules.get('djitellopy.tello')

    def before(self, step: Step) -> None:
        module = self._client_module()
        pause = float(getattr(getattr(module, 'Tello', None), 'TIME_BTW_COMMANDS', 0.1))
        wait = pause + 0.002 - (self.clock.now() - self._last_end)
        if wait > 0:
            time.sleep(wait)
        entry = getattr(module, 'drones', {}).get(self.ip)
        stamps = entry.get('responses') if isinstance(entry, dict) else None
        if isinstance(entry, dict) and not isinstance(stamps, _ReplyStamps):
            stamps = _ReplyStamps(self.clock, stamps or ())
            entry['responses'] = stamps
        self._stamps = stamps if isinstance(stamps, _ReplyStamps) else None
        self._mark = len(self._stamps.stamps) if self._stamps is not None else 0

    def measured(self, step: Step, record: SkillRecord) -> SkillRecord:
        self._last_end = self.clock.now()
        replies = [] if self._stamps is None else [
            t for t in self._stamps.stamps[self._mark:]
            if record.start_time <= t <= record.end_time]
        if not replies or not record.success:
            self.unstamped += int(record.success)
            return record
        self.stamped += 1
        return replace(record, end_time=replies[-1])

    def after(self, step: Step) -> None:
        if step.skill == 'takeoff':
            self.flying = True
        elif step.skill == 'land':
            self.flying = False

    def cleanup(self) -> None:
        if not self.flying:
            return
        try:
            land = call_text(self.backend.profile.skill('land'), None)
            calls = [c for cut in segment_text(self.backend.profile, land) for c in cut.calls]
            self.backend.perform(calls[0])
        except Exception as err:  # noqa: BLE001 -- best effort, the run already failed
            logger.warning('could not land the Tello after the failed run: %s', err)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@contextmanager
def _quiet_djitellopy() -> Iterator[None]:
    """djitellopy logs two INFO lines per command to stderr: only warnings while profiling.

    A filter, not a level: djitellopy sets its logger's level when it is first imported,
    which happens inside the run (TelloBackend.connect).
    """
    client_logger = logging.getLogger('djitellopy')
    quiet = _BelowWarning()
    client_logger.addFilter(quiet)
    try:
        yield
    finally:
        client_logger.removeFilter(quiet)


@contextmanager
def _tello_rig(profile: RobotProfile, emulated: bool, time_scale: float,
               host: str | None) -> Iterator[Rig]:
    clock = WallClock()
    # An endless battery: a long profiling run would need battery swaps on a drone.
    options = RobotOptions(time_scale=time_scale if emulated else 1.0,
                           endless_battery=True, own_loopback_host=True,
                           command_timeout_s=2.0 if emulated else None)
    with _quiet_djitellopy():
        robot = open_robot(profile, 'emulator' if emulated else 'real', host, clock, options)
        try:
            meta = dict(robot.meta, measurement=(
                "end of a call = arrival of the drone's reply at djitellopy's receiver "
                '(stamped by the profiler; djitellopy itself polls every 100 ms); '
                "djitellopy's TIME_BTW_COMMANDS pause kept between calls"))
            rig = _TelloRig(robot.backend, clock, robot.description, robot.address, meta)
            try:
                yield rig
            finally:
                rig.meta['stamped_calls'] = str(rig.stamped)
                rig.meta['unstamped_calls'] = str(rig.unstamped)
        finally:
            robot.close()


KIND = register_kind(TelloKind())
