"""The real djitellopy client, driven by TelloBackend, against the Tello emulator on loopback.

Every test gets its own loopback address (djitellopy routes replies by the sender's IP) and a
free control port; the state port is process-wide in djitellopy, so all tests share one.
Emulated durations are scaled down with ``time_scale``.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from utils import load_benchmark

from timelyllm_ros.core.clock import WallClock
from timelyllm_ros.core.request import Segment
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import SkillCall, Statement, segment_pieces, segment_text
from timelyllm_ros.language.traces import approx_tokenize
from timelyllm_ros.robots.emulators.tello import TelloEmulator, main
from timelyllm_ros.robots.executor import SegmentExecution, SkillExecutor

FAST = 0.01                    # 100x faster than a real drone
_hosts = itertools.count(20)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(('127.0.0.1', 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope='module')
def tello() -> RobotProfile:
    return load_profile('tello')


@pytest.fixture
def host() -> str:
    return f'127.0.0.{next(_hosts)}'


@pytest.fixture(scope='module')
def state_port() -> int:
    from timelyllm_ros.robots.tello import client_state_port

    return client_state_port() or free_udp_port()


@pytest.fixture
def emulator(host: str, state_port: int) -> Iterator[Callable[..., TelloEmulator]]:
    started: list[TelloEmulator] = []

    def make(**kwargs: object) -> TelloEmulator:
        kwargs.setdefault('time_scale', FAST)
        emu = TelloEmulator(host, 0, state_port, **kwargs).start()  # type: ignore[arg-type]
        started.append(emu)
        return emu

    yield make
    for emu in started:
        emu.stop()


@pytest.fixture
def backend(tello: RobotProfile, host: str, state_port: int) -> Iterator[Callable[..., object]]:
    pytest.importorskip('djitellopy')
    from timelyllm_ros.robots.tello import TelloBackend

    made: list[TelloBackend] = []

    def make(emu: TelloEmulator, **kwargs: object) -> TelloBackend:
        kwargs.setdefault('command_timeout_s', 1.0)
        kwargs.setdefault('motion_timeout_factor', 0.0)
        made.append(TelloBackend(tello, host, control_port=emu.port, state_port=state_port,
                                 **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for b in made:
        b.close()


def segments(profile: RobotProfile, plan: str) -> list[Segment]:
    """The plan cut as the scheduler cuts it while streaming (one segment per skill)."""
    out = []
    for index, (_, cut) in enumerate(segment_pieces(profile, approx_tokenize(plan))):
        if cut.statements:
            out.append(Segment(index, cut.text, cut.statements, 0.0, 0.0, 0.0, 0))
    return out


def run_plan(executor: SkillExecutor, profile: RobotProfile, plan: str) -> list[SegmentExecution]:
    results = []
    for seg in segments(profile, plan):
        results.append(executor.execute(seg))
        if not results[-1].success:
            break
    return results


def wait_for(predicate: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --- whole plans -------------------------------------------------------------------------------

def test_whole_plan_sends_the_expected_sdk_commands(tello, emulator, backend):
    emu = emulator()
    drone = backend(emu)
    executor = SkillExecutor(drone, WallClock())
    plan = 'to();mf(50);tc(90);mu(30)'
    results = run_plan(executor, tello, plan)
    assert len(results) == 4 and all(r.success for r in results), [r.error for r in results]
    assert [r.skills[0].call for r in results] == ['to()', 'mf(50)', 'tc(90)', 'mu(30)']
    assert emu.commands == ['command', 'takeoff', 'forward 50', 'cw 90', 'up 30']
    assert emu.in_air and emu.height == 130 and emu.yaw == 90
    # the state stream reaches djitellopy's process-wide state receiver
    assert wait_for(lambda: drone.state().get('h') == 130), drone.state()
    assert drone.state()['yaw'] == 90
    (landed,) = run_plan(executor, tello, 'ld()')
    assert landed.success
    assert emu.commands[-1] == 'land' and not emu.in_air and emu.height == 0
    assert 0 < emu.battery < 100                       # drained while flying
    assert wait_for(lambda: drone.state().get('h') == 0)
    assert abs(drone.state()['bat'] - emu.battery) <= 1
    for record in (s for r in results for s in r.skills):
        assert record.success and record.end_time >= record.start_time


def test_segment_text_plan_in_one_segment(tello, emulator, backend):
    emu = emulator()
    executor = SkillExecutor(backend(emu), WallClock())
    for index, cut in enumerate(segment_text(tello, 'to();mf(50);tc(90);mu(30);ld()')):
        result = executor.execute(Segment(index, cut.text, cut.statements, 0.0, 0.0, 0.0, 0))
        assert result.success, result.error
    assert emu.commands == ['command', 'takeoff', 'forward 50', 'cw 90', 'up 30', 'land']


def test_local_skills_and_loops_send_only_motions(tello, emulator, backend):
    emu = emulator()
    drone = backend(emu)
    executor = SkillExecutor(drone, WallClock())
    results = run_plan(executor, tello, "to();2{tu(45);md(20)};l('hello');tp();d(0.05);ld()")
    assert all(r.success for r in results), [r.error for r in results]
    assert emu.commands == ['command', 'takeoff', 'ccw 45', 'down 20', 'ccw 45', 'down 20',
                            'land']
    assert drone.pictures == 1
    delay = next(s for r in results for s in r.skills if s.skill == 'delay')
    assert delay.end_time - delay.start_time >= 0.05


# --- failures ----------------------------------------------------------------------------------

def test_error_reply_fails_the_segment_without_retrying_the_motion(tello, emulator, backend):
    emu = emulator(reply_error_for={'cw'})
    executor = SkillExecutor(backend(emu), WallClock())
    results = run_plan(executor, tello, 'to();mf(50);tc(90);mu(30);ld()')
    assert [r.success for r in results] == [True, True, False]
    failed = results[-1]
    assert failed.error.startswith('tc(90) failed:')
    assert "'cw 90'" in failed.error and "answered 'error'" in failed.error
    assert [(s.call, s.success) for s in failed.skills] == [('tc(90)', False)]
    assert emu.commands == ['command', 'takeoff', 'forward 50', 'cw 90']


def test_missing_reply_times_out(tello, emulator, backend):
    emu = emulator(drop_replies_for={'forward'})
    executor = SkillExecutor(backend(emu), WallClock())
    results = run_plan(executor, tello, 'to();mf(50);ld()')
    assert [r.success for r in results] == [True, False]
    assert 'mf(50)' in results[-1].error and 'no reply within 1 s' in results[-1].error
    assert emu.commands == ['command', 'takeoff', 'forward 50']


def test_handshake_retries_then_fails(tello, emulator, backend):
    from timelyllm_ros.robots.tello import TelloBackend

    emu = emulator(drop_replies_for={'command'})
    drone: TelloBackend = backend(emu, retry_count=2)       # type: ignore[assignment]
    with pytest.raises(RobotError, match='does not answer'):
        drone.connect()
    assert emu.commands == ['command', 'command'] and not drone.connected
    emu.drop_replies_for.clear()
    drone.connect()
    assert drone.connected


def test_out_of_range_argument_is_refused_before_sending(tello, emulator, backend):
    emu = emulator()
    drone = backend(emu)
    bad = SkillCall('move_forward', 'mf', {'distance': 600}, 'mf(600)')
    seg = Segment(0, 'mf(600)', (Statement('mf(600)', (bad,)),), 0.0, 0.0, 0.0, 0)
    result = SkillExecutor(drone, WallClock()).execute(seg)
    assert not result.success and result.skills == []
    assert 'mf(600): distance=600 above the maximum 500 cm' in result.error
    assert emu.commands == []                               # not even connected
    time.sleep(0.05)
    assert emu.commands == []


def test_move_before_takeoff_is_a_clear_error(tello, emulator, backend):
    emu = emulator()
    executor = SkillExecutor(backend(emu), WallClock())
    (result,) = run_plan(executor, tello, 'mf(50);ld()')
    assert not result.success
    assert "'error Motor stop'" in result.error and 'take off with to() first' in result.error
    assert emu.commands == ['command', 'forward 50']


def test_takeoff_while_flying_succeeds_without_a_command(tello, emulator, backend):
    """A plan that starts with to() given to a hovering drone: the goal of the call holds."""
    emu = emulator()
    executor = SkillExecutor(backend(emu), WallClock())
    results = run_plan(executor, tello, 'to();to();mf(50);ld()')
    assert all(result.success for result in results), [r.error for r in results]
    assert emu.commands == ['command', 'takeoff', 'forward 50', 'land']


def test_perception_answers_come_from_the_robot_options(tello):
    from timelyllm_ros.evaluation.plan_quality import cooperative_perception
    from timelyllm_ros.robots.factory import RobotOptions, open_robot

    robot = open_robot(tello, 'emulator', None, WallClock(), RobotOptions(
        time_scale=0.0, own_loopback_host=True, perception=cooperative_perception))
    try:
        executor = SkillExecutor(robot.backend, WallClock())
        results = run_plan(executor, tello, "to();?iv('cat')==True{g('cat')};ld()")
        assert all(result.success for result in results), [r.error for r in results]
        assert robot.emulator is not None and 'forward 100' in robot.emulator.commands
    finally:
        robot.close()


def test_emulator_stopped_mid_plan_fails_without_hanging(tello, emulator, backend):
    emu = emulator(time_scale=0.1)                          # to(): 0.5 s, mf(500): 0.54 s
    drone = backend(emu, command_timeout_s=1.0)
    executor = SkillExecutor(drone, WallClock())

    def kill_during_the_move() -> None:
        wait_for(lambda: 'forward 500' in emu.commands, 5.0)
        emu.stop()

    killer = threading.Thread(target=kill_during_the_move)
    killer.start()
    seg = segments(tello, 'mf(500)')[0]
    (takeoff,) = run_plan(executor, tello, 'to()')
    assert takeoff.success
    result = executor.execute(seg)
    killer.join(5.0)
    assert not result.success
    assert result.error.startswith('mf(500) failed:') and 'no reply' in result.error
    assert not emu.running
    # the dead drone keeps failing quickly, and closing does not hang
    again = executor.execute(segments(tello, 'ld()')[0])
    assert not again.success and 'no reply' in again.error
    drone.close()
    drone.close()


def test_djitellopy_receiver_survives_a_dead_emulator(tello, emulator, backend):
    from timelyllm_ros.robots.tello import _receiver_alive

    emu = emulator()
    executor = SkillExecutor(backend(emu), WallClock())
    assert run_plan(executor, tello, 'to()')[0].success
    assert _receiver_alive()


# --- hostile datagrams (issue 31, item 8) -------------------------------------------------------
# The drone and the hostile sender are both on 127.0.0.1: the hostile socket has the drone's IP
# and another port, which is what djitellopy used to route by.

@pytest.fixture
def local_drone(tello: RobotProfile, state_port: int
                ) -> Iterator[Callable[..., tuple[TelloEmulator, object]]]:
    """An emulator on 127.0.0.1 and a connected, flying backend driving it."""
    pytest.importorskip('djitellopy')
    from timelyllm_ros.robots.tello import TelloBackend

    opened: list[tuple[TelloEmulator, TelloBackend]] = []

    def make(time_scale: float = FAST, **kwargs: object) -> tuple[TelloEmulator, TelloBackend]:
        emu = TelloEmulator('127.0.0.1', 0, state_port, time_scale=time_scale).start()
        kwargs.setdefault('command_timeout_s', 1.0)
        kwargs.setdefault('motion_timeout_factor', 0.0)
        drone = TelloBackend(tello, '127.0.0.1', control_port=emu.port, state_port=state_port,
                             **kwargs)  # type: ignore[arg-type]
        opened.append((emu, drone))
        drone.connect()
        assert run_plan(SkillExecutor(drone, WallClock()), tello, 'to()')[0].success
        assert wait_for(lambda: drone.state().get('h') == 100), drone.state()
        return emu, drone

    yield make
    for emu, drone in opened:
        drone.close()
        emu.stop()


def _hostile(data: bytes, port: int) -> None:
    """Send one datagram to a local port from a socket of the drone's IP and another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(('127.0.0.1', 0))
        sock.sendto(data, ('127.0.0.1', port))


