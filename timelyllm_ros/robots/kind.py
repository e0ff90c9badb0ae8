"""Robot kinds: one plug-in per kind of robot, registered by name.

A :class:`RobotKind` says what is particular to one kind of robot (a Tello, an Indy7, the
chatbot), so that nothing else branches on a profile's name:

* which vendor backends it opens (``emulator``, ``real``) and how (:meth:`RobotKind.open`);
  the simulated backend is generic and needs no kind;
* the TUF class of its tasks (:meth:`RobotKind.task_class`);
* how ``lrtrace profile`` drives it: the rig (backend, clock and measurement hooks), the skills
  it can profile and the calls, in order (:meth:`RobotKind.profiling_rig`,
  :meth:`RobotKind.profiling_plan`, :meth:`RobotKind.profiling_steps`), and the name of its real
  robot's backend there (:attr:`RobotKind.client`).

Adding a kind takes one module and a profile YAML: the module subclasses :class:`RobotKind`
and calls :func:`register_kind`; the profile names the module in ``driver``
(``'package.module:Class'``), or the module lives in :mod:`timelyllm_ros.robots.kinds`, whose
modules are all registered when the registry is first read. A profile finds its kind with
:func:`kind_of`: the kind its ``driver`` names, else the kind registered under the profile's
name, else the first one registered for its ``kind`` (the category: drone, arm, chatbot, ...).

:class:`RobotOptions` and :class:`Robot` are what :func:`~timelyllm_ros.robots.factory.open_robot`
takes and returns (re-exported there).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from timelyllm_ros.core.clock import Clock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.plugins import load_named
from timelyllm_ros.robots.backend import RobotBackend
from timelyllm_ros.robots.rig import Rig, Step, profile_calls

BackendT = TypeVar('BackendT', bound=RobotBackend)

VENDOR_BACKENDS = ('emulator', 'real')
"""The backends a kind may open (``sim`` is generic: every profile has it)."""


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
    emulator: object | None = None       # the emulator started for it, if any
    meta: dict[str, str] = field(default_factory=dict)      # for a bag: {'emulator': class}
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Close the backend, then stop its emulator (idempotent)."""
        closers, self._closers = self._closers, []
        for closer in closers:
            closer()


