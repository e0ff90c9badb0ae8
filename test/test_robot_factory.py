"""The one robot factory: every backend by name, with the options profiling needs, and errors
that leave nothing running."""

from __future__ import annotations

import pytest

from timelyllm_ros.clock import SimClock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.profiles import load_profile
from timelyllm_ros.robots.factory import RobotOptions, open_robot
from timelyllm_ros.robots.sim_backend import SimulatedBackend


def test_sim_backend_is_seeded_and_closes_once() -> None:
    robot = open_robot(load_profile('tello'), 'sim', None, SimClock(),
                       RobotOptions(seed=3, jitter=0.1))
    assert isinstance(robot.backend, SimulatedBackend) and robot.backend.connected
    assert robot.emulator is None and 'jitter 0.1' in robot.description
    robot.close()
    robot.close()                                      # idempotent


def test_unknown_backends_and_kinds_without_a_vendor_backend_are_robot_errors() -> None:
    with pytest.raises(RobotError, match='unknown backend'):
        open_robot(load_profile('tello'), 'hardware', None, WallClock())
    with pytest.raises(RobotError, match="'chatbot' has no emulator backend"):
        open_robot(load_profile('chatbot'), 'emulator', None, WallClock())
    with pytest.raises(RobotError, match='needs the controller address'):
        open_robot(load_profile('indy7'), 'real', None, WallClock())


def test_emulated_tello_takes_the_profiling_options() -> None:
    pytest.importorskip('djitellopy', reason='djitellopy is not installed')
    options = RobotOptions(time_scale=0.05, endless_battery=True, own_loopback_host=True,
                           command_timeout_s=2.0)
    robot = open_robot(load_profile('tello'), 'emulator', None, WallClock(), options)
    try:
        emulator = robot.emulator
        assert emulator is not None and emulator.running            # type: ignore[attr-defined]
        assert emulator.time_scale == 0.05 and emulator.drain_per_s == 0.0  # type: ignore[attr-defined]
        assert robot.address.startswith('127.0.') and 'not hardware' in robot.description
        assert robot.backend.command_timeout_s == 2.0               # type: ignore[attr-defined]
    finally:
        robot.close()
    assert not emulator.running                                     # type: ignore[attr-defined]


def test_emulated_indy7_takes_the_profiling_options() -> None:
    pytest.importorskip('neuromeka', reason='neuromeka is not installed')
    options = RobotOptions(time_scale=0.05, poll_interval_s=0.002, motion_timeout_s=30.0,
                           gripper_wait_s=0.01, poses={'box': [0.4, 0.1, 0.2, 0, 180, 0]})
    robot = open_robot(load_profile('indy7'), 'emulator', None, WallClock(), options)
    try:
        arm = robot.backend
        assert (arm.poll_interval_s, arm.motion_timeout_s, arm.gripper_wait_s) == (  # type: ignore[attr-defined]
            0.002, 30.0, 0.01)
        assert arm.poses['box'] == [0.4, 0.1, 0.2, 0, 180, 0]       # type: ignore[attr-defined]
        assert robot.emulator is not None and 'Indy7Emulator' in robot.description
    finally:
        robot.close()
