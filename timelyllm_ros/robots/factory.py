"""Open a robot backend by name: ``sim`` | ``emulator`` | ``real``, the one way to get a robot.

The controller nodes and ``lrtrace profile`` open their robots here:

* ``sim`` -- :class:`~timelyllm_ros.robots.sim_backend.SimulatedBackend`: sleeps per the
  execution-time model (seeded, with optional jitter);
* ``emulator`` -- starts the robot's loopback emulator in this process and drives it through
  the real vendor client (djitellopy for the Tello, IndyDCP3 for the Indy7);
* ``real`` -- the vendor client against a robot at ``address``.

:class:`RobotOptions` holds what some callers need beyond that: emulated timing scaled by
``time_scale``, an endless emulated battery, client timeouts and poll periods (profiling
measures with tighter ones), and arm poses. Arm objects are named poses: with the emulator
every object name gets a reachable pose derived from the name (there is no camera); on a real
arm pass ``poses`` measured on the cell.

:func:`open_robot` returns a :class:`Robot`: the connected backend, a human-readable
description and the ``meta`` a bag records about it (which emulator, if any), the emulator
object itself, and :meth:`Robot.close`, which closes the backend and then stops the emulator.
Vendor clients and emulators are imported only when a robot is opened.
"""

from __future__ import annotations

import itertools
import math
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from timelyllm_ros.clock import Clock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.plan import SkillCall
from timelyllm_ros.profiles import RobotProfile
from timelyllm_ros.robots.backend import RobotBackend

if TYPE_CHECKING:
    from timelyllm_ros.robots.emulators.indy7 import Indy7Emulator
    from timelyllm_ros.robots.emulators.tello import TelloEmulator

BACKENDS = ('sim', 'emulator', 'real')
TELLO_HOST = '192.168.10.1'        # the drone's own Wi-Fi access point

_LOOPBACK_HOSTS = itertools.count()


