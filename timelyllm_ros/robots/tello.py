"""The Tello backend: performs MiniSpec skill calls on a Ryze Tello through ``djitellopy``.

:class:`TelloBackend` drives the unmodified ``djitellopy.Tello`` client (imported when
:meth:`TelloBackend.connect` runs) with Tello SDK 2.0 commands:

=====================  ===================================================================
skill                  what is sent
=====================  ===================================================================
mf / mb / ml / mr      ``forward X`` / ``back X`` / ``left X`` / ``right X`` (cm)
mu / md                ``up X`` / ``down X`` (cm)
tc / tu                ``cw X`` / ``ccw X`` (degrees)
to / ld                ``takeoff`` / ``land``
d                      nothing: waits on the backend's clock
l, tp                  nothing: logged locally (no camera stream here)
s, sa, g, iv, ox, ...  only with a ``perception`` callable (there is no vision model here):
                       it answers the call; ``g`` then flies ``forward`` the distance it gives
=====================  ===================================================================

Without ``perception`` the perception skills are unsupported, so the skill executor refuses a
segment holding one before anything is sent. A refusal (``error ...`` reply), a missing reply
(timeout) or a dead socket raises :class:`~timelyllm_ros.errors.RobotError` naming the command
and the reason; every wait is bounded.

``djitellopy`` quirks this module handles:

* The client keeps **process-wide** UDP sockets and receiver threads, created by the first
  ``Tello()`` and never closed; they bind ``Tello.CONTROL_UDP_PORT`` (also the port commands
  are sent to) and ``Tello.STATE_UDP_PORT``. The first backend of a process therefore creates
  the client with ``CONTROL_UDP_PORT = 0`` (replies come back on an ephemeral port, so an
  emulator may listen on any loopback port) and ``STATE_UDP_PORT = state_port``, then restores
  ``CONTROL_UDP_PORT``; each backend sends to its own ``(host, control_port)``. The state port
  stays the one of the first backend for the whole process (see :func:`client_state_port`).
* Replies and state are routed by the **sender's IP** only, so one open backend per host
  (loopback tests use distinct 127.x.y.z addresses or run one after the other).
* ``send_control_command`` retries on any non-``ok`` reply and takes an ``int`` timeout
  (``enforce_types`` rejects floats): timeouts are rounded up to whole seconds. Motions,
  takeoff and land are sent **once** (a lost reply does not mean the drone did not move);
  ``retry_count`` applies to the ``command`` handshake only.
* A reply that arrives after its command timed out would be taken as the next command's
  reply: the reply queue is cleared before every command.
* ``Tello.__del__`` calls ``end()``, which lands a flying drone and deletes the host's routing
  entry even if a newer client owns it: the backend uses a subclass without ``__del__``.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from timelyllm_ros.clock import Clock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.plan import SkillCall
from timelyllm_ros.profiles import RobotProfile
from timelyllm_ros.robots.backend import RobotBackend, wait_on

logger = logging.getLogger(__name__)

#: Skills sent as ``<command> <argument>``.
MOTION_COMMANDS = {
    'move_forward': 'forward', 'move_backward': 'back', 'move_left': 'left',
    'move_right': 'right', 'move_up': 'up', 'move_down': 'down',
    'turn_cw': 'cw', 'turn_ccw': 'ccw',
}
#: Skills performed without talking to the drone.
LOCAL_SKILLS = frozenset({'delay', 'log', 'take_picture'})
#: Skills that need a vision model (a ``perception`` callable).
PERCEPTION_SKILLS = frozenset({
    'scan', 'scan_abstract', 'goto', 'is_visible', 'object_x', 'object_y', 'object_width',
    'object_height', 'object_distance', 'probe', 're_plan',
})

_INIT_LOCK = threading.Lock()
_OPEN_HOSTS: set[str] = set()


def _djitellopy() -> Any:
    """The ``djitellopy.tello`` module (imported on first use)."""
    try:
        from djitellopy import tello
    except ImportError as err:
        raise RobotError(f'the Tello backend needs djitellopy (pip install djitellopy): '
                         f'{err}') from None
    return tello


@cache
def _client_class() -> type:
    """``djitellopy.Tello`` without the ``__del__`` that lands and unroutes on collection."""
    tello = _djitellopy().Tello

    class _Client(tello):  # type: ignore[misc, valid-type]
        def __del__(self) -> None:
            pass

    return _Client


def client_state_port() -> int | None:
    """The port on which djitellopy receives state in this process, or None before the first
    client (or without djitellopy)."""
    try:
        from djitellopy import tello
    except ImportError:
        return None
    return int(tello.Tello.STATE_UDP_PORT) if tello.threads_initialized else None


def _port_free(port: int) -> bool:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind(('', port))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _receiver_alive() -> bool:
    """Whether djitellopy's reply receiver thread still runs (it exits on a socket error)."""
    return any(thread.name.endswith('(udp_response_receiver)') and thread.is_alive()
               for thread in threading.enumerate())


