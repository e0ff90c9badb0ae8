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
  ``Tello()`` and never closed, and its receivers cannot be trusted with a network anyone can
  send to: the reply receiver takes a datagram from *any port* of a drone's IP as that drone's
  reply (one spoofed ``ok`` ends a motion as a success while the drone still flies), and the
  state receiver decodes each datagram as ASCII outside any guard, so one non-ASCII datagram
  to the state port ends its thread for the whole process (``state()`` then stays frozen,
  with nothing but a log line). This module therefore runs **its own receivers**
  (:class:`Receivers`, one per process, see :func:`receivers`) in place of djitellopy's: it
  marks djitellopy's threads as started, gives djitellopy its reply socket as
  ``client_socket``, and fills the very structures djitellopy's send path reads
  (``drones[ip]['responses']`` and ``['state']``); sending and waiting stay djitellopy's.
  They take a reply only from the drone's command port (``control_port``, 8889), a state line
  only when it is a complete ASCII state line (anything else is dropped and counted, see
  :meth:`TelloBackend.dropped`), stamp each state line's arrival (:meth:`TelloBackend.state`
  gives ``{}`` rather than a state older than ``state_timeout_s``, and
  :meth:`TelloBackend.state_problem` says why), and end only when their socket fails. A dead
  reply receiver is restarted before the next command, a dead state receiver after the next
  motion (which fails with the reason when it cannot be: the state of before the motion would
  otherwise stay the latest). A process in which djitellopy's own threads already run (a
  ``Tello()`` made outside this module) is refused.
* The reply socket is bound to an ephemeral port (replies come back to it, so an emulator may
  listen on any loopback port); each backend sends to its own ``(host, control_port)``. The
  state port stays the one of the first backend for the whole process (see
  :func:`client_state_port`).
* Replies and state are routed by the **sender's IP**, so one open backend per host
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
from collections import Counter
from collections.abc import Callable
from functools import cache
from typing import Any

from timelyllm_ros.core.clock import Clock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import RobotProfile
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

#: Largest datagram read: Tello replies and state lines are under 300 bytes; a longer one is
#: cut here (Linux drops the rest) and then judged like any other.
_MAX_DATAGRAM = 2048
#: How often a receiver looks up from a quiet socket, to notice that it was closed.
_POLL_S = 0.5
#: The fields of every SDK 1.3/2.0 state line (a Tello EDU adds mission-pad fields). A
#: datagram without all of them, each a finite number, is not a state line.
STATE_FIELDS = ('pitch', 'roll', 'yaw', 'vgx', 'vgy', 'vgz', 'templ', 'temph', 'tof', 'h',
                'bat', 'baro', 'time', 'agx', 'agy', 'agz')
_FLOAT_FIELDS = frozenset({'baro', 'agx', 'agy', 'agz'})
#: Why a datagram was dropped (keys of :meth:`TelloBackend.dropped`).
FOREIGN_REPLY = 'reply from another port'
NOT_ASCII = 'state datagram not ASCII'
NOT_STATE = 'state datagram not a state line'


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
    """The port on which the Tello clients of this process receive state, or None before the
    first backend connected."""
    return _RECEIVERS.state.port if _RECEIVERS is not None else None


def parse_state_line(data: bytes) -> dict[str, int | float | str] | None:
    """The fields of one state datagram, or None when it is not a complete ASCII state line.

    ``pitch:0;roll:0;...;agz:-1000.00;\\r\\n``: every field of :data:`STATE_FIELDS` must be
    there as a finite number (integers for all but ``baro`` and the accelerations); other
    fields (a Tello EDU's ``mid``, ``mpry``) are kept as djitellopy keeps them.
    """
    try:
        text = data.decode('ascii')
    except UnicodeDecodeError:
        return None
    raw: dict[str, str] = {}
    for item in text.strip().split(';'):
        key, colon, value = item.partition(':')
        if colon:
            raw[key] = value
    fields: dict[str, int | float | str] = dict(raw)
    # A Tello EDU's mission-pad fields are integers too, when it sends them.
    numbers = [*STATE_FIELDS, *(k for k in ('mid', 'x', 'y', 'z') if k in raw)]
    for key in numbers:
        if key not in raw:
            return None
        try:
            number = float(raw[key]) if key in _FLOAT_FIELDS else int(raw[key])
        except ValueError:
            return None
        if not math.isfinite(number):
            return None
        fields[key] = number
    return fields


