"""The LRTrace bag format: topics, message types, typestore and time conversion.

An LRTrace bag is a rosbag2 directory in MCAP storage (``<bag>/<bag>.mcap`` plus
``metadata.yaml``), written through rosbags with no ROS 2 installed, so that ``ros2 bag info``
and any MCAP tool can read it. Its messages are this package's interfaces (``msg/*.msg``):

==========================  =========================================  =====================
topic                       message type                               one message per
==========================  =========================================  =====================
``/lrtrace/meta``           ``timelyllm_ros/msg/TraceMeta``            bag (written first)
``/lrtrace/tasks``          ``timelyllm_ros/msg/TaskRecord``           task
``/lrtrace/segments``       ``timelyllm_ros/msg/Segment``              dispatched segment
``/lrtrace/segment_done``   ``timelyllm_ros/msg/SegmentDone``          executed segment
``/lrtrace/skills``         ``timelyllm_ros/msg/SkillExecution``       executed skill call
==========================  =========================================  =====================

Times have one unit per layer (STYLE.md habit 14): the core uses float seconds, bags use int
nanoseconds (``builtin_interfaces/Time`` stamps and the bag's log times). This module is the
only place in ``lrtrace`` that converts between the two. A time that never happened (NaN in
the core, e.g. a segment that was never executed) is stored as :data:`UNSET_STAMP_SEC`.
"""

from __future__ import annotations

import math
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from timelyllm_ros.core.task_record import UNSET_STAMP_SEC
from timelyllm_ros.errors import TraceFormatError

__all__ = [
    'MSG_TYPES', 'META_TOPIC', 'SEGMENTS_TOPIC', 'SEGMENT_DONE_TOPIC', 'SKILLS_TOPIC',
    'TASKS_TOPIC', 'TOPICS', 'TraceFormatError', 'UNSET_STAMP_SEC', 'VERSION_LATEST',
    'check_message', 'deserialize', 'msg_dir', 'ns_to_seconds', 'seconds_to_ns', 'serialize',
    'stamp', 'stamp_ns', 'stamp_seconds', 'typestore',
]

VERSION_LATEST = 1
"""The LRTrace format version this code writes; readers refuse newer versions."""

PACKAGE = 'timelyllm_ros'

TRACE_META = f'{PACKAGE}/msg/TraceMeta'
TASK_RECORD = f'{PACKAGE}/msg/TaskRecord'
SEGMENT = f'{PACKAGE}/msg/Segment'
SEGMENT_DONE = f'{PACKAGE}/msg/SegmentDone'
SKILL_EXECUTION = f'{PACKAGE}/msg/SkillExecution'
TIME = 'builtin_interfaces/msg/Time'

META_TOPIC = '/lrtrace/meta'
TASKS_TOPIC = '/lrtrace/tasks'
SEGMENTS_TOPIC = '/lrtrace/segments'
SEGMENT_DONE_TOPIC = '/lrtrace/segment_done'
SKILLS_TOPIC = '/lrtrace/skills'

TOPICS: dict[str, str] = {
    META_TOPIC: TRACE_META,
    TASKS_TOPIC: TASK_RECORD,
    SEGMENTS_TOPIC: SEGMENT,
    SEGMENT_DONE_TOPIC: SEGMENT_DONE,
    SKILLS_TOPIC: SKILL_EXECUTION,
}
"""Every LRTrace topic and its message type (in the order a recorder registers them)."""

MSG_TYPES = tuple(dict.fromkeys(TOPICS.values()))

CUSTOM_DATA_VERSION = 'lrtrace_version'
"""``metadata.yaml`` custom_data key holding the format version (the meta message holds it too)."""

_NS = 1_000_000_000
_INT32_MAX = 2**31 - 1


def msg_dir() -> Path:
    """The directory holding this package's ``.msg`` files.

    Looked up in ``$TIMELYLLM_MSG_DIR``, the source checkout (editable install),
    ``<prefix>/share/timelyllm_ros/msg`` (pip install) and the share directory of a colcon
    install above the installed package.

    Raises:
        TraceFormatError: no candidate directory holds ``TaskRecord.msg``.
    """
    override = os.environ.get('TIMELYLLM_MSG_DIR')
    here = Path(__file__).resolve().parent
    candidates = [Path(override)] if override else []
    candidates += [here.parent / 'msg', Path(sys.prefix) / 'share' / PACKAGE / 'msg']
    candidates += [parent / 'share' / PACKAGE / 'msg' for parent in here.parents]
    for candidate in candidates:
        if (candidate / 'TaskRecord.msg').is_file():
            return candidate
    raise TraceFormatError('cannot find the timelyllm_ros message definitions (msg/*.msg); '
                           'looked in ' + ', '.join(str(c) for c in candidates))


@lru_cache(maxsize=1)
def typestore() -> Typestore:
    """ROS 2 Jazzy's types plus this package's messages (``timelyllm_ros/msg/<Name>``).

    Raises:
        TraceFormatError: the message definitions are missing or do not parse.
    """
    store = get_typestore(Stores.ROS2_JAZZY)
    types: dict[str, Any] = {}
    for path in sorted(msg_dir().glob('*.msg')):
        try:
            types.update(get_types_from_msg(path.read_text(encoding='utf-8'),
                                            f'{PACKAGE}/msg/{path.stem}'))
        except Exception as err:  # noqa: BLE001 - rosbags raises several parser errors
            raise TraceFormatError(f'{path}: invalid message definition: {err}') from None
    store.register(types)
    missing = [name for name in MSG_TYPES if name not in store.types]
    if missing:
        raise TraceFormatError(f'message definitions missing from {msg_dir()}: {missing}')
    return store