class RobotKind:
    """One kind of robot: its vendor backends, task class and profiling.

    Subclass it, set the class attributes, override what differs from the defaults, and
    register an instance with :func:`register_kind`. Every method takes the profile: one kind
    may drive several profiles (``chatbot`` and ``chatbot_paragraph``).

    Attributes:
        name: The kind's registry name (``tello``); a profile of that name uses it.
        category: The profiles' ``kind`` it serves (``drone``, ``arm``, ``chatbot``, ...).
        backends: The vendor backends :meth:`open` opens: ``emulator`` and/or ``real``.
        client: What ``lrtrace profile --backend`` calls the real robot (its vendor client:
            ``djitellopy``); only when ``real`` is among the backends.
        profiling_defaults: ``grid``, ``repeats`` and ``time_scale`` of an emulated
            profiling run (missing ones: the real-robot defaults of :mod:`lrtrace.profiling`).
    """

    name: ClassVar[str] = ''
    category: ClassVar[str] = ''
    backends: ClassVar[tuple[str, ...]] = ()
    client: ClassVar[str] = 'real'
    profiling_defaults: ClassVar[Mapping[str, float]] = {}

    def open(self, profile: RobotProfile, backend: str, address: str | None, clock: Clock,
             options: RobotOptions) -> Robot:
        """Build and connect a vendor backend (``backend`` is one of :attr:`backends`;
        ``options`` are checked already). Leave nothing running when it fails.

        Raises:
            RobotError: the robot (or emulator) does not start or answer.
        """
        raise RobotError(f'robot kind {profile.name!r} has no {backend} backend (use sim)')

    def task_class(self, urgency: str) -> str:
        """The TUF class of a task of this kind, given the urgency its goal asks for
        (default: the urgency)."""
        return urgency

    # -- profiling (lrtrace profile) ---------------------------------------------------------
    def profiling_rig(self, profile: RobotProfile, emulated: bool, time_scale: float,
                      host: str | None, poses: Mapping[str, Sequence[float]]
                      ) -> AbstractContextManager[Rig]:
        """The connected robot a profiling run drives (closed when the context ends).

        Default: the backend opened with default options on a wall clock, timed by the
        executor around each call.

        Args:
            profile: The profile to profile.
            emulated: The emulator (True) or the real robot (False).
            time_scale: The emulator's time scale (1 for a real robot).
            host: The robot's address, or the address the emulator listens on.
            poses: Taught object poses (may be empty).
        """
        return self._default_rig(profile, emulated, time_scale, host, poses)

    @contextmanager
    def _default_rig(self, profile: RobotProfile, emulated: bool, time_scale: float,
                     host: str | None, poses: Mapping[str, Sequence[float]]) -> Iterator[Rig]:
        from timelyllm_ros.robots.factory import open_robot

        clock = WallClock()
        options = RobotOptions(time_scale=time_scale, poses=dict(poses) or None)
        robot = open_robot(profile, 'emulator' if emulated else 'real', host, clock, options)
        try:
            yield Rig(robot.backend, clock, robot.description,
                      dict(robot.meta, measurement='executor clock around each call'))
        finally:
            robot.close()

    def profiling_plan(self, profile: RobotProfile, backend: RobotBackend, emulated: bool,
                       poses: Mapping[str, Sequence[float]]
                       ) -> tuple[list[str], dict[str, str]]:
        """The skills to profile on a connected backend and, per skipped skill, why.

        Default: the skills :meth:`profiling_skip` has no reason to skip, in profile order.
        """
        profiled: list[str] = []
        skipped: dict[str, str] = {}
        for skill in profile.skills:
            reason = self.profiling_skip(skill.name, backend, emulated, poses)
            if reason is None:
                profiled.append(skill.name)
            else:
                skipped[skill.name] = reason
        return profiled, skipped

    def profiling_skip(self, name: str, backend: RobotBackend, emulated: bool,
                       poses: Mapping[str, Sequence[float]]) -> str | None:
        """Why one skill is not profiled on a connected backend, or None.

        Default: the skills the backend does not support.
        """
        if not backend.supports(name):
            return f'not supported by {type(backend).__name__}'
        return None

    def profiling_steps(self, profile: RobotProfile, profiled: Sequence[str], points: int,
                        poses: Mapping[str, Sequence[float]]) -> list[Step]:
        """The calls of one profiling run, in order.

        Default: every profiled skill over the grid of its first numeric argument
        (:func:`~timelyllm_ros.robots.rig.profile_calls`).
        """
        wanted = set(profiled)
        return [Step(skill, text) for skill, text in profile_calls(profile, points)
                if skill in wanted]

    def __repr__(self) -> str:
        return f'{type(self).__name__}(name={self.name!r}, category={self.category!r})'


# -- the registry -------------------------------------------------------------------------------
_KINDS: dict[str, RobotKind] = {}
_BUNDLED = 'timelyllm_ros.robots.kinds'
_bundled_loaded = False
_LOADING = threading.RLock()


def connect_to_emulator(build: Callable[[], BackendT], stop_emulator: Callable[[], object],
                        name: str) -> BackendT:
    """Build a backend for a started emulator and connect it; if that fails the emulator is
    stopped, so nothing is left running (a ValueError of the backend becomes a RobotError
    naming the kind)."""
    try:
        backend = build()
        backend.connect()
    except ValueError as err:
        stop_emulator()
        raise RobotError(f'{name}: {err}') from None
    except BaseException:
        stop_emulator()
        raise
    return backend


