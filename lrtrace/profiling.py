"""Profile a robot's skills into an LRTrace bag: a grid of calls through the skill executor.

:func:`profile_robot` drives the skills of a robot profile over a grid of argument values
through :class:`~timelyllm_ros.robots.executor.SkillExecutor` and records every executed skill
(``SkillExecution``) into a new bag, which ``lrtrace fit`` turns into execution-time models.

This module is the driver; what is particular to a robot is its kind's
(:class:`~timelyllm_ros.robots.kind.RobotKind`, :mod:`timelyllm_ros.robots.kinds`): the rig
(backend, clock and measurement hooks, :class:`~timelyllm_ros.robots.rig.Rig`), the skills it
can profile and the calls of one run, in order.

Backends:

* ``sim`` -- :class:`~timelyllm_ros.robots.sim_backend.SimulatedBackend` on a simulated
  clock: every skill of any profile, timed by the profile's own models (optional jitter).
* ``emulator`` -- starts the robot's loopback emulator, configured with the profile's models
  and ``time_scale``, and drives it through the real vendor client (the Tello through
  djitellopy, the Indy7 through IndyDCP3). The bag's meta records the emulator configuration
  (the models it was timed with and ``time_scale``), so that ``lrtrace fit`` reports
  real-robot seconds (recorded durations / ``time_scale``) and compares them with what the
  emulator was configured with.
* the kind's ``client`` (``djitellopy`` / ``indydcp3``) -- the same drive against the real
  robot at ``host`` (real time, ``time_scale`` 1). **The robot moves**: the drone takes off
  and flies the grid (every move is followed by its opposite, so it comes back), the arm
  moves joint 1 and the tool's x from the zero pose / base origin and back (the indy7
  models' own argument definitions); make sure the space is clear.

What is profiled and what is not: skills the backend cannot perform here, or performs without
the robot (perception skills without a perception source, ``d``/``l``/``tp`` on the Tello,
``detect``/``check`` on the Indy7, ...) are skipped with a reason, listed in the result and in
the bag's meta (``lrtrace fit`` lists them too). Set-up moves (the Indy7's return to the zero
pose before each move) go through the executor as well but are not recorded. How each rig
measures (nothing is subtracted) is in its kind's module and in the bag's meta
(``measurement``).

The default ``time_scale`` per robot keeps the round-trip overhead at about 1-2 % of the
shortest scaled duration while a default run takes well under a minute (:data:`DEFAULTS`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lrtrace.recorder import TraceRecorder
from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import Segment
from timelyllm_ros.errors import RobotError, TraceFormatError
from timelyllm_ros.language.profiles import RobotProfile, load_profile_name_or_file
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.robots.executor import SkillExecutor
from timelyllm_ros.robots.factory import RobotOptions, open_robot
from timelyllm_ros.robots.kind import RobotKind, kind_of, robot_kinds
from timelyllm_ros.robots.rig import Rig, Step, profile_calls

__all__ = ['BACKENDS', 'DEFAULTS', 'ProfileRun', 'Step', 'profile_calls', 'profile_robot']


def _real_backends() -> dict[str, str]:
    """The real-robot backends (each kind's vendor client, in name order) and the kind each
    drives."""
    return dict(sorted((kind.client, name) for name, kind in robot_kinds().items()
                       if 'real' in kind.backends))


REAL_BACKENDS = _real_backends()
"""The real-robot backends of the registered kinds and the kind each drives."""

BACKENDS = ('sim', 'emulator', *REAL_BACKENDS)
"""Backends of :func:`profile_robot` (with the registered kinds)."""

DEFAULTS: dict[tuple[str, str], dict[str, float]] = {
    ('sim', ''): {'grid': 13, 'repeats': 3, 'time_scale': 1.0},
    **{('emulator', name): {'grid': 6, 'repeats': 2, 'time_scale': 1.0,
                            **kind.profiling_defaults}
       for name, kind in robot_kinds().items() if 'emulator' in kind.backends},
    ('real', ''): {'grid': 6, 'repeats': 2, 'time_scale': 1.0},
}
"""Default grid points per numeric argument, runs per grid point and time scale (an
emulator's: its kind's ``profiling_defaults`` over the real-robot ones).

The emulator scales were chosen by measurement on loopback (2 cores): the Tello round trip
adds about 0.6 ms to a call (at 0.05: about 0.012 s in real-robot seconds, 1.5 % of the
shortest call, ``tc(1)`` at 0.8 s), the Indy7's about 5-7 ms (at 0.25: about 0.025 s, 4 % of
the shortest joint move, 2 % on average). A default run takes about 27 s (tello: 60 calls,
each at least djitellopy's 100 ms poll plus the 100 ms pause) and 19 s (indy7). Fewer grid
points or a smaller scale are faster; the fitted intercepts then move up by the overhead /
``time_scale``.
"""


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


# -- the run --------------------------------------------------------------------------------------
def _kind(profile: RobotProfile, backend: str) -> RobotKind | None:
    """The robot kind a backend drives (None: ``sim``, generic), checked against the profile.

    Raises:
        RobotError: unknown backend, no such backend for this robot, or no kind serves it.
    """
    if backend == 'sim':
        return None
    try:
        kind: RobotKind | None = kind_of(profile)
    except RobotError:
        kind = None                   # an unknown backend is named first
    real = _real_backends()           # with a kind the profile's driver just registered
    if backend not in ('emulator', *real):
        raise RobotError(f'unknown backend {backend!r}; one of '
                         f'{", ".join(("sim", "emulator", *real))}')
    if kind is None:
        kind = kind_of(profile)       # raises why no kind serves the profile
    if backend == 'emulator' and 'emulator' not in kind.backends:
        emulated = ', '.join(n for n, k in robot_kinds().items() if 'emulator' in k.backends)
        raise RobotError(f'no emulator for robot {profile.name!r} (emulators: {emulated})')
    if backend != 'emulator' and (kind.client != backend or 'real' not in kind.backends):
        raise RobotError(f'backend {backend!r} drives the {real[backend]} robot, not '
                         f'{profile.name!r}')
    return kind


def _settings(kind: RobotKind | None, backend: str) -> dict[str, float]:
    if kind is None:
        return DEFAULTS[('sim', '')]
    if backend == 'emulator':
        return {**DEFAULTS[('real', '')], **kind.profiling_defaults}
    return DEFAULTS[('real', '')]


def _validate(backend: str, grid: int, repeats: int, time_scale: float) -> None:
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
def _sim_rig(profile: RobotProfile, seed: int, jitter: float) -> Iterator[Rig]:
    clock = SimClock()
    robot = open_robot(profile, 'sim', None, clock, RobotOptions(seed=seed, jitter=jitter))
    try:
        yield Rig(robot.backend, clock, robot.description)
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
        backend: ``sim``, ``emulator``, or the robot kind's client for the real robot
            (``djitellopy``: a real Tello, ``indydcp3``: a real Indy7); see the module
            docstring.
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
    kind = _kind(profile, backend)
    settings = _settings(kind, backend)
    grid = int(settings['grid']) if grid is None else int(grid)
    repeats = int(settings['repeats']) if repeats is None else int(repeats)
    time_scale = float(settings['time_scale']) if time_scale is None else float(time_scale)
    _validate(backend, grid, repeats, time_scale)
    out = Path(out)
    if out.exists():
        raise TraceFormatError(f'{out} exists already, not overwriting')
    poses = dict(poses or {})
    emulated = backend == 'emulator'
    started = time.monotonic()
    rig_context: AbstractContextManager[Rig] = (
        _sim_rig(profile, seed, jitter) if kind is None
        else kind.profiling_rig(profile, emulated, time_scale, host, poses))
    with rig_context as rig:
        skipped: dict[str, str] = {}
        if kind is None:
            profiled = [skill.name for skill in profile.skills]
            steps = [Step(skill, text) for skill, text in profile_calls(profile, grid)]
        else:
            profiled, skipped = kind.profiling_plan(profile, rig.backend, emulated, poses)
            steps = kind.profiling_steps(profile, profiled, grid, poses)
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
          profiled: Sequence[str], skipped: Mapping[str, str], rig: Rig) -> dict[str, str]:
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


def _drive(profile: RobotProfile, rig: Rig, steps: Sequence[Step], recorder: TraceRecorder,
           run: ProfileRun, progress: Callable[[str], None] | None) -> None:
    """Execute the steps in order, recording every skill of the recorded ones."""
    executor = SkillExecutor(rig.backend, rig.clock)
    robot_id = f'{profile.name}-profile'
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
            rig.cleanup()
            raise RobotError(f'profiling {profile.name} stopped at call {index + 1} of '
                             f'{len(steps)} ({step.text}): {execution.error}; the bag keeps '
                             f'what was recorded before')
        rig.after(step)
        if progress is not None and step.record:
            duration = records[-1].end_time - records[-1].start_time if records else 0.0
            progress(f'{step.text}: {duration:.4f} s')
