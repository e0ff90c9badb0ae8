"""An IndyDCP3 gRPC server emulating a Neuromeka Indy7 on loopback, for tests without an arm.

:class:`Indy7Emulator` registers subclasses of the generated servicers of the ``neuromeka``
package (``Control``, ``RTDataExchange`` and ``Device``) on one ``grpc.server``, so that the
unmodified ``neuromeka.IndyDCP3`` client talks to it through real gRPC. Every service listens
on the same port; point the client at it with
``Indy7Backend(profile, port=emulator.port)`` (the real controller uses one port per service).

Implemented RPCs (everything else answers ``UNIMPLEMENTED``):

* ``Control``: ``MoveJ``, ``MoveL`` (absolute or relative targets), ``StopMotion``,
  ``Recover``.
* ``RTDataExchange``: ``GetControlData`` (op state, ``q``, ``p``), ``GetMotionData``
  (in motion / target reached / progress / motion id), ``GetViolationData``, ``GetIOData``.
* ``Device``: ``SetDO``, ``GetDO``.

A motion lasts the indy7 profile's mean execution time times ``time_scale``: ``move_joint``'s
model on the largest joint displacement for ``MoveJ``, ``move_task``'s model on the largest
x/y/z displacement for ``MoveL``. Positions are interpolated while moving and reach the target
at the end; there is no kinematics (a joint move leaves ``p`` alone and a task move ``q``).
Joint targets beyond +-175 degrees, motions while another one runs and motions in a violation
state are refused with a non-zero ``Response.code`` and a message -- which is what
``IndyDCP3.movej`` returns to its caller; the codes are this emulator's own (see ``CODE_*``).

Fault injection: :meth:`Indy7Emulator.fail_next_motion` (the next motion stops half way in
``OP_VIOLATE`` with a violation message), :meth:`Indy7Emulator.stall_motion` (the next or
current motion never reports done) and :meth:`Indy7Emulator.stop` (kill the server, even
mid-motion). Every command received is logged in :attr:`Indy7Emulator.commands`.

Run ``python -m timelyllm_ros.robots.emulators.indy7 --port 20001`` for a standalone server.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.profiles import RobotProfile, load_profile_name_or_file

JOINT_LIMIT_DEG = 175.0
"""Indy7 datasheet joint range, +- degrees."""

HOME_Q = (0.0, 0.0, -90.0, 0.0, -90.0, 0.0)
"""Initial joint angles (the profile's home pose)."""

HOME_P = (350.0, -186.5, 522.0, 0.0, 180.0, 0.0)
"""Initial task pose (mm, degrees); not derived from ``HOME_Q`` (no kinematics)."""

CODE_OK = 0
CODE_INVALID = 1        # malformed target
CODE_BUSY = 2           # another motion is running
CODE_VIOLATION = 3      # the robot is in a violation state; Recover first
CODE_JOINT_LIMIT = 4    # a joint target beyond the joint limit

_ABSOLUTE, _RELATIVE = 0, 1  # JointBaseType / TaskBaseType

# common_msgs.OpState, common_msgs.TrajState and device_msgs.DigitalState values
_OP_VIOLATE, _OP_IDLE, _OP_MOVING = 2, 5, 6
_TRAJ_NONE, _TRAJ_ACC, _TRAJ_CRUISE, _TRAJ_DEC = 0, 4, 5, 6
_TRAJ_CANCELLING, _TRAJ_FINISHED, _TRAJ_ERROR = 7, 8, 9
_ON_STATE = 1


@functools.cache
def _pb() -> SimpleNamespace:
    """The neuromeka protobuf and gRPC modules, imported on first use.

    The emulator module itself imports without ``neuromeka`` and ``grpc`` (the core's
    layering rule); only :meth:`Indy7Emulator.start` needs them.
    """
    import grpc
    from neuromeka.proto import (
        common_msgs_pb2,
        control_pb2_grpc,
        device_msgs_pb2,
        device_pb2_grpc,
        rtde_msgs_pb2,
        rtde_pb2_grpc,
    )

    return SimpleNamespace(grpc=grpc, common=common_msgs_pb2, control_grpc=control_pb2_grpc,
                           device=device_msgs_pb2, device_grpc=device_pb2_grpc,
                           rtde=rtde_msgs_pb2, rtde_grpc=rtde_pb2_grpc)


def _ok() -> Any:
    return _pb().common.Response(code=CODE_OK, msg='')


@dataclass
class _Motion:
    """One motion in progress."""

    kind: str                  # 'joint' or 'task'
    start: list[float]
    target: list[float]
    t0: float
    duration_s: float
    stall: bool = False
    fail: str | None = None

    def fraction(self, now: float) -> float:
        if self.duration_s <= 0:
            return 1.0
        return min(1.0, max(0.0, (now - self.t0) / self.duration_s))

    def position(self, fraction: float) -> list[float]:
        return [a + (b - a) * fraction for a, b in zip(self.start, self.target, strict=True)]


class _State:
    """The emulated controller, shared by the servicers (all access under ``lock``)."""

    def __init__(self, profile: RobotProfile, time_scale: float) -> None:
        self.profile = profile
        self.time_scale = time_scale
        self.lock = threading.Lock()
        self.q = list(HOME_Q)
        self.p = list(HOME_P)
        self.do: dict[int, int] = {}
        self.motion: _Motion | None = None
        self.motion_id = 0
        self.target_reached = True
        self.traj_state = _TRAJ_NONE
        self.violation = ''
        self.violation_code = 0
        self.pending_fail: str | None = None
        self.pending_stall = False
        self.commands: list[dict[str, Any]] = []
        self.started = time.monotonic()

    # -- motion --------------------------------------------------------------------------

    def update(self, now: float) -> None:
        """Advance the motion in progress to ``now`` (lock held)."""
        motion = self.motion
        if motion is None:
            return
        fraction = motion.fraction(now)
        if motion.stall:
            fraction = min(fraction, 0.5)
        if motion.fail is not None and fraction >= 0.5:
            self._set_position(motion, motion.position(0.5))
            self.motion = None
            self.target_reached = False
            self.traj_state = _TRAJ_ERROR
            self.violation = motion.fail
            self.violation_code = 1
            return
        self._set_position(motion, motion.position(fraction))
        if fraction >= 1.0 and not motion.stall:
            self.motion = None
            self.target_reached = True
            self.traj_state = _TRAJ_FINISHED

    def _set_position(self, motion: _Motion, position: list[float]) -> None:
        if motion.kind == 'joint':
            self.q = position
        else:
            self.p = position

    def op_state(self) -> int:
        if self.violation:
            return _OP_VIOLATE
        if self.motion is not None:
            return _OP_MOVING
        return _OP_IDLE

    def start_motion(self, command: str, kind: str, target: Sequence[float], base_type: int,
                     ) -> Any:
        """Validate and start a joint or task motion; log it either way."""
        now = time.monotonic()
        with self.lock:
            self.update(now)
            entry: dict[str, Any] = {'command': command, 'target': list(target),
                                     'base_type': base_type, 'time': now - self.started}
            self.commands.append(entry)
            code, msg = CODE_OK, ''
            current = self.q if kind == 'joint' else self.p
            absolute = list(target)
            if len(target) != 6:
                code, msg = CODE_INVALID, f'{command}: expected 6 target values, got {len(target)}'
            elif base_type not in (_ABSOLUTE, _RELATIVE):
                code, msg = CODE_INVALID, f'{command}: unsupported base type {base_type}'
            elif self.violation:
                code, msg = CODE_VIOLATION, (f'{command}: robot is in violation '
                                             f'({self.violation}); recover first')
            elif self.motion is not None:
                code, msg = CODE_BUSY, f'{command}: robot is moving (motion {self.motion_id})'
            else:
                if base_type == _RELATIVE:
                    absolute = [c + t for c, t in zip(current, target, strict=True)]
                if kind == 'joint':
                    for i, value in enumerate(absolute, start=1):
                        if abs(value) > JOINT_LIMIT_DEG:
                            code, msg = CODE_JOINT_LIMIT, (
                                f'{command}: joint {i} target {value:g} deg is outside the '
                                f'joint limit +-{JOINT_LIMIT_DEG:g} deg')
                            break
            if code != CODE_OK:
                entry.update(accepted=False, error=msg)
                return _pb().common.Response(code=code, msg=msg)
            duration = self.duration_s(kind, current, absolute)
            self.motion = _Motion(kind, list(current), absolute, now, duration,
                                  stall=self.pending_stall, fail=self.pending_fail)
            self.pending_stall = False
            self.pending_fail = None
            self.motion_id += 1
            self.target_reached = False
            self.traj_state = _TRAJ_ACC
            entry.update(accepted=True, error='', target=absolute, duration_s=duration,
                         motion_id=self.motion_id)
            return _ok()

    def duration_s(self, kind: str, current: Sequence[float], target: Sequence[float]) -> float:
        """Profile mean time for the displacement, times ``time_scale``."""
        delta = [t - c for c, t in zip(current, target, strict=True)]
        if kind == 'joint':
            model = self.profile.skill('move_joint').exec_time
            args: dict[str, object] = {f'j{i}': d for i, d in enumerate(delta, start=1)}
        else:
            model = self.profile.skill('move_task').exec_time
            args = dict(zip(('x', 'y', 'z'), delta[:3], strict=True))
        return model.mean_s(args) * self.time_scale

    def log(self, command: str, **fields: Any) -> None:
        self.commands.append({'command': command, 'time': time.monotonic() - self.started,
                              **fields})


class _Control:
    """The ``Control`` service: motion commands (mixed into ``ControlServicer``)."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def MoveJ(self, request: Any, context: Any) -> Any:  # noqa: N802 -- gRPC method name
        return self._state.start_motion('movej', 'joint', list(request.target.j_target),
                                        int(request.target.base_type))

    def MoveL(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self._state.start_motion('movel', 'task', list(request.target.t_target),
                                        int(request.target.base_type))

    def StopMotion(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            state.update(time.monotonic())
            state.log('stop_motion', category=int(request.category),
                      was_moving=state.motion is not None)
            if state.motion is not None:
                state.motion = None
                state.target_reached = False
                state.traj_state = _TRAJ_CANCELLING
        return _ok()

    def Recover(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            state.log('recover', violation=state.violation)
            state.violation = ''
            state.violation_code = 0
            state.traj_state = _TRAJ_NONE
        return _ok()


class _RTDE:
    """The ``RTDataExchange`` service: robot state (mixed into its servicer)."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def GetControlData(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            now = time.monotonic()
            state.update(now)
            elapsed = int(now - state.started)
            return _pb().rtde.ControlData(
                running_hours=elapsed // 3600, running_mins=elapsed // 60 % 60,
                running_secs=elapsed % 60, op_state=state.op_state(), sim_mode=True,
                is_robot_connected=True, q=state.q, qdot=[0.0] * 6, p=state.p,
                pdot=[0.0] * 6, ref_frame=[0.0] * 6, tool_frame=[0.0] * 6,
                response=_ok())

    def GetMotionData(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            now = time.monotonic()
            state.update(now)
            motion = state.motion
            if motion is not None:
                fraction = motion.fraction(now)
                progress = int(100 * (min(fraction, 0.5) if motion.stall else fraction))
                traj = (_TRAJ_ACC if fraction < 0.3 else
                        _TRAJ_CRUISE if fraction < 0.7 or motion.stall else
                        _TRAJ_DEC)
                remain = max(abs(t - c) for t, c in zip(
                    motion.target, state.q if motion.kind == 'joint' else state.p, strict=True))
            else:
                progress = 100 if state.target_reached else 0
                traj = state.traj_state
                remain = 0.0
            return _pb().rtde.MotionData(
                traj_state=traj, traj_progress=progress, is_in_motion=motion is not None,
                is_target_reached=motion is None and state.target_reached,
                is_pausing=False, is_stopping=False, has_motion=motion is not None,
                speed_ratio=100, motion_id=state.motion_id, remain_distance=remain,
                motion_queue_size=0, cur_traj_progress=progress,
                response=_ok())

    def GetViolationData(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            state.update(time.monotonic())
            return _pb().rtde.ViolationData(
                violation_code=state.violation_code, violation_str=state.violation,
                response=_ok())

    def GetIOData(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            return _pb().rtde.IOData(
                do=_signals(state.do), response=_ok())


class _Device:
    """The ``Device`` service: digital outputs (mixed into ``DeviceServicer``)."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def SetDO(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            signals = [(int(s.address), int(s.state)) for s in request.signals]
            for address, value in signals:
                state.do[address] = value
            state.log('set_do', signals=signals)
        return _ok()

    def GetDO(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        with state.lock:
            return _pb().device.DigitalList(signals=_signals(state.do))


def _signals(outputs: dict[int, int]) -> list[Any]:
    return [_pb().device.DigitalSignal(address=a, state=s) for a, s in sorted(outputs.items())]


@functools.cache
def _servicer_classes() -> tuple[type, type, type]:
    """The servicers: this module's methods over the generated ``*Servicer`` classes, whose
    other methods answer ``UNIMPLEMENTED`` (built on first use, see :func:`_pb`)."""
    pb = _pb()
    return (type('ControlEmulator', (_Control, pb.control_grpc.ControlServicer), {}),
            type('RTDataExchangeEmulator', (_RTDE, pb.rtde_grpc.RTDataExchangeServicer), {}),
            type('DeviceEmulator', (_Device, pb.device_grpc.DeviceServicer), {}))


class Indy7Emulator:
    """An emulated Indy7 controller serving IndyDCP3's gRPC services on one port.

    Args:
        host: Address to bind (loopback by default).
        port: Port to bind; 0 picks a free one (see :attr:`port` after :meth:`start`).
        profile: The indy7 profile whose execution-time models time the motions
            (default: the bundled ``indy7``).
        time_scale: Multiplies every motion's duration (0.05 makes tests fast; 0 is instant).
        max_workers: gRPC server threads.
    """

    def __init__(self, host: str = '127.0.0.1', port: int = 0,
                 profile: RobotProfile | str | Path | None = None, time_scale: float = 1.0,
                 max_workers: int = 8) -> None:
        if time_scale < 0:
            raise ValueError(f'time_scale must be >= 0, got {time_scale}')
        if not 0 <= port < 65536:
            raise ValueError(f'port {port} is outside 0..65535')
        if not isinstance(profile, RobotProfile):
            profile = load_profile_name_or_file(profile if profile is not None else 'indy7')
        self.host = host
        self.profile = profile
        self._requested_port = port
        self._max_workers = max_workers
        self._state = _State(profile, time_scale)
        self._server: Any = None
        self._port = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Indy7Emulator:
        """Bind and start serving (idempotent).

        Raises:
            OSError: the address could not be bound.
            ImportError: ``neuromeka`` or ``grpc`` is not installed.
        """
        if self._server is not None:
            return self
        pb = _pb()
        control, rtde, device = _servicer_classes()
        server = pb.grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                           thread_name_prefix='indy7-emulator'))
        pb.control_grpc.add_ControlServicer_to_server(control(self._state), server)
        pb.rtde_grpc.add_RTDataExchangeServicer_to_server(rtde(self._state), server)
        pb.device_grpc.add_DeviceServicer_to_server(device(self._state), server)
        try:
            port = server.add_insecure_port(f'{self.host}:{self._requested_port}')
        except RuntimeError as err:
            raise OSError(f'cannot bind {self.host}:{self._requested_port}: {err}') from None
        if port == 0:
            raise OSError(f'cannot bind {self.host}:{self._requested_port}')
        server.start()
        self._server = server
        self._port = port
        return self

    def stop(self, grace_s: float | None = 0.0) -> None:
        """Stop serving at once (in-flight calls are cancelled), even mid-motion."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait(5.0)

    @property
    def running(self) -> bool:
        """Whether the server is serving."""
        return self._server is not None

    @property
    def port(self) -> int:
        """The bound port (0 before :meth:`start`)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` to give a client."""
        return f'{self.host}:{self._port}'

    def __enter__(self) -> Indy7Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- fault injection -------------------------------------------------------------------

    def fail_next_motion(self, reason: str = 'collision detected') -> None:
        """Make the next accepted motion stop half way in ``OP_VIOLATE`` with ``reason``."""
        with self._state.lock:
            self._state.pending_fail = reason

    def stall_motion(self) -> None:
        """Make the current motion, or the next one if none runs, never report done.

        ``StopMotion`` still ends it.
        """
        state = self._state
        with state.lock:
            state.update(time.monotonic())
            if state.motion is not None:
                state.motion.stall = True
            else:
                state.pending_stall = True

    # -- inspection ------------------------------------------------------------------------

    @property
    def commands(self) -> list[dict[str, Any]]:
        """Every command received, in order (copies): ``command`` is ``movej``, ``movel``,
        ``set_do``, ``stop_motion`` or ``recover``; motions carry ``target`` (absolute),
        ``accepted``, ``error`` and ``duration_s``; ``set_do`` carries ``signals``."""
        with self._state.lock:
            return [dict(entry) for entry in self._state.commands]

    @property
    def q(self) -> list[float]:
        """Current joint angles in degrees."""
        with self._state.lock:
            self._state.update(time.monotonic())
            return list(self._state.q)

    @property
    def p(self) -> list[float]:
        """Current task pose ``[x, y, z, rx, ry, rz]`` (mm, degrees)."""
        with self._state.lock:
            self._state.update(time.monotonic())
            return list(self._state.p)

    @property
    def digital_outputs(self) -> dict[int, bool]:
        """Digital output states by address (True: on)."""
        with self._state.lock:
            return {a: s == _ON_STATE for a, s in self._state.do.items()}

    @property
    def in_motion(self) -> bool:
        """Whether a motion is in progress."""
        with self._state.lock:
            self._state.update(time.monotonic())
            return self._state.motion is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Serve an emulated Indy7 until interrupted.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog='python -m timelyllm_ros.robots.emulators.indy7',
        description='Emulated Indy7 IndyDCP3 gRPC server (all services on one port).')
    parser.add_argument('--host', default='127.0.0.1', help='address to bind')
    parser.add_argument('--port', type=int, default=0, help='port to bind (0: a free one)')
    parser.add_argument('--time-scale', type=float, default=1.0,
                        help='multiplies every motion duration')
    parser.add_argument('--profile', default='indy7', help='profile name or YAML path')
    args = parser.parse_args(argv)
    try:
        emulator = Indy7Emulator(args.host, args.port, args.profile, args.time_scale).start()
    except (OSError, ValueError, ProfileError) as err:
        print(f'indy7 emulator: {err}', file=sys.stderr)
        return 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f'indy7 emulator serving IndyDCP3 on {emulator.address}', flush=True)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()
    return 0


if __name__ == '__main__':
    sys.exit(main())