@dataclass(frozen=True, slots=True)
class RobotOptions:
    """How to open a robot, beyond its kind, backend and address (None: the backend's
    default)."""

    time_scale: float = 1.0              # emulators: skill durations x this
    endless_battery: bool = False        # Tello emulator: no drain (long profiling runs)
    own_loopback_host: bool = False      # emulated Tello on an address of its own (127.0.3.x):
                                         # djitellopy routes replies by the sender's address
    command_timeout_s: float | None = None   # Tello: wait for a reply (s)
    poll_interval_s: float | None = None     # Indy7: motion-state poll period (s)
    motion_timeout_s: float | None = None    # Indy7: longest motion (s)
    gripper_wait_s: float | None = None      # Indy7: wait after switching the gripper (s)
    poses: Mapping[str, Sequence[float]] | None = None   # Indy7: named object poses
    perception: Callable[[SkillCall], object] | None = None   # Tello: answers perception
                                         # skills (there is no vision model here)
    seed: int = 0                        # sim: seeds the sampled durations
    jitter: float = 0.0                  # sim: relative jitter of the durations

    def problem(self) -> str | None:
        """What is wrong with these options, or None."""
        if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
            return f'time_scale must be a finite number >= 0, got {self.time_scale}'
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            return f'jitter must be a finite number >= 0, got {self.jitter}'
        for name, value in (('command_timeout_s', self.command_timeout_s),
                            ('poll_interval_s', self.poll_interval_s),
                            ('motion_timeout_s', self.motion_timeout_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                return f'{name} must be a finite number > 0, got {value}'
        if self.gripper_wait_s is not None and not (math.isfinite(self.gripper_wait_s)
                                                    and self.gripper_wait_s >= 0):
            return f'gripper_wait_s must be a finite number >= 0, got {self.gripper_wait_s}'
        return None


@dataclass(slots=True)
class Robot:
    """An open robot: its backend, what it is, and how to close it (and its emulator)."""

    backend: RobotBackend
    description: str                     # human-readable, e.g. for a bag's metadata
    address: str = ''                    # where the client talks to
    emulator: TelloEmulator | Indy7Emulator | None = None   # started for it, if any
    meta: dict[str, str] = field(default_factory=dict)      # for a bag: {'emulator': class}
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Close the backend, then stop its emulator (idempotent)."""
        closers, self._closers = self._closers, []
        for closer in closers:
            closer()


def open_robot(profile: RobotProfile, backend: str, address: str | None, clock: Clock,
               options: RobotOptions | None = None) -> Robot:
    """Build and connect a robot.

    Raises:
        RobotError: unknown backend name, a robot kind without a vendor backend, invalid
            options, or a robot (or emulator) that does not start or answer. Nothing is left
            running then.
    """
    options = options or RobotOptions()
    if backend not in BACKENDS:
        raise RobotError(f'unknown backend {backend!r}; available: {", ".join(BACKENDS)}')
    problem = options.problem()
    if problem is not None:
        raise RobotError(f'{profile.name}: {problem}')
    if backend == 'sim':
        from timelyllm_ros.robots.sim_backend import SimulatedBackend

        simulated = SimulatedBackend(profile, clock, rng=np.random.default_rng(options.seed),
                                     jitter=options.jitter)
        simulated.connect()
        return Robot(simulated, f'simulated from the profile models, not hardware, jitter '
                                f'{options.jitter:g}', _closers=[simulated.close])
    if profile.name == 'tello':
        return _open_tello(profile, backend, address, clock, options)
    if profile.name == 'indy7':
        return _open_indy7(profile, backend, address, options)
    raise RobotError(f'robot kind {profile.name!r} has no {backend} backend (use sim)')


def _open_tello(profile: RobotProfile, backend: str, address: str | None, clock: Clock,
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
    try:
        drone = TelloBackend(profile, host=emulator.address[0], control_port=emulator.port,
                             state_port=state_port, clock=clock, **timeout)
        drone.connect()
    except ValueError as err:
        emulator.stop()
        raise RobotError(f'tello: {err}') from None
    except BaseException:
        emulator.stop()
        raise
    description = (f'TelloEmulator on {host}:{emulator.port} driven through djitellopy by '
                   f'TelloBackend; emulated timing = profile {profile.name} models x '
                   f'time_scale {options.time_scale:g}; not hardware')
    return Robot(drone, description, host, emulator, {'emulator': 'TelloEmulator'},
                 [drone.close, emulator.stop])


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(('127.0.0.1', 0))
        return int(probe.getsockname()[1])


def _loopback_host() -> str:
    """A loopback address of its own (any 127.x.y.z works on Linux)."""
    n = next(_LOOPBACK_HOSTS) % 250
    return f'127.0.3.{n + 1}' if sys.platform.startswith('linux') else '127.0.0.1'


def _open_indy7(profile: RobotProfile, backend: str, address: str | None,
                options: RobotOptions) -> Robot:
    from timelyllm_ros.robots.indy7 import Indy7Backend

    tuning: dict[str, Any] = {name: value for name, value in (
        ('poll_interval_s', options.poll_interval_s),
        ('motion_timeout_s', options.motion_timeout_s),
        ('gripper_wait_s', options.gripper_wait_s)) if value is not None}
    if backend == 'real':
        if address is None:
            raise RobotError('the real Indy7 backend needs the controller address')
        try:
            arm = Indy7Backend(profile, host=address, poses=options.poses, **tuning)
        except ValueError as err:
            raise RobotError(f'indy7: {err}') from None
        arm.connect()
        return Robot(arm, f'Indy7 at {arm.address} through IndyDCP3 (Indy7Backend); hardware',
                     address, _closers=[arm.close])
    from timelyllm_ros.robots.emulators.indy7 import Indy7Emulator

    try:
        emulator = Indy7Emulator(host=address or '127.0.0.1', profile=profile,
                                 time_scale=options.time_scale).start()
    except (OSError, ImportError, ValueError) as err:
        raise RobotError(f'cannot start the Indy7 emulator: {err}') from None
    try:
        arm = Indy7Backend(profile, host=emulator.host, port=emulator.port,
                           poses=options.poses, derive_unknown_poses=options.poses is None,
                           **tuning)
        arm.connect()
    except ValueError as err:
        emulator.stop()
        raise RobotError(f'indy7: {err}') from None
    except BaseException:
        emulator.stop()
        raise
    description = (f'Indy7Emulator on {emulator.address} driven through IndyDCP3 by '
                   f'Indy7Backend; emulated timing = profile {profile.name} models x '
                   f'time_scale {options.time_scale:g}; not hardware')
    return Robot(arm, description, emulator.address, emulator, {'emulator': 'Indy7Emulator'},
                 [arm.close, emulator.stop])
