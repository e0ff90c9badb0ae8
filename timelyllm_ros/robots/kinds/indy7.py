"""The Indy7 arm: :class:`~timelyllm_ros.robots.indy7.Indy7Backend` over IndyDCP3, on the arm's
controller or on :class:`~timelyllm_ros.robots.emulators.indy7.Indy7Emulator`.

Tasks of an arm are of TUF class ``arm`` whatever urgency their goal asks for (paper 000,
WID3: the arm's tasks form a class of their own).

Profiling (``lrtrace profile``, backends ``emulator`` and ``indydcp3``): joint 1 and the
tool's x move from the zero pose / base origin and back (the way back is performed, not
recorded), grip/release pairs, and on a real arm with taught poses the object skills.
:class:`~timelyllm_ros.robots.indy7.Indy7Backend` polls the motion state over gRPC; with the
emulator the rig polls every 2 ms (two RPCs of about 1 ms each per poll), so a motion is seen
done about 4-6 ms late. The gripper has no feedback: the backend waits ``gripper_wait_s``,
which the rig sets to the profile's grip/release time x ``time_scale`` on the emulator (the
emulator itself does not time the gripper). ``detect``/``check`` (answered from taught poses)
and, on the emulator, the object skills are skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from timelyllm_ros.core.clock import Clock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.robots.backend import RobotBackend
from timelyllm_ros.robots.factory import open_robot
from timelyllm_ros.robots.kind import (
    Robot,
    RobotKind,
    RobotOptions,
    connect_to_emulator,
    register_kind,
)
from timelyllm_ros.robots.rig import Rig, Step, call_text, skill_grid

if TYPE_CHECKING:
    from timelyllm_ros.robots.indy7 import Indy7Backend

LOCAL = {
    'detect': 'answered by Indy7Backend from its taught object poses (no camera, no arm '
              'motion): no robot time to measure',
    'check': 'answered by Indy7Backend from its taught object poses (no camera, no arm '
             'motion): no robot time to measure',
}
OBJECT_SKILLS = ('move_to', 'pick', 'place')
GRIPPER_SKILLS = ('grip', 'release')


class Indy7Kind(RobotKind):
    """The Neuromeka Indy7: emulator and real arm through IndyDCP3; tasks of class ``arm``."""

    name = 'indy7'
    category = 'arm'
    backends = ('emulator', 'real')
    client = 'indydcp3'
    profiling_defaults = {'grid': 6, 'repeats': 2, 'time_scale': 0.25}

    def task_class(self, urgency: str) -> str:
        return 'arm'

    def open(self, profile: RobotProfile, backend: str, address: str | None, clock: Clock,
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
            return Robot(arm, f'Indy7 at {arm.address} through IndyDCP3 (Indy7Backend); '
                              'hardware', address, _closers=[arm.close])
        from timelyllm_ros.robots.emulators.indy7 import Indy7Emulator

        try:
            emulator = Indy7Emulator(host=address or '127.0.0.1', profile=profile,
                                     time_scale=options.time_scale).start()
        except (OSError, ImportError, ValueError) as err:
            raise RobotError(f'cannot start the Indy7 emulator: {err}') from None
        arm = connect_to_emulator(
            lambda: Indy7Backend(profile, host=emulator.host, port=emulator.port,
                                 poses=options.poses,
                                 derive_unknown_poses=options.poses is None, **tuning),
            emulator.stop, 'indy7')
        description = (f'Indy7Emulator on {emulator.address} driven through IndyDCP3 by '
                       f'Indy7Backend; emulated timing = profile {profile.name} models x '
                       f'time_scale {options.time_scale:g}; not hardware')
        return Robot(arm, description, emulator.address, emulator,
                     {'emulator': 'Indy7Emulator'}, [arm.close, emulator.stop])

    # -- profiling -------------------------------------------------------------------------
    def profiling_rig(self, profile: RobotProfile, emulated: bool, time_scale: float,
                      host: str | None, poses: Mapping[str, Sequence[float]]
                      ) -> AbstractContextManager[Rig]:
        return _indy7_rig(profile, emulated, time_scale, host, poses)

    def profiling_skip(self, name: str, backend: RobotBackend, emulated: bool,
                       poses: Mapping[str, Sequence[float]]) -> str | None:
        unsupported = super().profiling_skip(name, backend, emulated, poses)
        if unsupported is not None:
            return unsupported
        if name in LOCAL:
            return LOCAL[name]
        if name in OBJECT_SKILLS and emulated:
            return ('the emulator performs it as a movel to a taught object pose, timed by '
                    "move_task's model of that displacement, not by this skill's sampled "
                    'model: nothing to compare; profile it on a real arm (--backend indydcp3 '
                    '--poses FILE)')
        if name in OBJECT_SKILLS and not poses:
            return 'needs taught object poses (--poses FILE)'
        return None

    def profiling_plan(self, profile: RobotProfile, backend: RobotBackend, emulated: bool,
                       poses: Mapping[str, Sequence[float]]
                       ) -> tuple[list[str], dict[str, str]]:
        profiled, skipped = super().profiling_plan(profile, backend, emulated, poses)
        if any(n in profiled for n in GRIPPER_SKILLS) \
                and not all(n in profiled for n in GRIPPER_SKILLS):
            for name in GRIPPER_SKILLS:
                if name in profiled:
                    profiled.remove(name)
                    skipped[name] = 'profiled only together with grip/release'
        return profiled, skipped

    def profiling_steps(self, profile: RobotProfile, profiled: Sequence[str], points: int,
                        poses: Mapping[str, Sequence[float]]) -> list[Step]:
        """One run: joint / task moves from the zero pose / base origin and back (the way
        back is not recorded), grip/release pairs, and object skills over the taught poses."""
        steps: list[Step] = []
        for name in ('move_joint', 'move_task'):
            if name not in profiled:
                continue
            skill = profile.skill(name)
            home = Step(name, call_text(skill, 0.0), record=False)
            steps.append(home)
            for value in skill_grid(skill, points) or []:
                steps += [Step(name, call_text(skill, value)), home]
        if all(name in profiled for name in GRIPPER_SKILLS):
            for _ in range(points):
                steps += [Step(name, call_text(profile.skill(name), None))
                          for name in GRIPPER_SKILLS]
        names = sorted(poses)
        if names and all(name in profiled for name in OBJECT_SKILLS):
            for i in range(points):
                here, there = names[i % len(names)], names[(i + 1) % len(names)]
                steps += [Step('move_to', f"{profile.skill('move_to').short}('{here}')"),
                          Step('pick', f"{profile.skill('pick').short}('{here}')"),
                          Step('place',
                               f"{profile.skill('place').short}('{here}', '{there}')")]
        return steps


class _Indy7Rig(Rig):
    """Indy7Backend; on the emulator the gripper wait follows the profile x time_scale."""

    def __init__(self, backend: Indy7Backend, clock: Clock, description: str,
                 meta: Mapping[str, str], gripper_s: Mapping[str, float] | None) -> None:
        super().__init__(backend, clock, description, meta)
        self.arm = backend
        self.gripper_s = dict(gripper_s or {})

    def before(self, step: Step) -> None:
        if step.skill in self.gripper_s:
            self.arm.gripper_wait_s = self.gripper_s[step.skill]


@contextmanager
def _indy7_rig(profile: RobotProfile, emulated: bool, time_scale: float, host: str | None,
               poses: Mapping[str, Sequence[float]]) -> Iterator[Rig]:
    from timelyllm_ros.robots.indy7 import Indy7Backend

    clock = WallClock()
    if emulated:
        gripper = {name: profile.skill(name).exec_time.mean_s({}) * time_scale
                   for name in GRIPPER_SKILLS if name in profile.skill_index}
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
    address = host if emulated else host or '127.0.0.1'
    robot = open_robot(profile, 'emulator' if emulated else 'real', address, clock, options)
    try:
        assert isinstance(robot.backend, Indy7Backend)
        meta = dict(robot.meta, measurement=measurement)
        yield _Indy7Rig(robot.backend, clock, robot.description + detail, meta, gripper)
    finally:
        robot.close()


KIND = register_kind(Indy7Kind())