def _reply_port() -> int:
    """The port the backend's commands leave from (and replies come back to)."""
    import sys

    return int(sys.modules['djitellopy.tello'].client_socket.getsockname()[1])


def test_a_non_ascii_state_datagram_does_not_freeze_the_state(tello, state_port, local_drone):
    _, drone = local_drone()
    _hostile(b'\xff\xfeh:999;bat:\x80\r\n', state_port)
    executor = SkillExecutor(drone, WallClock())
    assert run_plan(executor, tello, 'mu(50)')[0].success
    # djitellopy's state thread died on the decode error: h stayed 100 for good.
    assert wait_for(lambda: drone.state().get('h') == 150), drone.state()
    assert drone.dropped().get('state datagram not ASCII', 0) >= 1


def test_garbage_state_lines_are_dropped_not_taken_as_state(tello, state_port, local_drone):
    emu, drone = local_drone()
    for garbage in (b'h:999;bat:1;', b'pitch:0;roll:0;yaw:0;vgx:0;vg', b'ok', b'h:abc;' * 30,
                    b'x' * 5000, b''):
        _hostile(garbage, state_port)
    assert wait_for(lambda: drone.dropped().get('state datagram not a state line', 0) >= 5,
                    5.0), drone.dropped()
    executor = SkillExecutor(drone, WallClock())
    assert run_plan(executor, tello, 'mu(30)')[0].success
    assert wait_for(lambda: drone.state().get('h') == emu.height == 130), drone.state()


