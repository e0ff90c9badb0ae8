"""Profile a robot's skills into an LRTrace bag: a grid of calls through the skill executor.

:func:`profile_robot` drives the skills of a robot profile over a grid of argument values
through :class:`~timelyllm_ros.robots.executor.SkillExecutor` and records every executed skill
(``SkillExecution``) into a new bag, which ``lrtrace fit`` turns into execution-time models.

Backends:

* ``sim`` -- :class:`~timelyllm_ros.robots.sim_backend.SimulatedBackend` on a simulated
  clock: every skill of any profile, timed by the profile's own models (optional jitter).
* ``emulator`` -- starts the robot's loopback emulator, configured with the profile's models
  and ``time_scale``, and drives it through the real vendor client:
  :class:`~timelyllm_ros.robots.emulators.tello.TelloEmulator` through djitellopy
  (:class:`~timelyllm_ros.robots.tello.TelloBackend`) for ``tello``,
  :class:`~timelyllm_ros.robots.emulators.indy7.Indy7Emulator` through IndyDCP3
  (:class:`~timelyllm_ros.robots.indy7.Indy7Backend`) for ``indy7``. The bag's meta records
  the emulator configuration (the models it was timed with and ``time_scale``), so that
  ``lrtrace fit`` reports real-robot seconds (recorded durations / ``time_scale``) and
  compares them with what the emulator was configured with.
* ``djitellopy`` / ``indydcp3`` -- the same drive against a real Tello / Indy7 at ``host``
  (real time, ``time_scale`` 1). **The robot moves**: the drone takes off and flies the
  grid (every move is followed by its opposite, so it comes back), the arm moves joint 1 and
  the tool's x from the zero pose / base origin and back (the indy7 models' own argument
  definitions); make sure the space is clear.

What is profiled and what is not: skills the backend cannot perform here, or performs without
the robot (perception skills without a perception source, ``d``/``l``/``tp`` on the Tello,
``detect``/``check`` on the Indy7, ...) are skipped with a reason, listed in the result and in
the bag's meta (``lrtrace fit`` lists them too). Set-up moves (the Indy7's return to the zero
pose before each move) go through the executor as well but are not recorded.

Measurement (what the round trip adds, and what is done about it; nothing is subtracted):

* Tello: djitellopy polls its reply list every 100 ms (``time.sleep(0.1)`` in
  ``send_command_with_return``), so the time a call returns is quantised to 100 ms; and it
  sleeps before a command sent less than ``TIME_BTW_COMMANDS`` (0.1 s) after the previous
  reply. The profiler therefore takes a motion's end from the arrival of the drone's reply at
  djitellopy's receiver thread (it stamps the client's reply list of that drone), and leaves
  ``TIME_BTW_COMMANDS`` between calls so that the pause never falls inside a measured call.
  What remains is the UDP round trip and the emulator's scheduling, about 1 ms.
* Indy7: :class:`~timelyllm_ros.robots.indy7.Indy7Backend` polls the motion state over gRPC;
  with the emulator the profiler polls every 2 ms (two RPCs of about 1 ms each per poll), so a
  motion is seen done about 4-6 ms late. The gripper has no feedback: the backend waits
  ``gripper_wait_s``, which the profiler sets to the profile's grip/release time x
  ``time_scale`` on the emulator (the emulator itself does not time the gripper).

The default ``time_scale`` per robot keeps that overhead at about 1-2 % of the shortest scaled
duration while a default run takes well under a minute (:data:`DEFAULTS`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lrtrace.recorder import TraceRecorder
from timelyllm_ros.clock import Clock, SimClock, WallClock
from timelyllm_ros.errors import ProfileError, RobotError, TraceFormatError
from timelyllm_ros.profiles import RobotProfile, Skill, load_profile_name_or_file
from timelyllm_ros.request import Segment
from timelyllm_ros.robots.backend import RobotBackend, SkillRecord
from timelyllm_ros.robots.executor import SkillExecutor
from timelyllm_ros.robots.factory import RobotOptions, open_robot
from timelyllm_ros.segmenter import segment_text

if TYPE_CHECKING:
    from timelyllm_ros.robots.indy7 import Indy7Backend

__all__ = ['BACKENDS', 'DEFAULTS', 'ProfileRun', 'Step', 'profile_calls', 'profile_robot']

logger = logging.getLogger(__name__)

BACKENDS = ('sim', 'emulator', 'djitellopy', 'indydcp3')
"""Backends of :func:`profile_robot`."""

REAL_BACKENDS = {'djitellopy': 'tello', 'indydcp3': 'indy7'}
"""The real-robot backends and the profile each drives."""

DEFAULTS: dict[tuple[str, str], dict[str, float]] = {
    ('sim', ''): {'grid': 13, 'repeats': 3, 'time_scale': 1.0},
    ('emulator', 'tello'): {'grid': 6, 'repeats': 1, 'time_scale': 0.05},
    ('emulator', 'indy7'): {'grid': 6, 'repeats': 2, 'time_scale': 0.25},
    ('real', ''): {'grid': 6, 'repeats': 2, 'time_scale': 1.0},
}
"""Default grid points per numeric argument, runs per grid point and time scale.

