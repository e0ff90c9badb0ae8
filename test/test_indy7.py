"""Indy7 backend on the real IndyDCP3 client against the loopback IndyDCP3 emulator."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip('neuromeka')
pytest.importorskip('grpc')

from timelyllm_ros.errors import RobotError  # noqa: E402
from timelyllm_ros.language.profiles import RobotProfile, load_profile  # noqa: E402
from timelyllm_ros.language.segmenter import SkillCall, segment_text  # noqa: E402
from timelyllm_ros.robots.emulators.indy7 import (  # noqa: E402
    CODE_JOINT_LIMIT,
    HOME_Q,
    Indy7Emulator,
)
from timelyllm_ros.robots.indy7 import SERVICES, Indy7Backend, resolve_ports  # noqa: E402

SCALE = 0.05
RED = [400.0, 150.0, 200.0, 0.0, 180.0, 0.0]
BLUE = [420.0, -150.0, 260.0, 0.0, 180.0, 0.0]
POSES = {'red_box': RED, 'blue_box': BLUE}
PLAN = "move_to('red_box');pick('red_box');move_to('blue_box');place('red_box','blue_box')"
HOME_MJ = 'mj(0,0,-90,0,-90,0)'


@pytest.fixture(scope='module')
def profile() -> RobotProfile:
    return load_profile('indy7')


@pytest.fixture
def emulator(profile: RobotProfile) -> Iterator[Indy7Emulator]:
    with Indy7Emulator(profile=profile, time_scale=SCALE) as emu:
        yield emu


def _backend(profile: RobotProfile, port: int, **kwargs: object) -> Indy7Backend:
    options: dict[str, object] = {'poses': POSES, 'gripper_wait_s': 0.01,
                                  'motion_timeout_s': 5.0, 'rpc_timeout_s': 1.0}
    options.update(kwargs)
    return Indy7Backend(profile, port=port, **options)  # type: ignore[arg-type]


@pytest.fixture
def backend(profile: RobotProfile, emulator: Indy7Emulator) -> Iterator[Indy7Backend]:
    with _backend(profile, emulator.port) as robot:
        assert isinstance(robot, Indy7Backend)
        yield robot


def _calls(profile: RobotProfile, text: str) -> list[SkillCall]:
    return [call for cut in segment_text(profile, text) for call in cut.calls]


def _call(profile: RobotProfile, skill: str, **args: int | float | str) -> SkillCall:
    short = profile.skill(skill).short
    return SkillCall(skill=skill, short=short, args=dict(args),
                     text=f'{short}({",".join(map(repr, args.values()))})')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return int(sock.getsockname()[1])


def test_pick_and_place_plan_through_indydcp3(profile: RobotProfile, emulator: Indy7Emulator,
                                              backend: Indy7Backend) -> None:
    calls = _calls(profile, PLAN)
    assert [c.skill for c in calls] == ['move_to', 'pick', 'move_to', 'place']
    for call in calls:
        backend.check(call)
        assert backend.perform(call) is None
        assert not emulator.in_motion          # perform blocks until the motion is done

    log = emulator.commands
    assert [e['command'] for e in log] == ['movel', 'movel', 'set_do', 'movel', 'movel',
                                           'set_do']
    motions = [e for e in log if e['command'] == 'movel']
    assert [e['target'] for e in motions] == [RED, RED, BLUE, BLUE]
    assert all(e['accepted'] for e in motions)
    assert [e['motion_id'] for e in motions] == [1, 2, 3, 4]
    # The first motion from the home pose lasts the move_task model's mean, time-scaled.
    model = profile.skill('move_task').exec_time
    first = model.mean_s({'x': RED[0] - 350.0, 'y': RED[1] + 186.5, 'z': RED[2] - 522.0})
    assert motions[0]['duration_s'] == pytest.approx(first * SCALE)
    assert [e['signals'] for e in log if e['command'] == 'set_do'] == [[(0, 1)], [(0, 0)]]

    assert emulator.p == pytest.approx(BLUE)
    assert emulator.digital_outputs == {0: False}
    status = backend.status()
    assert status['op_state'] == 'OP_IDLE'
    assert status['p'] == pytest.approx(BLUE)
    assert status['q'] == pytest.approx(list(HOME_Q))
    assert status['is_target_reached'] is True and status['is_in_motion'] is False
    assert status['do'] == {0: False}
    assert status['motion_id'] == 4


def test_joint_task_gripper_and_perception_skills(profile: RobotProfile,
                                                  emulator: Indy7Emulator,
                                                  backend: Indy7Backend) -> None:
    calls = _calls(profile, "mj(170,10,-90,0,-90,-170);mt(300,-200,400,0,180,45);grip();"
                            "check('red_box');detect('cup');release()")
    results = [backend.perform(call) for call in calls]
    assert results == [None, None, None, True, False, None]
    assert emulator.q == pytest.approx([170, 10, -90, 0, -90, -170])
    assert emulator.p == pytest.approx([300, -200, 400, 0, 180, 45])
    joint = emulator.commands[0]
    assert joint['command'] == 'movej' and joint['accepted']
    mean = profile.skill('move_joint').exec_time.mean_s({'j1': 170.0})
    assert joint['duration_s'] == pytest.approx(mean * SCALE)
    assert [e['signals'] for e in emulator.commands if e['command'] == 'set_do'] == [
        [(0, 1)], [(0, 0)]]


def test_unknown_object_is_refused_before_sending(profile: RobotProfile,
                                                   emulator: Indy7Emulator,
                                                   backend: Indy7Backend) -> None:
    for text in ("move_to('green_box')", "pick('green_box')", "place('red_box','shelf')"):
        (call,) = _calls(profile, text)
        with pytest.raises(RobotError, match='unknown object .*(green_box|shelf)'):
            backend.perform(call)
    assert emulator.commands == []


def test_joint_limits_checked_by_backend_and_emulator(profile: RobotProfile,
                                                      emulator: Indy7Emulator,
                                                      backend: Indy7Backend) -> None:
    ok = _call(profile, 'move_joint', j1=170.0, j2=0.0, j3=-90.0, j4=0.0, j5=-90.0, j6=0.0)
    backend.check(ok)
    backend.perform(ok)
    too_far = _call(profile, 'move_joint', j1=200.0, j2=0.0, j3=-90.0, j4=0.0, j5=-90.0,
                    j6=0.0)
    with pytest.raises(RobotError, match=r'j1=200.0 above the maximum 175 deg'):
        backend.check(too_far)
    with pytest.raises(RobotError, match='above the maximum'):
        backend.perform(too_far)
    assert len(emulator.commands) == 1          # nothing sent for the refused call

    class Unchecked(Indy7Backend):
        def check(self, call: SkillCall) -> None:
            """Skip the profile limits so that the controller has to refuse."""

    with Unchecked(profile, port=emulator.port, rpc_timeout_s=1.0) as raw:
        with pytest.raises(RobotError, match=rf'movej refused by the robot \(code '
                                             rf'{CODE_JOINT_LIMIT}\): .*joint 1 target 200 '
                                             r'deg is outside the joint limit'):
            raw.perform(too_far)
    refused = emulator.commands[-1]
    assert refused['accepted'] is False and 'joint limit' in refused['error']
    assert emulator.q == pytest.approx([170, 0, -90, 0, -90, 0])


def test_stalled_motion_times_out(profile: RobotProfile, emulator: Indy7Emulator) -> None:
    emulator.stall_motion()
    (call,) = _calls(profile, 'mj(90,0,-90,0,-90,0)')
    with _backend(profile, emulator.port, motion_timeout_s=0.4) as robot:
        with pytest.raises(RobotError, match=r'mj\(90,0,-90,0,-90,0\): motion timeout'):
            robot.perform(call)
    assert emulator.commands[-1]['command'] == 'stop_motion'
    assert emulator.commands[-1]['was_moving'] is True
    assert not emulator.in_motion


def test_motion_fault_reports_violation_then_recovers(profile: RobotProfile,
                                                      emulator: Indy7Emulator,
                                                      backend: Indy7Backend) -> None:
    emulator.fail_next_motion('collision detected on joint 2')
    (call,) = _calls(profile, "move_to('red_box')")
    with pytest.raises(RobotError, match='OP_VIOLATE: collision detected on joint 2'):
        backend.perform(call)
    assert backend.status()['op_state'] == 'OP_VIOLATE'
    with pytest.raises(RobotError, match='refused by the robot .*recover first'):
        backend.perform(call)
    backend.recover()
    backend.perform(call)
    assert emulator.p == pytest.approx(RED)


def test_emulator_killed_mid_motion_fails_fast(profile: RobotProfile) -> None:
    emulator = Indy7Emulator(profile=profile, time_scale=1.0).start()   # mj(170) lasts 1.7 s
    (call,) = _calls(profile, 'mj(170,0,-90,0,-90,0)')
    try:
        with _backend(profile, emulator.port) as robot:
            killer = threading.Timer(0.3, emulator.stop)
            killer.start()
            # The gRPC status proves the call failed on the dead server, not at motion end.
            with pytest.raises(RobotError, match=r'mj\(170,0,-90,0,-90,0\): IndyDCP3 '
                                                 r'get_\w+ failed: (UNAVAILABLE|CANCELLED)'):
                robot.perform(call)
            killer.join()
            with pytest.raises(RobotError, match='status: IndyDCP3'):
                robot.status()
    finally:
        emulator.stop()


def test_dead_port_and_disconnected_use(profile: RobotProfile) -> None:
    port = _free_port()
    robot = _backend(profile, port, rpc_timeout_s=0.5)
    with pytest.raises(RobotError, match=rf'cannot reach IndyDCP3 at 127.0.0.1:{port}'):
        robot.connect()
    (call,) = _calls(profile, 'grip()')
    with pytest.raises(RobotError, match='not connected'):
        robot.perform(call)
    with pytest.raises(RobotError, match='not connected'):
        robot.status()
    robot.close()
    robot.close()


def test_silent_server_hits_the_rpc_deadline(profile: RobotProfile) -> None:
    with socket.socket() as silent:          # accepts TCP, never speaks HTTP/2
        silent.bind(('127.0.0.1', 0))
        silent.listen(1)
        robot = _backend(profile, silent.getsockname()[1], rpc_timeout_s=0.4)
        with pytest.raises(RobotError, match='get_control_data failed: DEADLINE_EXCEEDED'):
            robot.connect()


def test_ports_and_arguments() -> None:
    defaults = resolve_ports(None)
    assert defaults['control'] == 20001 and defaults['rtde'] == 20004
    assert resolve_ports(None, index=1)['device'] == 30002
    assert set(resolve_ports(5000).values()) == {5000}
    mixed = resolve_ports({'rtde': 5004})
    assert mixed['rtde'] == 5004 and mixed['control'] == 20001
    assert set(mixed) == set(SERVICES)
    with pytest.raises(ValueError, match='unknown IndyDCP3 service'):
        resolve_ports({'nope': 1})
    profile = load_profile('indy7')
    with pytest.raises(ValueError, match='6 finite numbers'):
        Indy7Backend(profile, poses={'cup': [1, 2, 3]})
    with pytest.raises(ValueError, match='index'):
        Indy7Backend(profile, index=2)
    assert all(Indy7Backend(profile).supports(s.name) for s in profile.skills)


def test_emulator_command_line(profile: RobotProfile) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    proc = subprocess.Popen(
        [sys.executable, '-m', 'timelyllm_ros.robots.emulators.indy7', '--time-scale', '0.01'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert 'serving IndyDCP3 on 127.0.0.1:' in line, proc.stderr.read() if proc.stderr else ''
        port = int(line.rsplit(':', 1)[1])
        with _backend(profile, port) as robot:
            for call in _calls(profile, HOME_MJ + ';grip()'):
                robot.perform(call)
            assert robot.status()['do'] == {0: True}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