def test_a_spoofed_ok_from_another_port_does_not_end_a_motion(tello, local_drone):
    # mu(50) takes 2.6 s at the model's pace: 1.3 s here, many djitellopy polls (0.1 s).
    emu, drone = local_drone(time_scale=0.5, motion_timeout_factor=2.0)
    executor = SkillExecutor(drone, WallClock())
    outcome: dict[str, object] = {}

    def climb() -> None:
        (result,) = run_plan(executor, tello, 'mu(50)')
        outcome.update(success=result.success, error=result.error,
                       height_when_done=emu.height, replies_when_done=emu.replies)

    climber = threading.Thread(target=climb)
    climber.start()
    assert wait_for(lambda: 'up 50' in emu.commands, 5.0)
    _hostile(b'ok', _reply_port())
    climber.join(10.0)
    # The spoofed ok used to end the motion as a success while the drone was still climbing.
    assert outcome['success'], outcome['error']
    assert outcome['height_when_done'] == 150
    assert ('up 50', 'ok') in outcome['replies_when_done']     # type: ignore[operator]
    assert drone.dropped().get('reply from another port', 0) >= 1


def test_a_silent_state_stream_is_not_reported_as_the_current_state(tello, local_drone):
    emu, drone = local_drone(state_timeout_s=0.5)
    assert drone.state().get('h') == 100 and drone.state_problem() == ''
    emu.stop()                                               # no more state lines
    assert wait_for(lambda: drone.state() == {}, 5.0), drone.state()
    assert 'no state line from 127.0.0.1' in drone.state_problem()


