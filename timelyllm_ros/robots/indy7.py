"""Neuromeka Indy7 backend: perform indy7-profile skill calls through the real IndyDCP3 client.

The backend drives an Indy7 (or :class:`timelyllm_ros.robots.emulators.indy7.Indy7Emulator`)
with ``neuromeka.IndyDCP3``, the vendor's gRPC client, imported only in :meth:`connect`.

Skill mapping (canonical names of ``robot_profiles/indy7.yaml``):

* ``move_joint`` ``mj(j1..j6)`` -- ``movej`` to absolute joint angles in degrees, then wait
  until the controller reports the motion done.
* ``move_task`` ``mt(x, y, z, rx, ry, rz)`` -- ``movel`` to a base-frame pose (mm, degrees),
  then wait.
* ``move_to(object)`` -- ``movel`` to ``poses[object]``. Perception is out of scope: objects
  are *known named poses* given to the constructor (taught once, e.g. with the teach pendant);
  an unknown object is a :class:`~timelyllm_ros.errors.RobotError` naming it.
* ``pick(object)`` -- ``move_to(object)``, close the gripper (digital output
  ``gripper_do_index`` on) and wait ``gripper_wait_s``.
* ``place(object, where)`` -- ``move_to(where)``, open the gripper (output off), wait.
* ``grip()`` / ``release()`` -- gripper digital output on / off, then wait.
* ``detect(object)`` / ``check(object)`` -- ``True`` when the object has a known pose (there
  is no camera in this backend).

Client quirks handled here:

* ``IndyDCP3(robot_ip, index)`` hard-codes its gRPC ports (control 20001, device 20002,
  config 20003, rtde 20004, boot 20010, cri 20181, teleop 20400; ``index=1`` adds 10000). To
  reach a server elsewhere (the emulator serves every service on one free loopback port) the
  backend replaces the channels and stubs of *its own client instance* after construction
  (:func:`_rewire`); the class and module constants are never touched.
* None of the client's calls passes a gRPC deadline, so a dead or hung controller would block
  forever. The backend wraps each stub of its instance in a proxy adding
  ``timeout=rpc_timeout_s`` to every call; a failed call becomes a ``RobotError`` naming the
  skill call and the gRPC status.
* The client's ``wait_motion_done`` has no fault detection and can return before a just-sent
  motion started (``is_target_reached`` is still true from the previous one). The backend
  polls ``get_motion_data``/``get_control_data`` itself: a motion is done once it was seen
  (``is_in_motion``/``has_motion`` or a new ``motion_id``) or ``start_grace_s`` passed, and
  the target is reached with no motion left; a violation/collision state fails the call;
  ``motion_timeout_s`` bounds the wait (``'motion timeout'``, after a best-effort
  ``stop_motion``).
* Command replies are ``Response{code, msg}`` dicts; a non-zero ``code`` is a refusal.
"""

from __future__ import annotations

import functools
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.robots.backend import RobotBackend

DEFAULT_ROBOT_IP = '127.0.0.1'
"""IndyDCP3's own default: a script running on the Indy7's STEP controller. From another
machine pass the STEP's LAN address (shown in the Conty app / teach pendant settings)."""

SERVICES = ('boot', 'control', 'device', 'config', 'rtde', 'cri', 'teleop')
"""The IndyDCP3 client's gRPC services (attribute names of its stubs and ``*_channel``)."""

_STUB_CLASSES = {
    'boot': 'BootStub', 'control': 'ControlStub', 'device': 'DeviceStub',
    'config': 'ConfigStub', 'rtde': 'RTDataExchangeStub', 'cri': 'CRIStub',
    'teleop': 'TeleOpStub',
}
_PORT_CONSTANTS = {
    'boot': 'BOOT_SOCKET_PORT', 'control': 'CONTROL_SOCKET_PORT',
    'device': 'DEVICE_SOCKET_PORT', 'config': 'CONFIG_SOCKET_PORT',
    'rtde': 'RTDE_SOCKET_PORT', 'cri': 'CRI_SOCKET_PORT', 'teleop': 'TELEOP_SOCKET_PORT',
}