class Receiver:
    """One UDP socket and the thread that reads it, restartable once its socket failed.

    Attributes:
        port: The local port (0: an ephemeral one, chosen again at each start).
        sock: The socket of the current thread.
        failure: Why the last thread ended ('' while it runs).
    """

    def __init__(self, name: str, port: int, handle: Callable[[bytes, Any], None]) -> None:
        self.name = name
        self.port = port
        self.handle = handle
        self.sock: socket.socket | None = None
        self.failure = ''
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Bind the port and start the thread.

        Raises:
            OSError: the port cannot be bound.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(('', self.port))
        except OSError:
            sock.close()
            raise
        sock.settimeout(_POLL_S)
        self.sock, self.failure = sock, ''
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True,
                                        name=f'tello-{self.name}-receiver')
        self._thread.start()

    def _run(self, sock: socket.socket) -> None:
        while True:
            try:
                data, sender = sock.recvfrom(_MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError as err:
                self.failure = f'{self.name} socket failed: {err}'
                logger.warning('Tello %s receiver stopped: %s', self.name, self.failure)
                sock.close()
                return
            try:
                self.handle(data, sender)
            except Exception:  # one datagram, whatever it holds, never ends the receiver
                logger.exception('Tello %s receiver: a datagram from %s could not be handled',
                                 self.name, sender)


class Receivers:
    """This process's Tello receivers, in place of djitellopy's (see the module docstring).

    Attributes:
        reply: Reads the replies; its socket is djitellopy's ``client_socket``.
        state: Reads the state lines on the process's state port.
    """

    def __init__(self, module: Any, state_port: int) -> None:
        self.module = module
        self.reply = Receiver('reply', 0, self._on_reply)
        self.state = Receiver('state', state_port, self._on_state)
        self._lock = threading.Lock()
        self._command_ports: dict[str, int] = {}
        self._state_at: dict[str, float] = {}
        self._dropped: dict[str, Counter[str]] = {}

    def start(self) -> None:
        """Open both sockets and make djitellopy send from the reply socket.

        Raises:
            OSError: a port cannot be bound.
        """
        self.reply.start()
        try:
            self.state.start()
        except OSError:
            assert self.reply.sock is not None
            self.reply.sock.close()
            raise
        self._install()

    def _install(self) -> None:
        # djitellopy's send path reads the module's client_socket at each command; with
        # threads_initialized set, Tello() never starts its own receivers.
        self.module.client_socket = self.reply.sock
        self.module.threads_initialized = True
        self.module.Tello.STATE_UDP_PORT = self.state.port

    def ensure(self, which: Receiver) -> str:
        """Restart a dead receiver; '' when it runs, else why it cannot (its port is taken)."""
        with self._lock:
            if which.alive:
                return ''
            failure = which.failure or 'stopped'
            try:
                which.start()
            except OSError as err:
                return f'{failure}, and it cannot be restarted: {err}'
            logger.warning('Tello %s receiver restarted after: %s', which.name, failure)
            self._install()
            return ''

    def route(self, ip: str, command_port: int) -> None:
        """Take replies from ``(ip, command_port)`` and state lines from ``ip``."""
        with self._lock:
            self._command_ports[ip] = command_port
            self._state_at.pop(ip, None)
            self._dropped[ip] = Counter()

    def unroute(self, ip: str) -> None:
        with self._lock:
            self._command_ports.pop(ip, None)
            self._state_at.pop(ip, None)

    def state_age_s(self, ip: str) -> float | None:
        """Seconds since the last state line from ``ip`` (None: none since it was routed)."""
        with self._lock:
            at = self._state_at.get(ip)
        return None if at is None else time.monotonic() - at

    def dropped(self, ip: str) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped.get(ip, {}))

    def _drop(self, ip: str, why: str) -> None:
        with self._lock:
            self._dropped.setdefault(ip, Counter())[why] += 1

    def _on_reply(self, data: bytes, sender: Any) -> None:
        ip, port = sender[0], sender[1]
        with self._lock:
            expected = self._command_ports.get(ip)
        if expected is None:
            return  # not a drone of this process (djitellopy ignores those too)
        if port != expected:
            self._drop(ip, FOREIGN_REPLY)
            logger.warning('Tello %s: dropped a reply from port %d (its command port is %d)',
                           ip, port, expected)
            return
        entry = self.module.drones.get(ip)
        if entry is not None:
            entry['responses'].append(data)

    def _on_state(self, data: bytes, sender: Any) -> None:
        ip = sender[0]
        with self._lock:
            known = ip in self._command_ports
        entry = self.module.drones.get(ip)
        if not known or entry is None:
            return
        state = parse_state_line(data)
        if state is None:
            self._drop(ip, NOT_STATE if data.isascii() else NOT_ASCII)
            return
        entry['state'] = state
        with self._lock:
            self._state_at[ip] = time.monotonic()


_RECEIVERS: Receivers | None = None


def receivers() -> Receivers | None:
    """The receivers of this process (None before the first backend connected)."""
    return _RECEIVERS