def test_a_dead_state_receiver_is_restarted_after_the_next_motion(tello, local_drone):
    from timelyllm_ros.robots import tello as tello_backend

    _, drone = local_drone()
    receiver = tello_backend.receivers().state
    receiver.sock.close()                   # what a failing socket does to its thread
    assert wait_for(lambda: not receiver.alive, 5.0)
    assert 'state receiver' in drone.state_problem()
    assert drone.state() == {}
    executor = SkillExecutor(drone, WallClock())
    assert run_plan(executor, tello, 'mu(20)')[0].success
    assert receiver.alive
    assert wait_for(lambda: drone.state().get('h') == 120), drone.state()


def test_a_state_receiver_that_cannot_restart_fails_the_motion(tello, state_port, local_drone):
    from timelyllm_ros.robots import tello as tello_backend

    _, drone = local_drone()
    receiver = tello_backend.receivers().state
    receiver.sock.close()
    assert wait_for(lambda: not receiver.alive, 5.0)
    executor = SkillExecutor(drone, WallClock())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.bind(('', state_port))                      # the port is taken meanwhile
        (result,) = run_plan(executor, tello, 'mu(20)')
    assert not result.success
    assert result.error.startswith('mu(20)') and 'state receiver' in result.error, result.error
    assert 'cannot be restarted' in result.error
    assert run_plan(executor, tello, 'md(20)')[0].success  # the port is free again
    assert wait_for(lambda: drone.state().get('h') == 100), drone.state()