The emulator scales were chosen by measurement on loopback (2 cores): the Tello round trip
adds about 0.6 ms to a call (at 0.05: about 0.012 s in real-robot seconds, 1.5 % of the
shortest call, ``tc(1)`` at 0.8 s), the Indy7's about 5-7 ms (at 0.25: about 0.025 s, 4 % of
the shortest joint move, 2 % on average). A default run takes about 27 s (tello: 60 calls,
each at least djitellopy's 100 ms poll plus the 100 ms pause) and 19 s (indy7). Fewer grid
points or a smaller scale are faster; the fitted intercepts then move up by the overhead /
``time_scale``.
"""

# Tello: every move is followed by its opposite (the drone comes back; the height stays >= 0).
_TELLO_PAIRS = {'move_forward': 'move_backward', 'move_left': 'move_right',
                'move_up': 'move_down', 'turn_cw': 'turn_ccw'}
_TELLO_LOCAL = {
    'delay': 'performed locally by TelloBackend (waits on its clock; exact by definition): '
             'no robot time to measure',
    'log': 'performed locally by TelloBackend (logged, no drone command): no robot time to '
           'measure',
    'take_picture': 'performed locally by TelloBackend (logged, no video stream, no drone '
                    'command): no robot time to measure',
}
_INDY7_LOCAL = {
    'detect': 'answered by Indy7Backend from its taught object poses (no camera, no arm '
              'motion): no robot time to measure',
    'check': 'answered by Indy7Backend from its taught object poses (no camera, no arm '
             'motion): no robot time to measure',
}
_INDY7_OBJECT_SKILLS = ('move_to', 'pick', 'place')
_GRIPPER_SKILLS = ('grip', 'release')



@dataclass(frozen=True, slots=True)
class Step:
    """One call of a profiling run.

    Attributes:
        skill: The canonical skill name.
        text: The call as sent through the executor, e.g. ``mf(116)``.
        record: False for set-up moves (performed, not recorded).
    """

    skill: str
    text: str
    record: bool = True


@dataclass(slots=True)
class ProfileRun:
    """What :func:`profile_robot` did.

    Attributes:
        path: The bag written.
        robot: The profile's name.
        backend: The backend used.
        time_scale: The emulator's time scale (1 for sim and real robots).
        grid: Grid points per numeric argument (calls per constant skill and run).
        repeats: Runs of the whole grid.
        samples: Recorded successful executions per profiled skill.
        skipped: Skills not profiled, with the reason.
        wall_s: Wall-clock seconds of the run (emulator start to bag closed).
        meta: The key/value pairs stored in the bag's meta message.
    """

    path: Path
    robot: str
    backend: str
    time_scale: float
    grid: int
    repeats: int
    samples: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    meta: dict[str, str] = field(default_factory=dict)


# -- grids and calls ----------------------------------------------------------------------------
def _grid(lo: float | None, hi: float | None, integer: bool, points: int) -> list[float]:
    """``points`` argument values from the lowest positive limit to the upper limit."""
    top = hi if hi is not None else 100.0
    bottom = lo if lo is not None and lo > 0 else top / points
    if points == 1:
        values = [top]
    else:
        values = [bottom + (top - bottom) * i / (points - 1) for i in range(points)]
    return sorted({round(v) for v in values}) if integer else [round(v, 3) for v in values]


def _call_text(skill: Skill, value: float | None) -> str:
    """``short(...)`` with ``value`` for the first numeric argument.

    Other numeric arguments take 0 (or their lower limit when 0 is outside it), string
    arguments ``'target'``.
    """
    numeric = [a for a in skill.args if a.type != 'str']
    literals = []
    for arg in skill.args:
        if arg.type == 'str':
            literals.append("'target'")
            continue
        v = value if numeric and arg is numeric[0] and value is not None else (
            0.0 if (arg.min is None or arg.min <= 0) and (arg.max is None or arg.max >= 0)
            else arg.min)
        if v is None:
            raise ProfileError(f'{skill.name}: argument {arg.name} has a negative maximum and '
                               f'no minimum: no value to profile it with')
        literals.append(str(int(v)) if arg.type == 'int' else f'{float(v):g}')
    return f'{skill.short}({", ".join(literals)})'


def _skill_grid(skill: Skill, points: int) -> list[float] | None:
    """The grid of the skill's first numeric argument (None: no numeric argument)."""
    numeric = [a for a in skill.args if a.type != 'str']
    if not numeric:
        return None
    return _grid(numeric[0].min, numeric[0].max, numeric[0].type == 'int', points)


def profile_calls(profile: RobotProfile, points: int = 13) -> list[tuple[str, str]]:
    """``(skill, call text)`` pairs covering every skill of a profile once per grid point.

    The first numeric argument runs over its grid; other numeric arguments take 0 (or their
    lower limit when 0 is outside it), string arguments ``'target'``; skills without numeric
    arguments are called once.
    """
    calls: list[tuple[str, str]] = []
    for skill in profile.skills:
        grid = _skill_grid(skill, points)
        for value in grid if grid is not None else [None]:
            calls.append((skill.name, _call_text(skill, value)))
    return calls


def _tello_steps(profile: RobotProfile, profiled: Sequence[str], points: int) -> list[Step]:
    """One run: take off, every move and its opposite over the grid, land; then more
    take-off/land pairs so that every profiled skill has ``points`` calls."""
    steps: list[Step] = []
    flying = 'takeoff' in profiled and 'land' in profiled
    if flying:
        steps.append(Step('takeoff', _call_text(profile.skill('takeoff'), None)))
    for first, second in _TELLO_PAIRS.items():
        if first not in profiled or second not in profiled:
            continue
        for value in _skill_grid(profile.skill(first), points) or []:
            for name in (first, second):
                steps.append(Step(name, _call_text(profile.skill(name), value)))
    if flying:
        steps.append(Step('land', _call_text(profile.skill('land'), None)))
        for _ in range(points - 1):
            steps += [Step('takeoff', _call_text(profile.skill('takeoff'), None)),
                      Step('land', _call_text(profile.skill('land'), None))]
    return steps


def _indy7_steps(profile: RobotProfile, profiled: Sequence[str], points: int,
                 poses: Mapping[str, Sequence[float]]) -> list[Step]:
    """One run: joint / task moves from the zero pose / base origin and back (the way back is
    not recorded), grip/release pairs, and object skills over the taught poses."""
    steps: list[Step] = []
    for name in ('move_joint', 'move_task'):
        if name not in profiled:
            continue
        skill = profile.skill(name)
        home = Step(name, _call_text(skill, 0.0), record=False)
        steps.append(home)
        for value in _skill_grid(skill, points) or []:
            steps += [Step(name, _call_text(skill, value)), home]
    if all(name in profiled for name in _GRIPPER_SKILLS):
        for _ in range(points):
            steps += [Step(name, _call_text(profile.skill(name), None))
                      for name in _GRIPPER_SKILLS]
    names = sorted(poses)
    if names and all(name in profiled for name in _INDY7_OBJECT_SKILLS):
        for i in range(points):
            here, there = names[i % len(names)], names[(i + 1) % len(names)]
            steps += [Step('move_to', f"{profile.skill('move_to').short}('{here}')"),
                      Step('pick', f"{profile.skill('pick').short}('{here}')"),
                      Step('place', f"{profile.skill('place').short}('{here}', '{there}')")]
    return steps


# -- rigs: backend, clock and measurement hooks ------------------------------------------------
class _Rig:
    """A connected backend with its clock and the profiler's measurement hooks."""

    def __init__(self, backend: RobotBackend, clock: Clock, description: str,
                 meta: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.clock = clock
        self.description = description
        self.meta = dict(meta or {})

    def before(self, step: Step) -> None:
        """Called before a step is executed."""

    def measured(self, step: Step, record: SkillRecord) -> SkillRecord:
        """The record to store for one executed skill (default: as the executor timed it)."""
        return record

    def cleanup(self, flying: bool) -> None:
        """Best-effort safe state after a failed run."""


class _ReplyStamps(list[Any]):
    """djitellopy's reply list of one drone that stamps each reply's arrival on a clock."""

    def __init__(self, clock: Clock, items: Sequence[Any] = ()) -> None:
        super().__init__(items)
        self.clock = clock
        self.stamps: list[float] = []

    def append(self, item: Any) -> None:
        self.stamps.append(self.clock.now())
        super().append(item)


class _TelloRig(_Rig):
    """TelloBackend with reply stamping and the inter-command pause outside the calls."""

    def __init__(self, backend: RobotBackend, clock: Clock, description: str, ip: str,
                 meta: Mapping[str, str]) -> None:
        super().__init__(backend, clock, description, meta)
        self.ip = ip
        self.stamped = 0
        self.unstamped = 0
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

    def cleanup(self, flying: bool) -> None:
        if not flying:
            return
        try:
            land = _call_text(self.backend.profile.skill('land'), None)
            calls = [c for cut in segment_text(self.backend.profile, land) for c in cut.calls]
            self.backend.perform(calls[0])
        except Exception as err:  # noqa: BLE001 -- best effort, the run already failed
            logger.warning('could not land the Tello after the failed run: %s', err)


class _Indy7Rig(_Rig):
    """Indy7Backend; on the emulator the gripper wait follows the profile x time_scale."""

    def __init__(self, backend: Indy7Backend, clock: Clock, description: str,
                 meta: Mapping[str, str], gripper_s: Mapping[str, float] | None) -> None:
        super().__init__(backend, clock, description, meta)
        self.arm = backend
        self.gripper_s = dict(gripper_s or {})

    def before(self, step: Step) -> None:
        if step.skill in self.gripper_s:
            self.arm.gripper_wait_s = self.gripper_s[step.skill]


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


def _robot_backend_name(backend: str) -> str:
    """The robot factory's name for a profiling backend (djitellopy/indydcp3: the robot)."""
    return backend if backend in ('sim', 'emulator') else 'real'


@contextmanager
def _tello_rig(profile: RobotProfile, backend: str, time_scale: float,
               host: str | None) -> Iterator[_Rig]:
    clock = WallClock()
    emulated = backend == 'emulator'
    # An endless battery: a long profiling run would need battery swaps on a drone.
    options = RobotOptions(time_scale=time_scale if emulated else 1.0,
                           endless_battery=True, own_loopback_host=True,
                           command_timeout_s=2.0 if emulated else None)
    with _quiet_djitellopy():
        robot = open_robot(profile, _robot_backend_name(backend), host, clock, options)
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


@contextmanager
def _indy7_rig(profile: RobotProfile, backend: str, time_scale: float, host: str | None,
               poses: Mapping[str, Sequence[float]]) -> Iterator[_Rig]:
    from timelyllm_ros.robots.indy7 import Indy7Backend

    clock = WallClock()
    if backend == 'emulator':
        gripper = {name: profile.skill(name).exec_time.mean_s({}) * time_scale
                   for name in _GRIPPER_SKILLS if name in profile.skill_index}
        options = RobotOptions(time_scale=time_scale, poll_interval_s=0.002,
                               motion_timeout_s=30.0,
                               gripper_wait_s=min(gripper.values(), default=0.5), poses=poses)
        measurement = ('executor clock around each call; Indy7Backend polls the motion '
                       'state every 2 ms')
        detail = ' (gripper: the backend waits the grip/release time x time_scale)'
    else:
        gripper = {}
        options = RobotOptions(poll_interval_s=0.01, poses=poses)
        measurement = ('executor clock around each call; Indy7Backend polls the motion '
                       'state every 10 ms')
        detail = ''
    address = host if backend == 'emulator' else host or '127.0.0.1'
    robot = open_robot(profile, _robot_backend_name(backend), address, clock, options)
    try:
        assert isinstance(robot.backend, Indy7Backend)
        meta = dict(robot.meta, measurement=measurement)
        yield _Indy7Rig(robot.backend, clock, robot.description + detail, meta, gripper)
    finally:
        robot.close()


# -- skills to profile ----------------------------------------------------------------------------
def _plan(profile: RobotProfile, backend: RobotBackend, backend_name: str,
          poses: Mapping[str, Sequence[float]]) -> tuple[list[str], dict[str, str]]:
    """The skills to profile and, per skipped skill, why."""
    kind = type(backend).__name__
    profiled: list[str] = []
    skipped: dict[str, str] = {}
    for skill in profile.skills:
        name = skill.name
        if backend_name == 'sim':
            profiled.append(name)
        elif not backend.supports(name):
            if profile.name == 'tello' and name != 're_plan':
                skipped[name] = (f'perception skill: {kind} performs it only with a '
                                 'perception source (vision model); there is none here')
            else:
                skipped[name] = f'not supported by {kind}'
        elif profile.name == 'tello' and name in _TELLO_LOCAL:
            skipped[name] = _TELLO_LOCAL[name]
        elif profile.name == 'tello' and name not in _TELLO_PAIRS \
                and name not in _TELLO_PAIRS.values() and name not in ('takeoff', 'land'):
            skipped[name] = f'{kind} performs it without a drone command here'
        elif profile.name == 'indy7' and name in _INDY7_LOCAL:
            skipped[name] = _INDY7_LOCAL[name]
        elif profile.name == 'indy7' and name in _INDY7_OBJECT_SKILLS:
            if backend_name == 'emulator':
                skipped[name] = ('the emulator performs it as a movel to a taught object pose, '
                                 "timed by move_task's model of that displacement, not by "
                                 "this skill's sampled model: nothing to compare; profile it "
                                 'on a real arm (--backend indydcp3 --poses FILE)')
            elif not poses:
                skipped[name] = 'needs taught object poses (--poses FILE)'
            else:
                profiled.append(name)
        else:
            profiled.append(name)
    if profile.name == 'tello':
        for first, second in _TELLO_PAIRS.items():
            if (first in profiled) != (second in profiled):
                lone = first if first in profiled else second
                profiled.remove(lone)
                skipped[lone] = 'flown only together with its opposite move, which is skipped'
        if ('takeoff' in profiled) != ('land' in profiled):
            lone = 'takeoff' if 'takeoff' in profiled else 'land'
            profiled.remove(lone)
            skipped[lone] = 'profiled only together with takeoff/land'
    if profile.name == 'indy7' and any(n in profiled for n in _GRIPPER_SKILLS) \
            and not all(n in profiled for n in _GRIPPER_SKILLS):
        for name in _GRIPPER_SKILLS:
            if name in profiled:
                profiled.remove(name)
                skipped[name] = 'profiled only together with grip/release'
    return profiled, skipped


# -- the run --------------------------------------------------------------------------------------
def _settings(robot: str, backend: str) -> dict[str, float]:
    if backend == 'sim':
        return DEFAULTS[('sim', '')]
    return DEFAULTS.get((backend, robot), DEFAULTS[('real', '')])


def _validate(profile: RobotProfile, backend: str, grid: int, repeats: int,
              time_scale: float) -> None:
    if backend not in BACKENDS:
        raise RobotError(f'unknown backend {backend!r}; one of {", ".join(BACKENDS)}')
    if backend == 'emulator' and profile.name not in ('tello', 'indy7'):
        raise RobotError(f'no emulator for robot {profile.name!r} (emulators: tello, indy7)')
    wanted = REAL_BACKENDS.get(backend)
    if wanted is not None and profile.name != wanted:
        raise RobotError(f'backend {backend!r} drives the {wanted} robot, not {profile.name!r}')
    if grid < 1 or repeats < 1:
        raise RobotError(f'grid ({grid}) and repeats ({repeats}) must be >= 1')
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise RobotError(f'time_scale must be > 0, got {time_scale}')
    if time_scale != 1.0 and backend != 'emulator':
        raise RobotError(f'time_scale applies to the emulator only (backend {backend!r} runs '
                         'in real time)')


def _segment(profile: RobotProfile, index: int, text: str, now: float) -> Segment:
    statements = tuple(s for cut in segment_text(profile, text) for s in cut.statements)
    if len(statements) != 1 or statements[0].error:
        raise TraceFormatError(f'{profile.name}: profiling call {text!r} does not parse')
    return Segment(index=index, text=text, statements=statements, cut_time=now,
                   dispatch_time=now, estimated_exec_s=0.0, tokens=0, is_last=True)


@contextmanager
def _sim_rig(profile: RobotProfile, seed: int, jitter: float) -> Iterator[_Rig]:
    clock = SimClock()
    robot = open_robot(profile, 'sim', None, clock, RobotOptions(seed=seed, jitter=jitter))
    try:
        yield _Rig(robot.backend, clock, robot.description)
    finally:
        robot.close()


def profile_robot(robot: str | Path | RobotProfile, backend: str, out: str | Path,
                  grid: int | None = None,
                  repeats: int | None = None, time_scale: float | None = None,
                  host: str | None = None, *, poses: Mapping[str, Sequence[float]] | None = None,
                  seed: int = 0, jitter: float = 0.0,
                  progress: Callable[[str], None] | None = None) -> ProfileRun:
    """Drive a robot's skills over a grid of arguments and record every execution into a bag.

    Args:
        robot: The robot profile (object, bundled name such as ``tello`` or a YAML path).
        backend: ``sim``, ``emulator``, ``djitellopy`` (a real Tello) or ``indydcp3`` (a real
            Indy7); see the module docstring.
        out: The bag directory to create (must not exist).
        grid: Argument values per numeric skill (and calls per constant skill) in one run;
            default per robot and backend (:data:`DEFAULTS`).
        repeats: Runs of the whole grid (default: :data:`DEFAULTS`).
        time_scale: The emulator's time scale (emulated durations = model x scale; default
            :data:`DEFAULTS`); only for ``emulator``.
        host: The robot's address (real backends; default the vendor's), or the loopback
            address the emulator listens on (default: one of its own).
        poses: Taught object poses ``{name: [x, y, z, rx, ry, rz]}`` (mm, degrees) for the
            Indy7's object skills on a real arm.
        seed: Random seed of the simulated backend.
        jitter: Relative standard deviation of the simulated backend's durations.
        progress: Called with one line per finished skill (optional).

    Returns:
        What was profiled and skipped, the time scale and the wall time.

    Raises:
        RobotError: Unknown backend, a backend that does not drive this robot, bad settings,
            an emulator that cannot start, a robot that does not answer, or a call that
            failed (the bag keeps what was recorded before).
        TraceFormatError: ``out`` exists already.
        ProfileError: Unknown profile.
    """
    profile = robot if isinstance(robot, RobotProfile) else load_profile_name_or_file(robot)
    settings = _settings(profile.name, backend if backend in BACKENDS else 'sim')
    grid = int(settings['grid']) if grid is None else int(grid)
    repeats = int(settings['repeats']) if repeats is None else int(repeats)
    time_scale = float(settings['time_scale']) if time_scale is None else float(time_scale)
    _validate(profile, backend, grid, repeats, time_scale)
    out = Path(out)
    if out.exists():
        raise TraceFormatError(f'{out} exists already, not overwriting')
    poses = dict(poses or {})
    started = time.monotonic()
    if backend == 'sim':
        rig_context = _sim_rig(profile, seed, jitter)
    elif profile.name == 'tello':
        rig_context = _tello_rig(profile, backend, time_scale, host)
    else:
        rig_context = _indy7_rig(profile, backend, time_scale, host, poses)
    with rig_context as rig:
        profiled, skipped = _plan(profile, rig.backend, backend, poses)
        if backend == 'sim':
            steps = [Step(skill, text) for skill, text in profile_calls(profile, grid)]
        elif profile.name == 'tello':
            steps = _tello_steps(profile, profiled, grid)
        else:
            steps = _indy7_steps(profile, profiled, grid, poses)
        meta = _meta(profile, backend, time_scale, grid, repeats, profiled, skipped, rig)
        run = ProfileRun(path=out, robot=profile.name, backend=backend, time_scale=time_scale,
                         grid=grid, repeats=repeats, skipped=skipped)
        source = (f'lrtrace profile: robot {profile.name}, backend {backend} '
                  f'({rig.description})')
        with TraceRecorder(out, source=source, info=meta) as recorder:
            _drive(profile, rig, steps * repeats, recorder, run, progress)
    run.meta = dict(meta, **rig.meta)
    run.wall_s = time.monotonic() - started
    return run


def _meta(profile: RobotProfile, backend: str, time_scale: float, grid: int, repeats: int,
          profiled: Sequence[str], skipped: Mapping[str, str], rig: _Rig) -> dict[str, str]:
    """The bag's meta key/value pairs (values are strings; structured ones JSON)."""
    meta = {'robot': profile.name, 'backend': backend, 'time_scale': f'{time_scale!r}',
            'grid': str(grid), 'repeats': str(repeats),
            'profiled': json.dumps(list(profiled)), 'skipped': json.dumps(dict(skipped)),
            **rig.meta}
    if backend in ('emulator', 'sim'):
        # What the robot was configured with: fit compares with it (real-robot seconds).
        meta['reference_profile'] = profile.name
        meta['reference_models'] = json.dumps(
            {name: profile.skill(name).exec_time.model_dump(mode='json', exclude_none=True)
             for name in profiled}, separators=(',', ':'))
        meta['seconds'] = ('recorded durations are emulated seconds = real-robot seconds x '
                           'time_scale' if backend == 'emulator' else 'simulated seconds')
    else:
        meta['seconds'] = 'real-robot seconds'
    return meta


def _drive(profile: RobotProfile, rig: _Rig, steps: Sequence[Step], recorder: TraceRecorder,
           run: ProfileRun, progress: Callable[[str], None] | None) -> None:
    """Execute the steps in order, recording every skill of the recorded ones."""
    executor = SkillExecutor(rig.backend, rig.clock)
    robot_id = f'{profile.name}-profile'
    flying = False
    for index, step in enumerate(steps):
        rig.before(step)
        execution = executor.execute(_segment(profile, index, step.text, rig.clock.now()))
        records = [rig.measured(step, record) for record in execution.skills]
        if step.record:
            task_id = f'profile-{step.skill}'
            for record in records:
                recorder.record_skill(robot_id, task_id, index, record)
                if record.success:
                    run.samples[record.skill] = run.samples.get(record.skill, 0) + 1
            end = records[-1].end_time if records else execution.end_time
            recorder.record_segment_done(robot_id, task_id, index, execution.start_time, end,
                                         execution.success, execution.error)
        if not execution.success:
            rig.cleanup(flying)
            raise RobotError(f'profiling {profile.name} stopped at call {index + 1} of '
                             f'{len(steps)} ({step.text}): {execution.error}; the bag keeps '
                             f'what was recorded before')
        if step.skill == 'takeoff':
            flying = True
        elif step.skill == 'land':
            flying = False
        if progress is not None and step.record:
            duration = records[-1].end_time - records[-1].start_time if records else 0.0
            progress(f'{step.text}: {duration:.4f} s')