def register_kind(kind: RobotKind) -> RobotKind:
    """Register a robot kind under its name (again for the same class: replaced).

    Returns:
        The kind, so that a module may write ``KIND = register_kind(MyKind())``.

    Raises:
        RobotError: no name or category, an unknown backend, or the name taken by another
            class.
    """
    if not kind.name or not kind.category:
        raise RobotError(f'{type(kind).__name__}: a robot kind needs a name and a category')
    unknown = [b for b in kind.backends if b not in VENDOR_BACKENDS]
    if unknown:
        raise RobotError(f'robot kind {kind.name!r}: unknown backends {unknown}; a kind opens '
                         f'{" and/or ".join(VENDOR_BACKENDS)} (sim is generic)')
    taken = _KINDS.get(kind.name)
    if taken is not None and _qualname(type(taken)) != _qualname(type(kind)):
        raise RobotError(f'robot kind {kind.name!r} is registered already by '
                         f'{_qualname(type(taken))}, not {_qualname(type(kind))}')
    _KINDS[kind.name] = kind
    return kind


def _qualname(cls: type) -> str:
    return f'{cls.__module__}:{cls.__qualname__}'


def _load_bundled() -> None:
    """Import every module of :mod:`timelyllm_ros.robots.kinds` (each registers its kind),
    once; callers in other threads wait until all are registered."""
    global _bundled_loaded
    if _bundled_loaded:
        return
    with _LOADING:
        if _bundled_loaded:
            return
        package = importlib.import_module(_BUNDLED)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if not info.name.startswith('_'):
                importlib.import_module(f'{_BUNDLED}.{info.name}')
        _bundled_loaded = True


def robot_kinds() -> dict[str, RobotKind]:
    """Every registered kind by name (the bundled ones first, in name order)."""
    _load_bundled()
    return dict(_KINDS)


def robot_kind(spec: str) -> RobotKind:
    """A robot kind by registered name (``tello``) or as ``'package.module:Class'`` (the
    module is imported and the kind registered).

    Raises:
        RobotError: unknown name, or a class that cannot be loaded or is no RobotKind.
    """
    _load_bundled()
    if spec in _KINDS:
        return _KINDS[spec]
    if ':' in spec:
        found = load_named(spec, 'robot kind', RobotError)
        if isinstance(found, RobotKind):
            return register_kind(found) if _KINDS.get(found.name) is not found else found
        if not (isinstance(found, type) and issubclass(found, RobotKind)):
            raise RobotError(f'{spec!r} is not a RobotKind subclass')
        registered = _KINDS.get(found.name)
        if registered is not None and type(registered) is found:
            return registered
        return register_kind(found())
    raise RobotError(f'unknown robot kind {spec!r}; registered: {", ".join(_KINDS)} (or name '
                     "one as 'package.module:Class')")


def kind_of(profile: RobotProfile) -> RobotKind:
    """The robot kind that drives a profile.

    The kind named by the profile's ``driver``; else the kind registered under the profile's
    name, when it serves the profile's ``kind``; else the first kind registered for its
    ``kind`` (the bundled ones first).

    Raises:
        RobotError: the driver cannot be loaded or serves another category, or no registered
            kind serves the profile's category.
    """
    if profile.driver is not None:
        kind = robot_kind(profile.driver)
        if kind.category != profile.kind:
            raise RobotError(f'profile {profile.name}: its driver {profile.driver!r} drives '
                             f'{kind.category!r} robots, the profile is a {profile.kind!r}')
        return kind
    kinds = robot_kinds()
    named = kinds.get(profile.name)
    if named is not None and named.category == profile.kind:
        return named
    for kind in kinds.values():
        if kind.category == profile.kind:
            return kind
    served = ', '.join(f'{k.name} ({k.category})' for k in kinds.values())
    raise RobotError(f'profile {profile.name}: no robot kind serves kind {profile.kind!r}; '
                     f'registered: {served}; name the module of a new one in the profile '
                     "(driver: 'package.module:Class')")


def categories() -> list[str]:
    """The profile kinds (categories) the registered robot kinds serve."""
    return list(dict.fromkeys(k.category for k in robot_kinds().values()))