def test_the_hostile_datagram_campaign_counts_nothing(state_port):

    pytest.importorskip('djitellopy')
    campaign = load_benchmark('hostile_datagrams')
    assert campaign.run_hostile_datagrams_campaign(seed=3, cases=6, state_port=state_port) == {
        'cases': 6, 'tello_frozen_state': 0, 'tello_spoofed_success': 0, 'tello_crashes': 0}


# --- perception ----------------------------------------------------------------------------------

def test_perception_skill_without_perception_is_refused(tello, emulator, backend):
    emu = emulator()
    drone = backend(emu)
    assert not drone.supports('is_visible') and drone.supports('move_forward')
    seg = segments(tello, "?iv('cat')==True{g('cat')}")[0]
    result = SkillExecutor(drone, WallClock()).execute(seg)
    assert not result.success and result.skills == []
    assert "skill 'is_visible'" in result.error and 'not supported' in result.error
    assert emu.commands == []


def test_perception_callable_answers_and_goto_flies_forward(tello, emulator, backend):
    emu = emulator()
    answers = {'is_visible': True, 'goto': 120.4}
    drone = backend(emu, perception=lambda call: answers[call.skill])
    executor = SkillExecutor(drone, WallClock())
    results = run_plan(executor, tello, "to();?iv('cat')==True{g('cat')};ld()")
    assert all(r.success for r in results), [r.error for r in results]
    assert emu.commands == ['command', 'takeoff', 'forward 120', 'land']
    goto = next(s for r in results for s in r.skills if s.skill == 'goto')
    assert goto.result == 120
    answers['is_visible'] = False
    results = run_plan(executor, tello, "to();?iv('cat')==True{g('cat')}")
    assert all(r.success for r in results)
    assert emu.commands[-1] == 'takeoff'


# --- connection rules ----------------------------------------------------------------------------

def test_one_open_backend_per_host_and_reconnect(tello, emulator, backend):
    emu = emulator()
    first, second = backend(emu), backend(emu)
    first.connect()
    with pytest.raises(RobotError, match='another TelloBackend'):
        second.connect()
    first.close()
    second.connect()
    assert second.connected and emu.commands == ['command', 'command']


def test_unreachable_drone_connect_fails_fast(tello, backend, host):
    from timelyllm_ros.robots.tello import TelloBackend

    class _Nowhere:
        port = free_udp_port()

    drone: TelloBackend = backend(_Nowhere, retry_count=1)  # type: ignore[assignment]
    with pytest.raises(RobotError, match='does not answer'):
        drone.connect()


# --- the emulator on its own (raw UDP, no djitellopy) --------------------------------------------

class _Raw:
    def __init__(self, emu: TelloEmulator) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(('127.0.0.1', 0))
        self.sock.settimeout(2.0)
        self.emu = emu

    def ask(self, command: str) -> str:
        self.sock.sendto(command.encode(), self.emu.address)
        return self.sock.recvfrom(1024)[0].decode()


