"""The one robot factory: every backend by name, with the options profiling needs, and errors
that leave nothing running."""

from __future__ import annotations

import pytest

from timelyllm_ros.core.clock import SimClock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.robots.factory import RobotOptions, open_robot
from timelyllm_ros.robots.sim_backend import SimulatedBackend

TELLO_OPTIONS = RobotOptions(time_scale=0.05, endless_battery=True, own_loopback_host=True,
                             command_timeout_s=2.0)


def test_sim_backend_is_seeded_and_closes_once() -> None:
    robot = open_robot(load_profile('tello'), 'sim', None, SimClock(),
                       RobotOptions(seed=3, jitter=0.1))
    assert isinstance(robot.backend, SimulatedBackend) and robot.backend.connected
    assert robot.emulator is None and robot.meta == {} and 'jitter 0.1' in robot.description
    robot.close()
    robot.close()                                      # idempotent


def test_unknown_backends_and_kinds_without_a_vendor_backend_are_robot_errors() -> None:
    with pytest.raises(RobotError, match='unknown backend'):
        open_robot(load_profile('tello'), 'hardware', None, WallClock())
    with pytest.raises(RobotError, match="'chatbot' has no emulator backend"):
        open_robot(load_profile('chatbot'), 'emulator', None, WallClock())
    with pytest.raises(RobotError, match='needs the controller address'):
        open_robot(load_profile('indy7'), 'real', None, WallClock())


@pytest.mark.parametrize(('options', 'problem'), [
    (RobotOptions(time_scale=-1.0), 'time_scale must be'),
    (RobotOptions(time_scale=float('nan')), 'time_scale must be'),
    (RobotOptions(jitter=-0.1), 'jitter must be'),
    (RobotOptions(command_timeout_s=0.0), 'command_timeout_s must be'),
    (RobotOptions(poll_interval_s=float('inf')), 'poll_interval_s must be'),
    (RobotOptions(gripper_wait_s=-1.0), 'gripper_wait_s must be'),
])
def test_invalid_options_are_robot_errors_before_anything_starts(
        options: RobotOptions, problem: str) -> None:
    for kind, backend in (('tello', 'sim'), ('tello', 'emulator'), ('indy7', 'emulator')):
        with pytest.raises(RobotError, match=problem):
            open_robot(load_profile(kind), backend, None, WallClock(), options)


def test_emulated_tello_takes_the_profiling_options() -> None:
    pytest.importorskip('djitellopy', reason='djitellopy is not installed')
    from timelyllm_ros.robots.emulators.tello import TelloEmulator
    from timelyllm_ros.robots.tello import TelloBackend

    robot = open_robot(load_profile('tello'), 'emulator', None, WallClock(), TELLO_OPTIONS)
    try:
        emulator = robot.emulator
        assert isinstance(emulator, TelloEmulator) and emulator.running
        assert emulator.time_scale == 0.05 and emulator.drain_per_s == 0.0
        assert emulator.idle_drain_per_s == 0.0
        assert robot.address.startswith('127.0.') and 'not hardware' in robot.description
        assert robot.meta == {'emulator': 'TelloEmulator'}
        assert isinstance(robot.backend, TelloBackend)
        assert robot.backend.command_timeout_s == 2.0
    finally:
        robot.close()
    assert not emulator.running
    robot.close()                                      # idempotent


def test_emulated_tello_defaults_keep_the_controller_behaviour() -> None:
    pytest.importorskip('djitellopy', reason='djitellopy is not installed')
    from timelyllm_ros.robots.emulators.tello import TelloEmulator
    from timelyllm_ros.robots.tello import TelloBackend

    robot = open_robot(load_profile('tello'), 'emulator', None, WallClock())
    try:
        assert isinstance(robot.emulator, TelloEmulator)
        assert robot.emulator.time_scale == 1.0 and robot.emulator.drain_per_s > 0
        assert robot.address == '127.0.0.1'
        assert isinstance(robot.backend, TelloBackend)
        assert robot.backend.command_timeout_s == 7.0   # TelloBackend's own default
    finally:
        robot.close()


def test_an_emulator_whose_robot_does_not_connect_is_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip('djitellopy', reason='djitellopy is not installed')
    from timelyllm_ros.robots.emulators.tello import TelloEmulator
    from timelyllm_ros.robots.tello import TelloBackend

    started: list[TelloEmulator] = []
    real_start = TelloEmulator.start

    def start(self: TelloEmulator) -> TelloEmulator:
        started.append(self)
        return real_start(self)

    def refuse(self: TelloBackend) -> None:
        raise RobotError('tello: no answer')

    monkeypatch.setattr(TelloEmulator, 'start', start)
    monkeypatch.setattr(TelloBackend, 'connect', refuse)
    with pytest.raises(RobotError, match='no answer'):
        open_robot(load_profile('tello'), 'emulator', None, WallClock(), TELLO_OPTIONS)
    assert len(started) == 1 and not started[0].running


def test_emulated_indy7_takes_the_profiling_options() -> None:
    pytest.importorskip('neuromeka', reason='neuromeka is not installed')
    options = RobotOptions(time_scale=0.05, poll_interval_s=0.002, motion_timeout_s=30.0,
                           gripper_wait_s=0.01, poses={'box': [0.4, 0.1, 0.2, 0, 180, 0]})
    from timelyllm_ros.robots.emulators.indy7 import Indy7Emulator
    from timelyllm_ros.robots.indy7 import Indy7Backend

    robot = open_robot(load_profile('indy7'), 'emulator', None, WallClock(), options)
    try:
        arm = robot.backend
        assert isinstance(arm, Indy7Backend)
        assert (arm.poll_interval_s, arm.motion_timeout_s, arm.gripper_wait_s) == (
            0.002, 30.0, 0.01)
        assert arm.poses['box'] == [0.4, 0.1, 0.2, 0, 180, 0]
        assert not arm.derive_unknown_poses            # poses given: only those
        emulator = robot.emulator
        assert isinstance(emulator, Indy7Emulator) and emulator.running
        assert 'Indy7Emulator' in robot.description and 'time_scale 0.05' in robot.description
        assert robot.meta == {'emulator': 'Indy7Emulator'}
    finally:
        robot.close()
    assert not emulator.running


def test_bad_arm_poses_are_robot_errors_and_stop_the_emulator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip('neuromeka', reason='neuromeka is not installed')
    from timelyllm_ros.robots.emulators.indy7 import Indy7Emulator

    started: list[Indy7Emulator] = []
    real_start = Indy7Emulator.start

    def start(self: Indy7Emulator) -> Indy7Emulator:
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(Indy7Emulator, 'start', start)
    with pytest.raises(RobotError, match="indy7: pose 'box'"):
        open_robot(load_profile('indy7'), 'emulator', None, WallClock(),
                   RobotOptions(poses={'box': [0.0, 1.0]}))
    assert len(started) == 1 and not started[0].running
