"""Open a robot backend by name: ``sim`` | ``emulator`` | ``real`` (what controller nodes use).

* ``sim`` -- :class:`~timelyllm_ros.robots.sim_backend.SimulatedBackend`: sleeps per the
  execution-time model;
* ``emulator`` -- starts the robot's loopback emulator in this process and drives it through
  the real vendor client (djitellopy for the Tello, IndyDCP3 for the Indy7);
* ``real`` -- the vendor client against a robot at ``address``.

Arm objects are named poses. With the emulator every object name gets a reachable pose derived
from the name (there is no camera); on a real arm pass ``poses`` measured on the cell.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence

from timelyllm_ros.clock import Clock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.profiles import RobotProfile
from timelyllm_ros.robots.backend import RobotBackend

BACKENDS = ('sim', 'emulator', 'real')


def open_backend(profile: RobotProfile, backend: str, address: str | None, clock: Clock,
                 poses: Mapping[str, Sequence[float]] | None = None
                 ) -> tuple[RobotBackend, Callable[[], None]]:
    """Build and connect a backend; returns it and a function that closes it (and its emulator).

    Raises:
        RobotError: unknown backend name, a robot kind without a vendor backend, or a robot
            (or emulator) that does not answer.
    """
    if backend not in BACKENDS:
        raise RobotError(f'unknown backend {backend!r}; available: {", ".join(BACKENDS)}')
    if backend == 'sim':
        from timelyllm_ros.robots.sim_backend import SimulatedBackend

        simulated = SimulatedBackend(profile, clock)
        simulated.connect()
        return simulated, simulated.close
    if profile.name == 'tello':
        return _open_tello(profile, backend, address, clock)
    if profile.name == 'indy7':
        return _open_indy7(profile, backend, address, poses)
    raise RobotError(f'robot kind {profile.name!r} has no {backend} backend (use sim)')


def _open_tello(profile: RobotProfile, backend: str, address: str | None, clock: Clock
                ) -> tuple[RobotBackend, Callable[[], None]]:
    from timelyllm_ros.robots.tello import TelloBackend, client_state_port

    if backend == 'real':
        drone = TelloBackend(profile, host=address or '192.168.10.1', clock=clock)
        drone.connect()
        return drone, drone.close
    from timelyllm_ros.robots.emulators.tello import TelloEmulator

    # djitellopy listens for state on one port per process; the first emulated drone of a
    # process picks a free one, so several controller processes can share a host.
    state_port = client_state_port() or _free_udp_port()
    emulator = TelloEmulator(host=address or '127.0.0.1', profile=profile,
                             state_port=state_port).start()
    drone = TelloBackend(profile, host=emulator.address[0], control_port=emulator.port,
                         state_port=state_port, clock=clock)
    try:
        drone.connect()
    except RobotError:
        emulator.stop()
        raise

    def close() -> None:
        drone.close()
        emulator.stop()

    return drone, close


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(('', 0))
        return int(probe.getsockname()[1])


def _open_indy7(profile: RobotProfile, backend: str, address: str | None,
                poses: Mapping[str, Sequence[float]] | None
                ) -> tuple[RobotBackend, Callable[[], None]]:
    from timelyllm_ros.robots.indy7 import Indy7Backend

    if backend == 'real':
        if address is None:
            raise RobotError('the real Indy7 backend needs the controller address')
        arm = Indy7Backend(profile, host=address, poses=poses)
        arm.connect()
        return arm, arm.close
    from timelyllm_ros.robots.emulators.indy7 import Indy7Emulator

    emulator = Indy7Emulator(host=address or '127.0.0.1', profile=profile).start()
    arm = Indy7Backend(profile, host=emulator.host, port=emulator.port, poses=poses,
                       derive_unknown_poses=poses is None)
    try:
        arm.connect()
    except RobotError:
        emulator.stop()
        raise

    def close() -> None:
        arm.close()
        emulator.stop()

    return arm, close