def test_emulator_protocol(emulator):
    emu = emulator()
    raw = _Raw(emu)
    try:
        assert raw.ask('takeoff').startswith('error')          # not in SDK mode yet
        assert raw.ask('command') == 'ok'
        assert raw.ask('battery?').isdigit() and raw.ask('height?') == '0'
        assert raw.ask('forward 50') == 'error Motor stop'
        assert raw.ask('land').startswith('error')
        assert raw.ask('takeoff') == 'ok' and raw.ask('height?') == '100'
        for bad in ('forward 10', 'forward 501', 'cw 0', 'cw 361', 'up x', 'up', 'jump 3',
                    'speed 200', ''):
            reply = raw.ask(bad) if bad else raw.ask(' ')
            assert reply.startswith('error') and 'ok' not in reply.lower(), (bad, reply)
        assert raw.ask('down 150').startswith('error')          # below the ground
        assert raw.ask('up 20') == 'ok' and raw.ask('down 40') == 'ok'
        assert raw.ask('height?') == '80'
        assert raw.ask('ccw 270') == 'ok' and emu.yaw == 90
        assert raw.ask('go 50 0 20 50') == 'ok' and emu.height == 100
        assert raw.ask('time?').isdigit() and raw.ask('sdk?') == '20'
        assert raw.ask('land') == 'ok' and not emu.in_air
    finally:
        raw.sock.close()
    assert emu.commands[:2] == ['takeoff', 'command']


def test_emulator_motion_takes_the_model_time(emulator, tello):
    emu = emulator(time_scale=0.05)
    raw = _Raw(emu)
    try:
        raw.ask('command')
        # Lower bounds only: a motion never answers before its model time, whatever the load.
        began = time.monotonic()
        assert raw.ask('takeoff') == 'ok'
        assert time.monotonic() - began >= 5.0 * 0.05 * 0.99
        began = time.monotonic()
        assert raw.ask('forward 500') == 'ok'
        expected = tello.skill('mf').exec_time.mean_s({'distance': 500}) * 0.05
        assert time.monotonic() - began >= expected * 0.99
    finally:
        raw.sock.close()


def test_emulator_state_stream(host):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(('127.0.0.1', 0))
        listener.settimeout(2.0)
        port = listener.getsockname()[1]
        with TelloEmulator(host, 0, port, time_scale=FAST, battery=80) as emu:
            listener.sendto(b'command', emu.address)         # the state goes to this host
            assert listener.recvfrom(1024)[0] == b'ok'
            lines = []
            while len(lines) < 3:                                # ~10 Hz; 2 s recv timeout
                data, sender = listener.recvfrom(1024)
                assert sender[0] == host
                lines.append(data.decode('ascii'))
    fields = dict(f.split(':') for f in lines[-1].strip().rstrip(';').split(';'))
    assert lines[-1].endswith(';\r\n')
    assert {'pitch', 'roll', 'yaw', 'vgx', 'h', 'bat', 'baro', 'time', 'agz'} <= set(fields)
    assert fields['h'] == '0' and 0 < int(fields['bat']) <= 80


def test_emulator_stop_is_idempotent_and_releases_the_port(host, state_port):
    emu = TelloEmulator(host, 0, state_port).start()
    port = emu.port
    emu.stop()
    emu.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as again:
        again.bind((host, port))


def test_emulator_cli_rejects_a_busy_port(host, capsys):
    with TelloEmulator(host, 0, free_udp_port()) as emu:
        assert main(['--host', host, '--port', str(emu.port)]) == 1
    assert 'cannot listen' in capsys.readouterr().err


_OPEN_AND_HOLD = """
import sys
from timelyllm_ros.core.clock import WallClock
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.robots.factory import open_robot
robot = open_robot(load_profile('tello'), 'emulator', None, WallClock())
print('ok', flush=True)
sys.stdin.read()
robot.close()
"""


def test_two_controller_processes_each_open_an_emulated_drone():
    # Each controller node is its own process with its own djitellopy state receiver: the
    # second one must not need the state port the first one holds (it used to: 8890).
    import subprocess
    import sys

    pytest.importorskip('djitellopy')
    procs = []
    try:
        for _ in range(2):
            proc = subprocess.Popen([sys.executable, '-c', _OPEN_AND_HOLD],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            procs.append(proc)
            line = proc.stdout.readline().strip()                 # type: ignore[union-attr]
            assert line == 'ok', proc.stderr.read()               # type: ignore[union-attr]
    finally:
        for proc in procs:
            proc.communicate('', timeout=30)
    assert [p.returncode for p in procs] == [0, 0]