def message_class(msgtype: str) -> Any:
    """The rosbags dataclass of a message type (e.g. ``timelyllm_ros/msg/TaskRecord``)."""
    try:
        return typestore().types[msgtype]
    except KeyError:
        raise TraceFormatError(f'unknown message type {msgtype!r}') from None


def serialize(msg: Any) -> bytes:
    """CDR bytes of a message (its type is the message's ``__msgtype__``)."""
    return bytes(typestore().serialize_cdr(msg, msg.__msgtype__))


def deserialize(data: bytes | memoryview, msgtype: str) -> Any:
    """Decode CDR bytes of a known message type.

    Raises:
        TraceFormatError: unknown type or bytes that do not decode as that type.
    """
    store = typestore()
    if msgtype not in store.types:
        raise TraceFormatError(f'unknown message type {msgtype!r}')
    try:
        return store.deserialize_cdr(bytes(data), msgtype)
    except Exception as err:  # noqa: BLE001 - rosbags raises struct/index/value errors
        raise TraceFormatError(f'malformed {msgtype} message: {err}') from None


TASK_SEGMENT_FIELDS = ('cut_tokens', 'cut_stamps', 'dispatch_stamps', 'start_stamps',
                       'end_stamps', 'estimated_execution_s', 'segment_texts', 'segment_success',
                       'segment_errors')
"""``TaskRecord`` arrays that hold one entry per segment (so they have the same length)."""


def check_message(msg: Any, msgtype: str) -> None:
    """Check what the CDR encoding cannot: the invariants readers of a message rely on.

    Args:
        msg: a decoded message.
        msgtype: its type.

    Raises:
        TraceFormatError: a ``TaskRecord`` whose per-segment arrays differ in length, or a
            stamp whose ``nanosec`` is not below one second.
    """
    if msgtype == TASK_RECORD:
        lengths = {name: len(getattr(msg, name)) for name in TASK_SEGMENT_FIELDS}
        if len(set(lengths.values())) > 1:
            raise TraceFormatError(f'TaskRecord {msg.task_id!r}: per-segment arrays differ in '
                                   f'length {lengths}')
    for name in ('arrival_stamp', 'done_stamp', 'generated_stamp', 'start_stamp', 'end_stamp',
                 'cut_stamps', 'dispatch_stamps', 'start_stamps', 'end_stamps'):
        value = getattr(msg, name, None)
        stamps = value if isinstance(value, list) else [] if value is None else [value]
        if any(not 0 <= int(s.nanosec) < _NS for s in stamps):
            raise TraceFormatError(f'{msgtype}: {name} has a nanosec field of one second or more')


# -- time -------------------------------------------------------------------------------------
def seconds_to_ns(seconds: float) -> int:
    """Float seconds → int nanoseconds (rounded to the nearest ns).

    Raises:
        TraceFormatError: NaN or infinite seconds.
    """
    if not math.isfinite(seconds):
        raise TraceFormatError(f'cannot store {seconds} s as nanoseconds')
    return round(seconds * _NS)


def ns_to_seconds(ns: int) -> float:
    """Int nanoseconds → float seconds."""
    return ns / _NS


def stamp(seconds: float) -> Any:
    """A ``builtin_interfaces/Time`` for float seconds; NaN gives the unset stamp.

    Raises:
        TraceFormatError: infinite seconds or a time outside the int32 seconds range.
    """
    time_class = message_class(TIME)
    if math.isnan(seconds):
        return time_class(sec=UNSET_STAMP_SEC, nanosec=0)
    return stamp_from_ns(seconds_to_ns(seconds))


def stamp_from_ns(ns: int) -> Any:
    """A ``builtin_interfaces/Time`` for int nanoseconds (``sec`` floors, ``nanosec`` ≥ 0).

    Raises:
        TraceFormatError: the time does not fit the stamp's int32 seconds.
    """
    sec, nanosec = divmod(int(ns), _NS)
    if not UNSET_STAMP_SEC < sec <= _INT32_MAX:
        raise TraceFormatError(f'{ns} ns does not fit a builtin_interfaces/Time stamp')
    return message_class(TIME)(sec=sec, nanosec=nanosec)


def is_unset(value: Any) -> bool:
    """Whether a stamp is the unset stamp."""
    return int(value.sec) == UNSET_STAMP_SEC


def stamp_ns(value: Any) -> int | None:
    """Int nanoseconds of a stamp; ``None`` for the unset stamp."""
    if is_unset(value):
        return None
    return int(value.sec) * _NS + int(value.nanosec)


def stamp_seconds(value: Any) -> float:
    """Float seconds of a stamp; NaN for the unset stamp."""
    ns = stamp_ns(value)
    return math.nan if ns is None else ns_to_seconds(ns)


def log_time_ns(*seconds: float) -> int:
    """A bag log time (uint64 ns) from the first finite of ``seconds``, clamped at 0."""
    for value in seconds:
        if math.isfinite(value):
            return max(0, seconds_to_ns(value))
    return 0
