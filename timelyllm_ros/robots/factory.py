"""Open a robot backend by name: ``sim`` | ``emulator`` | ``real``, the one way to get a robot.

The controller nodes and ``lrtrace profile`` open their robots here:

* ``sim`` -- :class:`~timelyllm_ros.robots.sim_backend.SimulatedBackend`: sleeps per the
  execution-time model (seeded, with optional jitter); any profile has it;
* ``emulator`` -- starts the robot's loopback emulator in this process and drives it through
  the real vendor client (djitellopy for the Tello, IndyDCP3 for the Indy7);
* ``real`` -- the vendor client against a robot at ``address``.

The vendor backends belong to the profile's robot kind
(:func:`~timelyllm_ros.robots.kind.kind_of`; the Tello's and the Indy7's are in
:mod:`timelyllm_ros.robots.kinds`): this module checks the request and hands it over.

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

import numpy as np

from timelyllm_ros.core.clock import Clock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.robots.kind import Robot, RobotOptions, kind_of

__all__ = ['BACKENDS', 'Robot', 'RobotOptions', 'open_robot']

BACKENDS = ('sim', 'emulator', 'real')


def open_robot(profile: RobotProfile, backend: str, address: str | None, clock: Clock,
               options: RobotOptions | None = None) -> Robot:
    """Build and connect a robot.

    Raises:
        RobotError: unknown backend name, a robot kind without that vendor backend (or no
            robot kind for the profile), invalid options, or a robot (or emulator) that does
            not start or answer. Nothing is left running then.
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
    kind = kind_of(profile)
    if backend not in kind.backends:
        raise RobotError(f'robot kind {profile.name!r} has no {backend} backend (use sim)')
    return kind.open(profile, backend, address, clock, options)