# common_msgs.OpState values that mean the controller stopped the motion on a fault.
_FAULT_STATES = {0: 'OP_SYSTEM_OFF', 2: 'OP_VIOLATE', 3: 'OP_RECOVER_HARD',
                 4: 'OP_RECOVER_SOFT', 8: 'OP_COLLISION', 9: 'OP_STOP_AND_OFF',
                 15: 'OP_POWER_OFF', 16: 'OP_MANUAL_RECOVER'}
_TRAJ_ERROR = 9  # common_msgs.TrajState.TRAJ_ERROR

_SKILLS = ('move_joint', 'move_task', 'move_to', 'pick', 'place', 'grip', 'release', 'detect',
           'check')


class _DeadlineStub:
    """Proxy of a generated gRPC stub that passes ``timeout=`` to every call."""

    def __init__(self, stub: object, timeout_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not callable(method):
            return method
        return functools.partial(method, timeout=self._timeout_s)


def derived_pose(name: str) -> list[float]:
    """A reachable task pose ``[x, y, z, rx, ry, rz]`` derived from an object's name."""
    code = zlib.crc32(name.encode())
    return [300.0 + code % 300, -300.0 + (code >> 9) % 600, 150.0 + (code >> 19) % 200,
            180.0, 0.0, 180.0]


def resolve_ports(port: int | Mapping[str, int] | None, index: int = 0) -> dict[str, int]:
    """The port of every IndyDCP3 service.

    Args:
        port: ``None`` for the client's defaults, one port for every service (the emulator's
            layout), or a mapping overriding some services (keys from :data:`SERVICES`).
        index: The client's port set (0: 2000x, 1: 3000x) for services not overridden.

    Raises:
        ValueError: an unknown service name or a port outside 1..65535.
    """
    from neuromeka import indydcp3

    ports = {name: getattr(indydcp3, const)[index] for name, const in _PORT_CONSTANTS.items()}
    if port is None:
        return ports
    overrides = dict.fromkeys(SERVICES, port) if isinstance(port, int) else dict(port)
    for name, value in overrides.items():
        if name not in ports:
            raise ValueError(f'unknown IndyDCP3 service {name!r}; one of {", ".join(SERVICES)}')
        if not 0 < int(value) < 65536:
            raise ValueError(f'{name}: port {value} is outside 1..65535')
        ports[name] = int(value)
    return ports


def _rewire(client: Any, host: str, ports: Mapping[str, int], default: Mapping[str, int],
            rpc_timeout_s: float) -> None:
    """Point one IndyDCP3 instance's channels at ``ports`` and add deadlines to its stubs.

    Only this instance changes: a channel whose port differs from the client's default is
    closed and replaced (channels connect lazily, so the default ones never dialled), then
    every stub attribute is wrapped in :class:`_DeadlineStub`.
    """
    import grpc
    from neuromeka import indydcp3

    for name in SERVICES:
        stub_class = getattr(indydcp3, _STUB_CLASSES[name])
        channel_attr = f'{name}_channel'
        if ports[name] != default[name]:
            old = getattr(client, channel_attr, None)
            if old is not None:
                old.close()
            channel = grpc.insecure_channel(f'{host}:{ports[name]}')
            setattr(client, channel_attr, channel)
            setattr(client, name, stub_class(channel))
        setattr(client, name, _DeadlineStub(getattr(client, name), rpc_timeout_s))


def _close_channels(client: Any) -> None:
    for name in SERVICES:
        channel = getattr(client, f'{name}_channel', None)
        if channel is not None:
            try:
                channel.close()
            except Exception:  # noqa: BLE001 -- close never raises
                pass
            setattr(client, f'{name}_channel', None)


class Indy7Backend(RobotBackend):
    """An Indy7 arm driven through ``neuromeka.IndyDCP3`` (see the module docstring).

    Args:
        profile: The indy7 robot profile (argument limits, skill names).
        host: The controller's address; ``127.0.0.1`` (the client's own default) suits an
            emulator or a script on the STEP controller -- pass the STEP's LAN address
            (:data:`DEFAULT_ROBOT_IP` documents it) for a real arm.
        port: ``None`` for IndyDCP3's fixed ports, an int to reach every service on one port
            (the emulator), or a mapping ``{service: port}`` (keys from :data:`SERVICES`).
        motion_timeout_s: Longest wait for one motion to finish.
        poses: Known object poses ``[x, y, z, rx, ry, rz]`` (mm, degrees) for ``move_to``,
            ``pick``, ``place``, ``detect`` and ``check``.
        gripper_do_index: The digital output that closes the gripper when on.
        index: IndyDCP3's port set (0 or 1) for services ``port`` does not override.
        rpc_timeout_s: gRPC deadline of every single call.
        gripper_wait_s: Wait after switching the gripper output (the gripper has no feedback).
        poll_interval_s: Motion-state polling period.
        start_grace_s: How long a just-sent motion may stay invisible in the motion data.
        derive_unknown_poses: Give an object with no taught pose a reachable pose derived from
            its name (emulated cells, where there is no camera); off for real arms.
    """

    def __init__(self, profile: RobotProfile, host: str = '127.0.0.1',
                 port: int | Mapping[str, int] | None = None, motion_timeout_s: float = 30.0,
                 poses: Mapping[str, Sequence[float]] | None = None, gripper_do_index: int = 0,
                 *, index: int = 0, rpc_timeout_s: float = 2.0, gripper_wait_s: float = 0.5,
                 poll_interval_s: float = 0.02, start_grace_s: float = 0.3,
                 derive_unknown_poses: bool = False) -> None:
        if index not in (0, 1):
            raise ValueError('index must be 0 or 1')
        for name, value in (('motion_timeout_s', motion_timeout_s),
                            ('rpc_timeout_s', rpc_timeout_s),
                            ('poll_interval_s', poll_interval_s)):
            if not value > 0:
                raise ValueError(f'{name} must be > 0, got {value}')
        if gripper_wait_s < 0 or start_grace_s < 0:
            raise ValueError('gripper_wait_s and start_grace_s must be >= 0')
        if gripper_do_index < 0:
            raise ValueError('gripper_do_index must be >= 0')
        self.poses: dict[str, list[float]] = {}
        for name, pose in (poses or {}).items():
            values = [float(v) for v in pose]
            if len(values) != 6 or not all(math.isfinite(v) for v in values):
                raise ValueError(f'pose {name!r} must be 6 finite numbers '
                                 f'[x, y, z, rx, ry, rz], got {list(pose)!r}')
            self.poses[name] = values
        self.derive_unknown_poses = derive_unknown_poses
        self.profile = profile
        self.host = host
        self.port = port
        self.index = index
        self.motion_timeout_s = motion_timeout_s
        self.gripper_do_index = gripper_do_index
        self.rpc_timeout_s = rpc_timeout_s
        self.gripper_wait_s = gripper_wait_s
        self.poll_interval_s = poll_interval_s
        self.start_grace_s = start_grace_s
        self._client: Any = None

    # -- connection ------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The connected ``IndyDCP3`` instance (RobotError when not connected)."""
        if self._client is None:
            raise RobotError(f'{self.profile.name}: not connected (call connect())')
        return self._client

    @property
    def address(self) -> str:
        """``host:port`` of the control service, for messages."""
        try:
            return f'{self.host}:{resolve_ports(self.port, self.index)["control"]}'
        except ImportError:
            return self.host

    def connect(self) -> None:
        """Create the client on the configured ports and probe the controller.

        Raises:
            RobotError: neuromeka missing, bad ports, or the controller did not answer within
                ``rpc_timeout_s``.
        """
        if self._client is not None:
            return
        try:
            from neuromeka import IndyDCP3
        except ImportError as err:
            raise RobotError(f'{self.profile.name}: the neuromeka package is not installed '
                             f'(pip install neuromeka): {err}') from None
        try:
            ports = resolve_ports(self.port, self.index)
        except ValueError as err:
            raise RobotError(f'{self.profile.name}: {err}') from None
        client = IndyDCP3(robot_ip=self.host, index=self.index)
        _rewire(client, self.host, ports, resolve_ports(None, self.index), self.rpc_timeout_s)
        try:
            self._rpc('connect', client.get_control_data)
        except RobotError as err:
            _close_channels(client)
            raise RobotError(f'{self.profile.name}: cannot reach IndyDCP3 at '
                             f'{self.host}:{ports["rtde"]} (rtde service): {err}') from None
        self._client = client

    def close(self) -> None:
        """Close the client's channels (idempotent, never raises)."""
        client, self._client = self._client, None
        if client is not None:
            _close_channels(client)

    # -- skills ----------------------------------------------------------------------------

    def supports(self, skill: str) -> bool:
        """Whether the skill is one of the Indy7 skills this backend maps to IndyDCP3."""
        return skill in _SKILLS and skill in self.profile.skill_index

    def perform(self, call: SkillCall) -> object:
        """Perform one call, blocking until the arm finished it.

        Returns:
            ``True``/``False`` for ``detect``/``check``, ``None`` for actions.

        Raises:
            RobotError: invalid call, unknown object, refusal, fault, timeout or lost link.
        """
        self.check(call)
        handler: Callable[[SkillCall], object] = getattr(self, f'_do_{call.skill}')
        if self._client is None:
            raise RobotError(f'{call.text}: {self.profile.name} backend is not connected')
        return handler(call)

    def _do_move_joint(self, call: SkillCall) -> None:
        target = [float(call.args[f'j{i}']) for i in range(1, 7)]
        self._move(call, 'movej', target)

    def _do_move_task(self, call: SkillCall) -> None:
        keys = ('x', 'y', 'z', 'rx', 'ry', 'rz')
        target = [float(call.args[k]) for k in keys]
        self._move(call, 'movel', target)

    def _pose(self, call: SkillCall, name: object) -> list[float]:
        pose = self.poses.get(str(name))
        if pose is None and self.derive_unknown_poses:
            pose = self.poses[str(name)] = derived_pose(str(name))
        if pose is None:
            known = ', '.join(sorted(self.poses)) or 'none'
            raise RobotError(f'{call.text}: unknown object {str(name)!r} (no taught pose; '
                             f'known objects: {known})')
        return pose

    def _do_move_to(self, call: SkillCall) -> None:
        self._move(call, 'movel', self._pose(call, call.args['object']))

    def _do_pick(self, call: SkillCall) -> None:
        pose = self._pose(call, call.args['object'])
        self._move(call, 'movel', pose)
        self._gripper(call, True)

    def _do_place(self, call: SkillCall) -> None:
        pose = self._pose(call, call.args['where'])
        self._move(call, 'movel', pose)
        self._gripper(call, False)

    def _do_grip(self, call: SkillCall) -> None:
        self._gripper(call, True)

    def _do_release(self, call: SkillCall) -> None:
        self._gripper(call, False)

    def _knows(self, name: object) -> bool:
        return self.derive_unknown_poses or str(name) in self.poses

    def _do_detect(self, call: SkillCall) -> bool:
        return self._knows(call.args['object'])

    def _do_check(self, call: SkillCall) -> bool:
        return self._knows(call.args['object'])

    # -- client calls ----------------------------------------------------------------------

    def _rpc(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call one client method; gRPC failures become RobotError naming ``what``."""
        import grpc

        try:
            return method(*args, **kwargs)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, 'code') else None
            details = err.details() if hasattr(err, 'details') else str(err)
            name = getattr(code, 'name', 'UNKNOWN')
            raise RobotError(f'{what}: IndyDCP3 {method.__name__} failed: {name}: '
                             f'{details}') from None

    def _command(self, call: SkillCall, method: str, *args: Any, **kwargs: Any
                 ) -> dict[str, Any]:
        """Send one command and raise when its ``Response`` carries a non-zero code."""
        reply = self._rpc(call.text, getattr(self.client, method), *args, **kwargs)
        if isinstance(reply, dict):
            if reply.get('error'):  # the client refuses some calls itself
                raise RobotError(f'{call.text}: {method} refused: {reply["error"]}')
            code = int(reply.get('code', 0) or 0)
            if code != 0:
                raise RobotError(f'{call.text}: {method} refused by the robot (code {code}): '
                                 f'{reply.get("msg", "")}')
        return reply if isinstance(reply, dict) else {}

    def _move(self, call: SkillCall, method: str, target: list[float]) -> None:
        before = self._rpc(call.text, self.client.get_motion_data)
        previous_id = before.get('motion_id')
        keyword = 'jtarget' if method == 'movej' else 'ttarget'
        self._command(call, method, **{keyword: target})
        self._wait_motion(call, previous_id, target)

    def _wait_motion(self, call: SkillCall, previous_id: object, target: list[float]) -> None:
        client = self.client
        started = time.monotonic()
        deadline = started + self.motion_timeout_s
        seen = False
        while True:
            motion = self._rpc(call.text, client.get_motion_data)
            control = self._rpc(call.text, client.get_control_data)
            op_state = int(control.get('op_state', 0))
            if op_state in _FAULT_STATES or int(motion.get('traj_state', 0)) == _TRAJ_ERROR:
                raise RobotError(f'{call.text}: motion failed, robot in '
                                 f'{_FAULT_STATES.get(op_state, "TRAJ_ERROR")}: '
                                 f'{self._violation(call)}')
            in_motion = bool(motion.get('is_in_motion')) or bool(motion.get('has_motion'))
            seen = seen or in_motion or motion.get('motion_id') != previous_id
            now = time.monotonic()
            if (not in_motion and motion.get('is_target_reached')
                    and (seen or now - started >= self.start_grace_s)):
                return
            if now >= deadline:
                try:
                    self._rpc(call.text, client.stop_motion)
                except RobotError:
                    pass
                raise RobotError(f'{call.text}: motion timeout after '
                                 f'{self.motion_timeout_s:g} s (target {target}, in motion: '
                                 f'{in_motion}, progress {motion.get("traj_progress", 0)}%)')
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - now)))

    def _violation(self, call: SkillCall) -> str:
        try:
            data = self._rpc(call.text, self.client.get_violation_data)
        except RobotError as err:
            return f'violation unknown ({err})'
        text = str(data.get('violation_str', '')).strip()
        return text or f'violation code {data.get("violation_code", "?")}'

    def _gripper(self, call: SkillCall, close: bool) -> None:
        self._command(call, 'set_do', [{'address': self.gripper_do_index,
                                        'state': 1 if close else 0}])
        if self.gripper_wait_s:
            time.sleep(self.gripper_wait_s)

    # -- state -----------------------------------------------------------------------------

    def recover(self) -> None:
        """Clear a violation state (``Recover``) so that motions are accepted again."""
        self._rpc('recover', self.client.recover)

    def status(self) -> dict[str, object]:
        """The robot's state from IndyDCP3's control, motion and DO data.

        Returns:
            ``op_state`` (name), ``q`` (deg), ``p`` (mm, deg), ``is_in_motion``,
            ``is_target_reached``, ``traj_state``, ``traj_progress``, ``motion_id`` and ``do``
            (address → on).

        Raises:
            RobotError: not connected or the controller did not answer.
        """
        from neuromeka.proto import common_msgs_pb2

        client = self.client
        control = self._rpc('status', client.get_control_data)
        motion = self._rpc('status', client.get_motion_data)
        outputs = self._rpc('status', client.get_do)
        op_state = int(control.get('op_state', 0))
        traj_state = int(motion.get('traj_state', 0))
        try:
            op_name = common_msgs_pb2.OpState.Name(op_state)
            traj_name = common_msgs_pb2.TrajState.Name(traj_state)
        except ValueError:
            op_name, traj_name = str(op_state), str(traj_state)
        return {
            'op_state': op_name,
            'q': [float(v) for v in control.get('q', [])],
            'p': [float(v) for v in control.get('p', [])],
            'is_in_motion': bool(motion.get('is_in_motion')),
            'is_target_reached': bool(motion.get('is_target_reached')),
            'traj_state': traj_name,
            'traj_progress': int(motion.get('traj_progress', 0)),
            'motion_id': int(motion.get('motion_id', 0)),
            'do': {int(s.get('address', 0)): int(s.get('state', 0)) == 1
                   for s in outputs.get('signals', [])},
        }
