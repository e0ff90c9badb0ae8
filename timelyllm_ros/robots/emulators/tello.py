"""A Tello SDK 2.0 emulator on UDP, for driving the real ``djitellopy`` client without a drone.

:class:`TelloEmulator` answers the Tello SDK 2.0 text protocol on a UDP port the way a Ryze
Tello does on 192.168.10.1:8889:

* ``command`` enters SDK mode (``ok``); other commands before it are refused.
* Control commands (``takeoff``, ``land``, ``forward|back|left|right|up|down X``,
  ``cw|ccw X``, ``go``, ``flip``, ``stop``, ``emergency``, ``speed``, ``streamon``, ...) answer
  ``ok`` once done. A motion lasts the tello profile's mean execution time of the matching
  skill times ``time_scale`` (``time_scale=0.01`` runs 100x faster than a real drone).
  Arguments are checked against the SDK ranges (20-500 cm, 1-360 degrees); bad, unknown or
  malformed commands answer ``error ...``; moves on the ground answer ``error Motor stop``.
* Read commands (``battery?``, ``height?``, ``time?``, ``speed?``, ``temp?``, ``tof?``,
  ``baro?``, ``wifi?``, ``sdk?``, ``sn?``, ``attitude?``, ``acceleration?``) answer plain
  numbers (or ``key:value;`` lists), which ``djitellopy``'s ``query_*`` methods parse.
* A state line (``pitch:0;roll:0;yaw:0;vgx:0;...;h:<cm>;bat:<pct>;...\\r\\n``) is sent at
  ``state_hz`` to ``state_port`` of the host that sent ``command``. The battery drains with
  emulated time (faster in the air), the height follows takeoff, up/down and land.

Fault injection: ``drop_replies_for`` (commands never answered: the client times out; the
command has no effect), ``reply_error_for`` (answered ``error``) and :meth:`TelloEmulator.stop`
(kills the server, also in the middle of a motion, whose reply then never comes). Every command
received is logged in :attr:`TelloEmulator.commands`, and every reply sent, with the command it
answers, in :attr:`TelloEmulator.replies` (logged before it leaves: a client that has a reply
from the emulator finds it there, which tells a real reply from a spoofed one).

Error replies never contain the letters ``ok``: ``djitellopy`` treats any reply containing
``ok`` as success. ``python -m timelyllm_ros.robots.emulators.tello --port 8889`` runs one in
the foreground. Note that a stock ``djitellopy`` script binds its own reply socket to the
*same* port number it sends to (8889), so on one host point it at a different port, or use
:class:`~timelyllm_ros.robots.tello.TelloBackend`, which replies on an ephemeral port.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from types import FrameType

from timelyllm_ros.language.profiles import RobotProfile, load_profile

logger = logging.getLogger(__name__)

#: SDK motion commands and the tello profile skill whose model times them.
MOTION_SKILLS = {
    'forward': 'move_forward', 'back': 'move_backward', 'left': 'move_left',
    'right': 'move_right', 'up': 'move_up', 'down': 'move_down',
    'cw': 'turn_cw', 'ccw': 'turn_ccw',
}
_SIMPLE_OK = frozenset({'streamon', 'streamoff', 'keepalive', 'motoron', 'motoroff',
                        'mon', 'moff', 'reboot'})
_MAX_DATAGRAM = 1024


class TelloEmulator:
    """A Tello drone on a loopback UDP port (SDK 2.0 text protocol).

    Attributes:
        drop_replies_for: Command words (``forward``) or whole commands (``forward 50``) that
            are never answered (and have no effect). May be changed while running.
        reply_error_for: Command words or whole commands answered with ``error``.
        time_scale: Multiplier of every emulated duration (motions and battery drain).
    """

    def __init__(self, host: str = '127.0.0.1', control_port: int = 0, state_port: int = 8890,
                 profile: RobotProfile | None = None, time_scale: float = 1.0, *,
                 state_host: str | None = None, state_hz: float = 10.0,
                 battery: float = 100.0, drain_per_s: float = 0.13,
                 idle_drain_per_s: float = 0.02, takeoff_height: int = 100,
                 drop_replies_for: Iterable[str] = (),
                 reply_error_for: Iterable[str] = ()) -> None:
        """Configure the emulator (nothing is bound before :meth:`start`).

        Args:
            host: Address to listen on (any 127.x.y.z works on Linux loopback).
            control_port: UDP port of the command socket; 0 picks a free one.
            state_port: Port the state lines are sent to on the client's host.
            profile: The tello profile whose execution-time models time the motions
                (the bundled ``tello`` profile by default).
            time_scale: Emulated durations are multiplied by this (0.01 = 100x faster).
            state_host: Where state lines go; by default the host that sent ``command``.
            state_hz: State lines per second.
            battery: Initial battery percentage.
            drain_per_s: Battery percentage drained per emulated second in the air.
            idle_drain_per_s: Battery percentage drained per emulated second on the ground.
            takeoff_height: Height after ``takeoff`` in cm.
            drop_replies_for: See the class attributes.
            reply_error_for: See the class attributes.

        Raises:
            ValueError: ``time_scale`` < 0 or ``state_hz`` <= 0.
        """
        if time_scale < 0:
            raise ValueError('time_scale must be >= 0')
        if state_hz <= 0:
            raise ValueError('state_hz must be > 0')
        self.host = host
        self._requested_port = control_port
        self.state_port = state_port
        self.state_host = state_host
        self.profile = profile if profile is not None else load_profile('tello')
        self.time_scale = time_scale
        self.state_hz = state_hz
        self.drain_per_s = drain_per_s
        self.idle_drain_per_s = idle_drain_per_s
        self.takeoff_height = takeoff_height
        self.drop_replies_for: set[str] = set(drop_replies_for)
        self.reply_error_for: set[str] = set(reply_error_for)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._commands: list[str] = []
        self._replies: list[tuple[str, str]] = []
        self._client: tuple[str, int] | None = None
        self._sdk_mode = False
        self._in_air = False
        self._height = 0
        self._yaw = 0
        self._speed = 10
        self._battery = float(battery)
        self._flight_s = 0.0
        self._last_update = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> TelloEmulator:
        """Bind the control socket and start the server and state threads.

        Returns:
            The emulator itself.

        Raises:
            OSError: The address cannot be bound.
            RuntimeError: Already started.
        """
        if self._sock is not None:
            raise RuntimeError('the emulator is already running')
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind((self.host, self._requested_port))
        except OSError:
            sock.close()
            raise
        sock.settimeout(0.05)
        self._sock = sock
        self._stop.clear()
        self._last_update = time.monotonic()
        self._threads = [
            threading.Thread(target=self._serve, name=f'tello-emulator-{self.port}',
                             daemon=True),
            threading.Thread(target=self._stream_state, name=f'tello-state-{self.port}',
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        logger.info('Tello emulator listening on %s:%d', *self.address)
        return self

    def stop(self) -> None:
        """Stop answering, end the threads and close the socket (idempotent).

        A motion in progress is abandoned: its reply never comes.
        """
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        self._threads = []
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def running(self) -> bool:
        """Whether the server is up."""
        return self._sock is not None and not self._stop.is_set()

    def __enter__(self) -> TelloEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation -----------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of the control socket (the port is known once started)."""
        return self.host, self.port

    @property
    def port(self) -> int:
        """The bound control port (the requested one before :meth:`start`)."""
        if self._sock is None:
            return self._requested_port
        return int(self._sock.getsockname()[1])

    @property
    def commands(self) -> list[str]:
        """Every command received, in order (a copy)."""
        with self._lock:
            return list(self._commands)

    @property
    def replies(self) -> list[tuple[str, str]]:
        """``(command, reply)`` of every reply sent, in order (a copy)."""
        with self._lock:
            return list(self._replies)

    @property
    def height(self) -> int:
        """Height above the ground in cm."""
        with self._lock:
            return self._height

    @property
    def battery(self) -> int:
        """Battery percentage now."""
        with self._lock:
            self._update()
            return int(self._battery)

    @property
    def in_air(self) -> bool:
        """Whether the drone flies."""
        with self._lock:
            return self._in_air

    @property
    def yaw(self) -> int:
        """Heading in degrees, -180..180."""
        with self._lock:
            return self._yaw

    def state_line(self) -> str:
        """The current state in the SDK 2.0 state format (one line, ``\\r\\n`` ended)."""
        with self._lock:
            self._update()
            return self._state_line()

    # -- internals -------------------------------------------------------------------------

    def _update(self) -> None:
        """Advance battery and flight time to now (lock held)."""
        now = time.monotonic()
        wall = now - self._last_update
        self._last_update = now
        emulated = wall / self.time_scale if self.time_scale > 0 else 0.0
        rate = self.drain_per_s if self._in_air else self.idle_drain_per_s
        self._battery = max(0.0, self._battery - rate * emulated)
        if self._in_air:
            self._flight_s += emulated

    def _state_line(self) -> str:
        tof = self._height + 10
        return (f'pitch:0;roll:0;yaw:{self._yaw};vgx:0;vgy:0;vgz:0;templ:60;temph:62;'
                f'tof:{tof};h:{self._height};bat:{int(self._battery)};'
                f'baro:{self._height / 100:.2f};time:{int(self._flight_s)};'
                'agx:0.00;agy:0.00;agz:-1000.00;\r\n')

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                data, sender = sock.recvfrom(_MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                break
            text = data.decode('utf-8', errors='replace').strip()
            with self._lock:
                self._commands.append(text)
                if text == 'command' or self._client is None:
                    self._client = sender
            word = text.split(' ', 1)[0]
            if text in self.drop_replies_for or word in self.drop_replies_for:
                logger.debug('emulator drops %r', text)
                continue
            if text in self.reply_error_for or word in self.reply_error_for:
                reply: str | None = 'error'
            else:
                reply = self._handle(text)
            if reply is None or self._stop.is_set():
                continue
            with self._lock:
                self._replies.append((text, reply))
            try:
                sock.sendto(reply.encode('utf-8'), sender)
            except OSError:
                break

    def _stream_state(self) -> None:
        period = 1.0 / self.state_hz
        while not self._stop.wait(period):
            sock = self._sock
            with self._lock:
                client = self._client
                self._update()
                line = self._state_line()
            host = self.state_host or (client[0] if client else None)
            if host is None or sock is None:
                continue
            try:
                sock.sendto(line.encode('ascii'), (host, self.state_port))
            except OSError:
                if self._stop.is_set():
                    break

    def _wait(self, seconds: float) -> bool:
        """Let emulated time pass; False when stopped meanwhile."""
        return not self._stop.wait(max(0.0, seconds) * self.time_scale)

    def _model_s(self, skill: str, args: dict[str, object]) -> float:
        try:
            return self.profile.skill(skill).exec_time.mean_s(args)
        except Exception:  # a profile without that skill: a nominal second
            return 1.0

    def _handle(self, text: str) -> str | None:
        """Perform one command; the reply text, or None for no reply."""
        parts = text.split()
        if not parts:
            return 'error Empty command'
        word, args = parts[0], parts[1:]
        if word == 'command':
            with self._lock:
                self._sdk_mode = True
            return 'ok'
        if not self._sdk_mode:
            return 'error Not in SDK mode'
        if word.endswith('?'):
            return self._read(word, args)
        if word in MOTION_SKILLS:
            return self._motion(word, args)
        if word == 'takeoff':
            return self._takeoff(args)
        if word == 'land':
            return self._land(args)
        if word == 'emergency' and not args:
            with self._lock:
                self._update()
                self._in_air = False
                self._height = 0
            return 'ok'
        if word == 'stop' and not args:
            return 'ok' if self._in_air else 'error Not flying'
        if word in _SIMPLE_OK and not args:
            return 'ok'
        if word == 'speed':
            value = _int_in(args, 10, 100)
            if value is None:
                return 'error Out of range'
            with self._lock:
                self._speed = value
            return 'ok'
        if word == 'rc':
            return None  # joystick commands are never answered
        if word == 'go':
            return self._go(args)
        if word == 'flip':
            if len(args) != 1 or args[0] not in ('l', 'r', 'f', 'b'):
                return 'error Invalid flip'
            if not self._in_air:
                return 'error Motor stop'
            return 'ok' if self._wait(1.0) else None
        return 'error Unknown command'

    def _motion(self, word: str, args: list[str]) -> str | None:
        low, high = (1, 360) if word in ('cw', 'ccw') else (20, 500)
        value = _int_in(args, low, high)
        if value is None:
            return 'error Out of range'
        if not self._in_air:
            return 'error Motor stop'
        skill = MOTION_SKILLS[word]
        name = 'degrees' if word in ('cw', 'ccw') else 'distance'
        if word == 'down' and self._height - value < 0:
            return 'error Too low'
        if not self._wait(self._model_s(skill, {name: value})):
            return None
        with self._lock:
            self._update()
            if word == 'up':
                self._height += value
            elif word == 'down':
                self._height -= value
            elif word in ('cw', 'ccw'):
                yaw = self._yaw + (value if word == 'cw' else -value)
                self._yaw = (yaw + 180) % 360 - 180
        return 'ok'

    def _takeoff(self, args: list[str]) -> str | None:
        if args:
            return 'error Unknown command'
        if self._in_air:
            return 'error Already flying'
        if self.battery < 10:
            return 'error No battery'
        if not self._wait(self._model_s('takeoff', {})):
            return None
        with self._lock:
            self._update()
            self._in_air = True
            self._height = self.takeoff_height
        return 'ok'

    def _land(self, args: list[str]) -> str | None:
        if args:
            return 'error Unknown command'
        if not self._in_air:
            return 'error Not flying'
        if not self._wait(self._model_s('land', {})):
            return None
        with self._lock:
            self._update()
            self._in_air = False
            self._height = 0
        return 'ok'

    def _go(self, args: list[str]) -> str | None:
        if len(args) != 4:
            return 'error Invalid go'
        try:
            x, y, z, speed = (int(a) for a in args)
        except ValueError:
            return 'error Invalid go'
        if not all(-500 <= v <= 500 for v in (x, y, z)) or not 10 <= speed <= 100 or all(
                -20 <= v <= 20 for v in (x, y, z)):
            return 'error Out of range'
        if not self._in_air:
            return 'error Motor stop'
        if self._height + z < 0:
            return 'error Too low'
        distance = (x * x + y * y + z * z) ** 0.5
        if not self._wait(distance / speed):
            return None
        with self._lock:
            self._update()
            self._height += z
        return 'ok'

    def _read(self, word: str, args: list[str]) -> str:
        if args:
            return 'error Unknown command'
        with self._lock:
            self._update()
            answers = {
                'battery?': str(int(self._battery)),
                'height?': str(self._height),
                'time?': str(int(self._flight_s)),
                'speed?': str(self._speed),
                'temp?': '61',
                'tof?': str(self._height + 10),
                'baro?': f'{self._height / 100:.2f}',
                'wifi?': '90',
                'sdk?': '20',
                'sn?': '0TQEMULATOR0001',
                'attitude?': f'pitch:0;roll:0;yaw:{self._yaw};',
                'acceleration?': 'agx:0.00;agy:0.00;agz:-1000.00;',
            }
        return answers.get(word, 'error Unknown command')


def _int_in(args: list[str], low: int, high: int) -> int | None:
    """The single integer argument if it lies in ``[low, high]``, else None."""
    if len(args) != 1:
        return None
    try:
        value = int(args[0])
    except ValueError:
        return None
    return value if low <= value <= high else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run an emulator in the foreground until interrupted.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog='python -m timelyllm_ros.robots.emulators.tello',
        description='Emulate a Tello drone (SDK 2.0 UDP text protocol) on loopback.')
    parser.add_argument('--host', default='127.0.0.1', help='address to listen on')
    parser.add_argument('--port', type=int, default=8889, help='control port (0 = free one)')
    parser.add_argument('--state-port', type=int, default=8890,
                        help="the client's state port")
    parser.add_argument('--state-host', default=None,
                        help='where state lines go (default: the sender of "command")')
    parser.add_argument('--time-scale', type=float, default=1.0,
                        help='multiplier of emulated durations (0.01 = 100x faster)')
    parser.add_argument('--battery', type=float, default=100.0, help='initial battery %%')
    parser.add_argument('--verbose', '-v', action='store_true', help='log every command')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format='%(asctime)s %(levelname)s %(message)s')
    emulator = TelloEmulator(args.host, args.port, args.state_port, time_scale=args.time_scale,
                             state_host=args.state_host, battery=args.battery)
    try:
        emulator.start()
    except OSError as err:
        print(f'cannot listen on {args.host}:{args.port}: {err}', file=sys.stderr)
        return 1
    done = threading.Event()

    def _quit(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGINT, _quit)
    signal.signal(signal.SIGTERM, _quit)
    print(f'Tello emulator on {emulator.host}:{emulator.port} (state to port '
          f'{emulator.state_port}); Ctrl-C to stop', flush=True)
    seen = 0
    while not done.wait(0.2):
        commands = emulator.commands
        for command in commands[seen:]:
            print(f'< {command}', flush=True)
        seen = len(commands)
    emulator.stop()
    return 0


if __name__ == '__main__':
    sys.exit(main())