class TelloBackend(RobotBackend):
    """A Ryze Tello (or a :class:`~timelyllm_ros.robots.emulators.tello.TelloEmulator`).

    Attributes:
        pictures: Calls of ``tp`` performed (no stream is opened; they are logged).
    """

    def __init__(self, profile: RobotProfile, host: str = '192.168.10.1',
                 command_timeout_s: float = 7.0, retry_count: int = 3,
                 control_port: int = 8889, state_port: int = 8890, *,
                 perception: Callable[[SkillCall], object] | None = None,
                 clock: Clock | None = None, motion_timeout_factor: float = 2.0,
                 wait_for_state_s: float = 1.0) -> None:
        """Configure the backend (nothing is opened before :meth:`connect`).

        Args:
            profile: The tello profile (skills, limits, execution-time models).
            host: The drone's IP address (a host name is resolved once, on connect).
            command_timeout_s: How long to wait for a reply beyond the expected duration
                (rounded up to whole seconds, at least 1).
            retry_count: Attempts of the ``command`` handshake (at least 1).
            control_port: The drone's command port.
            state_port: Local port for the state stream; process-wide in djitellopy, so
                only the first backend of a process chooses it.
            perception: Answers perception skills (``iv('cat')`` -> True, ``od('cat')`` ->
                cm, ``g('cat')`` -> the distance to fly forward); without it they are
                unsupported.
            clock: The clock ``d(seconds)`` waits on (a wall clock by default).
            motion_timeout_factor: A motion's reply is awaited for ``command_timeout_s`` plus
                this times the profile's mean execution time of the skill.
            wait_for_state_s: How long :meth:`connect` waits for a first state line (a
                missing state stream is logged, not fatal).

        Raises:
            ValueError: A non-positive timeout or retry count, or a negative factor.
        """
        if command_timeout_s <= 0 or retry_count < 1 or motion_timeout_factor < 0:
            raise ValueError('command_timeout_s and retry_count must be positive and '
                             'motion_timeout_factor >= 0')
        self.profile = profile
        self.host = host
        self.command_timeout_s = command_timeout_s
        self.retry_count = retry_count
        self.control_port = control_port
        self.state_port = state_port
        self.perception = perception
        self.clock: Clock = clock if clock is not None else WallClock()
        self.motion_timeout_factor = motion_timeout_factor
        self.wait_for_state_s = wait_for_state_s
        self.pictures = 0
        self._tello: Any = None
        self._ip = ''
        self._flying = False

    # -- connection ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` succeeded and :meth:`close` was not called since."""
        return self._tello is not None

    def connect(self) -> None:
        """Create the djitellopy client and enter SDK mode (``command``).

        Raises:
            RobotError: djitellopy is missing, the host is already used by another open
                backend, the state port is taken, or the drone does not answer.
        """
        if self._tello is not None:
            return
        module = _djitellopy()
        try:
            ip = socket.gethostbyname(self.host)
        except OSError as err:
            raise RobotError(f'cannot resolve the Tello host {self.host!r}: {err}') from None
        with _INIT_LOCK:
            if ip in _OPEN_HOSTS:
                raise RobotError(f'another TelloBackend is connected to {ip}: djitellopy '
                                 'routes replies by IP, close it first')
            tello = self._create_client(module, ip)
            _OPEN_HOSTS.add(ip)
        self._tello = tello
        self._ip = ip
        try:
            self._send('command', self.command_timeout_s, self.retry_count)
        except RobotError as err:
            self.close()
            raise RobotError(f'Tello at {ip}:{self.control_port} does not answer: {err}') from None
        self._wait_for_state()

    def _create_client(self, module: Any, ip: str) -> Any:
        """A client sending to ``(ip, control_port)``; the first one also opens the sockets."""
        tello_class = module.Tello
        if module.threads_initialized:
            bound = int(tello_class.STATE_UDP_PORT)
            if bound != self.state_port:
                logger.warning('djitellopy already receives state on port %d in this process; '
                               'state_port=%d is ignored', bound, self.state_port)
                self.state_port = bound
            client = _client_class()(host=ip, retry_count=self.retry_count)
        else:
            if not _port_free(self.state_port):
                raise RobotError(f'the Tello state port {self.state_port} is in use')
            saved = tello_class.CONTROL_UDP_PORT
            tello_class.CONTROL_UDP_PORT = 0  # reply socket on an ephemeral port
            tello_class.STATE_UDP_PORT = self.state_port  # read once by the state thread
            try:
                client = _client_class()(host=ip, retry_count=self.retry_count)
            except OSError as err:
                raise RobotError(f'cannot open the djitellopy sockets: {err}') from None
            finally:
                tello_class.CONTROL_UDP_PORT = saved
        client.address = (ip, self.control_port)
        return client

    def _wait_for_state(self) -> None:
        deadline = time.monotonic() + self.wait_for_state_s  # real time, whatever the clock
        while not self.state():
            if time.monotonic() >= deadline:
                logger.warning('no state line from the Tello at %s on port %d', self._ip,
                               self.state_port)
                return
            time.sleep(0.02)

    def close(self) -> None:
        """Forget the client: the host's routing entry is removed (never lands, never raises).

        djitellopy's sockets and receiver threads are process-wide daemons shared by every
        client; they stay open for the next backend.
        """
        tello, self._tello = self._tello, None
        if tello is None:
            return
        try:
            tello.is_flying = False  # end() would land; landing is the plan's business
            tello.stream_on = False
            tello.end()
        except Exception as err:  # close never raises
            logger.debug('djitellopy end() failed: %s', err)
        finally:
            with _INIT_LOCK:
                _OPEN_HOSTS.discard(self._ip)

    def state(self) -> dict[str, int | float | str]:
        """The latest state line from the drone (``h`` in cm, ``bat`` in %, ...); {} if none."""
        if self._tello is None:
            return {}
        try:
            return dict(self._tello.get_current_state())
        except KeyError:  # routing entry gone
            return {}

    # -- skills ----------------------------------------------------------------------------

    def supports(self, skill: str) -> bool:
        """Motions, takeoff, land and the local skills; perception only with ``perception``."""
        if skill in MOTION_COMMANDS or skill in ('takeoff', 'land') or skill in LOCAL_SKILLS:
            return True
        return skill in PERCEPTION_SKILLS and self.perception is not None

    def perform(self, call: SkillCall) -> object:
        """Perform one call, blocking until the drone answers (bounded).

        Returns:
            The perception answer for perception skills, the text for ``l``, else None.

        Raises:
            RobotError: Not connected, a call :meth:`check` refuses (unsupported skill, an
                argument that is not finite or outside the limits), a refusal, a timeout or a
                dead socket.
        """
        if self._tello is None:
            raise RobotError(f'{call.text}: the Tello backend is not connected')
        self.check(call)  # nothing leaves for the drone that the profile does not allow
        skill = call.skill
        if skill in MOTION_COMMANDS:
            value = next(iter(call.args.values()))
            self._motion(call, f'{MOTION_COMMANDS[skill]} {int(value)}')
            return None
        if skill == 'takeoff':
            if self._flying:
                # Already in the air (a plan that starts with to() while hovering): the SDK
                # would refuse; the goal of the call holds, so it succeeds without a command.
                logger.info('Tello %s: to() while flying: already in the air', self._ip)
                return None
            self._motion(call, 'takeoff')
            self._flying = True
            return None
        if skill == 'land':
            self._motion(call, 'land')
            self._flying = False
            return None
        if skill == 'delay':
            wait_on(self.clock, float(call.args['seconds']))
            return None
        if skill == 'log':
            text = call.args.get('text', '')
            logger.info('Tello %s log: %s', self._ip, text)
            return text
        if skill == 'take_picture':
            self.pictures += 1
            logger.info('Tello %s take_picture #%d (no video stream opened)', self._ip,
                        self.pictures)
            return None
        if skill in PERCEPTION_SKILLS and self.perception is not None:
            return self._perceive(call)
        raise RobotError(f'{call.text}: skill {skill!r} is not supported by TelloBackend')

    def _perceive(self, call: SkillCall) -> object:
        assert self.perception is not None
        try:
            result = self.perception(call)
        except RobotError:
            raise
        except Exception as err:
            raise RobotError(f'{call.text}: perception failed: {err}') from err
        if call.skill != 'goto':
            return result
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise RobotError(f'{call.text}: perception gave no distance ({result!r})')
        distance = round(result)
        if distance < 20:  # the SDK's smallest move: already there
            return 0
        distance = min(distance, 500)
        forward = SkillCall('move_forward', 'mf', {'distance': distance}, f'mf({distance})')
        self._motion(forward, f'forward {distance}', label=call.text)
        return distance

    def _motion(self, call: SkillCall, command: str, label: str | None = None) -> None:
        try:
            expected = self.profile.skill(call.skill).exec_time.mean_s(dict(call.args))
        except Exception:
            expected = 0.0
        timeout = self.command_timeout_s + self.motion_timeout_factor * expected
        try:
            self._send(command, timeout, 1)
        except RobotError as err:
            hint = ''
            if not self._flying and call.skill != 'takeoff':
                hint = ' (the drone is not flying: take off with to() first)'
            raise RobotError(f'{label or call.text}: {err}{hint}') from None

    def _send(self, command: str, timeout_s: float, attempts: int) -> None:
        """Send one control command through djitellopy and wait for ``ok``.

        Raises:
            RobotError: ``error`` reply, no reply within the timeout, or a socket failure.
        """
        module = _djitellopy()
        tello = self._tello
        if tello is None:
            raise RobotError(f'{command!r}: not connected')
        routed = module.drones.get(self._ip)
        if routed is None:
            raise RobotError(f'{command!r}: djitellopy no longer routes replies from {self._ip}')
        routed['responses'].clear()  # a late reply to a timed-out command is not ours
        seconds = max(1, math.ceil(timeout_s))
        tello.retry_count = attempts
        try:
            tello.send_control_command(command, timeout=seconds)
        except module.TelloException as err:
            latest = str(err).rpartition('Latest response:')[2].strip().strip("'")
            if latest.startswith('Aborting command') or not latest:
                reason = (f'no reply within {seconds} s after {attempts} attempt(s) '
                          f'(drone unreachable or stopped)')
                if not _receiver_alive():
                    reason += "; djitellopy's reply receiver thread is dead"
            else:
                reason = f'the drone answered {latest!r}'
            raise RobotError(f'{command!r} failed: {reason}') from None
        except OSError as err:
            raise RobotError(f'{command!r} failed: socket error: {err}') from None