def _receiver_alive() -> bool:
    """Whether the reply receiver thread runs (it ends only when its socket fails)."""
    return _RECEIVERS is not None and _RECEIVERS.reply.alive


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
                 wait_for_state_s: float = 1.0, state_timeout_s: float = 1.0) -> None:
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
            state_timeout_s: A state line older than this is not the current state (the
                drone sends about ten a second).

        Raises:
            ValueError: A non-positive timeout or retry count, or a negative factor.
        """
        if (command_timeout_s <= 0 or retry_count < 1 or motion_timeout_factor < 0
                or not state_timeout_s > 0):
            raise ValueError('command_timeout_s, state_timeout_s and retry_count must be '
                             'positive and motion_timeout_factor >= 0')
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
        self.state_timeout_s = state_timeout_s
        self.pictures = 0
        self._tello: Any = None
        self._ip = ''
        self._flying = False
        self._stale_logged = False

    # -- connection ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` succeeded and :meth:`close` was not called since."""
        return self._tello is not None

    def connect(self) -> None:
        """Create the djitellopy client and enter SDK mode (``command``).

        Raises:
            RobotError: djitellopy is missing, djitellopy's own receivers run in this
                process, the host is already used by another open backend, the state port is
                taken, or the drone does not answer.
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
            assert _RECEIVERS is not None
            _RECEIVERS.route(ip, self.control_port)
        self._tello = tello
        self._ip = ip
        try:
            self._send('command', self.command_timeout_s, self.retry_count)
        except RobotError as err:
            self.close()
            raise RobotError(f'Tello at {ip}:{self.control_port} does not answer: {err}') from None
        self._wait_for_state()

    def _create_client(self, module: Any, ip: str) -> Any:
        """A client sending to ``(ip, control_port)``; the first one also starts the
        process's receivers (:class:`Receivers`). Called with ``_INIT_LOCK`` held."""
        global _RECEIVERS
        if _RECEIVERS is None:
            if module.threads_initialized:
                raise RobotError(
                    "djitellopy's own receiver threads already run in this process (a "
                    'djitellopy.Tello was made outside TelloBackend): they take a reply from '
                    'any port of the drone and stop for good on one non-ASCII state datagram; '
                    'open Tello clients only through TelloBackend')
            started = Receivers(module, self.state_port)
            try:
                started.start()
            except OSError as err:
                raise RobotError(f'cannot open the Tello sockets (state port '
                                 f'{self.state_port}): {err}') from None
            _RECEIVERS = started
        elif _RECEIVERS.state.port != self.state_port:
            logger.warning('this process already receives Tello state on port %d; '
                           'state_port=%d is ignored', _RECEIVERS.state.port, self.state_port)
            self.state_port = _RECEIVERS.state.port
        client = _client_class()(host=ip, retry_count=self.retry_count)
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
        if _RECEIVERS is not None:
            _RECEIVERS.unroute(self._ip)
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
        """The drone's current state (``h`` in cm, ``bat`` in %, ...): the latest state line
        if it is younger than ``state_timeout_s`` and the state receiver runs, else {}
        (:meth:`state_problem` says why)."""
        if self._tello is None:
            return {}
        if self.state_problem():
            return {}
        try:
            return dict(self._tello.get_current_state())
        except KeyError:  # routing entry gone
            return {}

    def state_problem(self) -> str:
        """Why :meth:`state` has no current state ('' when it has one)."""
        if self._tello is None or _RECEIVERS is None:
            return 'not connected'
        if not _RECEIVERS.state.alive:
            # Whatever it received last can no longer be replaced: not current, however
            # young. The next motion restarts it (or fails saying why it cannot).
            return (f'the state receiver is dead ({_RECEIVERS.state.failure or "stopped"}); '
                    'it is restarted after the next motion')
        age = _RECEIVERS.state_age_s(self._ip)
        if age is not None and age <= self.state_timeout_s:
            self._stale_logged = False
            return ''
        problem = (f'no state line from {self._ip} on port {self.state_port} since the '
                   'connection' if age is None else
                   f'no state line from {self._ip} for {age:.1f} s (state_timeout_s '
                   f'{self.state_timeout_s:g})')
        if age is not None and not self._stale_logged:  # connect() warns of a silent start
            logger.warning('Tello %s: %s', self._ip, problem)
            self._stale_logged = True
        return problem

    def dropped(self) -> dict[str, int]:
        """Datagrams from the drone's IP dropped since :meth:`connect`, by reason: replies
        from a port other than its command port, state datagrams that are not ASCII or not a
        state line."""
        return _RECEIVERS.dropped(self._ip) if _RECEIVERS is not None and self._ip else {}

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
        # The motion changed the state: a state receiver that died meanwhile would leave the
        # state of before the motion as the latest one.
        assert _RECEIVERS is not None
        why = _RECEIVERS.ensure(_RECEIVERS.state)
        if why:
            raise RobotError(f'{label or call.text}: {command!r} done, but the state receiver '
                             f'is dead: {why}')

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
        assert _RECEIVERS is not None
        why = _RECEIVERS.ensure(_RECEIVERS.reply)
        if why:
            raise RobotError(f'{command!r} not sent: the reply receiver is dead: {why}')
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
                    reason += '; the reply receiver is dead: ' + (
                        _RECEIVERS.reply.failure if _RECEIVERS is not None else 'never started')
            else:
                reason = f'the drone answered {latest!r}'
            raise RobotError(f'{command!r} failed: {reason}') from None
        except OSError as err:
            raise RobotError(f'{command!r} failed: socket error: {err}') from None
